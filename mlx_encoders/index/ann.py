"""An approximate nearest-neighbour index (usearch's HNSW graph) built from the store's vectors.

Saved as `ann-<precision>.usearch` beside a JSON record of the store generation it was built from, its size and
CRC-32, its parameters and its calibration. Both are written to a temporary name and renamed into place, the record
last: a kill between the two leaves a record that no longer matches, so the file is rebuilt. A stale, damaged or
missing file is rebuilt.

Recall is measured, not assumed: the graph's connectivity and expansion at build follow the index's size and the
recall asked for (`parameters`), and the graph is calibrated (`calibrate`): CALIBRATION_QUERIES of the index's
vectors, held out of the graph until then (from HOLD_OUT_FROM vectors; a smaller graph's own, each one's own match
left out), are answered exactly and through it at a ladder of search expansions (steps of at most a half, smaller
where walks are long, so a search walks little wider than its recall needs), each level's recall@10 and median
time recorded. A search then walks with the least expansion that reached the
recall it asks for (`plan`), or answers exactly where the graph cannot reach it or is no faster.

An int8 or binary graph holds a quarter or a 32nd of the float32 graph's vector bytes; its distances only
approximate the true ones, so candidates are re-scored in float32 (a binary walk's every one, an int8 walk's
best `candidates` by int8 distance: `pool`), from `ann-<precision>.f32` (the rows, then the float32 vectors, in
row order; its size and CRC-32 in the record) memory-mapped rather than held in memory. int8 codes are the
vectors times one factor (1 / the largest magnitude of any component) in 127ths: ranks by inner product are the
same, and the codes use the whole int8 range.
"""

import contextlib
import itertools
import json
import os
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from ..checkpoint.atomic import disk_full
from ..engine.runtime import huge_pages
from .export import running

# precision -> (usearch scalar kind, metric); binary packs sign bits 8 to a byte and compares by Hamming distance
KINDS = {"float32": ("f32", "ip"), "int8": ("i8", "ip"), "binary": ("b1", "hamming")}
RECALL = 0.95  # the recall@10 a search asks for by default
# a graph's search width is its state: each search sets its own and walks with it, one at a time
SEARCH_LOCK = threading.Lock()
CANDIDATES = 100  # graph candidates re-scored exactly per query (at least 4 x k)
# recall@10 over 5,000 neighbours: queries differ in how hard they are, and at a million vectors two sets of 200
# found 0.955 and 0.964 through the same walk; 500 measure it to about 0.005 (each costs a walk at every level)
CALIBRATION_QUERIES = 500
# search expansions tried at calibration, in multiples of the candidates: a search walks at the least level that
# reached its recall, and a walk's time grows with its expansion, so the steps are small where walks are long
LADDER = (1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32)
# a binary walk ranks by sign bits: at a million vectors it keeps 3-5x an int8 walk's candidates for its recall
BINARY_LADDER = (*LADDER, 40, 48, 64, 80, 96, 128)
ENOUGH = 0.999  # a calibration level this good ends the ladder: more expansion only costs time
# a level past the recall the graph was built for and this many times slower than the exact product ends it too: no
# search that may choose walks that wide (a binary graph's ladder over 20,000 vectors would walk on to 12,800)
SLOWER = 4
HOLD_OUT_FROM = 10 * CALIBRATION_QUERIES  # from this many vectors the calibration queries join the graph after it
ADD_BATCH = 100_000  # vectors handed to usearch per call
TIMED = 50  # calibration queries timed one at a time (the median of 50 is steady to a few %)
EXACT_BLOCK = 16_384  # vectors per block of the calibration's exact product (x 500 queries: 32 MB of scores)


def usearch_index():
    try:
        from usearch.index import Index
    except ImportError:
        raise ImportError(
            "The approximate index needs usearch: pip install usearch (in a checkout: pip install -e '.[index]'), or "
            "search with ann=False"
        ) from None
    return Index


def as_input(vectors: np.ndarray, precision: str, scale: float = 1.0) -> np.ndarray:
    """What usearch takes for `vectors` in a graph of `precision`: packed sign bits, int8 codes (the vectors
    times `scale` in 127ths, a query's beyond the range clipped), or float32."""
    if precision == "binary":
        return np.packbits(vectors > 0, axis=-1)
    if precision == "int8":  # usearch would scale each float vector to unit length first: most codes near 0
        return np.clip(np.rint(vectors * np.float32(127 * scale)), -127, 127).astype(np.int8)
    return np.ascontiguousarray(vectors, np.float32)


def pool(candidates: int, expansion: int, precision: str) -> int:
    """How many of the walk's candidates are re-scored, best first by the graph's own distance: `candidates` of a
    float32 or int8 walk (int8 products rank the true neighbours as float32 does: at a million vectors the best
    100 of a walk of 1200-2400 held the same top 10 as its best quarter, found 0.4-0.8 ms sooner); every one a
    binary walk kept, whose Hamming distances rank them only roughly."""
    return expansion if precision == "binary" else candidates


def int8_scale(vectors: np.ndarray) -> float:
    """The factor that maps the largest component magnitude to 1, the edge of usearch's int8 range."""
    largest = float(np.abs(vectors).max()) if vectors.size else 0.0
    return 1.0 / largest if largest > 0 else 1.0


def crc(path: Path) -> int:
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return value


def paths(folder: Path, precision: str) -> tuple[Path, Path]:
    return folder / f"ann-{precision}.usearch", folder / f"ann-{precision}.json"


def floats_path(folder: Path, precision: str) -> Path:
    return folder / f"ann-{precision}.f32"


PLACING = threading.Lock()


def temporary_for(file: Path) -> Path:
    """A temporary name for `file`, this process's own: searchers that open a new index at once each build its graph
    (a shared name was renamed from under the others); one a killed process left is removed by the next writer."""
    for stale in file.parent.glob(f".{file.name}.*.tmp"):
        pid = stale.name.removesuffix(".tmp").rsplit(".", 1)[-1].split("-")[0]
        if pid.isdigit() and not running(int(pid)):
            with contextlib.suppress(OSError):
                stale.unlink()
    return file.with_name(f".{file.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # threads of one process too


def write_floats(file: Path, rows: np.ndarray, vectors: np.ndarray) -> int:
    """The rows (int64) then the vectors (float32) of a quantized graph's re-scoring, under a temporary name.
    Returns the file's CRC-32, taken from the bytes as they are written."""
    temporary, value = temporary_for(file), 0
    try:
        with temporary.open("wb") as f:
            blocks = (vectors[start : start + 65536].astype("<f4").tobytes() for start in range(0, len(vectors), 65536))
            for data in itertools.chain([np.ascontiguousarray(rows, "<i8").tobytes()], blocks):  # no second copy
                f.write(data)
                value = zlib.crc32(data, value)
    except OSError as e:
        with contextlib.suppress(OSError):  # on a read-only folder the removal fails too: the write's error tells
            temporary.unlink(missing_ok=True)
        raise OSError(f"could not write {temporary}: {e}; search exactly (--exact) meanwhile") from e
    os.replace(temporary, file)
    return value


def mapped(folder: Path, precision: str, info: dict, count: int, dimension: int, rebuild: bool = True):
    """(rows in memory, float32 vectors memory-mapped) of a quantized graph, or None where the file is missing or
    its bytes do not match the record, with the reason on stderr (and whether the caller `rebuild`s the graph or
    searches without it)."""
    file = floats_path(folder, precision)
    try:
        size = file.stat().st_size
        ok = size == count * (8 + 4 * dimension) == info.get("floats_bytes") and crc(file) == info.get("floats_crc32")
    except OSError:
        ok = False
    if not ok:
        then = "rebuilding" if rebuild else "searching exactly, without"
        print(f"mlx-encoders index: {then} {paths(folder, precision)[0]} (its float32 file {file} is missing or "
              "does not match its record)", file=sys.stderr)  # fmt: skip
        return None
    rows = np.fromfile(file, "<i8", count)
    return rows, np.memmap(file, "<f4", "r", offset=8 * count, shape=(count, dimension))


def parameters(count: int, recall: float, precision: str = "float32") -> dict[str, int]:
    """The graph's connectivity (links per node) and expansion at build for `count` vectors of `precision` and the
    recall asked for: denser links and a wider search at insertion make a graph whose walk reaches high recall in
    fewer steps, at a cost in build time and memory that grows with both; a larger float32 graph needs them
    sooner, as its walk from the entry point is longer. A quantized graph's longer walk stays cheap (its distances
    are int8 or bit products), so it keeps the sparser graph that builds in half the time, and a narrower search
    at insertion: at a million int8 vectors, 96 walks as well as 128 (recall@10 0.9645 against 0.965 at width
    2000) and inserts in 0.8x the time."""
    if recall <= 0.9:
        return {"connectivity": 16, "expansion_add": 64}
    if recall <= 0.95 and precision != "float32":
        return {"connectivity": 16, "expansion_add": 96}
    if recall <= 0.95 and count <= 200_000:
        return {"connectivity": 16, "expansion_add": 128}
    return {"connectivity": 32, "expansion_add": 200}


def build(folder: Path, rows: np.ndarray, vectors: np.ndarray, precision: str, generation: str,
          recall: float = RECALL, candidates: int = CANDIDATES, store_id: str | None = None):  # fmt: skip
    """A new HNSW index of `vectors` keyed by their store rows, built for `recall` and calibrated with
    `candidates` re-scored, saved atomically into `folder` (with the float32 file of a quantized graph). Returns
    (the index, its record). `generation` and `store_id` (the store's meta) tell the store's builds apart."""
    kind, metric = KINDS[precision]
    chosen = parameters(len(rows), recall, precision)
    scale = int8_scale(vectors) if precision == "int8" else 1.0
    index = usearch_index()(ndim=vectors.shape[1], metric=metric, dtype=kind, **chosen)
    held = sample(len(rows)) if len(rows) >= HOLD_OUT_FROM else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(len(rows)), held)
    seconds = {"insert": 0.0}  # wall time of each stage, in the record
    for part in (rest, held):  # in bulk, on every core; ADD_BATCH at a time bounds the copies made for usearch
        started = time.perf_counter()
        for start in range(0, len(part), ADD_BATCH):
            batch = part[start : start + ADD_BATCH]
            with huge_pages():  # the memory this batch's nodes took
                index.add(rows[batch].astype(np.uint64), as_input(vectors[batch], precision, scale),
                          threads=os.cpu_count() or 1)  # fmt: skip
        seconds["insert"] += time.perf_counter() - started
        if part is rest:  # measured on vectors the graph has not seen, as a query is
            started = time.perf_counter()
            calibration = calibrate(index, rows, vectors, precision, candidates, held if len(held) else None, scale,
                                    built_for=recall)  # fmt: skip
            seconds["calibrate"] = time.perf_counter() - started
    file, record = paths(folder, precision)
    temporary = temporary_for(file)
    try:
        index.save(str(temporary))
    except RuntimeError as e:  # usearch's report of a file it cannot write (a full disk among the causes)
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        full = " (the disk is full)" if disk_full(e, folder) else ""
        raise OSError(f"could not write {temporary}{full}: {e}; search exactly (--exact) meanwhile") from e
    with PLACING:  # a graph, its floats and its record from one thread: two builds' files mixed seemed damaged
        os.replace(temporary, file)
        info = {"generation": generation, "store_id": store_id, "rows": len(rows), "bytes": file.stat().st_size,
                "crc32": crc(file), "recall": recall, **chosen, "scale": scale, "calibration": calibration,
                "seconds": {k: round(v, 2) for k, v in seconds.items()}}  # fmt: skip
        if precision != "float32":
            floats = floats_path(folder, precision)
            info.update(floats_crc32=write_floats(floats, rows, vectors), floats_bytes=floats.stat().st_size)
        write_record(record, info)
    return index, info


def write_record(record: Path, info: dict) -> None:
    temporary = temporary_for(record)
    temporary.write_text(json.dumps(info))
    os.replace(temporary, record)


def rescored(index, vectors: np.ndarray, rows: np.ndarray, query: np.ndarray, k: int, candidates: int,
             expansion: int, precision: str, scale: float = 1.0) -> np.ndarray:  # fmt: skip
    """Positions of the best `k` of the graph's candidates for `query` (`pool`), re-scored on the float32
    vectors."""
    count = pool(candidates, expansion, precision)
    found = np.searchsorted(rows, candidates_of(index, query, count, expansion, precision, scale))
    return best(vectors, found, query, k)


def best(vectors: np.ndarray, found: np.ndarray, query: np.ndarray, k: int) -> np.ndarray:
    """The `k` of positions `found` whose float32 vectors score highest against `query`, best first (ties by
    position, as the exact search breaks them)."""
    scores = vectors[found] @ query
    return found[np.lexsort((found, -scores))[:k]]


def sample(count: int) -> np.ndarray:
    """The positions of the calibration queries: the same for the same number of vectors."""
    return np.sort(np.random.default_rng(0).choice(count, min(CALIBRATION_QUERIES, count), replace=False))


def calibrate(index, rows: np.ndarray, vectors: np.ndarray, precision: str, candidates: int,
              held: np.ndarray | None = None, scale: float = 1.0, k: int = 10,
              built_for: float = RECALL) -> dict:  # fmt: skip
    """recall@k and median milliseconds of the graph at each expansion of LADDER (BINARY_LADDER for a binary
    graph) until one reaches ENOUGH, keeps every vector or, past the recall the graph was `built_for`, is SLOWER
    than exact, and the exact product's time
    (recalls independent of the machine's load, times not). The queries are `held`, vectors left out of the graph
    (and of the true neighbours); else the `sample` of its own vectors, each one's own match left out (a graph
    walk that finds the query itself finds its neighbours sooner: a recall somewhat high). Recall is measured on
    every query, walked on every core at once; time on the first TIMED, one at a time, as a search runs."""
    picks = sample(len(rows)) if held is None else held
    left_out = len(picks) if held is not None else 1
    k = min(k, len(rows) - left_out)
    if k < 1:
        return {"queries": 0, "k": 0, "candidates": candidates, "exact_ms": 0.0, "levels": []}
    truth = exact_neighbours(vectors, picks, k, held is not None)
    times = []
    for position in picks[:TIMED]:
        start = time.perf_counter()
        np.argpartition(-(vectors @ vectors[position]), k - 1)[:k]
        times.append(time.perf_counter() - start)
    exact_ms = 1000 * statistics.median(times)
    levels, wanted = [], k + 1 - (held is not None)  # one more where the query itself is in the graph
    for multiple in BINARY_LADDER if precision == "binary" else LADDER:
        expansion = round(candidates * multiple)
        walked = candidates_of(index, vectors[picks], pool(candidates, expansion, precision), expansion, precision,
                               scale, threads=os.cpu_count() or 1)  # fmt: skip
        found = 0
        for position, keys, expected in zip(picks, walked, truth, strict=True):
            top = best(vectors, np.searchsorted(rows, keys), vectors[position], wanted)
            found += len(expected & (set(top.tolist()) - {int(position)}))
        times = []
        for position in picks[:TIMED]:
            start = time.perf_counter()
            rescored(index, vectors, rows, vectors[position], wanted, candidates, expansion, precision, scale)
            times.append(time.perf_counter() - start)
        levels.append([expansion, round(found / (k * len(picks)), 4), round(1000 * statistics.median(times), 4)])
        slow = levels[-1][2] > SLOWER * exact_ms and levels[-1][1] >= built_for
        if levels[-1][1] >= ENOUGH or expansion >= len(index) or slow:
            break
    return {"queries": len(picks), "k": k, "candidates": candidates, "exact_ms": round(exact_ms, 4), "levels": levels}


def exact_neighbours(vectors: np.ndarray, picks: np.ndarray, k: int, held: bool) -> list[set]:
    """The positions of each pick's `k` nearest vectors by inner product, leaving out every pick where they are
    `held` out of the graph, else the pick itself: one matrix product a block of EXACT_BLOCK vectors at a time."""
    queries = vectors[picks]
    scores, positions = np.zeros((len(picks), 0), np.float32), np.zeros((len(picks), 0), np.int64)
    for start in range(0, len(vectors), EXACT_BLOCK):
        block = queries @ vectors[start : start + EXACT_BLOCK].T  # (picks, vectors)
        width = block.shape[1]
        inside = np.flatnonzero((picks >= start) & (picks < start + width))  # the picks among these vectors
        block[slice(None) if held else inside, picks[inside] - start] = -np.inf
        cut = width - min(k, width)
        top = np.argpartition(block, cut, axis=1)[:, cut:]  # the block's k best of each pick
        scores = np.concatenate([scores, np.take_along_axis(block, top, 1)], axis=1)
        positions = np.concatenate([positions, top + start], axis=1)
        del block, top  # the block's scores and their order (the largest arrays here) before the next product
        if scores.shape[1] > k:
            keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            scores, positions = np.take_along_axis(scores, keep, 1), np.take_along_axis(positions, keep, 1)
    return [set(row.tolist()) for row in positions]


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


def valid_calibration(calibration) -> bool:
    """Whether a record's calibration (absent in a record of an earlier version) is what `plan` reads."""
    if calibration is None:
        return True
    if not isinstance(calibration, dict) or not isinstance(calibration.get("levels"), list):
        return False
    numbers = (int, float)
    return (
        isinstance(calibration.get("candidates"), int)
        and isinstance(calibration.get("exact_ms"), numbers)
        and all(
            isinstance(v, list) and len(v) == 3 and all(isinstance(x, numbers) for x in v)
            for v in calibration["levels"]
        )
    )


def load(folder: Path, precision: str, generation: str, count: int, rebuild: bool = True, store_id: str | None = None):
    """(The saved index, its record) when it matches the store (generation, store id, row count) and its bytes;
    else None, with the reason on stderr (and whether the caller `rebuild`s it or searches without it). A store
    deleted and built again starts at generation 1 again: its id tells it from the one the graph was built of (a
    record written before graphs kept the id is taken on its generation alone)."""
    file, record = paths(folder, precision)
    if not file.exists() or not record.exists():
        return None
    try:
        info = json.loads(record.read_text())
        if not isinstance(info, dict) or not valid_calibration(info.get("calibration")):
            raise ValueError("its record is not a graph's (a JSON object with its calibration)")
        reason = None
        other_store = info.get("store_id") not in (None, store_id)
        if info.get("generation") != generation or info.get("rows") != count or other_store:
            reason = "stale: the store changed since it was built"
        elif info.get("bytes") != file.stat().st_size or info.get("crc32") != crc(file):
            reason = "damaged: its bytes do not match its record"
        else:
            with huge_pages():
                index = usearch_index().restore(str(file))
            reason = None if index is not None and len(index) == count else "unreadable"
    except (OSError, ValueError, RuntimeError) as e:
        reason = f"unreadable: {e}"
    if reason is None:
        return index, info
    then = "rebuilding" if rebuild else "searching exactly, without"
    print(f"mlx-encoders index: {then} {file} ({reason})", file=sys.stderr)
    return None


def candidates_of(index, query: np.ndarray, count: int, expansion: int, precision: str, scale: float = 1.0,
                  threads: int = 1):  # fmt: skip
    """Store rows of the (up to) `count` nearest vectors to `query` in the graph, its walk keeping `expansion`
    candidates (at least `count`): recall rises with it, and so does the time. For a matrix of queries, a list of
    each one's, walked on `threads`."""
    with SEARCH_LOCK:  # the width is the graph's state: a search must walk with its own, not another thread's
        index.expansion_search = max(expansion, count)
        if query.ndim == 2:
            matches = index.search(as_input(query, precision, scale), count, threads=threads)
        else:
            matches = index.search(as_input(query[None], precision, scale)[0], count)
    if query.ndim != 2:
        return np.asarray(matches.keys, np.int64)
    if not hasattr(matches, "counts"):  # usearch answers a one-row matrix as a single query
        return [np.asarray(matches.keys, np.int64)]
    return [np.asarray(keys[:n], np.int64) for keys, n in zip(matches.keys, matches.counts, strict=True)]
