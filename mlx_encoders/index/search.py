"""Top-k search over a built index: exact (one matrix product over every vector) below `ann_threshold` vectors,
else through the HNSW graph of `ann.py`, whose candidates are re-scored exactly. `precision` "int8" or "binary"
ranks candidates on quantized vectors (`vectors.quantize_embeddings`, as `SentenceEncoder.encode(precision=)`)
and re-scores the best of them with the stored float32 vectors. Scores are cosine similarities.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import folder_digest
from ..sentence import SentenceEncoder
from ..vectors import quantize_embeddings
from . import ann as ann_index
from .store import Store, StoreError

ANN_THRESHOLD = 50_000  # below this many vectors a matrix product is as fast as the graph, and exact
PRECISIONS = ("float32", "int8", "binary")


@dataclass
class Hit:
    id: str
    score: float
    text: str


def best(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` highest scores, best first (ties in index order); O(N), not a full sort."""
    top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    return top[np.lexsort((top, -scores[top]))]


def check_encoder(encoder: SentenceEncoder, meta: dict[str, str], where: Path) -> None:
    found = folder_digest(encoder.path)
    if found != meta.get("model_fingerprint"):
        raise StoreError(
            f"The index {where} was built with the model {meta.get('model')!r}; {str(encoder.path)!r} is another "
            "model (its files differ). Search with the index's model, or build the index with this one."
        )


class Index:
    """A built index opened for searching. `model` (a folder or hub id, or a SentenceEncoder) embeds text queries;
    by default the model the index was built with. `ann`: True/False forces the graph on or off, None uses it
    from `ann_threshold` vectors. `rescore`: candidates re-scored exactly per query (at least 4 x k)."""

    def __init__(
        self,
        folder: str | Path,
        model: str | SentenceEncoder | None = None,
        *,
        ann: bool | None = None,
        ann_threshold: int = ANN_THRESHOLD,
        precision: str = "float32",
        rescore: int = 100,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.folder, self.precision, self.rescore = Path(folder), precision, rescore
        with Store(self.folder / "index.sqlite") as store:
            if "generation" not in store.meta:
                raise StoreError(f"{store.path} holds no finished build; run the build (again) to finish it")
            self.meta = store.meta
            self.rows, self.vectors = store.vectors()
        self.model, self.encoder = model, model if isinstance(model, SentenceEncoder) else None
        self.graph, self.checked = None, False
        if ann if ann is not None else len(self.rows) >= ann_threshold:
            generation = self.meta["generation"]
            self.graph = ann_index.load(self.folder, precision, generation, len(self.rows))
            if self.graph is None:
                self.graph = ann_index.build(self.folder, self.rows, self.vectors, precision, generation)
        elif precision != "float32":
            self.codes = self.quantize(self.vectors)

    def quantize(self, vectors: np.ndarray) -> np.ndarray:
        """int8 codes (ranges from the whole index) or +-1 signs, held as float32 for a BLAS product: exact, as
        sums of int8 products stay below 2**24 up to 1040 dimensions."""
        if self.precision == "binary":
            return np.where(vectors > 0, 1, -1).astype(np.float32)
        if not hasattr(self, "ranges"):
            self.ranges = np.vstack([self.vectors.min(0), self.vectors.max(0)])
        return quantize_embeddings(vectors, "int8", ranges=self.ranges).astype(np.float32)

    def embed(self, query: str) -> np.ndarray:
        if self.encoder is None:
            self.encoder = SentenceEncoder(self.model or self.meta["model"])
        if not self.checked:  # once: it hashes the model's files
            check_encoder(self.encoder, self.meta, self.folder)
            self.checked = True
        return self.encoder.encode_query(query, normalize_embeddings=True)

    def search(self, query: str | np.ndarray, k: int = 10) -> list[Hit]:
        """The `k` best documents for `query` (a text, or a unit vector of the index's dimension), best first."""
        if k < 1:
            raise ValueError(f"k must be 1 or more, got {k}")
        vector = self.embed(query) if isinstance(query, str) else np.asarray(query, np.float32)
        positions, scores = self.nearest(vector, k)
        with Store(self.folder / "index.sqlite") as store:
            found = store.documents([int(self.rows[p]) for p in positions])
        hits = [Hit(i, float(s), t) for p, s in zip(positions, scores, strict=True) for i, t in found[self.rows[p]]]
        return hits[:k]

    def nearest(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, exact scores) of the best `k` vectors, best first."""
        if self.graph is not None:
            rows = ann_index.candidates(self.graph, vector, max(self.rescore, 4 * k), self.precision)
            pool = np.searchsorted(self.rows, rows)  # rows are stored ascending
        elif self.precision != "float32":
            coarse = self.codes @ self.quantize(vector[None])[0]
            pool = best(coarse, max(self.rescore, 4 * k))
        else:
            scores = self.vectors @ vector
            top = best(scores, k)
            return top, scores[top]
        scores = self.vectors[pool] @ vector
        top = best(scores, k)
        return pool[top], scores[top]


def search(index: str | Path, query: str, k: int = 10, model: str | SentenceEncoder | None = None, **options) -> list:
    """The `k` best documents of the index in folder `index` for `query`: [Hit(id, score, text)], best first.
    Opens the index each call; keep an `Index` to answer many queries."""
    return Index(index, model, **options).search(query, k)
