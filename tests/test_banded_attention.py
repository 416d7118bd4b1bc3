"""ModernBERT on long inputs: its sliding-window layers compute only the band (`modernbert.banded_attention`),
its global layers a block of queries at a time (`engine.attention.blockwise_attention`). Outputs and gradients equal
transformers' (full L x L scores and masks) at several times the window, with padding, including padding queries
whose whole window is padding; both forms' memory grows linearly with the length."""

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from test_gradients import our_gradients, reference_gradients
from test_numerics import force_branch
from test_parity import as_torch

import mlx_encoders
from mlx_encoders.engine import attention as kernels
from mlx_encoders.models import modernbert
from mlx_encoders.models.base import padding_mask

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


def count_calls(monkeypatch, module, name: str) -> list:
    """Record the shape of the first argument of each call to `module.name`."""
    calls = []
    function = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(a[0].shape) or function(*a, **kw))
    return calls


@pytest.mark.parametrize("branch", ["cpu", "gpu"])
@pytest.mark.parametrize("length", [12, 3 * WINDOW, 10 * WINDOW + 3])
def test_band_matches_transformers_forward_and_gradients(checkpoint, monkeypatch, length, branch):
    force_branch(monkeypatch, branch)
    bands = count_calls(monkeypatch, modernbert, "banded_attention")
    check_against_transformers(checkpoint, length)
    assert bool(bands) == (length > 3 * WINDOW // 2)  # the band only where it is smaller than L x L


@pytest.mark.parametrize("length", [3 * WINDOW, 10 * WINDOW + 3])
def test_global_layers_by_blocks_match_transformers_forward_and_gradients(checkpoint, monkeypatch, length):
    """From 16 queries on, in blocks of 5 (the last one partial): the global layers (0 and 2) by blocks."""
    force_branch(monkeypatch, "cpu")
    monkeypatch.setattr(kernels, "BLOCKWISE_FROM", 16)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 5)
    blocks = count_calls(monkeypatch, kernels, "attention_by_blocks")
    check_against_transformers(checkpoint, length)
    assert len(blocks) == 4  # two global layers, in the gradients' forward pass and in the plain one


def check_against_transformers(checkpoint, length: int) -> None:
    folder = checkpoint("modernbert", "question-answering")
    batch = padded_batch(length)
    # QA's loss spans every position, padding included, so padding queries' outputs and gradients count too
    labels = {"start_positions": np.array([0, 2, length - 1]), "end_positions": np.array([1, 5, length - 2])}
    expected_loss, expected, _ = reference_gradients(folder, "question-answering", batch, labels)
    model = mlx_encoders.load_model(folder)
    loss, grads = our_gradients(model, batch, labels)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in grads.items():
        assert float(np.abs(g - expected[name]).max()) <= 1e-4 * scale, name

    reference = load_reference(folder, "question-answering")
    theirs = reference(**as_torch(batch)).start_logits.detach().numpy()
    ours = np.array(model(**batch).start_logits)
    np.testing.assert_allclose(ours, theirs, atol=1e-4 * max(1.0, np.abs(theirs).max()), rtol=0)


def peak_memory(compute, *args) -> int:
    """Bytes MLX's memory rose by while `compute(*args)` was evaluated, measured on a second run: the first makes any
    one-time buffers, and a collection before the measure frees what earlier tests left to the collector, which
    would otherwise be freed inside the measured run and hide part of its peak."""
    mx.eval(compute(*args))
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    # Over its memory limit, MLX's evaluation waits for each op before it starts the next: the peak is then the
    # graph's own, not how far the building thread ran ahead of the stream's (which another process's load moves).
    limit = mx.set_memory_limit(1)
    try:
        mx.eval(compute(*args))
    finally:
        mx.set_memory_limit(limit)
    return mx.get_peak_memory() - before


def assert_linear_memory(compute, short: int) -> None:
    """`compute(ids)`'s peak memory grows about 4x from `short` to 4 x `short` tokens of ids (all ones: also the
    attention mask), not the 16x of (L, L) scores."""
    peaks = []
    for length in (short, 4 * short):
        peaks.append(peak_memory(compute, mx.ones((1, length), mx.int32)))
    assert peaks[1] < 6 * peaks[0], peaks


def test_band_memory_grows_linearly_with_length():
    """The band's scores are (L / h) x h x 3h: the peak memory grows as L, not as the full mask's L^2."""
    args = modernbert.ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        local_attention=64, layer_types=["sliding_attention"],
    )  # fmt: skip
    model = modernbert.ModernBertModel(args)
    mx.eval(model.parameters())
    assert_linear_memory(lambda ids: model(ids, attention_mask=ids).last_hidden_state, 2048)


@pytest.mark.parametrize("keys", [3, 1])  # a key mask per batch row, or one for all
def test_attention_by_blocks_matches_torch_with_a_fully_masked_row(keys):
    """17 queries in blocks of 5 (the last one partial): outputs and the gradients of q, k, v and the mask."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2, 17, 8)).astype(np.float32) * 3 for _ in range(3))
    keep = np.ones((3, 17), np.int32)
    keep[1, 5:] = 0
    keep[2, :] = 0  # no real key: every weight equal, as with transformers' finite mask
    mask = np.array(padding_mask(mx.array(keep[:keys]), mx.float32))
    cotangent = rng.standard_normal(q.shape).astype(np.float32)
    tensors = [torch.from_numpy(t).double().requires_grad_(True) for t in (q, k, v, mask)]
    expected = torch.nn.functional.scaled_dot_product_attention(*tensors[:3], attn_mask=tensors[3])
    (expected * torch.from_numpy(cotangent).double()).sum().backward()

    def loss(*arrays):
        out = kernels.attention_by_blocks(*arrays, scale=8**-0.5, block=5)
        return (out * mx.array(cotangent)).sum(), out

    (_, got), grads = mx.value_and_grad(loss, argnums=(0, 1, 2, 3))(*(mx.array(t) for t in (q, k, v, mask)))
    np.testing.assert_allclose(np.array(got), expected.detach().numpy(), atol=1e-5, rtol=0)
    for name, grad, tensor in zip(("q", "k", "v", "mask"), grads, tensors, strict=True):
        exact = tensor.grad.numpy()
        np.testing.assert_allclose(np.array(grad), exact, atol=1e-5 * np.abs(exact).max(), rtol=0, err_msg=name)


def test_global_memory_grows_linearly_with_length(monkeypatch):
    """A global layer by blocks holds one block's (QUERY_BLOCK, L) scores at a time, in its forward pass and in
    its gradients: the peak memory grows as L (all (L, L) scores at once would grow it as L^2)."""
    monkeypatch.setattr(kernels, "BLOCKWISE_FROM", 256)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 128)
    args = modernbert.ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        layer_types=["full_attention"],
    )  # fmt: skip
    model = modernbert.ModernBertModel(args)
    mx.eval(model.parameters())
    gradients = nn.value_and_grad(model, lambda ids: model(ids, attention_mask=ids).last_hidden_state.sum())
    for run in (lambda ids: model(ids, attention_mask=ids).last_hidden_state, gradients):
        assert_linear_memory(run, 512)
