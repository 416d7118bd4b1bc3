"""examples/search.py run as a user runs it: index a tiny corpus, answer queries, reuse the saved index."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

SCRIPT = Path(__file__).parents[1] / "examples" / "search.py"
PARAGRAPHS = {
    "animals.md": ["Cats purr when they are content.", "Dogs bark at the mail carrier every morning."],
    "notes/code.txt": ["Use argparse to read command line options.", "A zip file bundles many files in one."],
}


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


def write_corpus(folder: Path) -> Path:
    for name, paragraphs in PARAGRAPHS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n\n".join(paragraphs) + "\n")
    return folder


def test_folder_corpus_and_index_reuse(tmp_path, model):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    query = PARAGRAPHS["notes/code.txt"][1]
    first = run("--corpus", corpus, "--model", model, "--index", index, "--query", query, "--top-k", "2")
    assert "Indexing 4 texts" in first.stderr
    lines = first.stdout.strip().splitlines()
    assert lines[0] == f"> {query}"
    assert lines[1] == " 1. 1.000  notes/code.txt#2" and lines[2].strip() == query
    assert len(lines) == 5  # the query, then two results of two lines each
    meta = json.loads((index / "index.json").read_text())
    assert meta["ids"] == ["animals.md#1", "animals.md#2", "notes/code.txt#1", "notes/code.txt#2"]
    assert meta["model"] == str(model) and len(meta["fingerprint"]) == 64

    again = run("--corpus", corpus, "--model", model, "--index", index, "--query", query, "--top-k", "2")
    assert "Reusing the index" in again.stderr and again.stdout == first.stdout

    (corpus / "animals.md").write_text("Parrots can imitate speech.\n")
    changed = run("--corpus", corpus, "--model", model, "--index", index, "--query", "Parrots can imitate speech.")
    assert "Indexing 3 texts" in changed.stderr
    assert changed.stdout.splitlines()[2] == " 1. 1.000  animals.md#1"


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
