"""A corpus on disk -> (id, text) documents: a folder of .txt/.md files (one document per paragraph, id
`relative/path#n`), a .jsonl file of {"id", "text"} objects or plain strings, a .csv or .parquet file with a `text`
column (and an optional `id` column), or a folder holding any of these. Files are read by `records`' rules (UTF-8,
line ends, missing values, ids), and every error names the file and line (or Parquet row)."""

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..records import (
    Record,
    RecordError,
    csv_records,
    jsonl_records,
    paragraphs,
    parquet_records,
    record_id,
    text_lines,
)

SUFFIXES = (".txt", ".md", ".jsonl", ".csv", ".parquet")

Document = tuple[str, str, Record | None]  # (id, text, where it was read; None for pairs given in Python)


class CorpusError(ValueError):
    """The corpus cannot be read as it is; the message names the file (and line) and what to fix."""


def document_text(value, record: Record) -> str:
    """A document's text: a non-empty string."""
    if isinstance(value, str) and value:
        return value
    kind = "empty" if value == "" else f"{'null' if value is None else type(value).__name__}, not a string"
    raise CorpusError(f"{record.where}: the text is {kind}; write its text or remove that {record.unit}")


def text_documents(file: Path, name: str) -> list[Document]:
    runs = paragraphs(text_lines(file))
    return [(f"{name}#{i}", " ".join(" ".join(r.value for r in run).split()), run[0]) for i, run in enumerate(runs, 1)]


def jsonl_documents(file: Path, name: str) -> list[Document]:
    docs = []
    for record in jsonl_records(file):
        item, default = record.value, f"{name}:{record.line}"
        if isinstance(item, dict) and "text" in item:
            beir = "id" not in item and "_id" in item  # BEIR's corpus.jsonl: its ids, its title before the text
            doc_id = record_id(item["_id"] if beir else item.get("id"), record.where, default)
            text = document_text(item["text"], record)
            title = item.get("title") if beir else None
            docs.append((doc_id, f"{title} {text}".strip() if isinstance(title, str) and title else text, record))
        elif isinstance(item, str):
            docs.append((default, document_text(item, record), record))
        else:
            raise CorpusError(f'{record.where}: expected a string or an object with a "text" string')
    return docs


def table_documents(records: Iterable[Record], name: str) -> list[Document]:
    """The rows of a .csv or .parquet file: a `text` cell and an optional `id` one."""
    docs = []
    for record in records:
        doc_id = record_id(record.value.get("id"), record.where, f"{name}:{record.line}")
        docs.append((doc_id, document_text(record.value["text"], record), record))
    return docs


READERS = {
    ".txt": text_documents,
    ".md": text_documents,
    ".jsonl": jsonl_documents,
    ".csv": lambda file, name: table_documents(csv_records(file, required=("text",)), name),
    ".parquet": lambda file, name: table_documents(parquet_records(file, ("id", "text"), ("text",)), name),
}


def file_kind(path: Path) -> str:
    """A corpus file's format by its extension, in any case; a gzip-compressed text file's (docs.jsonl.gz: .jsonl),
    which reads as its text."""
    suffix = path.suffix.lower()
    inner = Path(path.stem).suffix.lower()
    return inner if suffix == ".gz" and inner in SUFFIXES and inner != ".parquet" else suffix


def read_corpus(corpus: str | Path | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (id, text) documents of `corpus`: a path (file or folder), or (id, text) pairs given as they are.
    Ids must be unique; an empty corpus is an error."""
    if not isinstance(corpus, (str, Path)):
        where, docs = "the given documents", []
        for number, pair in enumerate(corpus, 1):
            pair = pair.tolist() if isinstance(pair, np.ndarray) and pair.ndim == 1 else pair  # a table's row
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise CorpusError(f"{where}, item {number}: expected an (id, text) pair, got {pair!r:.60}")
            record = Record(pair, where, number, "item")
            given = pair[0].item() if isinstance(pair[0], np.generic) else pair[0]  # a numpy or pandas id
            try:
                doc_id = record_id(given, record.where, None)
            except RecordError as e:
                raise CorpusError(str(e)) from None
            if doc_id is None:
                raise CorpusError(f"{record.where}: the id is missing; give every document an id")
            docs.append((doc_id, document_text(pair[1], record), record))
    else:
        path = Path(corpus)
        try:
            if path.is_dir():  # extensions in any case (B.TXT), as the training data's reader takes them
                files = sorted(p for p in path.rglob("*") if file_kind(p) in SUFFIXES and p.is_file())
                docs = [d for f in files for d in READERS[file_kind(f)](f, f.relative_to(path).as_posix())]
            elif not path.exists():
                raise CorpusError(f"no such file or folder: {corpus}")
            elif file_kind(path) in READERS and path.is_file():
                docs = READERS[file_kind(path)](path, path.name)
            else:
                raise CorpusError(f"the corpus must be a folder or a {', '.join(SUFFIXES)} file; got {corpus}")
        except RecordError as e:
            raise CorpusError(str(e)) from None
        where = str(path)
    if not docs:
        raise CorpusError(f"the corpus {where} holds no texts; add .txt/.md/.jsonl/.csv/.parquet files with text")
    check_documents(docs, where)
    return [(doc_id, text) for doc_id, text, _ in docs]


def check_documents(docs: list[Document], where: str) -> None:
    """Every text a string, ids and texts UTF-8 (the store's), every id once; a repeated id names both places it
    was read. Checked before anything is embedded."""
    first: dict[str, Record | None] = {}
    for doc_id, text, record in docs:
        if not isinstance(text, str):
            raise CorpusError(f"document {doc_id!r} of {where}: the text is {type(text).__name__}, not a string")
        for name, value in (("id", doc_id), ("text", text)):
            try:
                str(value).encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, from text decoded with errors="surrogateescape"
                raise CorpusError(
                    f"document {doc_id!r} of {where}: its {name} is not valid Unicode ({e.reason} at character "
                    f"{e.start}); fix or drop it"
                ) from None
        if doc_id in first:
            raise CorpusError(f"{repeated(doc_id, record, first[doc_id])}; ids must be unique")
        first[doc_id] = record


def repeated(doc_id: str, record: Record | None, earlier: Record | None) -> str:
    if record is None or earlier is None:
        return f"the id {doc_id!r} appears twice in the given documents"
    at = f"{earlier.unit} {earlier.line}" if earlier.file == record.file else earlier.where
    return f"{record.where}: the id {doc_id!r} appears twice (first at {at})"
