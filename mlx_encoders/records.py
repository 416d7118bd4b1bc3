"""Rows of a corpus or training-data file, each with where it came from: the one reader under the index
(`index/documents.py`) and training (`train/data.py`), so both read a file by the same rules:

- Text is UTF-8. A leading byte-order mark is dropped and CRLF and CR line ends read as LF, in every format;
  bytes that are not UTF-8 (latin-1, a surrogate written as bytes) and a lone surrogate escape in JSON
  (`"\\ud800"`) are errors naming the file and line.
- .txt/.md: each line that is not blank is a row (`text_lines`); a run of them between blank lines is a
  paragraph (`paragraphs`). .jsonl: one JSON value a line, blank lines skipped. .csv/.tsv: a header line, then one
  record a row, quoted fields spanning lines allowed (a row's line is where it starts); a record of blank cells
  is skipped, one with another number of fields than the header is an error. .parquet: the row number.
- A null and an empty string are the same missing value (`missing`); ids are strings or integers (`record_id`).
"""

import csv
import gzip
import io
import json
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

BOM = b"\xef\xbb\xbf"
GZIP_MAGIC = b"\x1f\x8b"
CSV_FIELD_LIMIT = 2**31 - 1  # a C long on every platform
CSV_LIMIT_LOCK = threading.Lock()
PARQUET_BATCH = 8192  # rows per record batch read from a .parquet file
SURROGATE = re.compile("[\ud800-\udfff]")


class RecordError(ValueError):
    """A file that cannot be read as it is; the message names the file and line (or row) and what to fix."""


@dataclass(frozen=True)
class Record:
    """One row of a file: its value (a line's text, a JSON value, a dict of cells) and its 1-based line, or its
    1-based row in a Parquet file (`unit` "row")."""

    value: object
    file: str
    line: int
    unit: str = "line"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file}: {self.unit} {self.line}"


def missing(value) -> bool:
    """True for a null and for an empty string (a CSV cannot tell them apart, so no format does)."""
    return value is None or (isinstance(value, str) and not value)


def record_id(value, where: str, default: str) -> str:
    """A row's id as a string: `default` when it is missing; a string or an integer as written; else an error."""
    if missing(value):
        return default
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise RecordError(f"{where}: the id is {type(value).__name__} {value!r:.40}; write ids as strings or integers")


def read_text(file: str | Path) -> str:
    """The text of a UTF-8 file (gzip-compressed or not, as BEIR's files ship) with LF line ends, its byte-order
    mark dropped. A pipe (`<(command)`) reads as a file."""
    file = Path(file)
    if file.is_dir() or not file.exists():
        raise RecordError(f"{file}: {'a folder, not a file' if file.is_dir() else 'no such file'}; check the path")
    raw = file.read_bytes()
    if raw.startswith(GZIP_MAGIC):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise RecordError(f"{file}: gzip-compressed, but not a whole gzip file ({e}); check the download") from None
    raw = raw.removeprefix(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        before = raw[: e.start]
        line = before.count(b"\n") + before.count(b"\r") - before.count(b"\r\n") + 1
        byte = e.start - max(before.rfind(b"\n"), before.rfind(b"\r"))
        found = f"{line}: not UTF-8 ({e.reason} at byte {byte} of the line)"
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            found = "1: not UTF-8 but UTF-16 (it starts with UTF-16's byte-order mark)"
        raise RecordError(f"{file}:{found}; re-save the file as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def writable_file(path: Path) -> Path:
    """`path`, where a file can be written: its folder exists and it is not a folder (checked before any work)."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the path of the file to write")
    if not path.parent.is_dir():
        raise ValueError(f"{path.parent} is not a folder; create it first, or write the file elsewhere")
    return path


def text_lines(file: str | Path) -> list[Record]:
    """The lines of a text file that are not blank, each its text without the line end."""
    file = Path(file)
    lines = read_text(file).split("\n")
    return [Record(line, str(file), number) for number, line in enumerate(lines, 1) if line.strip()]


def paragraphs(lines: list[Record]) -> list[list[Record]]:
    """`text_lines` grouped into runs between blank lines (a gap in the line numbers)."""
    runs: list[list[Record]] = []
    for record in lines:
        if runs and runs[-1][-1].line == record.line - 1:
            runs[-1].append(record)
        else:
            runs.append([record])
    return runs


def jsonl_records(file: str | Path) -> list[Record]:
    """One JSON value a line (any type: the caller checks it); blank lines are skipped."""
    file, records = Path(file), []
    for number, line in enumerate(read_text(file).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or an integer beyond Python's digit limit
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)[:80]
            raise RecordError(f"{where}: not a JSON value ({detail}); fix or remove that line") from None
        if "\\u" in line and has_surrogate(value):  # only an escape makes one: the text is UTF-8
            raise RecordError(
                f"{where}: a lone surrogate escape such as \\ud800 (half of a UTF-16 pair) is no character; write "
                "the character itself or both escapes of its pair, or remove that line"
            )
        records.append(Record(value, str(file), number))
    return records


def stdin_texts() -> list[str]:
    """The non-empty lines of standard input, one text each (no line ends, no byte-order mark), as every command
    reads texts not given as arguments; a terminal (nothing piped in) is refused."""
    if sys.stdin.isatty():
        raise ValueError("no input: give texts as arguments or pipe them in, one per line")
    lines = [line.rstrip("\r\n") for line in stdin_lines()]  # a Windows line end is no part of the text
    if lines:
        lines[0] = lines[0].removeprefix("\ufeff")  # nor is a byte-order mark before the first line
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError("no input: stdin held no non-empty lines")
    return texts


def stdin_lines() -> list[str]:
    """Standard input's lines (line ends kept), read as UTF-8 whatever the locale says; a line that is not UTF-8 is
    named."""
    if not hasattr(sys.stdin, "buffer"):  # a text stream put in its place (tests, embedding programs)
        lines = list(sys.stdin)
    else:
        lines = [raw.decode("utf-8", "surrogateescape") for raw in sys.stdin.buffer.read().splitlines(keepends=True)]
    for number, line in enumerate(lines, 1):  # undecodable bytes arrive as lone surrogates
        if has_surrogate(line):
            raise ValueError(f"stdin line {number} is not UTF-8; re-save the input as UTF-8")
    return lines


def has_surrogate(value) -> bool:
    if isinstance(value, str):
        return SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(has_surrogate(k) or has_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(has_surrogate(v) for v in value)


def csv_records(file: str | Path, delimiter: str = ",", required: Sequence[str] = ()) -> list[Record]:
    """The records of a CSV (delimiter ",") or TSV ("\\t") file as dicts {header cell: cell}; the header must hold
    the `required` columns. A cell may be as long as the file (an article; the csv module stops at 128 KiB)."""
    file = Path(file)
    text = read_text(file)
    # The limit is the csv module's, for the whole process: only ever raised (never lowered under another
    # thread's reader), to this file's length.
    with CSV_LIMIT_LOCK:
        csv.field_size_limit(max(csv.field_size_limit(), min(len(text) + 1, CSV_FIELD_LIMIT)))
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    records, start = [], 1
    try:
        header = next(reader, [])
        for column in required:
            if column not in header:
                raise RecordError(f"{file}: no {column!r} column in the header {header}; name one column {column}")
        repeated = sorted({c for c in header if header.count(c) > 1})
        if repeated:
            raise RecordError(f"{file}:1: the header names {repeated[0]!r} twice; give each column its own name")
        start = reader.line_num + 1
        for cells in reader:
            if any(cell.strip() for cell in cells):
                if len(cells) != len(header):
                    raise RecordError(
                        f"{file}:{start}: {len(cells)} fields where the header (line 1) has {len(header)}; quote "
                        "fields that hold the delimiter"
                    )
                records.append(Record(dict(zip(header, cells, strict=True)), str(file), start))
            start = reader.line_num + 1
    except csv.Error as e:
        raise RecordError(
            f"{file}:{start}: not valid CSV ({e}); check the quotes of the record that starts there, or write the "
            "data as .jsonl"
        ) from None
    return records


def parquet_records(file: str | Path, columns: Sequence[str], required: Sequence[str] = ()) -> Iterator[Record]:
    """The rows of a Parquet file as dicts of those of `columns` it has (it must have the `required` ones), read a
    record batch at a time so Arrow never holds the table whole. Nulls read as None."""
    try:  # lazily: pyarrow is an optional extra, needed only when a .parquet file is met
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{file}: a .parquet file needs pyarrow: pip install pyarrow") from None
    file = Path(file)
    try:
        table = pq.ParquetFile(file)
        names = table.schema_arrow.names
        for column in required:
            if column not in names:
                raise RecordError(f"{file}: no {column!r} column in the columns {names}; name one column {column}")
        row = 0
        for batch in table.iter_batches(PARQUET_BATCH, columns=[c for c in columns if c in names]):
            for values in batch.to_pylist():
                row += 1
                yield Record(values, str(file), row, "row")
    except pa.ArrowException as e:  # not Parquet, truncated or damaged pages
        raise RecordError(f"{file}: not a readable Parquet file ({e}); rewrite it") from None
