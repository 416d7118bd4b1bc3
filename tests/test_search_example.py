"""examples/search.py run as a user runs it: builds an index of a folder with mlx_encoders.index, answers queries,
and reuses the index on a rerun. The index itself is tested in test_index.py."""

import importlib.util
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from test_index import st_model, write_corpus

SCRIPT = Path(__file__).parents[1] / "examples" / "search.py"


def run(*args) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_example_builds_searches_and_reuses_the_index(tmp_path):
    model, corpus, index = st_model(tmp_path / "model"), write_corpus(tmp_path / "corpus"), tmp_path / "index"
    query = "A zip file bundles many files in one."
    first = run("--corpus", corpus, "--model", model, "--index", index, "--query", query, "-k", "2")
    assert first.stderr == f"{index}: 8 documents, 8 texts embedded\n"
    lines = first.stdout.splitlines()
    assert lines[:4] == ["", f"> {query}", " 1. 1.000  notes/code.txt#2", f"    {query}"] and len(lines) == 6

    (corpus / "new.md").write_text("Owls hunt at night.\n")
    again = run("--corpus", corpus, "--model", model, "--index", index, "--query", "Owls hunt at night.", "-k", "1")
    assert again.stderr == f"{index}: 9 documents, 1 texts embedded\n"
    assert again.stdout.splitlines()[2] == " 1. 1.000  new.md#1"


def crash_image(folder: Path, copy: Path) -> Path:
    """`copy` of the index `folder` as a process killed mid-build leaves it: the store with a write-ahead log holding
    a committed transaction (a rewrite of the meta table) and its shared-memory index."""
    with closing(sqlite3.connect(folder / "index.sqlite", isolation_level=None)) as con:
        con.execute("PRAGMA wal_autocheckpoint = 0")  # the transaction stays in the log, as in a killed process
        con.execute("INSERT OR REPLACE INTO meta SELECT name, value FROM meta")
        shutil.copytree(folder, copy)
    return copy


def test_a_damaged_cache_is_built_again_with_one_line_and_a_named_index_refuses(tmp_path, monkeypatch, capsys):
    """Each file of the default index folder (a cache under ~/.cache) cut to half its size, as a crash or a full
    disk leaves it: SQLite recovers a cut log or shared-memory file itself; a cut store is found damaged, and the
    example says so in one line naming the folder, builds the index again and answers as before."""
    model, corpus = st_model(tmp_path / "model"), write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = importlib.util.spec_from_file_location("search_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    query = "Cacti store water."
    argv = ["--corpus", str(corpus), "--model", str(model), "--query", query, "-k", "2"]
    assert example.main(argv) == 0
    answer = capsys.readouterr().out
    assert answer.splitlines()[2] == " 1. 1.000  more.jsonl:2"
    [cache] = (tmp_path / "home" / ".cache" / "mlx-encoders").glob("search-st-*")
    pristine = crash_image(cache, tmp_path / "pristine")
    assert sorted(p.name for p in pristine.iterdir()) == ["index.sqlite", "index.sqlite-shm", "index.sqlite-wal"]

    for file in sorted(pristine.iterdir()):
        shutil.rmtree(cache)
        shutil.copytree(pristine, cache)
        os.truncate(cache / file.name, file.stat().st_size // 2)
        assert example.main(argv) == 0, file.name
        out, err = capsys.readouterr()
        assert out == answer, file.name
        shown = f"~/.cache/mlx-encoders/{cache.name}"  # the home folder as a reader writes it
        rebuilt = f"{shown}: the cached index was damaged; building it again"
        lines = [rebuilt, f"{shown}: 8 documents, 8 texts embedded"] if file.name == "index.sqlite" else []
        assert err.splitlines() == (lines or [f"{shown}: 8 documents, 0 texts embedded"]), file.name

    named = shutil.copytree(pristine, tmp_path / "named")
    os.truncate(named / "index.sqlite", 4096)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--index", str(named)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.startswith(f"search.py: error: The index store {named / 'index.sqlite'} is damaged")
    assert done.stderr.count("\n") == 1
