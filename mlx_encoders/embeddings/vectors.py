"""Embedding vectors after `encode()`: similarity scores and precision quantization.

Matches sentence-transformers' `util/similarity.py` (cos_sim, dot_score, euclidean_sim, manhattan_sim and
their pairwise forms: a (D,) vector counts as one row, so a matrix result is (1, M)) and
`util/quantization.py` (`quantize_embeddings`: int8/uint8 buckets from per-dimension min/max ranges,
binary/ubinary sign bits packed 8 to a byte). Similarities return float32 mx.arrays where they return torch
tensors; quantization works on numpy arrays, as theirs does.
"""

import warnings

import mlx.core as mx
import numpy as np

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
CALIBRATION_MIN_ROWS = 100  # fewer rows give unstable int8/uint8 ranges; sentence-transformers warns below this too
CHUNK_ELEMENTS = 2**24  # distance matrices are computed in row chunks of at most this many (rows, M, D) elements


def as_float(x) -> mx.array:
    """float32 mx.array from a numpy array, an mx.array, or a list of either (stacked) or of numbers."""
    if isinstance(x, list) and x and all(isinstance(v, mx.array) for v in x):
        x = mx.stack(x)
    return x.astype(mx.float32) if isinstance(x, mx.array) else mx.array(np.asarray(x, dtype=np.float32))


def to_numpy(x) -> np.ndarray:
    """`np.asarray(x)`, an mx.array in bfloat16 (which numpy has no type for) widened to float32 first."""
    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.asarray(x)


def as_matrix(x) -> mx.array:
    x = as_float(x)
    return x[None] if x.ndim == 1 else x


def normalize(x: mx.array) -> mx.array:
    """Unit length along the last axis, as torch's F.normalize (norms below 1e-12 divide by 1e-12)."""
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def distances(a: mx.array, b: mx.array, p: int) -> mx.array:
    """(N, D) x (M, D) -> (N, M) L1 (p=1) or L2 (p=2) distances, as torch.cdist, a chunk of rows at a time."""
    rows = max(1, CHUNK_ELEMENTS // max(b.size, 1))
    parts = []
    for start in range(0, a.shape[0], rows):
        diff = mx.abs(a[start : start + rows, None] - b[None])  # (rows, M, D)
        parts.append(diff.sum(-1) if p == 1 else mx.sqrt((diff * diff).sum(-1)))
    return mx.concatenate(parts) if parts else mx.zeros((0, b.shape[0]))


def cos_sim(a, b) -> mx.array:
    return normalize(as_matrix(a)) @ normalize(as_matrix(b)).T


def dot_score(a, b) -> mx.array:
    return as_matrix(a) @ as_matrix(b).T


def euclidean_sim(a, b) -> mx.array:
    return -distances(as_matrix(a), as_matrix(b), 2)


def manhattan_sim(a, b) -> mx.array:
    return -distances(as_matrix(a), as_matrix(b), 1)


def pairwise_cos_sim(a, b) -> mx.array:
    return (normalize(as_float(a)) * normalize(as_float(b))).sum(-1)


def pairwise_dot_score(a, b) -> mx.array:
    return (as_float(a) * as_float(b)).sum(-1)


def pairwise_euclidean_sim(a, b) -> mx.array:
    diff = as_float(a) - as_float(b)
    return -mx.sqrt((diff * diff).sum(-1))


def pairwise_manhattan_sim(a, b) -> mx.array:
    return -mx.abs(as_float(a) - as_float(b)).sum(-1)


# similarity_fn_name -> (every row with every row, row i with row i)
SIMILARITIES = {
    "cosine": (cos_sim, pairwise_cos_sim),
    "dot": (dot_score, pairwise_dot_score),
    "euclidean": (euclidean_sim, pairwise_euclidean_sim),
    "manhattan": (manhattan_sim, pairwise_manhattan_sim),
}


def check_similarity_name(name, known=SIMILARITIES) -> str:
    """`name` (or a `SimilarityFunction` member's value) when `known`."""
    name = getattr(name, "value", name)
    if name not in known:
        raise ValueError(f"similarity_fn_name must be one of {', '.join(known)}, got {name!r}")
    return name


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"Precision {precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    return precision


def quantization_ranges(embeddings: np.ndarray, precision: str, calibration: np.ndarray | None) -> np.ndarray:
    """(2, D): per-dimension min and max of `calibration`, else of the embeddings themselves."""
    if calibration is None:
        if embeddings.ndim == 1 or embeddings.shape[0] == 1:
            raise ValueError(
                f"Cannot compute {precision} quantization ranges from a single embedding. Call "
                "`quantize_embeddings` with `ranges` or `calibration_embeddings` from a representative set of "
                "embeddings instead."
            )
        if embeddings.shape[0] < CALIBRATION_MIN_ROWS:
            warnings.warn(
                f"Computing {precision} quantization buckets based on {len(embeddings)} embeddings. {precision} "
                "quantization is more stable with `ranges` calculated from more embeddings or a "
                "`calibration_embeddings` that can be used to calculate the buckets.",
                UserWarning,
                stacklevel=3,
            )
        calibration = embeddings
    calibration = to_numpy(calibration)
    return np.vstack((np.min(calibration, axis=0), np.max(calibration, axis=0)))


def quantize_embeddings(
    embeddings,
    precision: str,
    ranges: np.ndarray | None = None,
    calibration_embeddings: np.ndarray | None = None,
) -> np.ndarray | list[np.ndarray]:
    """Float embeddings -> `precision`, as sentence-transformers' `quantize_embeddings`.

    int8/uint8: 256 buckets per dimension between the `ranges` (2, D) min/max, else those of
    `calibration_embeddings`, else of `embeddings` themselves (which needs 2 rows or more). binary/ubinary: the
    sign bits (x > 0) packed 8 to a byte, (N, ceil(D / 8)), binary shifted by -128 into int8. A list of (L, D)
    matrices (token embeddings) is quantized matrix by matrix with ranges shared across the list.
    """
    check_precision(precision)
    if isinstance(embeddings, list):
        if not embeddings:
            return []
        matrices = [to_numpy(m) for m in embeddings]
        if matrices[0].ndim == 2:
            if precision.endswith("int8") and ranges is None:
                data = np.concatenate(matrices) if calibration_embeddings is None else calibration_embeddings
                if len(data):
                    ranges = quantization_ranges(data, precision, calibration_embeddings)
            return [quantize_embeddings(m, precision, ranges, calibration_embeddings) for m in matrices]
        embeddings = np.array(matrices)
    embeddings = to_numpy(embeddings)
    if embeddings.dtype in (np.uint8, np.int8):
        raise ValueError("Embeddings to quantize must be float rather than int8 or uint8.")
    if precision == "float32":
        return embeddings.astype(np.float32)
    if embeddings.ndim == 2 and embeddings.shape[0] == 0:  # nothing to calibrate or pack
        width = embeddings.shape[1] if precision.endswith("int8") else (embeddings.shape[1] + 7) // 8
        return np.zeros((0, width), np.int8 if precision in ("int8", "binary") else np.uint8)
    if precision.endswith("int8"):
        if ranges is None:
            ranges = quantization_ranges(embeddings, precision, calibration_embeddings)
        ranges = to_numpy(ranges).astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        codes = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return codes.astype(np.uint8) if precision == "uint8" else (codes - 128).astype(np.int8)
    bits = np.packbits(embeddings > 0, axis=-1)
    return (bits - 128).astype(np.int8) if precision == "binary" else bits
