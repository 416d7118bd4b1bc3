"""ModernBERT's sliding-window layers on long inputs compute only the band (`modernbert.banded_attention`):
outputs and gradients equal transformers' (its full L x L mask) at several times the window, with padding,
including padding queries whose whole window is padding."""

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import load_reference
from test_gradients import our_gradients, reference_gradients
from test_numerics import force_branch
from test_parity import as_torch

import mlx_encoders
from mlx_encoders.models import modernbert

WINDOW = 8  # tests/checkpoints.py's ModernBERT: local_attention 8, so |i - j| <= 4


def padded_batch(length: int) -> dict:
    """Three rows of random ids: full length, a third of it, and 3 tokens (its later windows hold no real key)."""
    rng = np.random.default_rng(length)
    ids = rng.integers(5, 300, (3, length))
    mask = np.zeros((3, length), np.int64)
    for row, real in enumerate((length, length // 3, 3)):
        mask[row, :real] = 1
    ids[mask == 0] = 0  # ModernBERT's pad id
    return {"input_ids": mx.array(ids, mx.int32), "attention_mask": mx.array(mask, mx.int32)}


def count_bands(monkeypatch) -> list:
    calls = []
    banded = modernbert.banded_attention
    monkeypatch.setattr(modernbert, "banded_attention", lambda *a: calls.append(a[0].shape) or banded(*a))
    return calls


@pytest.mark.parametrize("branch", ["cpu", "gpu"])
@pytest.mark.parametrize("length", [12, 3 * WINDOW, 10 * WINDOW + 3])
def test_band_matches_transformers_forward_and_gradients(checkpoint, monkeypatch, length, branch):
    force_branch(monkeypatch, branch)
    bands = count_bands(monkeypatch)
    folder = checkpoint("modernbert", "question-answering")
    batch = padded_batch(length)
    # QA's loss spans every position, padding included, so padding queries' outputs and gradients count too
    labels = {"start_positions": np.array([0, 2, length - 1]), "end_positions": np.array([1, 5, length - 2])}
    expected_loss, expected, _ = reference_gradients(folder, "question-answering", batch, labels)
    model = mlx_encoders.load_model(folder)
    loss, grads = our_gradients(model, batch, labels)
    assert bool(bands) == (length > 3 * WINDOW // 2)  # the band only where it is smaller than L x L
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        assert float(np.abs(g - expected[name]).max()) <= 1e-4 * scale, name

    reference = load_reference(folder, "question-answering")
    theirs = reference(**as_torch(batch)).start_logits.detach().numpy()
    ours = np.array(model(**batch).start_logits)
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * max(1.0, np.abs(theirs).max()), rtol=0)


def test_band_memory_grows_linearly_with_length():
    """The band's scores are (L / h) x h x 3h: doubling L doubles the peak memory (the full mask's quadruples)."""
    args = modernbert.ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        local_attention=64, layer_types=["sliding_attention"],
    )  # fmt: skip
    model = modernbert.ModernBertModel(args)
    mx.eval(model.parameters())
    peaks = []
    for length in (2048, 4096):
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(model(mx.ones((1, length), mx.int32), attention_mask=mx.ones((1, length), mx.int32)).last_hidden_state)
        peaks.append(mx.get_peak_memory() - before)
    assert peaks[1] < 2.3 * peaks[0], peaks
