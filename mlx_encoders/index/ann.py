"""An approximate nearest-neighbour index (usearch's HNSW graph) built from the store's vectors.

Saved as `ann-<precision>.usearch` beside a JSON record of the store generation it was built from, its size and
CRC-32, its parameters and its calibration. Both are written to a temporary name and renamed into place, the record
last: a kill between the two leaves a record that no longer matches, so the file is rebuilt. A stale, damaged or
missing file is rebuilt.

Recall is measured, not assumed: the graph's connectivity and expansion at build follow the index's size and the
recall asked for (`parameters`), and the graph is calibrated (`calibrate`): CALIBRATION_QUERIES of the index's
vectors, held out of the graph until then, are answered exactly and through it at a ladder of search expansions,
each level's recall@10 and median time recorded. A search then walks with the least expansion
that reached the recall it asks for (`plan`), or answers exactly where the graph cannot reach it or is no faster.
"""

import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

# precision -> (usearch scalar kind, metric); binary packs sign bits 8 to a byte and compares by Hamming distance
KINDS = {"float32": ("f32", "ip"), "int8": ("i8", "ip"), "binary": ("b1", "hamming")}
RECALL = 0.95  # the recall@10 a search asks for by default
CANDIDATES = 100  # graph candidates re-scored exactly per query (at least 4 x k)
CALIBRATION_QUERIES = 100
LADDER = (1, 2, 4, 8, 16, 32)  # search expansions tried at calibration, in multiples of the candidates
ENOUGH = 0.999  # a calibration level this good ends the ladder: more expansion only costs time
HOLD_OUT_FROM = 10 * CALIBRATION_QUERIES  # from this many vectors the calibration queries join the graph after it


def usearch_index():
    try:
        from usearch.index import Index
    except ImportError:
        raise ImportError(
            "The approximate index needs usearch: pip install 'mlx-encoders[index]' (or search with ann=False)"
        ) from None
    return Index


def as_input(vectors: np.ndarray, precision: str) -> np.ndarray:
    return np.packbits(vectors > 0, axis=-1) if precision == "binary" else np.ascontiguousarray(vectors, np.float32)


def crc(path: Path) -> int:
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def paths(folder: Path, precision: str) -> tuple[Path, Path]:
    return folder / f"ann-{precision}.usearch", folder / f"ann-{precision}.json"


def parameters(count: int, recall: float) -> dict[str, int]:
    """The graph's connectivity (links per node) and expansion at build for `count` vectors and the recall asked
    for: denser links and a wider search at insertion make a graph whose walk reaches high recall in fewer steps,
    at a cost in build time and memory that grows with both; a larger graph needs them sooner, as its walk from
    the entry point is longer."""
    if recall <= 0.9:
        return {"connectivity": 16, "expansion_add": 64}
    if recall <= 0.95 and count <= 200_000:
        return {"connectivity": 16, "expansion_add": 128}
    return {"connectivity": 32, "expansion_add": 200}


def build(folder: Path, rows: np.ndarray, vectors: np.ndarray, precision: str, generation: str,
          recall: float = RECALL, candidates: int = CANDIDATES):  # fmt: skip
    """A new HNSW index of `vectors` keyed by their store rows, built for `recall` and calibrated with
    `candidates` re-scored, saved atomically into `folder`. Returns (the index, its record)."""
    kind, metric = KINDS[precision]
    chosen = parameters(len(rows), recall)
    index = usearch_index()(ndim=vectors.shape[1], metric=metric, dtype=kind, **chosen)
    held = sample(len(rows)) if len(rows) >= HOLD_OUT_FROM else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(len(rows)), held)
    for part in (rest, held):  # in bulk: usearch inserts on every core
        if len(part):
            index.add(rows[part].astype(np.uint64), as_input(vectors[part], precision), threads=os.cpu_count() or 1)
        if part is rest:  # measured on vectors the graph has not seen, as a query is
            calibration = calibrate(index, rows, vectors, precision, candidates, held if len(held) else None)
    file, record = paths(folder, precision)
    temporary = file.with_name(file.name + ".tmp")
    try:
        index.save(str(temporary))
    except RuntimeError as e:  # usearch's report of a file it cannot write
        raise OSError(f"could not write {temporary}: {e}") from e
    os.replace(temporary, file)
    info = {"generation": generation, "rows": len(rows), "bytes": file.stat().st_size, "crc32": crc(file),
            "recall": recall, **chosen, "calibration": calibration}  # fmt: skip
    write_record(record, info)
    return index, info


def write_record(record: Path, info: dict) -> None:
    temporary = record.with_name(record.name + ".tmp")
    temporary.write_text(json.dumps(info))
    os.replace(temporary, record)


def rescored(index, vectors: np.ndarray, rows: np.ndarray, query: np.ndarray, k: int, candidates: int,
             expansion: int, precision: str) -> np.ndarray:  # fmt: skip
    """Positions of the best `k` of the graph's `candidates` for `query`, re-scored on the float32 vectors."""
    found = np.searchsorted(rows, candidates_of(index, query, candidates, expansion, precision))
    scores = vectors[found] @ query
    return found[np.argsort(-scores, kind="stable")[:k]]


def sample(count: int) -> np.ndarray:
    """The positions of the calibration queries: the same for the same number of vectors."""
    return np.sort(np.random.default_rng(0).choice(count, min(CALIBRATION_QUERIES, count), replace=False))


def calibrate(index, rows: np.ndarray, vectors: np.ndarray, precision: str, candidates: int,
              held: np.ndarray | None = None, k: int = 10) -> dict:  # fmt: skip
    """recall@k and median milliseconds of the graph at each expansion of LADDER (until one reaches ENOUGH), and
    the exact product's time (recalls independent of the machine's load, times not). The queries are `held`,
    vectors left out of the graph (and of the true neighbours); else the `sample` of its own vectors, each one's
    own match left out (a graph walk that finds the query itself finds its neighbours sooner: a recall somewhat
    high)."""
    picks = sample(len(rows)) if held is None else held
    left_out = len(picks) if held is not None else 1
    k = min(k, len(rows) - left_out)
    if k < 1:
        return {"queries": 0, "k": 0, "candidates": candidates, "exact_ms": 0.0, "levels": []}
    truth, times = [], []
    for position in picks:
        start = time.perf_counter()
        scores = vectors @ vectors[position]
        scores[picks if held is not None else position] = -np.inf
        best = np.argpartition(-scores, k - 1)[:k]
        times.append(time.perf_counter() - start)
        truth.append(set(best.tolist()))
    exact_ms = 1000 * statistics.median(times)
    levels = []
    for multiple in LADDER:
        expansion, found, times = candidates * multiple, 0, []
        for position, expected in zip(picks, truth, strict=True):
            start = time.perf_counter()
            top = rescored(index, vectors, rows, vectors[position], k + 1 - (held is not None), candidates, expansion,
                           precision)  # fmt: skip
            times.append(time.perf_counter() - start)
            found += len(expected & (set(top.tolist()) - {int(position)}))
        levels.append([expansion, round(found / (k * len(picks)), 4), round(1000 * statistics.median(times), 4)])
        if levels[-1][1] >= ENOUGH:
            break
    return {"queries": len(picks), "k": k, "candidates": candidates, "exact_ms": round(exact_ms, 4), "levels": levels}


def plan(info: dict, recall: float, forced: bool) -> dict | None:
    """How a search of `recall` answers, from the graph's calibration: {"expansion_search", "recall" (measured),
    "ms"} of the least expansion that reached `recall`, or None (exact) where none did or the exact product was
    as fast. `forced` (the graph at any cost): the least expansion that reached it, else the widest measured."""
    calibration = info["calibration"]
    levels = calibration["levels"]
    if not levels:  # too few vectors to measure: every one is a candidate
        return {"expansion_search": calibration["candidates"], "recall": 1.0, "ms": 0.0}
    reached = [level for level in levels if level[1] >= recall]
    if not forced and (not reached or reached[0][2] >= calibration["exact_ms"]):
        return None
    expansion, measured, ms = (reached or levels[-1:])[0]
    return {"expansion_search": expansion, "recall": measured, "ms": ms}


def load(folder: Path, precision: str, generation: str, count: int, rebuild: bool = True):
    """(The saved index, its record) when it matches the store (generation, row count) and its bytes; else None,
    with the reason on stderr (and whether the caller `rebuild`s it or searches without it)."""
    file, record = paths(folder, precision)
    if not file.exists() or not record.exists():
        return None
    try:
        info = json.loads(record.read_text())
        reason = None
        if info.get("generation") != generation or info.get("rows") != count:
            reason = "stale: the store changed since it was built"
        elif info.get("bytes") != file.stat().st_size or info.get("crc32") != crc(file):
            reason = "damaged: its bytes do not match its record"
        else:
            index = usearch_index().restore(str(file))
            reason = None if index is not None and len(index) == count else "unreadable"
    except (OSError, ValueError, RuntimeError) as e:
        reason = f"unreadable: {e}"
    if reason is None:
        return index, info
    then = "rebuilding" if rebuild else "searching exactly, without"
    print(f"mlx-encoders index: {then} {file} ({reason})", file=sys.stderr)
    return None


def candidates_of(index, query: np.ndarray, count: int, expansion: int, precision: str) -> np.ndarray:
    """Store rows of the (up to) `count` nearest vectors to `query` in the graph, its walk keeping `expansion`
    candidates (at least `count`): recall rises with it, and so does the time."""
    index.expansion_search = max(expansion, count)
    matches = index.search(as_input(query[None], precision)[0], count)
    return np.asarray(matches.keys, np.int64)
