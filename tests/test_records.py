"""One reader of corpus and data files for the index (`read_corpus`) and training (`read_rows`,
`read_documents`): `mlx_encoders.records`. First each case found reading files, through both readers: CRLF and
CR line ends, a byte-order mark, null and empty values, ids that are neither strings nor integers, lone
surrogates. Then a property-based campaign (hypothesis, derandomized): random .txt/.jsonl/.csv corpora in UTF-8
with or without a byte-order mark or in latin-1, with stray latin-1 bytes and lone surrogates, LF, CRLF, CR or
mixed line ends, nulls, empty cells and malformed lines; each either reads the rows a simple oracle written
here from the generated data expects, or is refused with the reader's error naming the file and the line the
oracle expects, never another exception. The campaign records its case counts, printed at the end of the run."""

import json
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_encoders.index import CorpusError, read_corpus
from mlx_encoders.train.data import DataError, read_documents, read_rows

# ----- each case found -----


@pytest.mark.parametrize("end", ["\r\n", "\r"])
def test_crlf_and_cr_line_ends_read_as_lf(tmp_path, end):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(f"First.{end}{end}Second,{end}still second.{end}".encode())
    assert read_corpus(notes) == [("notes.txt#1", "First."), ("notes.txt#2", "Second, still second.")]
    documents = read_documents(notes)
    assert [[(r.values["text"], r.line) for r in d] for d in documents] == [
        [("First.", 1)],
        [("Second,", 3), ("still second.", 4)],
    ]
    table = tmp_path / "rows.csv"  # a line end inside a quoted cell is a line end too: LF
    table.write_bytes(f'id,text{end}a,"two{end}lines"{end}b,one{end}'.encode())
    assert read_corpus(table) == [("a", "two\nlines"), ("b", "one")]
    assert [(r.values["text"], r.line) for r in read_rows(table)] == [("two\nlines", 2), ("one", 4)]


def test_a_byte_order_mark_is_dropped_in_every_format(tmp_path):
    files = {
        "rows.csv": "id,text\r\na,Rain falls.\r\n",
        "rows.jsonl": '{"id": "a", "text": "Rain falls."}\n',
        "notes.txt": "Rain falls.\n",
    }
    expected = {"rows.csv": "a", "rows.jsonl": "a", "notes.txt": "notes.txt#1"}
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8-sig")
        assert read_corpus(path) == [(expected[name], "Rain falls.")]
        values = read_rows(path)[0].values
        assert values["text"] == "Rain falls." and "\ufeffid" not in values and "\ufefftext" not in values
    utf16 = tmp_path / "wide.txt"  # UTF-16's byte-order mark is named, not dropped
    utf16.write_text("Rain falls.\n", encoding="utf-16")
    with pytest.raises(CorpusError, match=f"^{utf16}:1: not UTF-8 but UTF-16"):
        read_corpus(utf16)


def test_null_and_empty_values_are_missing_alike(tmp_path):
    """A missing id is the default `file:line`; a missing text is an error naming the line, in the index and in
    training, from JSON null, JSON "" and an empty CSV cell alike."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"id": null, "text": "x"}\n{"id": "", "text": "y"}\n{"id": 7, "text": "z"}\n')
    assert read_corpus(jsonl) == [("docs.jsonl:1", "x"), ("docs.jsonl:2", "y"), ("7", "z")]
    table = tmp_path / "docs.csv"
    table.write_text("id,text\n,x\nb,y\n")
    assert read_corpus(table) == [("docs.csv:2", "x"), ("b", "y")]

    for name, text in [("null.jsonl", '{"text": "a"}\n{"text": null}\n'), ("empty.jsonl", '"a"\n""\n')]:
        (tmp_path / name).write_text(text)
        with pytest.raises(CorpusError, match=rf"^{tmp_path / name}:2: the text is (null|empty)"):
            read_corpus(tmp_path / name)
    table.write_text("id,text\na,x\nb,\n")
    with pytest.raises(CorpusError, match=f"^{table}:3: the text is empty"):
        read_corpus(table)

    for name, text, line in [
        ("train.csv", "text,label\nfine,pos\n,neg\n", 3),
        ("null.jsonl", '{"text": "fine", "label": "pos"}\n{"text": null, "label": "neg"}\n', 2),
        ("empty.jsonl", '{"text": "fine", "label": "pos"}\n{"text": "", "label": "neg"}\n', 2),
    ]:
        (tmp_path / name).write_text(text)
        rows = read_rows(tmp_path / name)
        assert rows[0].text("text") == "fine"
        with pytest.raises(DataError, match=f"^{tmp_path / name}:{line}: no value in column 'text'"):
            rows[1].text("text")


def test_ids_are_strings_or_integers(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    for bad in ("1.5", "true", '["a"]', '{"n": 1}'):
        jsonl.write_text(f'{{"id": "a", "text": "x"}}\n{{"id": {bad}, "text": "y"}}\n')
        with pytest.raises(CorpusError, match=f"^{jsonl}:2: the id is .*; write ids as strings or integers"):
            read_corpus(jsonl)
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1.0, None], "text": ["x", "y"]}), table)
    with pytest.raises(CorpusError, match=f"^{table}: row 1: the id is float"):
        read_corpus(table)
    pq.write_table(pa.table({"id": [3, None], "text": ["x", "y"]}), table)
    assert read_corpus(table) == [("3", "x"), ("docs.parquet:2", "y")]


def test_lone_surrogates_are_named_by_file_and_line(tmp_path):
    escaped = tmp_path / "escaped.jsonl"  # json.loads accepts the escape; no codec can write the character
    escaped.write_text('{"text": "fine", "label": "a"}\n{"text": "half \\ud800 a pair", "label": "b"}\n')
    raw = tmp_path / "raw.txt"  # the same surrogate written as bytes, which UTF-8 does not allow
    raw.write_bytes(b"fine\nhalf " + "\ud800".encode("utf-8", "surrogatepass") + b" a pair\n")
    for path, message in [(escaped, "a lone surrogate escape"), (raw, "not UTF-8")]:
        with pytest.raises(CorpusError, match=f"^{path}:2: {message}"):
            read_corpus(path)
        with pytest.raises(DataError, match=f"^{path}:2: {message}"):
            read_rows(path)


def test_malformed_csv_is_named_by_file_and_line(tmp_path):
    table = tmp_path / "docs.csv"
    for text, line, message in [
        ('id,text\na,"never closed\nb,more\n', 2, r"not valid CSV \(unexpected end of data\)"),
        ('id,text\na,x\nb,"quoted" then not\n', 3, "not valid CSV"),
        ("id,text\na,x\nb\n", 3, r"1 fields where the header \(line 1\) has 2"),
        ("text,text\nx,y\n", 1, "the header names 'text' twice"),
    ]:
        table.write_text(text)
        for read, error in [(read_corpus, CorpusError), (read_rows, DataError)]:
            with pytest.raises(error, match=f"^{table}:{line}: {message}"):
                read(table)


def test_a_repeated_id_names_both_places(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "x", "text": "one"}\n\n{"id": "x", "text": "two"}\n')
    with pytest.raises(CorpusError, match=r"a.jsonl:3: the id 'x' appears twice \(first at line 1\)"):
        read_corpus(tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").write_text('{"id": "x", "text": "one"}\n')
    (tmp_path / "b.csv").write_text("id,text\nx,two\n")
    with pytest.raises(CorpusError, match=rf"^{tmp_path / 'b.csv'}:2: the id 'x' appears twice \(first at "):
        read_corpus(tmp_path)


# ----- the campaign -----

CASES = 400
BOM = b"\xef\xbb\xbf"
ENDINGS = {"LF": ("\n",), "CRLF": ("\r\n",), "CR": ("\r",), "mixed": ("\n", "\r\n", "\r")}
WORDS = {  # the latin-1 file's words can all be written in latin-1
    "utf-8": ("rain", "café", "€5", "😀", "naïve", "a,b", 'say "hi"', "x'y", "tab\tstop", "line\u2028sep"),
    "latin-1": ("rain", "fall", "café", "naïve", "a,b", 'say "hi"', "x'y", "tab\tstop", "£3"),
}
DAMAGE = (None,) * 24 + (b"\xe9", "\ud800".encode("utf-8", "surrogatepass"))  # a latin-1 byte, a lone surrogate
IDS = (None, "", "a", "b", 1, 2, "1", 1.5, True)  # None and "" are missing; 1 and "1" are the same id
ABSENT, BLANK, INVALID = object(), object(), object()  # a key left out of a JSON object; a blank line; bad JSON


@dataclass
class Line:
    """One physical line of a generated file: text without a line end, stray bytes after it, its line end."""

    content: str
    damage: bytes | None = None
    ending: str = "\n"


@dataclass
class Case:
    name: str
    lines: list[Line]
    items: list  # per format: what each line or record holds (see the writers)
    codec: str
    bom: bool


def one_of(*values):
    return st.sampled_from(values)


@st.composite
def phrase(draw, codec: str, breaks: bool = False) -> str:
    """A few words, joined by spaces (and by line breaks when `breaks`)."""
    words = draw(st.lists(st.sampled_from(WORDS[codec]), min_size=1, max_size=3))
    return "".join(w + (draw(one_of(" ", " ", "\n")) if breaks else " ") for w in words[:-1]) + words[-1]


@st.composite
def text_case(draw, codec: str) -> tuple[list[Line], list]:
    """Paragraphs of 1-3 lines (spaces around some) between blank lines (empty or whitespace)."""
    lines = []
    for number in range(draw(st.integers(1, 4))):
        if number or draw(st.booleans()):
            lines += [Line(draw(one_of("", " ", "\t"))) for _ in range(draw(st.integers(1, 2)))]
        for _ in range(draw(st.integers(1, 3))):
            lines.append(Line(draw(one_of("", " ")) + draw(phrase(codec)) + draw(one_of("", " "))))
    return lines, []


@st.composite
def jsonl_case(draw, codec: str) -> tuple[list[Line], list]:
    """Lines of objects (id and text drawn, either may be absent, null or empty), plain strings, other JSON values,
    invalid JSON, blank lines and lone surrogate escapes; items[i] is the value on line i + 1 (or BLANK or
    INVALID)."""
    lines, items = [], []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(one_of(*["object"] * 12, "string", "string", "blank", "other", "bad"))
        if kind == "blank":
            lines.append(Line(draw(one_of("", "  "))))
            items.append(BLANK)
            continue
        if kind == "bad":
            lines.append(Line('{"text": oops}'))
            items.append(INVALID)
            continue
        text = draw(one_of(*[draw(phrase(codec, breaks=True))] * 6, None, "", 5, ABSENT))
        if isinstance(text, str) and draw(st.integers(0, 40)) == 0:
            text += "\ud800"  # an escape json.dumps writes as \ud800, as any ASCII-only JSON writer would
        if kind == "object":
            value = {} if text is ABSENT else {"text": text}
            if draw(st.booleans()):
                value["id"] = draw(st.sampled_from(IDS))
        else:
            value = text if kind == "string" and isinstance(text, str) else draw(one_of(None, 5, [1]))
        ascii_only = draw(st.booleans()) or has_surrogate(text)
        lines.append(Line(json.dumps(value, ensure_ascii=ascii_only)))
        items.append(value)
    return lines, items


@st.composite
def csv_case(draw, codec: str) -> tuple[list[Line], list]:
    """A header, then records: cells drawn (an empty text or id cell sometimes; quoted when they must be, or by
    chance; line breaks in quoted texts), blank lines, records of blank cells, short records, a bad quote, and
    an unclosed quote as the last record. items: the header, then per record (kind, first line, cells)."""
    header = draw(one_of(["id", "text"], ["text", "id"], ["text"]))
    lines, items = [Line(",".join(header))], [header]
    kinds = ["record"] * 16 + ["blank", "blank cells", "short", "bad quote", "unclosed"]
    count = draw(st.integers(1, 5))
    for number in range(count):
        kind = draw(st.sampled_from(kinds if number == count - 1 else kinds[:-1]))
        cells = {"id": draw(one_of("", "a", "b", "1", "7")), "text": draw(one_of(*[draw(phrase(codec, True))] * 6, ""))}
        start = len(lines) + 1
        if kind == "blank":
            record = ""
        elif kind == "blank cells":
            record = ",".join(draw(one_of("", " ")) for _ in header)
        elif kind == "short":
            record = quoted(cells["text"] or "x", draw(st.booleans())) if len(header) == 2 else "x,y"
        elif kind == "bad quote":
            record = ",".join('"x" y' if c == "text" else quoted(cells[c], False) for c in header)
        elif kind == "unclosed":
            record = ",".join('"never closed' if c == "text" else quoted(cells[c], False) for c in header)
        else:
            record = ",".join(quoted(cells[c], draw(st.booleans())) for c in header)
        lines += [Line(piece) for piece in record.split("\n")]
        items.append((kind, start, [cells[c] for c in header]))
    return lines, items


def quoted(cell: str, always: bool) -> str:
    must = any(c in cell for c in ',"\n') or cell != cell.strip()
    return '"' + cell.replace('"', '""') + '"' if must or always else cell


def has_surrogate(value) -> bool:
    return isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value)


@st.composite
def corpora(draw) -> Case:
    suffix = draw(one_of(".txt", ".jsonl", ".csv"))
    codec = draw(one_of("utf-8", "utf-8", "utf-8", "latin-1"))
    case = {".txt": text_case, ".jsonl": jsonl_case, ".csv": csv_case}[suffix]
    lines, items = draw(case(codec))
    endings = ENDINGS[draw(st.sampled_from(list(ENDINGS)))]
    for line in lines:
        line.ending = draw(st.sampled_from(endings))
        line.damage = draw(st.sampled_from(DAMAGE))
    lines[-1].ending = draw(st.sampled_from(("", *endings)))
    return Case(f"corpus{suffix}", lines, items, codec, draw(st.booleans()))


def file_bytes(case: Case) -> bytes:
    out, previous = [BOM if case.bom else b""], ""
    for line in case.lines:
        if previous == "\r" and not line.content and not line.damage and line.ending.startswith("\n"):
            line.ending = "\r\n"  # a CR, then an empty line's LF, would be one CRLF: keep the lines apart
        out.append(encoded(line, case.codec) + (line.damage or b"") + line.ending.encode())
        previous = line.ending
    return b"".join(out)


def encoded(line: Line, codec: str) -> bytes:
    return line.content.encode(codec)


# The oracle: what each reader must give, from the generated lines and items alone. An outcome is ("rows", ...)
# or ("error", line or None, words the message holds); files are checked in the readers' order: the bytes, then
# the syntax of every line, then each row's values, then repeated ids.


def not_utf8(case: Case):
    for number, line in enumerate(case.lines, 1):
        try:
            (encoded(line, case.codec) + (line.damage or b"")).decode("utf-8")
        except UnicodeDecodeError:
            return ("error", number, "not UTF-8")
    return None


def oracle(case: Case) -> dict[str, tuple]:
    """{"index": outcome, "rows": outcome, "texts": outcome, "documents": outcome (for .txt)}."""
    bad = not_utf8(case)
    if bad:
        return {"index": bad, "rows": bad, "documents": bad}
    suffix = case.name.rsplit(".", 1)[1]
    return {"txt": text_oracle, "jsonl": jsonl_oracle, "csv": csv_oracle}[suffix](case)


def text_oracle(case: Case) -> dict[str, tuple]:
    rows = [(line.content, n) for n, line in enumerate(case.lines, 1) if line.content.strip()]
    documents = []
    for text, n in rows:
        if documents and documents[-1][-1][1] == n - 1:
            documents[-1].append((text, n))
        else:
            documents.append([(text, n)])
    index = [(f"{case.name}#{i}", " ".join(" ".join(t for t, _ in d).split())) for i, d in enumerate(documents, 1)]
    return {
        "index": ("rows", index),
        "rows": ("rows", [({"text": t}, n) for t, n in rows]),
        "documents": ("rows", [[({"text": t}, n) for t, n in d] for d in documents]),
    }


def jsonl_oracle(case: Case) -> dict[str, tuple]:
    numbered = [(n, item) for n, item in enumerate(case.items, 1) if item is not BLANK]
    for n, item in numbered:
        if item is INVALID:
            return dict.fromkeys(("index", "rows"), ("error", n, "not a JSON value"))
        if has_surrogate(item) or (isinstance(item, dict) and has_surrogate(item.get("text"))):
            return dict.fromkeys(("index", "rows"), ("error", n, "a lone surrogate escape"))
    index, rows = [], []
    for n, item in numbered:
        if isinstance(item, dict) and "text" in item:
            index.append(document(item.get("id"), item["text"], n, f"{case.name}:{n}"))
        elif isinstance(item, str):
            index.append(document(None, item, n, f"{case.name}:{n}"))
        else:
            index.append(("error", n, 'expected a string or an object with a "text" string'))
        kind = "null" if item is None else type(item).__name__
        rows.append(("row", item, n) if isinstance(item, dict) else ("error", n, f"a JSON {kind}, not an object"))
    return {"index": documents_outcome(index)} | rows_outcome(rows, "text")


def csv_oracle(case: Case) -> dict[str, tuple]:
    header, *records = case.items
    for kind, start, _ in records:
        if kind == "short":
            found = 1 if len(header) == 2 else 2
            return dict.fromkeys(("index", "rows"), ("error", start, f"{found} fields where the header"))
        if kind in ("bad quote", "unclosed"):
            return dict.fromkeys(("index", "rows"), ("error", start, "not valid CSV"))
    index, rows = [], []
    for kind, start, cells in records:
        if kind == "record" and any(cell.strip() for cell in cells):  # a record of blank cells is no row
            values = dict(zip(header, cells, strict=True))
            index.append(document(values.get("id"), values["text"], start, f"{case.name}:{start}"))
            rows.append(("row", values, start))
    return {"index": documents_outcome(index)} | rows_outcome(rows, "text")


def document(key, text, n: int, default: str) -> tuple:
    """("document", id, text, line) of a row the index reads, or ("error", line, words): an id that is missing is
    `default`, one that is not a string or an integer an error; then a text that is not a non-empty string."""
    if not (key is None or key == "" or isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))):
        return ("error", n, "the id is")
    if not isinstance(text, str) or text == "":
        return ("error", n, f"the text is {'empty' if text == '' else 'null' if text is None else type(text).__name__}")
    return ("document", default if key is None or key == "" else str(key), text, n)


def documents_outcome(index: list[tuple]) -> tuple:
    """The index's outcome: the first row's error, else the first repeated id, else the documents."""
    for entry in index:
        if entry[0] == "error":
            return entry
    first = {}
    for _, key, _, n in index:
        if key in first:
            return ("error", n, f"the id {key!r} appears twice (first at line {first[key]})")
        first[key] = n
    if not index:
        return ("error", None, "holds no texts")
    return ("rows", [(key, text) for _, key, text, _ in index])


def rows_outcome(rows: list[tuple], column: str) -> dict[str, tuple]:
    """Training's outcomes from ("row", values, line) or ("error", line, words) per row: the rows read (or the
    first error), then each row's text."""
    for entry in rows:
        if entry[0] == "error":
            return {"rows": entry}
    if not rows:
        return {"rows": ("error", None, "holds no rows")}
    read = ("rows", [(values, n) for _, values, n in rows])
    for _, values, n in rows:
        text = values.get(column)
        if text is None or text == "":
            return {"rows": read, "texts": ("error", n, f"no value in column {column!r}")}
        if not isinstance(text, str):
            return {"rows": read, "texts": ("error", n, "must hold a text")}
    return {"rows": read, "texts": ("rows", [values[column] for _, values, _ in rows])}


def outcome(read, path) -> tuple:
    """What a reader gave: ("rows", ...) or ("error", the line its message names or None, the message)."""
    try:
        return ("rows", read(path))
    except (CorpusError, DataError) as e:  # any other exception fails the test
        message = str(e)
        named = re.match(rf"{re.escape(str(path))}:(\d+): ", message)
        assert named or str(path) in message, f"the error names no file: {message}"
        return ("error", int(named[1]) if named else None, message)


def check(got: tuple, expected: tuple, case: Case, reader: str) -> None:
    context = f"{reader} of {case.name} ({case.codec}{', BOM' if case.bom else ''}): {case.lines}"
    if expected[0] == "rows":
        assert got == expected, f"{context}: expected {expected}, got {got}"
    else:
        assert got[0] == "error", f"{context}: expected {expected}, read {got}"
        assert got[1] == expected[1] and expected[2] in got[2], f"{context}: expected {expected}, got {got}"


READERS = {
    "index": read_corpus,
    "rows": lambda path: [(row.values, row.line) for row in read_rows(path)],
    "documents": lambda path: [[(row.values, row.line) for row in d] for d in read_documents(path)],
}


def texts(path):
    values = []
    for row in read_rows(path):
        values.append(row.text("text"))
    return values


REFUSALS = (  # each is drawn in the campaign
    "not UTF-8", "not a JSON value", "a lone surrogate escape", "fields where the header", "not valid CSV",
    "the text is empty", "the text is null", "the id is", "appears twice", "not an object", "no value in column",
)  # fmt: skip


def test_random_corpora_read_right_or_are_refused_naming_the_line(tmp_path, record_property):
    """A case is one reader on one corpus: the index's, training's rows, then their texts (or its documents)."""
    counts, refusals = {"cases": 0, "read": 0, "refused": 0}, set()
    serial = iter(range(10**6))

    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=corpora())
    def run(case):
        folder = tmp_path / f"case{next(serial)}"
        folder.mkdir()
        path = folder / case.name
        path.write_bytes(file_bytes(case))
        for reader, expected in oracle(case).items():
            got = outcome(texts if reader == "texts" else READERS[reader], path)
            check(got, expected, case, reader)
            refusals.update(words for words in REFUSALS if expected[0] == "error" and words in expected[2])
            counts["cases"] += 1
            counts["read" if got[0] == "rows" else "refused"] += 1

    run()
    n, ok, errors = counts["cases"], counts["read"], counts["refused"]
    line = f"corpus campaign: {n} cases, {ok} read, {errors} refused"
    print(line)
    record_property("summary", line)
    assert ok and errors and refusals == set(REFUSALS), set(REFUSALS) - refusals


def test_a_gzip_compressed_file_reads_as_its_text(tmp_path):
    """BEIR's corpora ship as .jsonl.gz: read as their text, and a cut-off download is named as one."""
    import gzip

    from mlx_encoders.records import RecordError, read_text

    lines = '{"_id": "MED-10", "title": "Statins", "text": "Lower cholesterol."}\n'
    (tmp_path / "corpus.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    assert read_text(tmp_path / "corpus.jsonl.gz") == lines
    assert read_corpus(tmp_path / "corpus.jsonl.gz") == [("MED-10", "Statins Lower cholesterol.")]
    (tmp_path / "cut.gz").write_bytes(gzip.compress(lines.encode())[:20])
    with pytest.raises(RecordError, match="cut.gz: gzip-compressed, but not a whole gzip file"):
        read_text(tmp_path / "cut.gz")


def test_a_pipe_reads_as_a_file(tmp_path):
    """`--corpus <(command)` gives a pipe (/dev/fd/N), which exists but is no regular file."""
    import os
    import threading

    from mlx_encoders.records import text_lines

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text("one\ntwo\n"), daemon=True)
    writer.start()
    assert [r.value for r in text_lines(pipe)] == ["one", "two"]
    writer.join(timeout=10)


def test_a_csv_cell_longer_than_the_csv_module_s_default_limit_is_read(tmp_path):
    """pandas and datasets read an article of 200,000 characters in one cell; so does every CSV reader here."""
    article = "word " * 40_000
    (tmp_path / "docs.csv").write_text(f'id,text\na,"{article}"\nb,short\n')
    assert [len(text) for _, text in read_corpus(tmp_path / "docs.csv")] == [len(article), 5]


def test_a_beir_corpus_line_gives_its_id_and_its_title_before_the_text(tmp_path):
    lines = [{"_id": "MED-10", "title": "Statins", "text": "Lower cholesterol."}, {"_id": "MED-14", "text": "Diet."}]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_corpus(tmp_path / "corpus.jsonl") == [("MED-10", "Statins Lower cholesterol."), ("MED-14", "Diet.")]
