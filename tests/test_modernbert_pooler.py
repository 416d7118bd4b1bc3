"""ModernBERT's `pooler_output` (the CLS token after the final norm) against transformers' last hidden state, and
`SentenceEncoder(pooling="cls")` on it against sentence-transformers' CLS pooling."""

import numpy as np
import torch
from checkpoints import make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_sentence import TEXTS, save_st
from transformers import AutoModel, AutoTokenizer

import mlx_encoders
from mlx_encoders import SentenceEncoder


def test_pooler_output_is_the_cls_token_after_the_final_norm(checkpoint):
    folder = checkpoint("modernbert")
    tokenizer, reference = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = reference(**batch)
    assert "pooler_output" not in out  # transformers' ModernBertModel has none: the field adds, changes nothing
    model, ours_tok = mlx_encoders.load(folder)
    mine = model(**ours_tok(TEXTS, padding=True))
    np.testing.assert_allclose(np.array(mine.pooler_output), out.last_hidden_state[:, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(np.array(mine.last_hidden_state)[:, 0], np.array(mine.pooler_output))


def test_cls_pooling_matches_sentence_transformers(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "modernbert", seed=3)
    folder = save_st(tmp_path / "st", checkpoint, Pooling(32, pooling_mode="cls"))
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=4)
    np.testing.assert_allclose(SentenceEncoder(folder).encode(TEXTS, batch_size=4), expected, atol=1e-5)
    np.testing.assert_allclose(SentenceEncoder(checkpoint, pooling="cls").encode(TEXTS), expected, atol=1e-5)
