"""An approximate nearest-neighbour index (usearch's HNSW graph) built from the store's vectors.

Saved as `ann-<precision>.usearch` beside a JSON record of the store generation it was built from, its size and
CRC-32. Both are written to a temporary name and renamed into place, the record last: a kill between the two
leaves a record that no longer matches, so the file is rebuilt. A stale, damaged or missing file is rebuilt.
"""

import json
import os
import sys
import zlib
from pathlib import Path

import numpy as np

# precision -> (usearch scalar kind, metric); binary packs sign bits 8 to a byte and compares by Hamming distance
KINDS = {"float32": ("f32", "ip"), "int8": ("i8", "ip"), "binary": ("b1", "hamming")}


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


def build(folder: Path, rows: np.ndarray, vectors: np.ndarray, precision: str, generation: str):
    """A new HNSW index of `vectors` keyed by their store rows, saved atomically into `folder`."""
    kind, metric = KINDS[precision]
    index = usearch_index()(ndim=vectors.shape[1], metric=metric, dtype=kind)
    if len(rows):
        index.add(rows.astype(np.uint64), as_input(vectors, precision), threads=os.cpu_count() or 1)
    file, record = paths(folder, precision)
    temporary = file.with_name(file.name + ".tmp")
    try:
        index.save(str(temporary))
    except RuntimeError as e:  # usearch's report of a file it cannot write
        raise OSError(f"could not write {temporary}: {e}") from e
    os.replace(temporary, file)
    info = {"generation": generation, "rows": len(rows), "bytes": file.stat().st_size, "crc32": crc(file)}
    temporary = record.with_name(record.name + ".tmp")
    temporary.write_text(json.dumps(info))
    os.replace(temporary, record)
    return index


def load(folder: Path, precision: str, generation: str, count: int, rebuild: bool = True):
    """The saved index when it matches the store (generation, row count) and its bytes; else None, with the reason
    on stderr (and whether the caller `rebuild`s it or searches without it)."""
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
        return index
    then = "rebuilding" if rebuild else "searching exactly, without"
    print(f"mlx-encoders index: {then} {file} ({reason})", file=sys.stderr)
    return None


def candidates(index, query: np.ndarray, count: int, precision: str) -> np.ndarray:
    """Store rows of the (up to) `count` nearest vectors to `query` in the graph."""
    index.expansion_search = 2 * count  # the graph walk keeps this many candidates: recall rises with it
    matches = index.search(as_input(query[None], precision)[0], count)
    return np.asarray(matches.keys, np.int64)
