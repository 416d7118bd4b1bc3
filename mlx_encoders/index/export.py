"""Hand an index to another engine: one Parquet file, one row per document in corpus order, with the columns the
vector engines ingest (LanceDB, Qdrant, pgvector, FAISS, OpenSearch, Vespa read Parquet or Arrow):

- `id` (string), `text` (string);
- `vector`, an index with a dense model: a fixed-size list of its unit-length float32 vector, or of int8 codes
  (`precision="int8"`: sentence-transformers' `quantize_embeddings` with the per-dimension ranges of the whole
  index), or of uint8 bytes of sign bits (`precision="binary"`: x > 0, packed 8 to a byte, the first dimension in
  the highest bit: numpy's `packbits`, sentence-transformers' "ubinary");
- `sparse_indices` (int32) and `sparse_values` (float32) lists, an index with a sparse model: the text's terms in
  ascending order and their weights.

The schema's metadata holds, under the key `mlx_encoders`, a JSON object of the index's models (names and
fingerprints), dimensions, similarity, precision (and the int8 ranges, to quantize queries the same way) and
counts. Everything is read through the store's checked reads in one read transaction, so a damaged store is an
error, never a wrong file; the file is written under a temporary name and renamed, so a failed export leaves no
file (or the previous one) at `output`.
"""

import json
import os
import re
import socket
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..embeddings.vectors import quantize_embeddings
from ..errors import OptionError
from ..records import writable_file
from .store import Store, StoreError

PRECISIONS = ("float32", "int8", "binary")
BATCH = 10_000  # documents per Parquet row group: what is held in memory beside the vectors
METADATA_KEY = b"mlx_encoders"
# what the `vector` column holds at each precision, in words for the metadata
ENCODINGS = {
    "float32": "unit-length float32 vectors: the cosine similarity is the dot product",
    "int8": "int8 codes per dimension, floor((x - min) / ((max - min) / 255)) - 128 with the int8_ranges "
    "[min, max] below (sentence-transformers' quantize_embeddings): rank by the dot product of codes",
    "binary": "sign bits (x > 0) packed 8 to a uint8 byte, the first dimension in the highest bit (numpy.packbits, "
    "sentence-transformers' ubinary): rank by Hamming distance",
}


def pyarrow_modules():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("index export writes Parquet with pyarrow: pip install pyarrow") from None
    return pa, pq


def quantized(vectors: np.ndarray, precision: str) -> tuple[np.ndarray, dict]:
    """(the vectors in `precision`, what the metadata adds for it)."""
    if precision == "int8":
        ranges = np.vstack([vectors.min(0), vectors.max(0)]) if len(vectors) else np.zeros((2, vectors.shape[1]))
        return quantize_embeddings(vectors, "int8", ranges=ranges), {"int8_ranges": ranges.tolist()}
    if precision == "binary":
        return quantize_embeddings(vectors, "ubinary"), {}
    return vectors, {}


def sparse_columns(store: Store, numbers: np.ndarray, seen: set[int], columns: list, pa) -> int:
    """Append the `sparse_indices` and `sparse_values` of the documents of text rows `numbers` to `columns`; return
    how many postings the rows not in `seen` have (then added to it), for the count of all postings."""
    distinct = sorted(set(numbers.tolist()))
    terms, found, weights = store.postings_of(distinct)  # by row, then term
    starts, ends = np.searchsorted(found, numbers, "left"), np.searchsorted(found, numbers, "right")
    columns.append(
        pa.array([terms[a:b].astype(np.int32) for a, b in zip(starts, ends, strict=True)], pa.list_(pa.int32()))
    )
    columns.append(
        pa.array([weights[a:b].astype(np.float32) for a, b in zip(starts, ends, strict=True)], pa.list_(pa.float32()))
    )
    new = [row for row in distinct if row not in seen]
    seen.update(new)
    return int(np.sum(np.searchsorted(found, new, "right") - np.searchsorted(found, new, "left")))


def schema_for(pa, meta: dict[str, str], precision: str, codes: np.ndarray | None, described: dict):
    """The Arrow schema of an export of the index of `meta`, with its metadata (see the module's docstring)."""
    dense, sparse = codes is not None, meta.get("sparse_model_fingerprint", "") != ""
    fields = [pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string(), nullable=False)]
    if dense:
        kind = {"float32": pa.float32(), "int8": pa.int8(), "binary": pa.uint8()}[precision]
        fields.append(pa.field("vector", pa.list_(kind, codes.shape[1]), nullable=False))
    if sparse:
        fields += [
            pa.field("sparse_indices", pa.list_(pa.int32())),
            pa.field("sparse_values", pa.list_(pa.float32())),
        ]
    about = {
        **{name: meta.get(name, "") for name in ("model", "model_fingerprint", "pooling", "sparse_model",
                                                  "sparse_model_fingerprint", "generation", "store_id")},
        "dimension": int(meta.get("dimension", 0)),
        "sparse_dimension": int(meta.get("sparse_dimension", 0)),
        "similarity": "cosine" if dense else "dot",
        "normalized": dense,
        "precision": precision if dense else None,
        "vector": ENCODINGS[precision] if dense else None,
        **described,
        "documents": int(meta["documents"]),
        "texts": int(meta["texts"]),
    }  # fmt: skip
    return pa.schema(fields, metadata={METADATA_KEY: json.dumps(about)})


def remove_stale_temporaries(output: Path) -> None:
    """Remove the temporary files of exports to `output` that were killed (SIGKILL, power loss) before they could
    remove their own: `.NAME.HOST.PID.tmp` of this host whose process no longer runs (another host's are left to
    it: its process cannot be seen from here)."""
    pattern = re.compile(rf"\.{re.escape(output.name)}\.{re.escape(socket.gethostname())}\.(\d+)\.tmp")
    found = (pattern.fullmatch(path.name) for path in output.parent.iterdir()) if output.parent.is_dir() else ()
    for match in found:
        if match and not running(int(match[1])):
            (output.parent / match[0]).unlink(missing_ok=True)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def export(
    index: str | Path, output: str | Path, *, precision: str = "float32", quiet: bool = False
) -> dict[str, int | str]:
    """Write the index in folder `index` to the Parquet file `output` (see the module's docstring), dense vectors
    in `precision` ("float32", "int8" or "binary"). Returns counts: documents, texts, bytes, and the path."""
    if precision not in PRECISIONS:
        raise OptionError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    pa, pq = pyarrow_modules()
    folder, output = Path(index), writable_file(Path(output))
    with Store(folder / "index.sqlite") as store:
        meta = store.begin_read()  # every read below sees one build
        if "generation" not in meta:
            raise StoreError(f"{store.path} holds no finished build; run the build (again) to finish it")
        store.require_checksums()
        dense, sparse = meta.get("model_fingerprint", "") != "", meta.get("sparse_model_fingerprint", "") != ""
        if not dense and precision != "float32":
            raise OptionError(f"The index {folder} has no dense vectors (no --model) to write in {precision}")
        rows, vectors = store.vectors() if dense else (np.zeros(0, np.int64), None)
        codes, described = quantized(vectors, precision) if dense else (None, {})
        schema = schema_for(pa, meta, precision, codes, described)
        about = json.loads(schema.metadata[METADATA_KEY])
        remove_stale_temporaries(output)
        temporary = output.with_name(f".{output.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        bar = tqdm(total=about["documents"], desc="exporting", unit="doc", leave=False,
                   disable=quiet or not sys.stderr.isatty())  # fmt: skip
        try:
            with pq.ParquetWriter(temporary, schema) as writer:
                seen, postings = set(), 0
                for batch in store.all_documents(BATCH):
                    ids, numbers, texts = zip(*batch, strict=True)
                    columns = [pa.array(ids, pa.string()), pa.array(texts, pa.string())]
                    numbers = np.array(numbers, np.int64)
                    if dense:
                        picked = np.searchsorted(rows, numbers)  # rows are stored ascending
                        if np.any(rows[np.minimum(picked, len(rows) - 1)] != numbers):
                            raise store.damaged("a document's text has no vector")
                        picked = codes[picked]
                        columns.append(pa.FixedSizeListArray.from_arrays(pa.array(picked.ravel()), codes.shape[1]))
                    if sparse:
                        postings += sparse_columns(store, numbers, seen, columns, pa)
                    writer.write_batch(pa.record_batch(columns, schema=schema))
                    bar.update(len(batch))
            if sparse:
                store.check_counts(postings=postings)
            with open(temporary, "rb") as f:  # on disk before it takes the name: never a file cut short there
                os.fsync(f.fileno())
            os.replace(temporary, output)
        except BaseException as e:
            temporary.unlink(missing_ok=True)
            if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):  # pyarrow's name only the temporary
                raise OSError(getattr(e, "errno", None), f"could not write {output}: {e}") from e
            raise
        finally:
            bar.close()
    size = output.stat().st_size
    if not quiet:
        print(
            f"mlx-encoders index: exported {about['documents']} documents ({about['texts']} texts) of {folder} to "
            f"{output} ({size / 1e6:.1f} MB)",
            file=sys.stderr,
            flush=True,
        )
    return {"documents": about["documents"], "texts": about["texts"], "bytes": size, "path": str(output)}
