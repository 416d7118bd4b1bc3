"""BGE-M3 against its authors' formulas, transcribed in torch from FlagEmbedding 1.4
(inference/embedder/encoder_only/m3.py: `M3Embedder.encode_single_device`'s `_process_token_weights` and
`_process_colbert_vecs`, `compute_lexical_matching_score`, `colbert_score`, `compute_score`'s weighted means;
finetune/embedder/encoder_only/m3/modeling.py: `_dense_embedding` ("cls"), `_sparse_embedding`,
`_colbert_embedding`), on a seeded XLM-R with seeded heads saved as torch pickles, as the real model ships them.
FlagEmbedding itself is not installed: it pulls in peft and more.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_reference, make_checkpoint
from transformers import AutoTokenizer

import mlx_encoders
from mlx_encoders import BGEM3

QUERIES = ["what is BGE M3?", "x", "how do sparse and dense scores combine? " * 2]
DOCUMENTS = ["BGE M3 gives dense, sparse and multi-vector outputs.", "", "x x x", "A cat sat on the mat. " * 3]
COLBERT_DIM = 24  # the hidden size, as BGE-M3's colbert_linear keeps it


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory) -> tuple[Path, Path]:
    """(source, converted): a seeded XLM-R with seeded sparse and ColBERT heads saved as .pt files, as BGE-M3
    ships them, and the folder `convert` makes of it."""
    source = make_checkpoint(tmp_path_factory.mktemp("m3"), "xlm-roberta")
    torch.manual_seed(5)
    torch.save(torch.nn.Linear(24, 1).state_dict(), source / "sparse_linear.pt")
    torch.save(torch.nn.Linear(24, COLBERT_DIM).state_dict(), source / "colbert_linear.pt")
    return source, mlx_encoders.convert(source, tmp_path_factory.mktemp("out") / "m3")


def reference(source: Path, texts: list[str], max_length: int = 8192) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = load_reference(source, "encoder")
    sparse_linear, colbert_linear = torch.nn.Linear(24, 1), torch.nn.Linear(24, COLBERT_DIM)
    sparse_linear.load_state_dict(torch.load(source / "sparse_linear.pt", weights_only=True))
    colbert_linear.load_state_dict(torch.load(source / "colbert_linear.pt", weights_only=True))
    unused = {tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[t]) for t in ("cls_token", "eos_token")}
    unused |= {tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[t]) for t in ("pad_token", "unk_token")}
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
        dense = F.normalize(hidden[:, 0], dim=-1)
        token_weights = torch.relu(sparse_linear(hidden)).squeeze(-1)
        colbert = F.normalize(
            colbert_linear(hidden[:, 1:]) * batch["attention_mask"][:, 1:][:, :, None].float(), dim=-1
        )
    lexical = []
    for weights, ids in zip(token_weights.numpy(), batch["input_ids"].tolist(), strict=True):
        result = {}
        for w, idx in zip(weights, ids, strict=True):
            if idx not in unused and w > 0 and w > result.get(str(idx), 0):
                result[str(idx)] = w
        lexical.append(result)
    vecs = [c[: int(m.sum()) - 1].numpy() for c, m in zip(colbert, batch["attention_mask"], strict=True)]
    return {"dense_vecs": dense.numpy(), "lexical_weights": lexical, "colbert_vecs": vecs}


def lexical_score(a: dict, b: dict) -> float:
    return sum(w * b[t] for t, w in a.items() if t in b)


def colbert(q: np.ndarray, p: np.ndarray) -> float:
    q, p = torch.from_numpy(q), torch.from_numpy(p)
    return float(torch.einsum("in,jn->ij", q, p).max(-1).values.sum() / q.size(0))


def test_outputs_match_flag_embedding_formulas(bge_m3):
    source, converted = bge_m3
    m3 = BGEM3(converted)
    texts = QUERIES + DOCUMENTS
    got = m3.encode(texts, batch_size=3, return_colbert_vecs=True)
    expected = reference(source, texts)
    np.testing.assert_allclose(got["dense_vecs"], expected["dense_vecs"], atol=1e-5)
    for mine, theirs in zip(got["lexical_weights"], expected["lexical_weights"], strict=True):
        assert mine.keys() == theirs.keys()
        np.testing.assert_allclose([mine[k] for k in theirs], list(theirs.values()), atol=1e-5)
    assert any(got["lexical_weights"]) and all(len(c) for c in got["colbert_vecs"])
    for mine, theirs in zip(got["colbert_vecs"], expected["colbert_vecs"], strict=True):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    short, expected = m3.encode(texts, max_length=12), reference(source, texts, max_length=12)  # cut texts
    np.testing.assert_allclose(short["dense_vecs"], expected["dense_vecs"], atol=1e-5)
    single = m3.encode(QUERIES[0], return_dense=False)
    assert single["dense_vecs"] is None and single["lexical_weights"].keys() == got["lexical_weights"][0].keys()


def test_combined_scores_match_flag_embedding_formulas(bge_m3):
    source, converted = bge_m3
    scores = BGEM3(converted).compute_scores(QUERIES, DOCUMENTS, (0.4, 0.2, 0.4))
    q, d = reference(source, QUERIES), reference(source, DOCUMENTS)
    dense = q["dense_vecs"] @ d["dense_vecs"].T
    sparse = np.array([[lexical_score(a, b) for b in d["lexical_weights"]] for a in q["lexical_weights"]])
    multi = np.array([[colbert(a, b) for b in d["colbert_vecs"]] for a in q["colbert_vecs"]])
    np.testing.assert_allclose(scores["dense"], dense, atol=1e-5)
    np.testing.assert_allclose(scores["sparse"], sparse, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(scores["colbert"], multi, atol=1e-5)
    np.testing.assert_allclose(scores["sparse+dense"], (0.2 * sparse + 0.4 * dense) / 0.6, atol=1e-5, rtol=1e-5)
    combined = (0.4 * multi + 0.2 * sparse + 0.4 * dense) / 1.0
    np.testing.assert_allclose(scores["colbert+sparse+dense"], combined, atol=1e-5, rtol=1e-5)
    assert sparse.max() > 0  # shared tokens: the lexical score is exercised


def test_heads_are_read_only_as_safetensors(tmp_path, bge_m3, monkeypatch):
    source, converted = bge_m3
    assert (converted / "sparse_linear.safetensors").exists() and not list(converted.glob("*.pt"))
    pickled = shutil.copytree(source, tmp_path / "pickled")
    monkeypatch.setattr(torch, "load", None)  # loading must not reach for torch's unpickler
    with pytest.raises(FileNotFoundError, match="sparse_linear.pt, a torch pickle, which is not read.*convert"):
        BGEM3(pickled)
