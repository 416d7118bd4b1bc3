"""Batch invariance, reduced precision and masks that can never produce NaN."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.models import MODEL_TYPES

TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog.", " ".join(["a long text"] * 60)]
# Documented in README: max abs difference from float32, relative to the output's scale.
TOLERANCE = {"float16": 1e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_text_alone_equals_itself_in_a_padded_batch(checkpoint, model_type):
    model, tokenizer = mlx_encoders.load(checkpoint(model_type, "masked-lm"))
    batch = tokenizer(TEXTS, padding=True)
    together = np.array(model(**batch).logits)
    for i, text in enumerate(TEXTS):
        alone = np.array(model(**tokenizer([text])).logits)[0]
        n = alone.shape[0]
        np.testing.assert_allclose(together[i, :n], alone, atol=1e-5, rtol=0, err_msg=f"text {i}")


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reduced_precision_is_finite_and_close(checkpoint, model_type, dtype):
    folder = checkpoint(model_type, "masked-lm")
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS, padding=True)
    reference = np.array(model(**batch).logits)
    low = mlx_encoders.load_model(folder, dtype=dtype)
    assert {v.dtype for _, v in tree_flatten(low.parameters())} == {getattr(mx, dtype)}
    out = low(**batch).logits
    assert out.dtype == getattr(mx, dtype)
    out = np.array(out.astype(mx.float32))
    assert np.isfinite(out).all()
    real = np.array(batch["attention_mask"]).astype(bool)
    err = np.abs(out - reference)[real].max() / np.abs(reference).max()
    assert err <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sliding_window_wholly_in_padding_stays_finite(checkpoint, dtype):
    """A 1-token-long text beside a long one: padded queries far from any real key see only masked keys."""
    model = mlx_encoders.load_model(checkpoint("modernbert"), dtype=dtype)
    _, tokenizer = mlx_encoders.load(checkpoint("modernbert"))
    batch = tokenizer(["", " ".join(["words"] * 100)], padding=True)
    assert batch["input_ids"].shape[1] > 2 + model.args.local_attention  # a whole window past row 0's end
    out = model(**batch).last_hidden_state.astype(mx.float32)
    assert bool(mx.all(mx.isfinite(out)))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_all_padding_rows_stay_finite_in_float16(checkpoint, model_type):
    model = mlx_encoders.load_model(checkpoint(model_type, "masked-lm"), dtype="float16")
    ids = mx.ones((2, 12), dtype=mx.int32) * 5
    mask = mx.array([[1] + [0] * 11, [0] * 12], dtype=mx.int32)  # one real token; no real token at all
    assert bool(mx.all(mx.isfinite(model(ids, attention_mask=mask).logits)))
