"""MUVERA fixed-dimensional encodings: one vector per multi-vector text, whose dot products approximate MaxSim.

As fastembed defines them (fastembed/postprocess/muvera.py, after Dhulipala et al. 2024): for each of `r_reps`
repetitions, `k_sim` random hyperplanes (SimHash) split the token vectors into 2^k_sim buckets; a bucket holds the
sum of its vectors (documents: their mean, and an empty bucket takes the first vector of the nearest non-empty
bucket by Hamming distance of the bucket ids); buckets are projected to `dim_proj` by a random +-1 matrix scaled
by 1/sqrt(dim_proj) when dim_proj < dim, and everything is concatenated. The same seed gives fastembed's numbers.
"""

import numpy as np

from .vectors import to_numpy


class Muvera:
    """Multi-vector (n, dim) matrices -> fixed (r_reps * 2**k_sim * dim_proj,) float64 vectors.

    `process_document` for the corpus side, `process_query` for queries; score with a plain dot product.
    """

    def __init__(self, dim: int, k_sim: int = 5, dim_proj: int = 16, r_reps: int = 20, random_seed: int = 42):
        if dim_proj > dim:
            raise ValueError(f"Cannot project to a higher dimensionality (dim_proj={dim_proj} > dim={dim})")
        self.dim, self.k_sim, self.dim_proj, self.r_reps = dim, k_sim, dim_proj, r_reps
        generator = np.random.default_rng(random_seed)
        # drawn in fastembed's order (hyperplanes of each repetition in turn, then projections): the same numbers
        self.hyperplanes = np.stack([generator.normal(size=(dim, k_sim)) for _ in range(r_reps)])  # (R, dim, k)
        self.projections = generator.choice([-1, 1], size=(r_reps, dim, dim_proj))  # (R, dim, dim_proj)
        buckets = np.arange(2**k_sim)
        self.hamming = np.array([[bin(a ^ b).count("1") for b in buckets] for a in buckets])  # (B, B)

    @property
    def embedding_size(self) -> int:
        return self.r_reps * 2**self.k_sim * self.dim_proj

    def process_document(self, vectors) -> np.ndarray:
        """A document's FDE: bucket means, empty buckets filled."""
        return self.process(vectors, fill_empty_clusters=True, normalize_by_count=True)

    def process_query(self, vectors) -> np.ndarray:
        """A query's FDE: bucket sums, empty buckets left at zero."""
        return self.process(vectors, fill_empty_clusters=False, normalize_by_count=False)

    def process(self, vectors, fill_empty_clusters: bool = True, normalize_by_count: bool = True) -> np.ndarray:
        vectors = to_numpy(vectors)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim or not len(vectors):
            raise ValueError(f"Expected a non-empty (n, {self.dim}) matrix of token vectors, got {vectors.shape}")
        count = 2**self.k_sim
        out = []
        for hyperplanes, projection in zip(self.hyperplanes, self.projections, strict=True):
            ids = (vectors @ hyperplanes > 0) @ (1 << np.arange(self.k_sim))  # (n,) bucket of each vector
            centers = np.zeros((count, self.dim))
            np.add.at(centers, ids, vectors)  # in vector order, as a loop would add them
            sizes = np.bincount(ids, minlength=count)
            empty = sizes == 0
            if normalize_by_count:
                centers[~empty] /= sizes[~empty][:, None]
            if fill_empty_clusters and empty.any():
                nearest = np.argmin(np.where(empty[None, :], self.k_sim + 1, self.hamming), axis=1)
                first = np.zeros(count, np.int64)
                present, where = np.unique(ids, return_index=True)
                first[present] = where  # each non-empty bucket's first vector
                centers[empty] = vectors[first[nearest[empty]]]
            if self.dim_proj < self.dim:
                centers = (1 / np.sqrt(self.dim_proj)) * (centers @ projection)
            out.append(centers.ravel())
        return np.concatenate(out)
