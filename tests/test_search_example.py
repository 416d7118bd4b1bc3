"""examples/search.py run as a user runs it: builds an index of a folder with mlx_encoders.index, answers queries,
and reuses the index on a rerun. The index itself is tested in test_index.py."""

import subprocess
import sys
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
