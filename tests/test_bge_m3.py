"""BGE-M3 against its authors' package, FlagEmbedding (`BGEM3FlagModel`: `encode`, `compute_lexical_matching_score`,
`colbert_score`, `compute_score`), run on a seeded XLM-R with seeded heads saved as torch pickles, as the real model
ships them; our loader reads the folder `convert` makes of it.
"""

import importlib
import importlib.util
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint

import mlx_encoders
from mlx_encoders import BGEM3

QUERIES = ["what is BGE M3?", "x", "how do sparse and dense scores combine? " * 2]
DOCUMENTS = ["BGE M3 gives dense, sparse and multi-vector outputs.", "", "x x x", "A cat sat on the mat. " * 3]
COLBERT_DIM = 24  # the hidden size, as BGE-M3's colbert_linear keeps it
# imported by FlagEmbedding's LLM rerankers; not in recent transformers
REMOVED_MODULE = "transformers.modeling_attn_mask_utils"


def bgem3_flag_model() -> type:
    """FlagEmbedding's `BGEM3FlagModel`. `import FlagEmbedding` also imports its LLM rerankers, written against
    `transformers.modeling_attn_mask_utils`, which recent transformers no longer has; BGE-M3's own modules never use
    it, so where that import fails the two package `__init__`s that pull the rerankers in are replaced by bare
    packages and the M3 module is imported by its full name."""
    try:
        from FlagEmbedding import BGEM3FlagModel

        return BGEM3FlagModel
    except ModuleNotFoundError as error:
        if error.name != REMOVED_MODULE:
            raise
    root = Path(importlib.util.find_spec("FlagEmbedding").origin).parent
    for name in ("FlagEmbedding", "FlagEmbedding.inference"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
    return importlib.import_module("FlagEmbedding.inference.embedder.encoder_only.m3").M3Embedder


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory) -> tuple[Path, Path]:
    """(source, converted): a seeded XLM-R with seeded sparse and ColBERT heads saved as .pt files, as BGE-M3
    ships them, and the folder `convert` makes of it."""
    source = make_checkpoint(tmp_path_factory.mktemp("m3"), "xlm-roberta")
    torch.manual_seed(5)
    torch.save(torch.nn.Linear(24, 1).state_dict(), source / "sparse_linear.pt")
    torch.save(torch.nn.Linear(24, COLBERT_DIM).state_dict(), source / "colbert_linear.pt")
    return source, mlx_encoders.convert(source, tmp_path_factory.mktemp("out") / "m3")


@pytest.fixture(scope="module")
def flag(bge_m3):
    """FlagEmbedding's model on the source folder: it reads the .pt heads itself (torch.load, weights only)."""
    return bgem3_flag_model()(str(bge_m3[0]), use_fp16=False, devices="cpu")


def assert_lexical_equal(mine: list[dict], theirs: list[dict]) -> None:
    for a, b in zip(mine, theirs, strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in b], [float(w) for w in b.values()], atol=1e-5)


def test_outputs_match_flag_embedding(bge_m3, flag):
    m3 = BGEM3(bge_m3[1])
    texts = QUERIES + DOCUMENTS
    got = m3.encode(texts, batch_size=3, return_colbert_vecs=True)
    expected = flag.encode(texts, batch_size=3, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    np.testing.assert_allclose(got["dense_vecs"], expected["dense_vecs"], atol=1e-5)
    assert_lexical_equal(got["lexical_weights"], expected["lexical_weights"])
    assert any(got["lexical_weights"]) and all(len(c) for c in got["colbert_vecs"])
    for mine, theirs in zip(got["colbert_vecs"], expected["colbert_vecs"], strict=True):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    short = m3.encode(texts, max_length=12, return_colbert_vecs=True)  # texts cut at the limit
    expected = flag.encode(texts, max_length=12, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    np.testing.assert_allclose(short["dense_vecs"], expected["dense_vecs"], atol=1e-5)
    assert_lexical_equal(short["lexical_weights"], expected["lexical_weights"])
    assert max(len(c) for c in short["colbert_vecs"]) == 11  # 12 tokens less [CLS]: the cut is exercised
    for mine, theirs in zip(short["colbert_vecs"], expected["colbert_vecs"], strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    single = m3.encode(QUERIES[0], return_dense=False)
    assert single["dense_vecs"] is None and single["lexical_weights"].keys() == got["lexical_weights"][0].keys()


def test_default_lengths_and_token_texts_are_flag_embeddings(bge_m3, flag):
    """Texts cut at FlagEmbedding's passage_max_length (512 unless set; the model reads 8,192), queries in
    compute_scores at its query_max_length; lexical weights keyed by each token decoded alone."""
    flag = type(flag)(str(bge_m3[0]), use_fp16=False, devices="cpu", query_max_length=6, passage_max_length=9)
    m3 = BGEM3(bge_m3[1], query_max_length=6, passage_max_length=9)
    assert (BGEM3(bge_m3[1]).passage_max_length, BGEM3(bge_m3[1]).query_max_length) == (512, 512)
    got = m3.encode(DOCUMENTS, return_colbert_vecs=True)
    expected = flag.encode(DOCUMENTS, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    assert max(len(c) for c in got["colbert_vecs"]) == 8  # 9 tokens less [CLS]: the default cut is exercised
    np.testing.assert_allclose(got["dense_vecs"], expected["dense_vecs"], atol=1e-5)
    pairs = [(a, b) for a in QUERIES for b in DOCUMENTS]
    theirs = np.array(flag.compute_score(pairs, batch_size=1)["colbert+sparse+dense"])
    np.testing.assert_allclose(
        m3.compute_scores(QUERIES, DOCUMENTS)["colbert+sparse+dense"].ravel(), theirs, atol=1e-5, rtol=1e-5
    )
    for weights in (got["lexical_weights"], got["lexical_weights"][:1], got["lexical_weights"][0]):
        assert m3.convert_id_to_token(weights) == flag.convert_id_to_token(weights)


def test_combined_scores_match_flag_embedding(bge_m3, flag):
    weights = [0.4, 0.2, 0.4]  # dense, sparse, colbert
    scores = BGEM3(bge_m3[1]).compute_scores(QUERIES, DOCUMENTS, tuple(weights))
    q, d = (flag.encode(t, return_sparse=True, return_colbert_vecs=True) for t in (QUERIES, DOCUMENTS))
    sparse = flag.compute_lexical_matching_score(q["lexical_weights"], d["lexical_weights"])
    multi = np.array([[float(flag.colbert_score(a, b)) for b in d["colbert_vecs"]] for a in q["colbert_vecs"]])
    np.testing.assert_allclose(scores["sparse"], sparse, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(scores["colbert"], multi, atol=1e-5)
    assert sparse.max() > 0  # shared tokens: the lexical score is exercised
    # One pair per batch: in a padded batch FlagEmbedding's compute_score lets a document's padding (zero vectors)
    # into MaxSim, so a pair's ColBERT score would depend on its batch-mates.
    pairs = [(a, b) for a in QUERIES for b in DOCUMENTS]
    expected = flag.compute_score(pairs, batch_size=1, weights_for_different_modes=weights)
    m3 = BGEM3(bge_m3[1])  # one query or one document as a str: its row or column
    row = m3.compute_scores(QUERIES[1], DOCUMENTS, tuple(weights))
    column = m3.compute_scores(QUERIES, DOCUMENTS[0], tuple(weights))
    for mode in ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense"):
        theirs = np.array(expected[mode]).reshape(len(QUERIES), len(DOCUMENTS))
        np.testing.assert_allclose(scores[mode], theirs, atol=1e-5, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(row[mode], theirs[1:2], atol=1e-5, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(column[mode], theirs[:, :1], atol=1e-5, rtol=1e-5, err_msg=mode)


def test_heads_are_read_only_as_safetensors(tmp_path, bge_m3, monkeypatch):
    source, converted = bge_m3
    assert (converted / "sparse_linear.safetensors").exists() and not list(converted.glob("*.pt"))
    pickled = shutil.copytree(source, tmp_path / "pickled")
    monkeypatch.setattr(torch, "load", None)  # loading must not reach for torch's unpickler
    with pytest.raises(FileNotFoundError, match="sparse_linear.pt, a torch pickle, which is not read.*convert"):
        BGEM3(pickled)
