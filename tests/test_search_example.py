"""examples/search.py run as a user runs it: index a tiny corpus, answer queries, reuse and update the saved
index; a killed run, a full disk or a damaged index file never leaves an index that ranks wrongly."""

import errno
import importlib.util
import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from checkpoints import make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

from convert.__main__ import main as convert_main
from mlx_encoders import SentenceEncoder

SCRIPT = Path(__file__).parents[1] / "examples" / "search.py"
_spec = importlib.util.spec_from_file_location("search_example", SCRIPT)
search = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(search)

PARAGRAPHS = {
    "animals.md": ["Cats purr when they are content.", "Dogs bark at the mail carrier every morning."],
    "notes/code.txt": ["Use argparse to read command line options.", "A zip file bundles many files in one."],
}
# Runs the example with sqlite3 connections that kill the process just before the last statement of the write
# transaction (the vectors are already inserted and deleted), with a one-page cache so pages reach the file.
KILLED_WHILE_WRITING = """
import os, runpy, signal, sqlite3, sys
sys.argv = sys.argv[1:]  # the example's path, then its arguments
class Killed(sqlite3.Connection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.execute("PRAGMA cache_size = 1")

    def executemany(self, sql, rows):
        if sql.startswith("INSERT OR REPLACE INTO meta"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().executemany(sql, rows)
connect = sqlite3.connect
sqlite3.connect = lambda *args, **kwargs: connect(*args, factory=Killed, **kwargs)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny random sentence-transformers model: it cannot rank by meaning, but a query equal to a paragraph
    gets that paragraph first with score 1.000."""
    folder = tmp_path_factory.mktemp("model")
    transformer = Transformer(str(make_checkpoint(folder / "bert", "bert")))
    SentenceTransformer(modules=[transformer, Pooling(32), Normalize()], device="cpu").save(str(folder / "st"))
    return folder / "st"


def run(*args) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def main(capsys, *args) -> tuple[str, str]:
    """The example's main() in this process: (stdout, stderr)."""
    search.main([str(a) for a in args])
    captured = capsys.readouterr()
    return captured.out, captured.err


def error(capsys, *args) -> str:
    """The message main() exits with (its own SystemExit, or argparse's usage error)."""
    with pytest.raises(SystemExit) as exit:
        search.main([str(a) for a in args])
    return f"{exit.value.code} {capsys.readouterr().err}"


def write_corpus(folder: Path, paragraphs: dict[str, list[str]] = PARAGRAPHS) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    for name, texts in paragraphs.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n\n".join(texts) + "\n")
    return folder


def stored(index: Path) -> tuple[dict[str, str], dict[str, bytes]]:
    """(meta, vectors by text key) of an index folder, read with sqlite3 alone."""
    with closing(sqlite3.connect(index / "index.sqlite")) as con:
        return dict(con.execute("SELECT name, value FROM meta")), dict(con.execute("SELECT key, vector FROM vectors"))


def sql(statement: str, *params):
    def corrupt(file: Path) -> None:
        with closing(sqlite3.connect(file)) as con, con:
            con.execute(statement, params)

    return corrupt


def float64_vectors(file: Path) -> None:
    with closing(sqlite3.connect(file)) as con, con:
        rows = con.execute("SELECT key, vector FROM vectors").fetchall()
        wider = [(np.frombuffer(vector, "<f4").astype("<f8").tobytes(), key) for key, vector in rows]
        con.executemany("UPDATE vectors SET vector = ? WHERE key = ?", wider)
        con.execute("UPDATE meta SET value = '<f8' WHERE name = 'dtype'")


CORRUPTIONS = {  # name: (how to damage index.sqlite, the reason the example gives)
    "garbage bytes": (lambda f: f.write_bytes(random.Random(0).randbytes(8192)), "file is not a database"),
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "malformed"),
    "zero bytes": (lambda f: f.write_bytes(b""), "no such table"),
    "other model": (sql("UPDATE meta SET value = ? WHERE name = 'model_fingerprint'", "0" * 64), "model_fingerprint"),
    "wrong dimension": (sql("UPDATE meta SET value = '16' WHERE name = 'dimension'"), "its dimension is '16'"),
    "short vector": (sql("UPDATE vectors SET vector = substr(vector, 1, 64) WHERE rowid = 2"), "not 128 bytes"),
    "float64 vectors": (float64_vectors, "its dtype is '<f8'"),
    "NaN row": (sql("UPDATE vectors SET vector = ? WHERE rowid = 3", np.full(32, np.nan, "<f4").tobytes()), "NaN"),
    "missing row": (sql("DELETE FROM vectors WHERE rowid = 1"), "its rows is '4', expected '3'"),
}


def test_folder_corpus_and_index_reuse(tmp_path, model):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    query = PARAGRAPHS["notes/code.txt"][1]
    first = run("--corpus", corpus, "--model", model, "--index", index, "--query", query, "--top-k", "2")
    assert f"Indexing 4 texts with {model} into {index}" in first.stderr and "Embedded 4 texts" in first.stderr
    lines = first.stdout.strip().splitlines()
    assert lines[0] == f"> {query}"
    assert lines[1] == " 1. 1.000  notes/code.txt#2" and lines[2].strip() == query
    assert len(lines) == 5  # the query, then two results of two lines each
    meta, vectors = stored(index)
    assert meta["model"] == str(model) and meta["dimension"] == "32" and meta["rows"] == "4" and len(vectors) == 4

    again = run("--corpus", corpus, "--model", model, "--index", index, "--query", query, "--top-k", "2")
    assert "Reusing the index" in again.stderr and "Embedded" not in again.stderr and again.stdout == first.stdout

    (corpus / "animals.md").write_text("Parrots can imitate speech.\n")
    changed = run("--corpus", corpus, "--model", model, "--index", index, "--query", "Parrots can imitate speech.")
    assert f"Updating the index in {index}: 1 new or changed texts, 2 dropped" in changed.stderr
    assert changed.stdout.splitlines()[2] == " 1. 1.000  animals.md#1"
    assert len(changed.stdout.strip().splitlines()) == 1 + 3 * 2  # --top-k 5 on 3 texts: all 3


def test_counts_agree_when_the_corpus_repeats_a_text(tmp_path, model, capsys):
    # five paragraphs, four distinct texts: each distinct text is embedded and stored once
    corpus = write_corpus(tmp_path / "corpus", {**PARAGRAPHS, "again.md": [PARAGRAPHS["animals.md"][0]]})
    index = tmp_path / "index"
    _, first = main(capsys, "--corpus", corpus, "--model", model, "--index", index, "--query", "cats")
    _, again = main(capsys, "--corpus", corpus, "--model", model, "--index", index, "--query", "cats")
    assert f"Indexing 4 texts with {model} into {index}" in first
    assert f"Reusing the index in {index} (4 texts)" in again


def test_quick_start_rerun_reuses_the_conversion_and_the_index(tmp_path, model, capsys, monkeypatch):
    """README's quick start run twice as it is (convert with --force, then search with the default index), then
    with another model and back: each model keeps its own default index."""
    monkeypatch.setattr(search, "DEFAULT_INDEX", tmp_path / "cache" / "search-index")
    corpus, converted = write_corpus(tmp_path / "corpus"), tmp_path / "model-8bit"
    # the tiny model's widths take group size 32
    command = [
        "--quantize", "--bits", "8", "--group-size", "32", str(model), "--mlx-path", str(converted), "--force",
        "--no-calibration",
    ]  # fmt: skip
    query = ["--corpus", corpus, "--query", PARAGRAPHS["animals.md"][0]]
    assert convert_main(command) == 0
    first, first_err = main(capsys, *query, "--model", converted)
    assert f"Converted {model} -> {converted}" in first and "Indexing 4 texts" in first_err
    weights = (converted / "model.safetensors").stat().st_mtime_ns

    assert convert_main(command) == 0
    again, again_err = main(capsys, *query, "--model", converted)
    assert f"{converted} is already a conversion of {model} with these options; reusing it" in again
    assert (converted / "model.safetensors").stat().st_mtime_ns == weights
    assert "Reusing the index" in again_err and "Embedded" not in again_err
    assert again.splitlines()[-4:] == first.splitlines()[-4:]

    _, other_err = main(capsys, *query, "--model", model)
    _, back_err = main(capsys, *query, "--model", converted)
    assert "Indexing 4 texts" in other_err and "Reusing the index" in back_err
    assert len(list(search.DEFAULT_INDEX.iterdir())) == 2


def test_jsonl_corpus_and_queries_from_stdin(tmp_path, model):
    corpus = tmp_path / "docs.jsonl"
    lines = [{"id": "a", "text": "First document."}, "A plain string line.", {"text": "Third one."}]
    corpus.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--corpus", str(corpus), "--model", str(model), "--index", str(tmp_path / "i"),
         "--top-k", "1"],
        input="Third one.\nFirst document.\n", capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "\n> Third one.\n 1. 1.000  docs.jsonl:3\n    Third one.\n"
        "\n> First document.\n 1. 1.000  a\n    First document.\n"
    )


def test_incremental_update_equals_full_rebuild(tmp_path, model, capsys, monkeypatch):
    encoded = []  # every document text sent to encode (a query is a single str)
    real_encode = SentenceEncoder.encode

    def counting_encode(self, texts, **kwargs):
        encoded.extend([] if isinstance(texts, str) else texts)
        return real_encode(self, texts, **kwargs)

    monkeypatch.setattr(SentenceEncoder, "encode", counting_encode)
    corpus, updated, rebuilt = tmp_path / "corpus", tmp_path / "updated", tmp_path / "rebuilt"
    main(capsys, "--corpus", write_corpus(corpus), "--model", model, "--index", updated, "-q", "x")
    assert encoded == [text for texts in PARAGRAPHS.values() for text in texts]

    changed = "Dogs bark at the postman."
    new = {
        "animals.md": [PARAGRAPHS["animals.md"][0], changed],  # one paragraph changed
        "notes/code.txt": PARAGRAPHS["notes/code.txt"][1:],  # one removed
        "plants.txt": ["Ferns grow in the shade.", "Cacti store water."],  # two added
    }
    queries = [arg for texts in new.values() for text in texts for arg in ("-q", text)]
    write_corpus(corpus, new)
    encoded.clear()
    out, err = main(capsys, "--corpus", corpus, "--model", model, "--index", updated, *queries)
    assert encoded == [changed, "Ferns grow in the shade.", "Cacti store water."]
    assert "3 new or changed texts, 2 dropped" in err

    encoded.clear()
    full_out, full_err = main(capsys, "--corpus", corpus, "--model", model, "--index", rebuilt, *queries)
    assert len(encoded) == 5 and "Indexing 5 texts" in full_err
    assert out == full_out  # the same ranking and scores for every paragraph as a query
    (meta, vectors), (full_meta, full_vectors) = stored(updated), stored(rebuilt)
    assert meta == full_meta and vectors.keys() == full_vectors.keys()
    for key, vector in vectors.items():  # batches of other lengths pad differently: float rounding only
        np.testing.assert_allclose(np.frombuffer(vector, "<f4"), np.frombuffer(full_vectors[key], "<f4"), atol=1e-6)


def test_killed_while_writing_keeps_previous_index(tmp_path, model):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    run("--corpus", corpus, "--model", model, "--index", index, "-q", "x")
    before = stored(index)
    size = (index / "index.sqlite").stat().st_size
    write_corpus(corpus, {"many.txt": [f"Paragraph number {i} of a longer file." for i in range(200)]})
    args = [str(SCRIPT), "--corpus", corpus, "--model", model, "--index", index, "-q", "x"]
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, *map(str, args)], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    # Killed mid-transaction with new pages already in the file and the old ones in the rollback journal:
    assert (index / "index.sqlite").stat().st_size > size and (index / "index.sqlite-journal").exists()

    write_corpus(corpus)
    query = PARAGRAPHS["animals.md"][1]
    after = run("--corpus", corpus, "--model", model, "--index", index, "-q", query, "-k", "1")
    assert "Reusing the index" in after.stderr and stored(index) == before
    assert after.stdout.splitlines()[2] == " 1. 1.000  animals.md#2"


@pytest.mark.parametrize(
    "failure", [OSError(errno.ENOSPC, "No space left on device"), sqlite3.OperationalError("database or disk is full")]
)
def test_disk_full_keeps_previous_index(tmp_path, model, capsys, monkeypatch, failure):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    main(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", "x")
    before = stored(index)

    class FullDisk(sqlite3.Connection):
        def executemany(self, sql, rows):
            if sql.startswith("INSERT OR REPLACE INTO meta"):  # after the vectors were inserted and deleted
                raise failure
            return super().executemany(sql, rows)

    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *args, **kwargs: connect(*args, factory=FullDisk, **kwargs))
    (corpus / "more.txt").write_text("A new paragraph.\n")
    message = error(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", "x")
    assert message.startswith(f"Could not save the index {index / 'index.sqlite'}: {failure}. Nothing was saved")
    assert "Free disk space if it is full" in message
    monkeypatch.undo()
    assert stored(index) == before

    (corpus / "more.txt").unlink()
    out, err = main(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", PARAGRAPHS["animals.md"][0])
    assert "Reusing the index" in err and out.splitlines()[2] == " 1. 1.000  animals.md#1"


@pytest.mark.parametrize("damage", CORRUPTIONS)
def test_damaged_index_is_rebuilt(tmp_path, model, capsys, damage):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    main(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", "x")
    corrupt, reason = CORRUPTIONS[damage]
    corrupt(index / "index.sqlite")

    query = PARAGRAPHS["notes/code.txt"][0]
    out, err = main(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", query, "-k", "1")
    assert f"The index {index / 'index.sqlite'} is unusable (" in err and reason in err
    assert "; rebuilding it\n" in err and "Indexing 4 texts" in err
    assert out.splitlines()[2] == " 1. 1.000  notes/code.txt#1"
    _, err = main(capsys, "--corpus", corpus, "--model", model, "--index", index, "-q", query)
    assert "Reusing the index" in err


def test_bad_corpus_and_arguments_fail_clearly(tmp_path, model, capsys):
    jsonl, options = tmp_path / "docs.jsonl", ["--model", model, "--index", tmp_path / "index"]
    jsonl.write_bytes(b'"fine"\n\n{"text": "unterminated\n')
    assert error(capsys, "--corpus", jsonl, *options).startswith(f"{jsonl}:3: not a JSON value (")
    jsonl.write_bytes(b'"fine"\n"caf\xe9"\n')  # latin-1, not UTF-8
    assert error(capsys, "--corpus", jsonl, *options).startswith(f"{jsonl}:2: not a JSON value (")

    jsonl.write_text("\n  \n")
    assert error(capsys, "--corpus", jsonl, *options).startswith(f"The corpus {jsonl} is empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.md").write_text("\n\n   \n")
    assert error(capsys, "--corpus", tmp_path / "blank", *options).startswith(
        f"The corpus {tmp_path / 'blank'} is empty"
    )

    for value in ("-1", "0", "two"):
        message = error(capsys, "--corpus", jsonl, *options, "-k", value)
        assert f"argument --top-k/-k: must be a positive integer (1 or more), got '{value}'" in message
    assert not (tmp_path / "index").exists()
