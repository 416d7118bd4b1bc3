"""Training data: rows read from JSONL, CSV/TSV, plain text or any iterable of dicts (a `datasets.Dataset` is one),
turned into tokenized examples with labels, and padded into batches.

Token labels are aligned to sub-tokens as transformers' token-classification tutorial `tokenize_and_align_labels`
does (first sub-token of a word labelled, the rest -100, or every sub-token with `label_all_tokens=True`); masked-LM
batches are masked afresh by `masking.Masker` each time `collate` builds them. Every error about the data names the
file and its 1-based line (or the 1-based item of an iterable) and says what is wrong.
Longer than most modules: one reader and collate per task, sharing their checks.
"""

import json
import math
import numbers
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding

from ..models.base import PROBLEM_TYPES
from ..records import RecordError, csv_records, jsonl_records, missing, paragraphs, text_lines
from ..tokenizer import USIZE_MAX, Tokenizer
from .config import OptionError
from .losses import IGNORE_INDEX
from .masking import Masker, next_sentence_pairs, special_ids

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".txt": "text"}
ITERABLE = "the data"
INTEGER = re.compile(r"-?\d+")
FRACTION = re.compile(r"-?\d*\.\d+(e-?\d+)?", re.IGNORECASE)
LABEL_ID_SPREAD = 10  # label ids read from data must be < this many times the number of distinct ids
REGRESSION_LABELS = {"LABEL_0": 0}  # a regression head's one output, as transformers names it
REGRESSION_LIMIT = 1e12  # regression targets beyond this would overflow the float32 squared error and its gradients
LABEL_COLUMNS = ("label", "labels", "score", "scores")  # sentence-transformers' DEFAULT_LABEL_COLUMNS
INDEX_COLUMN = re.compile(r"Unnamed: \d+")
COLUMNS_FLAG = "columns= (--columns NAME=COLUMN ...)"


class DataError(ValueError):
    """Malformed training data; the message names the file and line."""


HEAD_COLUMNS = "text_column= / text_pair_column= / label_column="  # the options that name a head task's columns
PICKED_COLUMNS = "columns= (--columns)"  # the option that picks and names an embedding or reranking task's columns


@dataclass(frozen=True)
class Row:
    """One row of training data and where it came from: `line` is 1-based (the item number for an iterable); `where`
    reads `file:line`, as every error of `records` does."""

    values: dict
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"item {self.line} of the data" if self.source == ITERABLE else f"{self.source}:{self.line}"

    def get(self, column: str, options: str = HEAD_COLUMNS):
        """The value in `column`; a DataError naming the row when the row has no such column or the value is missing
        (null or empty, `records.missing`), and the task's `options` that name columns."""
        value = self.values.get(column)
        if missing(value):
            found = ", ".join(repr(c) for c in self.values) or "none"
            raise DataError(
                f"{self.where}: no value in column {column!r} (columns: {found}); fill it, or name the right "
                f"column with {options}"
            )
        return value

    def text(self, column: str, options: str = HEAD_COLUMNS) -> str:
        value = self.get(column, options)
        if not isinstance(value, str):
            raise DataError(
                f"{self.where}: column {column!r} must hold a text, found {type(value).__name__} {value!r:.60}"
            )
        return value


@dataclass
class Examples:
    """Tokenized examples of one task: `labels[i]` belongs to `encodings[i]` (None for masked-LM, where `collate`
    draws them), `rows[i]` is the row it came from (a long masked-LM document gives several examples)."""

    task: str
    encodings: list[Encoding]
    labels: list
    label2id: dict[str, int]
    rows: list[Row]
    problem_type: str | None = None  # sequence classification's, given or read from the data (`infer_from_row`)
    label_vectors: bool = False  # multi-label targets given as 0/1 vectors, not as names or ids

    def __len__(self) -> int:
        return len(self.encodings)


# ----- reading rows -----


def read_rows(data: str | Path | Iterable[Mapping], text_column: str = "text") -> list[Row]:
    """The rows of a .jsonl/.ndjson, .csv, .tsv or .txt file (a .txt line is a row `{text_column: line}`; blank lines
    are skipped), read by `records`' rules, or of an iterable of dicts such as a `datasets.Dataset`. Fails on an
    empty source."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        kind = SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
        try:
            rows = file_rows(path, kind, text_column)
        except RecordError as e:
            raise DataError(str(e)) from None
    else:
        rows = iterable_rows(data)
    if not rows:
        source = data if isinstance(data, (str, Path)) else ITERABLE
        raise DataError(f"{source} holds no rows of training data; check the path or the filter that built it")
    return rows


def file_rows(path: Path, kind: str, text_column: str) -> list[Row]:
    if kind == "text":
        return [Row({text_column: r.value}, r.file, r.line) for r in text_lines(path)]
    if kind != "jsonl":
        return [Row(r.value, r.file, r.line) for r in csv_records(path, "\t" if kind == "tsv" else ",")]
    rows = []
    for record in jsonl_records(path):
        row = Row(record.value, record.file, record.line)
        if not isinstance(record.value, dict):
            kind = "null" if record.value is None else type(record.value).__name__
            raise DataError(f"{row.where}: a JSON {kind}, not an object; write one object a line")
        rows.append(row)
    return rows


def column_map(columns: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
    """`columns` as {name to read it as: column of the data}, in order: a mapping as given, or a list of "COLUMN"
    (kept as it is named) and "NAME=COLUMN" items, as `--columns` takes them."""
    if isinstance(columns, Mapping):
        pairs = list(columns.items())
    elif isinstance(columns, Sequence) and not isinstance(columns, str):
        pairs = [tuple(c.split("=", 1)) if isinstance(c, str) and "=" in c else (c, c) for c in columns]
    else:
        raise OptionError(f"columns must be a dict {{name: column}} or a list of columns, got {columns!r}")
    names = [name for name, _ in pairs]
    bad = [p for p in pairs if not all(isinstance(x, str) and x.strip() for x in p)]
    if not pairs or bad or len(set(names)) != len(names):
        raise OptionError(
            f"columns must name each column once, as NAME=COLUMN (read COLUMN as NAME) or COLUMN, e.g. anchor=query "
            f"positive negative_1; got {columns!r}"
        )
    return dict(pairs)


def select_columns(rows: list[Row], columns: Mapping[str, str] | Sequence[str] | None) -> list[Row]:
    """`rows` holding only `columns` (`column_map`), renamed and in that order; all of them when None."""
    if columns is None:
        return rows
    wanted = column_map(columns)
    selected = []
    for row in rows:
        missing = [column for column in wanted.values() if column not in row.values]
        if missing:
            found = ", ".join(repr(c) for c in row.values) or "none"
            raise DataError(
                f"{row.where}: no column {missing[0]!r}, which columns= (--columns) names; the row has {found}"
            )
        selected.append(Row({name: row.values[column] for name, column in wanted.items()}, row.source, row.line))
    return selected


def is_fraction(value) -> bool:
    """A number with a fractional part, as a float or as a CSV cell writes it ("0.5", "1e-3"): no text a loss reads."""
    if isinstance(value, float):
        return True
    return isinstance(value, str) and FRACTION.fullmatch(value.strip()) is not None


def by_position(row: Row, layout: str, names: str) -> tuple[list[str], str | None]:
    """(text columns, label column or None) of a row whose columns carry none of the names a task reads: every
    column but a label one, in the row's order, as sentence-transformers' data collator takes them (its losses
    read the first as the anchor or query and the next as the positive). `layout` says what the names would be,
    `names` an example of `--columns` for this task, for the error."""
    label = next((c for c in LABEL_COLUMNS if c in row.values), None)
    texts = [c for c in row.values if c not in LABEL_COLUMNS]
    ids = [c for c in texts if c == "id" or c.endswith(("_id", "_ids", "_idx"))]
    # pandas' to_csv writes its row index as a first column without a name ("Unnamed: 0" once read back)
    index = [c for c in texts if not c.strip() or INDEX_COLUMN.fullmatch(c)]
    numbers = [c for c in texts[2:] if is_fraction(row.values[c])]  # a score under another name, not a document
    if len(texts) < 2 or ids or index or numbers:
        found = ", ".join(repr(c) for c in row.values) or "none"
        look = "looks" if len(ids) == 1 else "look"
        why = f"{', '.join(map(repr, ids))} {look} like ids, not texts" if ids else "fewer than two text columns"
        if index:
            why = f"{index[0]!r} looks like a row index (pandas writes one unless to_csv(index=False)), not a text"
        elif numbers:
            why = (
                f"{numbers[0]!r} holds a number ({str(row.values[numbers[0]]).strip()}), not a text; a score column is "
                f"named {' or '.join(LABEL_COLUMNS)}"
            )
        raise DataError(
            f"{row.where}: {layout}, or any columns read by position (first the query, then the documents); this "
            f"row has {found} ({why}). Name the columns to read with {COLUMNS_FLAG}, e.g. --columns {names}"
        )
    return texts, label


def in_first_row_order(rows: list[Row]) -> list[Row]:
    """`rows`, each holding the first row's columns in another key order put in the first row's (columns read by
    position are then read by name, as `datasets` reads them)."""
    order = list(rows[0].values) if rows else []
    return [
        Row({c: row.values[c] for c in order}, row.source, row.line)
        if list(row.values) != order and set(row.values) == set(order) else row
        for row in rows
    ]  # fmt: skip


def iterable_rows(data: Iterable[Mapping]) -> list[Row]:
    if isinstance(data, (Mapping, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"Training data must be a file path or an iterable of dicts, got {type(data).__name__}")
    rows = []
    for number, values in enumerate(data, 1):
        if not isinstance(values, Mapping):
            raise DataError(f"item {number} of the data: a {type(values).__name__}, not a dict of columns")
        rows.append(Row(dict(values), ITERABLE, number))
    return rows


def read_documents(data: str | Path | Iterable[Mapping], text_column: str = "text") -> list[list[Row]]:
    """Documents as lists of rows, one sentence (or text) each: in a .txt file, runs of lines separated by blank
    lines; elsewhere, each row is a one-row document."""
    if not (isinstance(data, (str, Path)) and Path(data).suffix.lower() == ".txt"):
        return [[row] for row in read_rows(data, text_column)]
    path = Path(data)
    try:
        runs = paragraphs(text_lines(path))
    except RecordError as e:
        raise DataError(str(e)) from None
    if not runs:
        raise DataError(f"{path} holds no text; check the path")
    return [[Row({text_column: r.value}, r.file, r.line) for r in run] for run in runs]


# ----- labels -----


# The problem type is read from the first row's label: an integer there makes the labels classes.
REGRESSION_HINT = "; if the labels are numbers to predict, pass problem_type='regression' (--problem-type regression)"


def label_key(value, row: Row, column: str) -> str | int:
    """A label as written: a name (str) or an id (int); a CSV cell of digits is an id."""
    if isinstance(value, str) and not value.strip():
        raise DataError(f"{row.where}: empty label in column {column!r}; fill it or remove the row")
    if isinstance(value, str):
        return int(value) if row.source.endswith((".csv", ".tsv")) and INTEGER.fullmatch(value.strip()) else value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    numbers = REGRESSION_HINT if isinstance(value, float) else ""
    raise DataError(
        f"{row.where}: column {column!r} must hold a label name or id, found {type(value).__name__} {value!r:.60}"
        f"{numbers}"
    )


class NamedInData(dict):
    """label2id built from the label names of the data: ids in other data (the evaluation's) would be read against
    an order the user never chose, so they are refused."""


def build_label2id(keys: list[tuple[str | int, Row]], label2id: Mapping[str, int] | None) -> dict[str, int]:
    """The given `label2id`, else one built from the data: sorted names -> 0..n-1 (a `NamedInData`), or ids 0..max
    as "LABEL_i"."""
    if label2id is not None:
        given = {str(name): int(i) for name, i in label2id.items()}
        return NamedInData(given) if isinstance(label2id, NamedInData) else given
    names = sorted({k for k, _ in keys if isinstance(k, str)})
    ids = [(k, row) for k, row in keys if isinstance(k, int)]
    if names and ids:
        numbers = REGRESSION_HINT if all(FRACTION.fullmatch(n.strip()) for n in names) else ""
        raise DataError(
            f"{ids[0][1].where}: label id {ids[0][0]} among label names ({', '.join(names[:5])}); write every label "
            f"as a name or every label as an id, or pass label2id={numbers}"
        )
    if names:
        return NamedInData({name: i for i, name in enumerate(names)})
    # ids may leave gaps (a sample of the classes), but a far-off id is a typo that would build a huge head
    distinct = len({k for k, _ in ids})
    for k, row in ids:
        if k >= LABEL_ID_SPREAD * distinct:
            raise DataError(
                f"{row.where}: label id {k} is far beyond the {distinct} distinct ids in the data (ids must be < "
                f"{LABEL_ID_SPREAD * distinct}, {LABEL_ID_SPREAD}x that count); fix the row, or pass label2id= naming "
                "every class"
            )
    return {f"LABEL_{i}": i for i in range(max(k for k, _ in ids) + 1)}


def check_classes(mapping: dict[str, int], rows: list[Row], label2id: Mapping[str, int] | None) -> None:
    """Labels read from the data name two classes at least: with one, every prediction is right and nothing is
    learnt (a softmax over one class has a loss of 0)."""
    if label2id is None and len(mapping) == 1:
        where = "the data" if rows[0].source == ITERABLE else rows[0].source
        raise DataError(
            f"{where}: every label is {next(iter(mapping))!r}; a classifier needs two classes at least: add rows of "
            "the others, or give fine_tune label2id= naming every class"
        )


def label_id(key: str | int, row: Row, label2id: dict[str, int]) -> int:
    """The id of a label name or id, checked against `label2id`."""
    if isinstance(key, int):
        if isinstance(label2id, NamedInData):
            names = ", ".join(list(label2id)[:5])
            raise DataError(
                f"{row.where}: label id {key}, where the training data names its labels ({names}); write the labels "
                "as names, or pass label2id= giving each name its id"
            )
        if key in label2id.values():
            return key
        raise DataError(f"{row.where}: label id {key} is not one of the ids 0..{len(label2id) - 1}; fix the row")
    if key in label2id:
        return label2id[key]
    known = ", ".join(repr(name) for name in list(label2id)[:20])
    raise DataError(f"{row.where}: unknown label {key!r}; the labels are {known}; fix the row or extend label2id")


def as_list(value, row: Row, column: str) -> list:
    """A list cell; in CSV a list is written as JSON, e.g. ["a", "b"]."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{row.where}: column {column!r} is not a valid JSON list ({e.msg})") from None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence | np.ndarray):
        raise DataError(
            f"{row.where}: column {column!r} must hold a list, found {type(value).__name__} {value!r:.60} (in a CSV "
            'cell, write the list as JSON: ["a", "b"])'
        )
    return list(value)


def regression_target(value, row: Row, column: str) -> float:
    try:
        target = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        target = math.nan
    if math.isnan(target):
        raise DataError(f"{row.where}: column {column!r} must hold a number for regression, found {value!r:.60}")
    if not abs(target) <= REGRESSION_LIMIT:  # the squared error, in float32, would overflow and stop the run
        raise DataError(
            f"{row.where}: regression target {value!r:.60} in column {column!r} is not a finite number within "
            f"+-{REGRESSION_LIMIT:g}; fix the row, or scale the targets"
        )
    return target


def classification_labels(
    rows: list[Row], column: str, problem_type: str, label2id: Mapping[str, int] | None, vectors: bool | None = None
) -> tuple[list, dict[str, int], bool]:
    """Per row: an id (single-label), a multi-hot float list (multi-label: `multi_hot` says how the rows give it) or
    a float (regression); label2id; and whether the rows gave 0/1 vectors."""
    if problem_type == "regression":
        if label2id is not None and dict(label2id) != REGRESSION_LABELS:  # REGRESSION_LABELS: an earlier read's own
            raise DataError(
                f"{rows[0].where}: the labels are regression targets (numbers), so label2id= (names of classes) "
                "would be ignored; drop it, or give class labels"
            )
        return [regression_target(row.get(column), row, column) for row in rows], dict(REGRESSION_LABELS), False
    if problem_type == "single_label_classification":
        keys = [(label_key(row.get(column), row, column), row) for row in rows]
        mapping = build_label2id(keys, label2id)
        check_classes(mapping, rows, label2id)
        return [label_id(k, row, mapping) for k, row in keys], mapping, False
    lists = [as_list(row.get(column), row, column) for row in rows]
    if hot := multi_hot(lists, rows, column, label2id, vectors):
        return *hot, True
    per_row = [[label_key(v, row, column) for v in values] for values, row in zip(lists, rows, strict=True)]
    mapping = build_label2id([(k, row) for ks, row in zip(per_row, rows, strict=True) for k in ks], label2id)
    hots = []
    for ks, row in zip(per_row, rows, strict=True):
        hot = [0.0] * len(mapping)
        for k in ks:
            hot[label_id(k, row, mapping)] = 1.0
        hots.append(hot)
    return hots, mapping, False


def is_number(value) -> bool:
    """A real number, numpy's included, not a str or bool."""
    return isinstance(value, numbers.Real | np.number) and not isinstance(value, bool | np.bool_)


def multi_hot(
    lists: list[list], rows: list[Row], column: str, label2id: Mapping[str, int] | None, vectors: bool | None
) -> tuple[list, dict[str, int]] | None:
    """Multi-label targets written as multi-hot vectors (0/1 per class, transformers' float labels): (the vectors,
    label2id), or None for lists of label names or ids. `vectors` says which the training data held (True, False);
    else (None) rows that all are 0/1 numbers of one length, 2 or more, are vectors (read as ids, every row would
    name every class), and so is a 0/1 list that repeats a value (no list of ids does): every row must then be one."""
    if vectors is False or not lists:
        return None

    def zero_one(values: list) -> bool:
        return all(is_number(v) and v in (0, 1) for v in values)

    if vectors is True and label2id is not None:
        width = len(label2id)
    else:
        certain = [len(v) for v in lists if zero_one(v) and len(set(map(float, v))) < len(v)]
        widths = certain or [len(v) for v in lists if zero_one(v)]
        width = Counter(widths).most_common(1)[0][0] if widths else 0
        if vectors is None and not certain and (width < 2 or not all(zero_one(v) and len(v) == width for v in lists)):
            return None  # names or ids
    fits = [len(values) == width and zero_one(values) for values in lists]
    odd = next((row for fit, row in zip(fits, rows, strict=True) if not fit), None)
    if odd is not None:
        raise DataError(
            f"{odd.where}: column {column!r} holds {odd.get(column)!r:.60}, not a 0/1 vector of {width} classes as the "
            "other rows' multi-hot vectors are; write every row as a vector of 0s and 1s of one length, or as a list "
            "of label names or ids"
        )
    mapping = dict(label2id) if label2id is not None else {f"LABEL_{i}": i for i in range(width)}
    if len(mapping) != width:
        raise DataError(f"{rows[0].where}: the 0/1 vectors have {width} classes but label2id= names {len(mapping)}")
    return [[float(v) for v in values] for values in lists], mapping


def align_labels(
    word_labels: list[int], word_ids: list[int | None], label_all_tokens: bool = False,
    b_to_i: Mapping[int, int] | None = None,
) -> list[int]:  # fmt: skip
    """transformers' `tokenize_and_align_labels` (examples/pytorch/token-classification/run_ner.py): a word's label
    on its first sub-token, -100 on its other sub-tokens (with `label_all_tokens`, its label, a B- tag as its I- tag
    by `b_to_i`) and on special tokens."""
    aligned, previous = [], None
    for word in word_ids:
        if word is None:
            aligned.append(IGNORE_INDEX)
        elif word != previous:
            aligned.append(word_labels[word])
        elif label_all_tokens:
            aligned.append((b_to_i or {}).get(word_labels[word], word_labels[word]))
        else:
            aligned.append(IGNORE_INDEX)
        previous = word
    return aligned


def b_to_i_labels(label2id: Mapping[str, int]) -> dict[int, int]:
    """run_ner.py's `b_to_i_label`: each B-X tag's id to its I-X tag's, where the labels have it."""
    return {
        i: label2id[f"I-{name[2:]}"]
        for name, i in label2id.items()
        if name.startswith("B-") and f"I-{name[2:]}" in label2id
    }


# ----- tasks -----


def sequence_classification_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    *,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str = "label",
    problem_type: str | None = None,
    label2id: Mapping[str, int] | None = None,
    max_length: int | None = None,
    label_vectors: bool | None = None,
) -> Examples:
    """Texts (or text pairs) with one label each: a name or id (single-label), a list of them or a 0/1 vector
    (multi-label; `label_vectors` True or False says which, None reads it from the rows), a number (regression).
    `problem_type` takes transformers' names; None reads it from the first row's label."""
    if problem_type is not None and problem_type not in PROBLEM_TYPES:
        raise ValueError(f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {problem_type!r}")
    rows = read_rows(data, text_column)
    problem_type = problem_type or infer_from_row(rows[0], label_column)
    texts = [row.text(text_column) for row in rows]
    pairs = [row.text(text_pair_column) for row in rows] if text_pair_column else None
    label2id = label2id if label2id is not None else class_label_names(data, label_column)
    labels, mapping, vectors = classification_labels(rows, label_column, problem_type, label2id, label_vectors)
    encodings = tokenizer.encode_batch(texts, pairs, max_length=max_length)
    return Examples("sequence-classification", encodings, labels, mapping, rows, problem_type, vectors)


def class_label_names(data, column: str) -> dict[str, int] | None:
    """label2id from a `datasets.Dataset`'s ClassLabel feature for `column` (or a sequence of them: NER tags), as
    transformers' examples take it: the names of every class, those no row holds included; None otherwise."""
    feature = (getattr(data, "features", None) or {}).get(column)
    names = getattr(feature, "names", None) or getattr(getattr(feature, "feature", None), "names", None)
    return {name: i for i, name in enumerate(names)} if isinstance(names, list) and names else None


def infer_from_row(row: Row, column: str) -> str:
    """The problem type a data file's label says (the model's config has none yet): a list of labels means
    multi-label, a fractional number regression, anything else one label per text."""
    value = row.get(column)
    listed = isinstance(value, (list, tuple)) or isinstance(value, np.ndarray) and value.ndim == 1
    if listed or (isinstance(value, str) and value.lstrip().startswith("[")):
        return "multi_label_classification"
    if isinstance(value, float) or (isinstance(value, str) and FRACTION.fullmatch(value.strip())):
        return "regression"
    return "single_label_classification"


def token_classification_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    *,
    text_column: str = "tokens",
    label_column: str = "ner_tags",
    label2id: Mapping[str, int] | None = None,
    label_all_tokens: bool = False,
    max_length: int | None = None,
) -> Examples:
    """Rows of a word list and a tag list (names such as BIO tags "B-PER", or ids), as in the Hugging Face
    datasets' `tokens` / `ner_tags` columns; word labels are aligned to sub-tokens with `align_labels`."""
    rows = read_rows(data, text_column)
    words = [word_list(row, text_column, label_column) for row in rows]
    tags = [
        [label_key(t, row, label_column) for t in as_list(row.get(label_column), row, label_column)] for row in rows
    ]
    label2id = label2id if label2id is not None else class_label_names(data, label_column)
    mapping = build_label2id([(t, row) for ts, row in zip(tags, rows, strict=True) for t in ts], label2id)
    check_classes(mapping, rows, label2id)
    ids = [[label_id(t, row, mapping) for t in ts] for ts, row in zip(tags, rows, strict=True)]
    encodings = encode_words(tokenizer, words, max_length)
    b_to_i = b_to_i_labels(mapping)
    labels = [align_labels(i, e.word_ids, label_all_tokens, b_to_i) for i, e in zip(ids, encodings, strict=True)]
    for row, aligned, ws in zip(rows, labels, words, strict=True):
        if all(label == IGNORE_INDEX for label in aligned):  # else a batch of such rows has a loss of 0 / 0
            raise DataError(
                f"{row.where}: no word of the row gives a token to label (its words {ws!r:.60} tokenize to nothing, "
                "such as zero-width or control characters alone); remove the row or fix its words"
            )
    return Examples("token-classification", encodings, labels, mapping, rows)


def word_list(row: Row, text_column: str, label_column: str) -> list[str]:
    words = as_list(row.get(text_column), row, text_column)
    tags = as_list(row.get(label_column), row, label_column)
    if not all(isinstance(w, str) for w in words):
        raise DataError(f"{row.where}: column {text_column!r} must hold a list of words (str)")
    if not words:
        raise DataError(f"{row.where}: column {text_column!r} holds no words, so no token to label; remove the row")
    if len(words) != len(tags):
        raise DataError(f"{row.where}: {len(words)} words but {len(tags)} tags; give one tag per word")
    return words


def encode_words(tokenizer: Tokenizer, words: list[list[str]], max_length: int | None) -> list[Encoding]:
    """Pre-split words, as transformers' `tokenizer(words, is_split_into_words=True, truncation=True)`."""
    limit = min(max_length or tokenizer.model_max_length, USIZE_MAX)
    with tokenizer.truncating(dict(max_length=limit, direction=tokenizer.truncation_side)) as backend:
        return backend.encode_batch(words, is_pretokenized=True)


# run_ner.py's model types whose tokenizers it loads with add_prefix_space=True
PREFIX_SPACE_TYPES = ("roberta", "deberta", "gpt2", "bloom")


def with_prefix_space(tokenizer: Tokenizer, model_type: str | None) -> Tokenizer:
    """`tokenizer`, for a model of `model_type` that transformers' token-classification example (run_ner.py) loads
    with `add_prefix_space=True`, made so in place (its byte-level steps, and tokenizer_config.json when saved): each
    pre-split word is read after a space, as running text reads it, and the trained model's saved tokenizer reads
    words as in training. Other tokenizers are left as they are."""
    if model_type not in PREFIX_SPACE_TYPES:
        return tokenizer
    spec = json.loads(tokenizer.backend.to_str())
    steps = [spec.get("pre_tokenizer") or {}, spec.get("post_processor") or {}, spec.get("decoder") or {}]
    steps = [t for step in steps for t in (step.get("pretokenizers") or step.get("processors") or [step])]
    changed = [step for step in steps if "add_prefix_space" in step and not step["add_prefix_space"]]
    if changed:
        for step in changed:
            step["add_prefix_space"] = True
        tokenizer.backend = type(tokenizer.backend).from_str(json.dumps(spec))
        tokenizer.config["add_prefix_space"] = True
    return tokenizer


def masked_lm_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    *,
    text_column: str = "text",
    max_length: int | None = None,
) -> Examples:
    """Masked-LM examples: each document (a blank-line-separated run of lines in a .txt file, else a row's text)
    split into windows of at most `max_length` tokens, so no text is cut off. Masks are drawn in `collate`."""
    encodings, rows = lm_windows(data, tokenizer, text_column, max_length)
    check_maskable(encodings, rows, tokenizer)
    return Examples("masked-lm", encodings, [None] * len(encodings), {}, rows)


def check_maskable(encodings: list[Encoding], rows: list[Row], tokenizer: Tokenizer) -> None:
    """Every masked-LM example has a token to mask (else the batch's loss is an empty mean): special tokens, typed in
    the text or not, are never masked (as transformers' collator); a typed one is warned about, naming the lines."""
    special = special_ids(tokenizer)
    for e, row in zip(encodings, rows, strict=True):
        if all(s or i in special for i, s in zip(e.ids, e.special_tokens_mask, strict=True)):
            raise DataError(f"{row.where}: the document has no token to mask, only special or unknown ones; remove it")
    warn_typed_special(encodings, rows, tokenizer, "which masked-LM training never masks, so it is no word to learn")


def warn_typed_special(encodings: list[Encoding], rows: list[Row], tokenizer: Tokenizer, effect: str) -> None:
    """Warn, naming the file and lines, where a special token typed in the text ("[MASK]", "<|endoftext|>") became
    that special id rather than the text's characters."""
    special = special_ids(tokenizer)
    # an unknown character becomes [UNK], which is no typed token; GPT-2's <|endoftext|> is its unk token too
    named = {
        getattr(tokenizer, n) for n in ("cls_token", "sep_token", "pad_token", "mask_token", "bos_token", "eos_token")
    }
    unknown = None if tokenizer.unk_token in named else tokenizer.token_id(tokenizer.unk_token)
    typed: dict[tuple[str, int], tuple[Row, set[str]]] = {}  # by (source, line): a Row holds a dict, unhashable
    for e, row in zip(encodings, rows, strict=True):
        found = {t for t, i, s in zip(e.tokens, e.ids, e.special_tokens_mask, strict=True) if s == 0 and i in special
                 and i != unknown}  # fmt: skip
        if found:
            typed.setdefault((row.source, row.line), (row, set()))[1].update(found)
    if typed:
        (first, tokens), *others = typed.values()
        lines = ", ".join(str(row.line) for row, _ in others[:5]) + (", ..." if len(others) > 5 else "")
        more = f" (and in {len(others)} more: {'items' if first.source == ITERABLE else 'lines'} {lines})"
        warnings.warn(
            f"{first.where}: {', '.join(sorted(tokens))} typed in the text{more if others else ''} becomes the "
            f"special token itself, {effect}; remove it, or write it otherwise if it is not meant as that token",
            UserWarning,
            stacklevel=4,
        )


def lm_windows(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    text_column: str,
    max_length: int | None,
    special_per_window: bool = True,
) -> tuple[list[Encoding], list[Row]]:
    """Each document's windows of at most `max_length` tokens, each with the row the document starts on; each
    window between the tokenizer's special tokens ([CLS] ... [SEP]), or, not `special_per_window`, the document
    cut as a whole, so that they stand only at its real start and end (run_clm's `group_texts`)."""
    documents = read_documents(data, text_column)
    texts = ["\n".join(row.text(text_column) for row in doc) for doc in documents]
    if special_per_window:
        whole = tokenizer.encode_batch(texts, max_length=max_length)
    else:
        whole, limit = tokenizer.encode_batch(texts, truncation=False), max_length or tokenizer.model_max_length
        for encoding in whole:
            if len(encoding.ids) > limit:
                encoding.truncate(limit)
    encodings, rows = [], []
    for first, doc in zip(whole, documents, strict=True):
        windows = [first, *first.overflowing]
        encodings += windows
        rows += [doc[0]] * len(windows)
    return encodings, rows


def causal_lm_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    *,
    text_column: str = "text",
    max_length: int | None = None,
) -> Examples:
    """Causal-LM examples: each document split into windows of at most `max_length` tokens, the tokenizer's special
    tokens (an end-of-text token) only at its real start and end, as run_clm's `group_texts` places them;
    `collate` labels every real token with itself (the loss shifts them) and padding with -100."""
    encodings, rows = lm_windows(data, tokenizer, text_column, max_length, special_per_window=False)
    kept = []
    for i, (e, row) in enumerate(zip(encodings, rows, strict=True)):
        if len(e.ids) >= 2:
            kept.append((e, row))
        elif i == 0 or rows[i - 1] is not row:  # the document's first window: the whole document is one token
            raise DataError(f"{row.where}: the document has {len(e.ids)} token(s), so nothing to predict; remove it")
        # else a document's last window of one token: it has no next token to predict, so it is dropped
    warn_typed_special(encodings, rows, tokenizer, "which causal-LM training then learns to predict inside text")
    return Examples("causal-lm", [e for e, _ in kept], [None] * len(kept), {}, [row for _, row in kept])


def pretraining_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    *,
    text_column: str = "text",
    max_length: int | None = None,
) -> Examples:
    """BERT pretraining examples: next-sentence pairs drawn with `rng` from the documents of a .txt file (one
    sentence a line, blank lines between documents); `labels` holds the next-sentence label, `collate` the masks."""
    documents = read_documents(data, text_column)
    if len(documents) < 2:  # the random second sentences come from another document
        raise DataError(
            f"{documents[0][0].source}: next-sentence pairs need at least 2 documents, found 1; separate documents "
            "with a blank line"
        )
    pairs = next_sentence_pairs(documents, rng)
    if not pairs:
        raise DataError(f"{documents[0][0].source}: no document has two sentences; write one sentence a line")
    first = [row.text(text_column) for row, _, _ in pairs]
    second = [row.text(text_column) for _, row, _ in pairs]
    encodings = tokenizer.encode_batch(first, second, max_length=max_length)
    check_maskable(encodings, [row for row, _, _ in pairs], tokenizer)
    return Examples("pretraining", encodings, [label for *_, label in pairs], {}, [row for row, _, _ in pairs])


# ----- batches -----


def word_ids(encodings: list[Encoding], width: int, tokenizer: Tokenizer) -> np.ndarray:
    """(B, L) word numbers for whole-word masking, as transformers' collator finds words: a token not special starts
    a word where it does not begin at the previous token's end, or follows a special one; -1 on special tokens and
    padding (`_calc_word_ids_and_prob_mask`)."""
    out = np.full((len(encodings), width), -1, dtype=np.int64)
    for row, e in enumerate(encodings):
        start, word, previous_end, previous_special = tokenizer.real_tokens(len(e.ids), width).start, -1, -1, False
        for i, ((begin, end), special) in enumerate(zip(e.offsets, e.special_tokens_mask, strict=True)):
            if not special:
                word += begin != previous_end or previous_special
                out[row, start + i] = word
            previous_end, previous_special = end, bool(special)
    return out


def collate(
    examples: Examples,
    indices: Sequence[int],
    tokenizer: Tokenizer,
    masker: Masker | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
    """The padded batch of `examples[indices]` as numpy arrays: the model's inputs and the labels its task's loss
    takes. Masked-LM and pretraining batches are masked by `masker` with `rng`, afresh on every call."""
    encodings = [examples.encodings[i] for i in indices]
    labels = [examples.labels[i] for i in indices]
    batch = tokenizer.pad(encodings, return_tensors="np")
    if examples.task in ("masked-lm", "pretraining"):
        batch["input_ids"], batch["labels"] = mask_batch(batch["input_ids"], encodings, masker, rng, tokenizer)
        if examples.task == "pretraining":
            batch["next_sentence_label"] = np.array(labels, dtype=np.int32)
    elif examples.task == "causal-lm":
        batch["labels"] = np.where(batch["attention_mask"] == 1, batch["input_ids"], IGNORE_INDEX).astype(np.int32)
    elif examples.task == "token-classification":
        batch["labels"] = np.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=np.int32)
        for row, aligned in enumerate(labels):  # on the tokens' own side of the padding
            batch["labels"][row, tokenizer.real_tokens(len(aligned), batch["input_ids"].shape[1])] = aligned
    else:
        batch["labels"] = np.array(labels, dtype=np.float32 if isinstance(labels[0], (float, list)) else np.int32)
    return batch


def mask_batch(
    input_ids: np.ndarray, encodings: list[Encoding], masker: Masker | None, rng: np.random.Generator | None,
    tokenizer: Tokenizer,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(masked ids, labels) of a padded batch: special tokens and padding are never selected."""
    if masker is None or rng is None:
        raise ValueError(
            "Masked-LM batches need a masker and a generator: "
            "collate(..., masker=Masker.from_tokenizer(tokenizer), rng=np.random.default_rng(seed))"
        )
    special = np.ones(input_ids.shape, dtype=bool)
    for row, e in enumerate(encodings):  # on the tokens' own side of the padding
        special[row, tokenizer.real_tokens(len(e.ids), input_ids.shape[1])] = np.array(e.special_tokens_mask, bool)
    words = word_ids(encodings, input_ids.shape[1], tokenizer) if masker.whole_word else None
    return masker(input_ids, special, rng, words)
