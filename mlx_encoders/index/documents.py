"""A corpus on disk -> (id, text) documents: a folder of .txt/.md files (one document per paragraph, id
`relative/path#n`), a .jsonl file of {"id", "text"} objects or plain strings, a .csv or .parquet file with a `text`
column (and an optional `id` column), or a folder holding any of these. A line that is not JSON or not UTF-8 is
named by file and line, a bad Parquet row by file and row."""

import csv
import json
from collections.abc import Iterable
from pathlib import Path

SUFFIXES = (".txt", ".md", ".jsonl", ".csv", ".parquet")
PARQUET_BATCH = 8192  # rows per record batch read from a .parquet file


class CorpusError(ValueError):
    """The corpus cannot be read as it is; the message names the file (and line) and what to fix."""


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def text_documents(file: Path, name: str) -> list[tuple[str, str]]:
    try:
        text = file.read_bytes().decode()
    except UnicodeDecodeError as e:
        line = file.read_bytes()[: e.start].count(b"\n") + 1
        raise CorpusError(f"{file}:{line}: not UTF-8 ({e.reason}); convert the file to UTF-8") from None
    return [(f"{name}#{i}", p) for i, p in enumerate(paragraphs(text), 1)]


def jsonl_documents(file: Path, name: str) -> list[tuple[str, str]]:
    docs = []
    for number, line in enumerate(file.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line.decode())
        except UnicodeDecodeError as e:
            raise CorpusError(f"{file}:{number}: not UTF-8 ({e.reason}); fix or remove that line") from None
        except ValueError as e:
            raise CorpusError(f"{file}:{number}: not a JSON value ({e}); fix or remove that line") from None
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            docs.append((str(item.get("id", f"{name}:{number}")), item["text"]))
        elif isinstance(item, str):
            docs.append((f"{name}:{number}", item))
        else:
            raise CorpusError(f'{file}:{number}: expected a string or an object with a "text" string')
    return docs


def csv_documents(file: Path, name: str) -> list[tuple[str, str]]:
    with file.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            if "text" not in (reader.fieldnames or []):
                raise CorpusError(f"{file}: no 'text' column in the header {reader.fieldnames}; name one column text")
            return [(row.get("id") or f"{name}:{reader.line_num}", row["text"] or "") for row in reader]
        except UnicodeDecodeError as e:
            raise CorpusError(f"{file}:{reader.line_num + 1}: not UTF-8 ({e.reason}); fix that line") from None
        except csv.Error as e:
            raise CorpusError(f"{file}:{reader.line_num}: {e}") from None


def parquet_documents(file: Path, name: str) -> list[tuple[str, str]]:
    """The `text` (and optional `id`) column, read a record batch at a time so Arrow never holds the table whole."""
    try:  # lazily: pyarrow is an optional extra, needed only when a .parquet file is met
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f'{file}: a .parquet file needs pyarrow: pip install "mlx-encoders[parquet]"') from None
    docs, first_row, row = [], {}, 0
    try:
        table = pq.ParquetFile(file)
        names = table.schema_arrow.names
        if "text" not in names:
            raise CorpusError(f"{file}: no 'text' column in the columns {names}; name one column text")
        for batch in table.iter_batches(PARQUET_BATCH, columns=[c for c in ("id", "text") if c in names]):
            ids = batch.column("id").to_pylist() if "id" in names else [None] * batch.num_rows
            for doc_id, text in zip(ids, batch.column("text").to_pylist(), strict=True):
                row += 1
                if not isinstance(text, str):
                    kind = "null" if text is None else type(text).__name__
                    raise CorpusError(f"{file}: row {row}: the text is {kind}, not a string; fix or remove that row")
                doc_id = f"{name}:{row}" if doc_id is None or doc_id == "" else str(doc_id)
                if doc_id in first_row:
                    raise CorpusError(
                        f"{file}: row {row}: the id {doc_id!r} appears twice (first at row {first_row[doc_id]}); "
                        "ids must be unique"
                    )
                first_row[doc_id] = row
                docs.append((doc_id, text))
    except pa.ArrowException as e:  # not Parquet, truncated or damaged pages
        raise CorpusError(f"{file}: not a readable Parquet file ({e}); rewrite it") from None
    return docs


READERS = {
    ".txt": text_documents,
    ".md": text_documents,
    ".jsonl": jsonl_documents,
    ".csv": csv_documents,
    ".parquet": parquet_documents,
}


def read_corpus(corpus: str | Path | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (id, text) documents of `corpus`: a path (file or folder), or (id, text) pairs given as they are.
    Ids must be unique; an empty corpus is an error."""
    if not isinstance(corpus, (str, Path)):
        docs = [(str(i), t) for i, t in corpus]
        where = "the given documents"
    else:
        path = Path(corpus)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            docs = [d for f in files for d in READERS[f.suffix](f, f.relative_to(path).as_posix())]
        elif path.suffix in READERS and path.is_file():
            docs = READERS[path.suffix](path, path.name)
        else:
            raise CorpusError(f"the corpus must be a folder or a {', '.join(SUFFIXES)} file; got {corpus}")
        where = str(path)
    if not docs:
        raise CorpusError(f"the corpus {where} holds no texts; add .txt/.md/.jsonl/.csv/.parquet files with text")
    seen = set()
    for doc_id, text in docs:
        if not isinstance(text, str):
            raise CorpusError(f"document {doc_id!r} of {where}: the text is {type(text).__name__}, not a string")
        if doc_id in seen:
            raise CorpusError(f"the id {doc_id!r} appears twice in {where}; ids must be unique")
        seen.add(doc_id)
    return docs
