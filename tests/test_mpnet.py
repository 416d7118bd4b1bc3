"""MPNet against transformers and sentence-transformers where its relative-position bias matters: padded texts
longer than its 32 buckets and its 128 max_distance (the test checkpoint takes 256 tokens)."""

import json

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from test_gradients import make_labels, our_gradients, reference_gradients
from test_parity import assert_close, our_outputs, reference_outputs
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.models.mpnet import ModelArgs, relative_position_buckets

TEXTS = [
    " ".join(["Relative positions past the exact range fall into logarithmic buckets."] * 30),  # cut at 256
    " ".join(["A middle-sized text"] * 40),  # ~160 tokens: past max_distance
    "Short, and padded far.",
    "",
]


# Both directions, exact and logarithmic, capped at the last; distance 0 counts as backwards, so bucket 16 (ahead
# by 0) stays empty.
USED_BUCKETS = set(range(32)) - {16}


def long_batch(tokenizer) -> dict:
    batch = dict(tokenizer(TEXTS, padding=True, truncation=True))
    lengths = np.array(batch["attention_mask"]).sum(axis=1)
    assert lengths[0] == 256 and 128 < lengths[1] < 256 and lengths[2] < 32, lengths
    return batch


def test_buckets_match_transformers():
    positions = torch.arange(700)
    expected = MPNetEncoder.relative_position_bucket(positions[None, :] - positions[:, None])  # key - query
    got = np.array(relative_position_buckets(700))
    np.testing.assert_array_equal(got, expected.numpy())
    assert set(np.unique(got).tolist()) == USED_BUCKETS


@pytest.mark.parametrize("task", ["encoder", "masked-lm", "sequence-classification"])
def test_long_padded_texts_match_transformers(checkpoint, task):
    folder = checkpoint("mpnet", task)
    model, tokenizer = mlx_encoders.load(folder)
    batch = long_batch(tokenizer)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)


def test_long_padded_texts_gradients_match_transformers(checkpoint):
    """The relative bias is one table shared by every layer: its gradient sums theirs, over all 32 buckets."""
    folder = checkpoint("mpnet")
    model, tokenizer = mlx_encoders.load(folder)
    batch = long_batch(tokenizer)
    labels = make_labels("encoder", model.args, batch)
    expected_loss, expected, _ = reference_gradients(folder, "encoder", batch, labels)
    loss, grads = our_gradients(model, batch, labels)
    assert abs(loss - expected_loss) <= 1e-4 * abs(expected_loss)
    table = expected["encoder.relative_attention_bias.weight"]
    reached = np.abs(table).sum(axis=1) != 0
    assert set(np.flatnonzero(reached).tolist()) == USED_BUCKETS  # every bucket; never rows past 32
    assert set(grads) == set(expected)
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        err = float(np.abs(g - expected[name]).max())
        assert err <= 1e-4 * scale, f"{name}: max abs error {err:.3g} > 1e-4 x largest gradient {scale:.3g}"


def test_sentence_encoder_matches_sentence_transformers(checkpoint, tmp_path):
    """all-mpnet-base-v2's layout: the MPNet folder, mean pooling (1_Pooling) and 2_Normalize."""
    modules = [Transformer(str(checkpoint("mpnet")), max_seq_length=200), Pooling(32, pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path))
    layout = [m["path"] for m in json.loads((tmp_path / "modules.json").read_text())]
    assert layout == ["", "1_Pooling", "2_Normalize"]
    texts = [*TEXTS, "A cat sat on the mat."]
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(texts, batch_size=3, convert_to_numpy=True)
    with pytest.warns(UserWarning, match="2 of 5 texts are longer than max_seq_length=200"):
        got = SentenceEncoder(tmp_path).encode(texts, batch_size=3)
    assert got.shape == expected.shape == (len(texts), 32)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_fewer_buckets_than_transformers_uses_fail_at_load():
    with pytest.raises(ValueError, match="'relative_attention_num_buckets' must be at least 32, got 16"):
        ModelArgs.from_dict({"model_type": "mpnet", "relative_attention_num_buckets": 16})
