"""mlx_encoders.index with a sparse (SPLADE) model: postings built incrementally, resumably and over 2 ranks,
exact sparse search against sentence-transformers' SparseEncoder, hybrid search against the fusion formulas
written out here, and `mlx-encoders index build --sparse-model` / `index search --mode`."""

import functools
import json
import os
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
from sentence_transformers import SparseEncoder as STSparseEncoder
from test_index import FILES, IDS, free_ports, st_model, write_corpus
from test_sparse import save_splade
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders import SentenceEncoder, SparseEncoder
from mlx_encoders.__main__ import main as cli
from mlx_encoders.index import Index, StoreError, build, read_corpus, search

ROOT = Path(__file__).parents[1]
LAUNCH = Path(sys.executable).with_name("mlx.launch")  # the venv's, whether or not it is on PATH
LAUNCH = LAUNCH if LAUNCH.exists() else shutil.which("mlx.launch") or "mlx.launch"
PROMPTS = {"query": "query: ", "document": "passage: "}  # so a wrong side (query vs document) shows
MAX_ACTIVE_DIMS = 100  # as sparse as a trained SPLADE's vectors; a random one activates most of the vocabulary


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny seeded dense model and two tiny seeded SPLADE folders, saved by sentence-transformers."""
    folder = tmp_path_factory.mktemp("models")
    splades = {}
    for seed in (0, 1):
        checkpoint = make_checkpoint(folder / f"mlm{seed}", "bert", "masked-lm", seed=seed)
        splade = save_splade(folder / f"splade{seed}", checkpoint, prompts=PROMPTS, max_active_dims=MAX_ACTIVE_DIMS)
        splades[f"splade{seed}"] = splade
    return {"dense": st_model(folder), **splades}


@pytest.fixture(scope="module")
def sparse(models) -> SparseEncoder:
    return SparseEncoder(models["splade0"])


@pytest.fixture(scope="module")
def dense(models) -> SentenceEncoder:
    return SentenceEncoder(models["dense"])


def postings(index: Path) -> dict[str, dict[int, float]]:
    """The inverted index read with sqlite3 alone: text -> {term: weight}; fails on a posting without its text."""
    with closing(sqlite3.connect(index / "index.sqlite")) as con:
        orphans = con.execute("SELECT count(*) FROM postings WHERE row NOT IN (SELECT row FROM texts)").fetchone()
        assert orphans == (0,)
        out: dict[str, dict[int, float]] = {}
        for text, term, weight in con.execute(
            "SELECT t.text, p.term, p.weight FROM postings p JOIN texts t USING (row)"
        ):
            out.setdefault(text, {})[term] = weight
        return out


def assert_same_postings(a: Path, b: Path, model: Path) -> None:
    """The same texts and terms, and each weight up to float32 rounding of `model`'s sums."""
    pa, pb = postings(a), postings(b)
    assert pa.keys() == pb.keys()
    sums = encoder_terms(model, [PROMPTS["document"] + text for text in pa])
    for text, terms in pa.items():  # other batch neighbours: rounding only
        assert terms.keys() == pb[text].keys()
        assert_float32_close([terms[t] for t in terms], [pb[text][t] for t in terms], sums)


@functools.cache
def st_sparse(folder: Path) -> STSparseEncoder:
    return STSparseEncoder(str(folder), device="cpu")


def oracle_sparse(models, texts: list[str], query: str) -> np.ndarray:
    st = st_sparse(models["splade0"])
    return st.similarity(st.encode_query([query]), st.encode_document(texts)).numpy()[0]


def oracle_dense(models, texts: list[str], query: str) -> np.ndarray:
    st = SentenceTransformer(str(models["dense"]), device="cpu")
    return st.encode(texts, normalize_embeddings=True) @ st.encode(query, normalize_embeddings=True)


def test_sparse_search_equals_sentence_transformers(tmp_path, models, sparse):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert build(corpus, index, None, sparse_model=sparse, quiet=True)["added"] == 8
    texts = [text for _, text in read_corpus(corpus)]  # in IDS order
    st = st_sparse(models["splade0"])
    stored = postings(index)
    for text, row in zip(texts, st.encode_document(texts).to_dense().numpy(), strict=True):
        got = np.zeros_like(row)
        got[list(stored[text])] = list(stored[text].values())
        np.testing.assert_allclose(got, row, atol=1e-5)  # the document side, with its prompt

    for query in ("a question about files", "Cats purr when they are content."):
        expected = oracle_sparse(models, texts, query)
        assert (expected > 0).all()  # a random SPLADE shares terms with every text: all are ranked
        order = np.argsort(-expected, kind="stable")
        hits = Index(index).search(query, k=5)  # the index's own sparse model; sparse is the only mode
        assert [h.id for h in hits] == [IDS[i] for i in order[:5]]
        np.testing.assert_allclose([h.score for h in hits], expected[order[:5]], rtol=1e-5, atol=1e-5)
    several = sparse.encode_query(["files", "cats"])
    with pytest.raises(ValueError, match="a sparse query is one vector; got a SparseVectors of 2 rows"):
        Index(index).search(several, k=5)
    assert Index(index).search(sparse.encode_query(["files"]), k=5) == Index(index).search("files", k=5)

    with pytest.raises(ValueError, match=f"The index {index} has no dense model, so it cannot answer a hybrid"):
        Index(index).search("files", mode="hybrid")
    with pytest.raises(StoreError, match=f"built with the sparse model .*'{models['splade1']}' is another model"):
        Index(index, sparse_model=models["splade1"]).search("files")
    with pytest.raises(StoreError, match="sparse_model_fingerprint"):  # another sparse model, or none
        build(corpus, index, None, sparse_model=models["splade1"], quiet=True)
    with pytest.raises(StoreError, match="built with the sparse model .* gives model_fingerprint"):
        build(corpus, index, models["dense"], quiet=True)


def test_incremental_rebuild_updates_postings(tmp_path, models, dense, sparse, monkeypatch):
    corpus, index, clean = tmp_path / "corpus", tmp_path / "index", tmp_path / "clean"
    build(write_corpus(corpus), index, dense, sparse_model=sparse, quiet=True)
    before = postings(index)
    changed = {**FILES, "animals.md": "Cats purr when they are content.\n\nDogs bark at the postman.\n"}
    del changed["table.csv"]
    changed["plants.txt"] = "Cacti store water.\n\nMoss likes damp stones.\n"
    encoded = []
    real = SparseEncoder.encode
    monkeypatch.setattr(SparseEncoder, "encode", lambda self, t, *a, **k: encoded.extend(t) or real(self, t, *a, **k))
    counts = build(write_corpus(corpus, changed), index, dense, sparse_model=sparse, quiet=True)
    assert sorted(encoded) == ["Dogs bark at the postman.", "Moss likes damp stones."]
    assert counts == {"documents": 8, "texts": 7, "added": 2, "dropped": 3}
    after = postings(index)
    gone = {"Dogs bark at the mail carrier every morning.", "Rain falls from the clouds.", "The sun rises in the east."}
    assert gone <= before.keys() and not gone & after.keys()  # removed texts leave no postings
    monkeypatch.undo()
    build(corpus, clean, dense, sparse_model=sparse, quiet=True)
    assert_same_postings(index, clean, models["splade0"])
    for text in after.keys() & before.keys():
        assert after[text] == before[text]  # unchanged texts keep their postings


# Builds with 2-text chunks and SIGKILLs itself right after the 3rd chunk is committed; every text sent to the
# sparse model is logged first.
KILLED_BUILD = """
import os, signal, sys
from mlx_encoders import SparseEncoder
from mlx_encoders.index import build
from mlx_encoders.index.store import Store
corpus, index, model, sparse, log = sys.argv[1:]
encode, stage, commits = SparseEncoder.encode, Store.stage, []
def logged_encode(self, texts, *args, **kwargs):
    with open(log, "a") as f:
        f.writelines(t + "\\n" for t in texts)
    return encode(self, texts, *args, **kwargs)
def stage_then_die(self, *args):
    stage(self, *args)
    commits.append(1)
    if len(commits) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
SparseEncoder.encode, Store.stage = logged_encode, stage_then_die
build(corpus, index, model, sparse_model=sparse, chunk=2, quiet=True)
"""


def test_killed_build_resumes_with_its_postings(tmp_path, models, dense, sparse, monkeypatch):
    corpus, index, clean = write_corpus(tmp_path / "corpus"), tmp_path / "index", tmp_path / "clean"
    build(corpus, index, dense, sparse_model=sparse, quiet=True)
    previous = postings(index)
    texts = [f"Paragraph number {i} of a longer file." for i in range(12)]
    (corpus / "long.txt").write_text("\n\n".join(texts))
    log = tmp_path / "encoded.txt"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BUILD, str(corpus), str(index), str(models["dense"]), str(models["splade0"]),
         str(log)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = log.read_text().splitlines()
    assert len(first) == 6 and set(first) <= set(texts)
    assert postings(index) == previous  # staged only: searches still see the previous index

    resumed = []
    real = SparseEncoder.encode
    monkeypatch.setattr(SparseEncoder, "encode", lambda self, t, *a, **k: resumed.extend(t) or real(self, t, *a, **k))
    assert build(corpus, index, dense, sparse_model=sparse, quiet=True)["added"] == 12
    assert not set(first) & set(resumed) and sorted(first + resumed) == sorted(texts)
    monkeypatch.undo()
    build(corpus, clean, dense, sparse_model=sparse, quiet=True)
    assert_same_postings(index, clean, models["splade0"])


RANK_BUILD = """
import sys
from mlx_encoders.index import build
corpus, index, model, sparse = sys.argv[1:]
build(corpus, index, model, sparse_model=sparse, chunk=3, quiet=True)
"""


def test_two_ranks_build_equals_one_process(tmp_path, models, dense, sparse):
    files = {**FILES, "long.txt": "\n\n".join(f"Sentence {i} about topic {i % 5}." for i in range(12))}
    corpus, index, single = write_corpus(tmp_path / "corpus", files), tmp_path / "index", tmp_path / "single"
    launched = subprocess.run(
        [LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)), sys.executable, "-c",
         RANK_BUILD, str(corpus), str(index), str(models["dense"]), str(models["splade0"])],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180,
    )  # fmt: skip
    assert launched.returncode == 0 and not list((index / "shards").glob("*.sqlite")), launched.stderr
    build(corpus, single, dense, sparse_model=sparse, chunk=3, quiet=True)
    assert len(postings(index)) == 20
    assert_same_postings(index, single, models["splade0"])


def test_hybrid_search_equals_the_fusion_formulas(tmp_path, models, dense, sparse):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, dense, sparse_model=sparse, quiet=True)
    texts = [text for _, text in read_corpus(corpus)]
    query = "a question about files"
    scores = {"dense": oracle_dense(models, texts, query), "sparse": oracle_sparse(models, texts, query)}
    ranks = {mode: np.argsort(np.argsort(-s, kind="stable"), kind="stable") + 1 for mode, s in scores.items()}
    opened = Index(index, models["dense"], sparse_model=models["splade0"])
    with closing(sqlite3.connect(index / "index.sqlite")) as con:  # equal fused scores go by text row
        row = dict(con.execute("SELECT text, row FROM texts"))

    for depth, k in ((100, 5), (3, 3)):  # a text outside a mode's best `depth` (at least k) gets nothing from it
        rrf = [sum(1 / (60 + r[i]) for r in ranks.values() if r[i] <= depth) for i in range(8)]
        order = sorted(range(8), key=lambda i: (-rrf[i], row[texts[i]]))[:k]
        hits = opened.search(query, k=k, mode="hybrid", depth=depth)
        assert [h.id for h in hits] == [IDS[i] for i in order]
        np.testing.assert_allclose([h.score for h in hits], [rrf[i] for i in order], rtol=1e-12)
    rrf = [sum(1 / (10 + r[i]) for r in ranks.values()) for i in range(8)]
    hits = opened.search(query, k=8, mode="hybrid", rrf_k=10)
    np.testing.assert_allclose([h.score for h in hits], sorted(rrf, reverse=True), rtol=1e-12)

    alpha = 0.3
    normal = {m: (s - s.min()) / (s.max() - s.min()) for m, s in scores.items()}
    weighted = alpha * normal["dense"] + (1 - alpha) * normal["sparse"]
    order = np.argsort(-weighted, kind="stable")[:4]
    hits = search(index, query, k=4, mode="hybrid", fusion="weighted", alpha=alpha)
    assert [h.id for h in hits] == [IDS[i] for i in order]
    np.testing.assert_allclose([h.score for h in hits], weighted[order], atol=1e-4)
    assert [h.id for h in search(index, query, k=3)] == [IDS[i] for i in np.argsort(-scores["dense"])[:3]]
    with pytest.raises(ValueError, match="alpha within"):
        opened.search(query, mode="hybrid", fusion="weighted", alpha=1.5)


def test_command_line_sparse_and_hybrid(tmp_path, models, capsys):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert cli(["index", "build", "--corpus", str(corpus), "--index", str(index), "--quiet"]) != 0
    assert "needs a model (--model), a sparse model (--sparse-model) or both" in capsys.readouterr().err
    build_args = ["--corpus", str(corpus), "--index", str(index), "--model", str(models["dense"])]
    assert cli(["index", "build", *build_args, "--sparse-model", str(models["splade0"])]) == 0
    assert "8 documents, 8 texts (8 added, 0 dropped)" in capsys.readouterr().out
    opened = Index(index)
    query = "a question about files"
    found = {}
    for mode, options, keywords in (
        ("sparse", [], {}),
        ("hybrid", [], {}),
        ("hybrid", ["--fusion", "weighted", "--alpha", "0.7"], {"fusion": "weighted", "alpha": 0.7}),
        ("hybrid", ["--depth", "3"], {"depth": 3}),  # texts outside a mode's best 3 get nothing from it
    ):
        assert (
            cli(["index", "search", "--index", str(index), query, "-k", "3", "--mode", mode, *options, "--json"]) == 0
        )
        got = json.loads(capsys.readouterr().out)[0]["hits"]
        expected = opened.search(query, k=3, mode=mode, **keywords)
        found[" ".join([mode, *options])] = [(h["id"], h["score"]) for h in got]
        assert [(h["id"], h["score"]) for h in got] == [(h.id, h.score) for h in expected]
    assert found["hybrid --depth 3"] != found["hybrid"]

    plain = tmp_path / "plain"
    assert cli(["index", "build", "--corpus", str(corpus), "--index", str(plain), "-m", str(models["dense"])]) == 0
    capsys.readouterr()
    assert cli(["index", "search", "--index", str(plain), query, "--mode", "sparse"]) != 0
    assert f"The index {plain} has no sparse model" in capsys.readouterr().err
