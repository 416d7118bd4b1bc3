"""Top-k search over a built index: exact (one matrix product over every vector) below `ann_threshold` vectors,
else through the HNSW graph of `ann.py` where it reaches the recall asked for faster, its candidates re-scored
exactly. `precision` "int8" or "binary"
ranks candidates on quantized vectors (`vectors.quantize_embeddings`, as `SentenceEncoder.encode(precision=)`)
and re-scores the best of them with the stored float32 vectors. Scores are cosine similarities.

An index built with a sparse model also answers `mode="sparse"` (exact: the dot product of the query's weights
with the postings of its terms) and `mode="hybrid"`: each mode's best `depth` texts fused by reciprocal-rank
fusion (`rrf`: the sum over the rankings of 1 / (rrf_k + rank), rank from 1) or `weighted` (alpha x the dense
score + (1 - alpha) x the sparse score, each min-max normalised over its ranking; 0 where a text is absent).
"""

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import folder_digest
from ..embeddings.sentence import SentenceEncoder
from ..embeddings.sparse import SparseEncoder, SparseVectors
from ..embeddings.vectors import quantize_embeddings
from ..errors import OptionError
from . import ann as ann_index
from .store import Store, StoreError

ANN_THRESHOLD = 50_000  # below this many vectors a matrix product is as fast as the graph, and exact
PRECISIONS = ("float32", "int8", "binary")


def check_graph_options(precision: str, recall: float) -> None:
    """A precision the index holds vectors in and a recall a graph can be calibrated for."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if isinstance(recall, bool) or not isinstance(recall, (int, float)) or not 0 < recall <= 1:
        raise OptionError(f"recall must be a number in (0, 1], got {recall!r}")


MODES = ("dense", "sparse", "hybrid")
FUSIONS = ("rrf", "weighted")
RRF_K = 60  # reciprocal-rank fusion's constant, as its authors (Cormack et al. 2009) and most engines use
MAX_K = 10_000  # the most results (and hybrid depth) one search returns: bounds the work a request can ask for


class StaleIndex(StoreError):
    """The store was rebuilt after this `Index` read its vectors: open the index again."""


@dataclass
class Hit:
    id: str
    score: float
    text: str


def best(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` highest scores, best first, ties in index order (at the cut too, so that a smaller `k`
    gives the start of a larger one's answer); O(N), not a full sort."""
    if k <= 0:
        return np.zeros(0, np.int64)
    if k >= len(scores):
        top = np.arange(len(scores))
    else:
        cut = scores[np.argpartition(-scores, k - 1)[k - 1]]  # the k-th highest score
        above = np.flatnonzero(scores > cut)
        top = np.concatenate([above, np.flatnonzero(scores == cut)[: k - len(above)]])
    return top[np.lexsort((top, -scores[top]))]


def recorded(kind: type, given, meta: dict[str, str], key: str, where: Path):
    """The encoder `given` (a folder or hub id), else the one the index records under `key`."""
    if given:
        return kind(given)
    try:
        return kind(meta[key])
    except FileNotFoundError as e:  # an index copied from another machine, or built with a relative folder
        recorded_as = "a folder on the machine that built it" if Path(meta[key]).is_absolute() else (
            "a folder relative to where it was built, or a hub id"
        )  # fmt: skip
        raise FileNotFoundError(
            f"The index {where} records its {key.replace('_', ' ')} as {meta[key]!r}, as given when it was built: "
            f"{recorded_as}. Pass the model (--{key.replace('_', '-')} PATH or {key}=PATH) to search it. ({e})"
        ) from e


def check_encoder(encoder, meta: dict[str, str], where: Path, kind: str = "model") -> None:
    found = folder_digest(encoder.path)
    if found != meta.get(f"{kind}_fingerprint"):
        raise StoreError(
            f"The index {where} was built with the {kind.replace('_', ' ')} {meta.get(kind)!r}; "
            f"{str(encoder.path)!r} is another model (its files differ). Search with the index's model, or build "
            "the index with this one."
        )


def fuse(
    rankings: list[tuple[np.ndarray, np.ndarray]],
    fusion: str = "rrf",
    rrf_k: float = RRF_K,
    weights: tuple[float, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, fused scores), best first (ties by row), of several (rows, scores) rankings, each best first:
    `rrf` sums 1 / (rrf_k + rank) over the rankings a row is in; `weighted` sums weight x its min-max normalised
    score (1 when all of a ranking's scores are equal)."""
    total: dict[int, float] = {}
    for i, (rows, scores) in enumerate(rankings):
        if fusion == "rrf":
            parts = 1.0 / (rrf_k + np.arange(1, len(rows) + 1))
        else:
            low, high = (float(scores.min()), float(scores.max())) if len(scores) else (0.0, 0.0)
            normal = (scores - low) / (high - low) if high > low else np.ones(len(scores))
            parts = (1.0 if weights is None else weights[i]) * normal
        for row, part in zip(rows.tolist(), parts.tolist(), strict=True):
            total[row] = total.get(row, 0.0) + part
    order = sorted(total, key=lambda row: (-total[row], row))
    return np.array(order, np.int64), np.array([total[row] for row in order], np.float64)


class Index:
    """A built index opened for searching. `model` (a folder or hub id, or a SentenceEncoder) embeds text queries;
    by default the model the index was built with; so does `sparse_model` (a SparseEncoder or its folder) for an
    index built with one. `ann`: True/False forces the graph on or off, None may use it from `ann_threshold`
    vectors: with the least search expansion its calibration says reaches `recall` (recall@10), or exactly where
    it cannot or is no faster (`ann.plan`); `ef_search` sets the expansion by hand. `rescore`: candidates
    re-scored exactly per query (at least 4 x k). `way` (and `describe()`, in words) says which way searches
    answer. `write=False` never writes into the folder: where the graph is missing or stale, search is exact
    instead of building it.

    The vectors are read once, here; each search checks that the store is still the build they came from and
    raises `StaleIndex` (a StoreError) once the index has been rebuilt: open it again."""

    def __init__(
        self,
        folder: str | Path,
        model: str | SentenceEncoder | None = None,
        *,
        sparse_model: str | SparseEncoder | None = None,
        ann: bool | None = None,
        ann_threshold: int = ANN_THRESHOLD,
        precision: str = "float32",
        rescore: int = ann_index.CANDIDATES,
        recall: float = ann_index.RECALL,
        ef_search: int | None = None,
        write: bool = True,
    ):
        check_graph_options(precision, recall)
        for name, value in (("ef_search", ef_search), ("rescore", rescore)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise OptionError(f"{name} must be an integer of 1 or more, got {value!r}")
        self.folder, self.precision, self.rescore = Path(folder), precision, rescore
        with Store(self.folder / "index.sqlite") as store:
            self.meta = store.begin_read()  # the meta and the vectors of one build
            if "generation" not in self.meta:
                raise StoreError(f"{store.path} holds no finished build; run the build (again) to finish it")
            store.require_checksums()
            self.generation = generation_of(self.meta)
            self.dense = self.meta.get("model_fingerprint", "") != ""
            count = store.count()
            wanted = self.dense and (ann if ann is not None else count >= ann_threshold)
            loaded = self.saved_graph(count, write) if wanted else None
            floats = loaded and loaded[2]
            self.rows, self.vectors = floats or store.vectors()  # a quantized graph's floats stay on disk
        self.model, self.encoder = model, model if isinstance(model, SentenceEncoder) else None
        self.sparse_model = sparse_model
        self.sparse_encoder = sparse_model if isinstance(sparse_model, SparseEncoder) else None
        self.sparse = self.meta.get("sparse_model_fingerprint", "") != ""
        self.graph, self.checked, self.scale = None, set(), 1.0
        self.loading = threading.Lock()  # the models, loaded on the first search that needs them
        self.way = {"method": "exact", "vectors": len(self.rows), "precision": precision}
        if wanted:
            self.open_graph(recall, ef_search, forced=ann is True, write=write, loaded=loaded and loaded[:2])
        if self.dense and self.graph is None and precision == "int8":  # binary searches its float32 vectors then
            self.codes = self.quantize(self.vectors)

    def saved_graph(self, count: int, write: bool) -> tuple | None:
        """(graph, record, (rows, float32 vectors memory-mapped) or None for a float32 graph) of the saved graph
        when it matches the store, else None (`ann.load`, `ann.mapped`)."""
        generation, precision = self.meta["generation"], self.precision
        loaded = ann_index.load(self.folder, precision, generation, count, write, self.meta.get("store_id"))
        if loaded is None or precision == "float32":
            return loaded and (*loaded, None)
        floats = ann_index.mapped(self.folder, precision, loaded[1], count, int(self.meta["dimension"]), write)
        return floats and (*loaded, floats)

    def open_graph(self, recall: float, ef_search: int | None, forced: bool, write: bool, loaded) -> None:
        """Use the `loaded` graph (or build one, and calibrate it), then choose how searches answer (`way`):
        through it with the least expansion its calibration says reaches `recall` (or `ef_search`), or exactly
        where it cannot reach `recall` or is no faster than the exact product (unless `forced`)."""
        generation, precision = self.meta["generation"], self.precision
        if loaded is None and write and not os.access(self.folder, os.W_OK):
            self.way["why"] = "the folder is read-only: no graph is built"  # searched from the store file alone
            return
        if loaded is None and write:
            loaded = ann_index.build(self.folder, self.rows, self.vectors, precision, generation, recall, self.rescore,
                                     self.meta.get("store_id"))  # fmt: skip
            if precision != "float32":  # re-score from the file just written, not from memory
                floats = ann_index.mapped(self.folder, precision, loaded[1], len(self.rows), self.vectors.shape[1])
                self.rows, self.vectors = floats or (self.rows, self.vectors)
        if loaded is None:
            return
        graph, info = loaded
        self.scale = info.get("scale", 1.0)
        if "calibration" not in info and write:  # a graph of an earlier version: measure it once
            built_for = info.get("recall", recall)
            info["calibration"] = ann_index.calibrate(graph, self.rows, self.vectors, precision, self.rescore,
                                                      scale=self.scale, built_for=built_for)  # fmt: skip
            ann_index.write_record(ann_index.paths(self.folder, precision)[1], info)
        if ef_search is not None or "calibration" not in info:
            chosen = {"expansion_search": ef_search or 2 * self.rescore, "recall": None}
        else:
            chosen = ann_index.plan(info, recall, forced)
        if chosen is None:
            self.way["why"] = f"the graph is no faster at recall@10 {recall} (calibrated at build)"
            return
        self.graph = graph
        self.way = {"method": "graph", "vectors": len(self.rows), "precision": precision,
                    "connectivity": graph.connectivity, "expansion_search": chosen["expansion_search"],
                    "candidates": ann_index.pool(self.rescore, chosen["expansion_search"], precision),
                    "recall": chosen["recall"]}  # fmt: skip

    def describe(self) -> str:
        """How searches of this index answer, in words (`way`)."""
        way = self.way
        if way["method"] == "exact":
            why = f"; {way['why']}" if "why" in way else ""
            return f"exact search over {way['vectors']} vectors ({way['precision']}{why})"
        measured = "not measured" if way["recall"] is None else f"{way['recall']} measured at build"
        return (
            f"HNSW graph search over {way['vectors']} vectors ({way['precision']}): connectivity "
            f"{way['connectivity']}, expansion_search {way['expansion_search']}, {way['candidates']} candidates "
            f"re-scored; recall@10 {measured}"
        )

    def memory(self) -> dict[str, int]:
        """Bytes this index holds in memory to answer dense searches: the graph (its nodes, links and vectors:
        usearch's serialized length, the bytes they fill; its `memory_usage` counts the arenas reserved for
        growth as well), the float32 vectors (none where a quantized graph's are memory-mapped: it reads the few
        it re-scores from the page cache; an exact search reads them all) and the quantized codes of an exact
        search."""
        held = self.graph is None or not isinstance(self.vectors, np.memmap)
        return {
            "graph": int(self.graph.serialized_length) if self.graph is not None else 0,
            "float32 vectors": int(self.vectors.nbytes) if held else 0,
            "codes": int(self.codes.nbytes) if hasattr(self, "codes") else 0,
        }

    def quantize(self, vectors: np.ndarray) -> np.ndarray:
        """int8 codes (ranges from the whole index, per dimension) or +-1 signs, held as float32 for a BLAS
        product."""
        if self.precision == "binary":
            return np.where(vectors > 0, 1, -1).astype(np.float32)
        if not hasattr(self, "ranges"):
            self.ranges = np.vstack([self.vectors.min(0), self.vectors.max(0)])
        return quantize_embeddings(vectors, "int8", ranges=self.ranges).astype(np.float32)

    def embed(self, query: str) -> np.ndarray:
        with self.loading:  # threads searching a new index load its model once
            if self.encoder is None:
                self.encoder = recorded(SentenceEncoder, self.model, self.meta, "model", self.folder)
            if "model" not in self.checked:  # once: it hashes the model's files
                check_encoder(self.encoder, self.meta, self.folder)
                self.checked.add("model")
        return self.encoder.encode_query(query, normalize_embeddings=True)

    def embed_sparse(self, query: str | SparseVectors) -> tuple[np.ndarray, np.ndarray]:
        """(term ids, weights) of a text query (by the sparse model) or of one sparse vector."""
        if isinstance(query, str):
            with self.loading:
                if self.sparse_encoder is None:
                    model = self.sparse_model
                    self.sparse_encoder = recorded(SparseEncoder, model, self.meta, "sparse_model", self.folder)
                if "sparse_model" not in self.checked:
                    check_encoder(self.sparse_encoder, self.meta, self.folder, "sparse_model")
                    self.checked.add("sparse_model")
            query = self.sparse_encoder.encode_query(query)
        if len(query.shape) == 2 and query.shape[0] != 1:
            raise ValueError(
                f"a sparse query is one vector; got a SparseVectors of {query.shape[0]} rows (shape {query.shape}): "
                "search with one query at a time (encode_query of one text gives one vector)"
            )
        return query.col, query.data

    def search(
        self,
        query: str | np.ndarray | SparseVectors | tuple[np.ndarray | None, SparseVectors | None],
        k: int = 10,
        *,
        mode: str | None = None,
        fusion: str = "rrf",
        rrf_k: float = RRF_K,
        alpha: float = 0.5,
        depth: int = 100,
    ) -> list[Hit]:
        """The `k` best documents for `query`, best first: a text, a unit vector of the index's dimension (dense),
        one sparse vector (sparse), or a (unit vector, sparse vector) pair of the same query embedded elsewhere
        (either mode, and hybrid; a server embeds queries so). `mode`: "dense" (default when the index has a dense
        model), "sparse" or "hybrid" (each mode's best `depth` texts fused by `fusion`, "rrf" with `rrf_k` or
        "weighted" with the dense share `alpha`)."""
        mode = self.check_mode(mode, k, fusion, rrf_k, alpha, depth)
        dense, sparse = query if isinstance(query, tuple) else (query, query)
        if mode == "hybrid" and not isinstance(query, (str, tuple)):
            raise TypeError(
                f"a hybrid search takes a text or a (vector, sparse vector) pair, got {type(query).__name__}"
            )
        with self.snapshot() as store:  # postings and documents of the build the vectors come from
            if mode == "dense":
                rows, scores = self.dense_nearest(dense, k)
            elif mode == "sparse":
                rows, scores = self.sparse_nearest(sparse, k, store)
            else:
                rankings = [self.dense_nearest(dense, max(depth, k)), self.sparse_nearest(sparse, max(depth, k), store)]
                rows, scores = fuse(rankings, fusion, rrf_k, (alpha, 1 - alpha))
                rows, scores = rows[:k], scores[:k]
            found = store.documents([int(r) for r in rows])
        hits = [Hit(i, float(s), t) for r, s in zip(rows, scores, strict=True) for i, t in found[int(r)]]
        return hits[:k]

    @contextmanager
    def snapshot(self) -> Iterator[Store]:
        """The store as of one moment (a read transaction), checked to be the build this index was opened at."""
        with Store(self.folder / "index.sqlite") as store:
            now = generation_of(store.begin_read())  # every read below sees one build, even if another commits
            if now != self.generation:
                raise StaleIndex(
                    f"The index {self.folder} was rebuilt (generation {now[0]}) after it was opened (generation "
                    f"{self.generation[0]}), and its vectors are the old build's: open the index again (a server "
                    "reopens it by itself)."
                )
            yield store

    def check_mode(self, mode: str | None, k: int, fusion: str, rrf_k: float, alpha: float, depth: int) -> str:
        mode = mode or ("dense" if self.dense else "sparse")
        for name, value in (("k", k), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_K:
                raise OptionError(f"{name} must be a whole number from 1 to {MAX_K}, got {value!r}")
        if mode not in MODES or fusion not in FUSIONS:
            raise OptionError(f"mode must be one of {MODES} and fusion one of {FUSIONS}; got {mode!r}, {fusion!r}")
        if not (math.isfinite(rrf_k) and rrf_k >= 0) or not 0 <= alpha <= 1:  # NaN fails every comparison
            raise OptionError(f"rrf_k must be finite, 0 or more, and alpha within [0, 1]; got {rrf_k}, {alpha}")
        for kind, present, option in (("dense", self.dense, "--model"), ("sparse", self.sparse, "--sparse-model")):
            if mode in (kind, "hybrid") and not present:
                raise ValueError(
                    f"The index {self.folder} has no {kind} model, so it cannot answer a {mode} search; build it "
                    f"with {option} (into a new --index folder) or search with another mode."
                )
        return mode

    def dense_nearest(self, query: str | np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, cosine scores) of the best `k` texts, best first."""
        vector = self.embed(query) if isinstance(query, str) else np.asarray(query, np.float32)
        if vector.shape != self.vectors.shape[1:]:
            raise ValueError(
                f"a query vector of shape {vector.shape}, but the index {self.folder} holds vectors of "
                f"{self.vectors.shape[1]} dimensions: embed the query with the index's model"
            )
        if not np.isfinite(vector).all():  # no ranking by NaN: every comparison fails and nothing was found
            raise ValueError(f"a query vector with NaN or infinite values; the index {self.folder} ranks finite ones")
        positions, scores = self.nearest(vector, k)
        return self.rows[positions], scores

    def sparse_nearest(
        self, query: str | SparseVectors, k: int, store: Store | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows, dot products) of the best `k` texts sharing a term with the query, best first (ties by row), read
        from `store` (a `snapshot`; else one of its own)."""
        terms, weights = self.embed_sparse(query)
        order = np.argsort(terms)
        terms, weights = terms[order], weights[order].astype(np.float64)
        if store is None:
            with self.snapshot() as store:
                found, rows, values = store.postings(terms)
        else:
            found, rows, values = store.postings(terms)
        rows, slots = np.unique(rows, return_inverse=True)  # ascending rows: ties go by row
        scores = np.bincount(slots, weights=values * weights[np.searchsorted(terms, found)], minlength=len(rows))
        top = best(scores, k) if len(rows) else np.zeros(0, np.int64)
        return rows[top], scores[top]

    def nearest(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, exact scores) of the best `k` vectors, best first; exactly when the candidates asked for
        would be every vector (a graph may leave a few nodes unreachable: a search for all of them must not)."""
        count = max(self.rescore, 4 * k)
        # binary codes alone rank too coarsely for a pool to hold the best (recall@10 about 0.5)
        if count >= len(self.rows) or (self.graph is None and self.precision != "int8"):
            scores = self.vectors @ vector
            top = best(scores, k)
            return top, scores[top]
        if self.graph is not None:  # the expansion grows with the candidates, as calibrated for rescore
            expansion = self.way["expansion_search"] * count // self.rescore
            count = ann_index.pool(count, expansion, self.precision)
            rows = ann_index.candidates_of(self.graph, vector, count, expansion, self.precision, self.scale)
            pool = np.searchsorted(self.rows, rows)  # rows are stored ascending
        else:  # int8 codes close enough that the rescored pool holds the exact best
            # a code c stands for low + (c + 128) * step per dimension: against the float query, codes @ (step * q)
            # orders the documents as their values do (the offsets add the same to every score)
            steps = (self.ranges[1] - self.ranges[0]) / 255
            coarse = self.codes @ (steps * vector).astype(np.float32)
            pool = best(coarse, count)
        scores = self.vectors[pool] @ vector
        top = best(scores, k)
        return pool[top], scores[top]


def generation_of(meta: dict[str, str]) -> tuple[str | None, str | None]:
    """What tells builds of a store apart: its generation, and the id of the store (a folder deleted and built
    again starts at generation 1 again)."""
    return meta.get("generation"), meta.get("store_id")


def search(
    index: str | Path,
    query: str,
    k: int = 10,
    model: str | SentenceEncoder | None = None,
    *,
    mode: str | None = None,
    fusion: str = "rrf",
    rrf_k: float = RRF_K,
    alpha: float = 0.5,
    depth: int = 100,
    **options,
) -> list:
    """The `k` best documents of the index in folder `index` for `query`: [Hit(id, score, text)], best first.
    `mode`, `fusion`, `rrf_k`, `alpha`, `depth` as `Index.search`; `options` go to `Index`. Opens the index each
    call (again, should a build commit between its opening and its search); keep an `Index` to answer many queries."""
    for attempt in (1, 2):
        try:
            return Index(index, model, **options).search(
                query, k, mode=mode, fusion=fusion, rrf_k=rrf_k, alpha=alpha, depth=depth
            )
        except StaleIndex:
            if attempt == 2:
                raise
