"""Attention by blocks of batch rows and heads on the CPU (engine.attention.attention_in_blocks) against torch's
eager attention in float64: outputs and gradients, under every mask shape the models pass; and where it runs (the
batching runner's forward passes, not a caller's own or a gradient's)."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from tolerance import assert_float32_close, encoder_terms

from mlx_encoders import SentenceEncoder
from mlx_encoders.engine import attention as engine_attention
from mlx_encoders.engine.attention import attention, blocks_of_scores, in_blocks, score_blocks

# float32 scores, softmax and products over at most a few hundred terms, against float64
TOL = 2e-5


def reference(q, k, v, mask, scale):
    """softmax(q k^T scale + mask) v in float64 torch, and its gradients for a cotangent `ct`."""
    q, k, v = (torch.tensor(np.array(t), dtype=torch.float64, requires_grad=True) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + torch.tensor(np.array(mask), dtype=torch.float64)
    return q, k, v, torch.softmax(scores, -1) @ v


def masks(B, H, Lq, Lk, rng):
    keys = np.where(rng.random((B, 1, 1, Lk)) < 0.2, np.float32(-3.4e38) / 2, 0).astype(np.float32)
    keys[:, :, :, 0] = 0  # every query sees a key
    return {
        "none": None,
        "keys": keys,
        "per-head": rng.normal(size=(B, H, Lq, Lk)).astype(np.float32),
        "shared": rng.normal(size=(1, 1, Lq, Lk)).astype(np.float32),
        "per-row": rng.normal(size=(B, 1, Lq, Lk)).astype(np.float32),
    }


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks at test sizes: a pass of more than 4 KB of scores runs in blocks of at most 2 KB."""
    monkeypatch.setattr(engine_attention, "SCORES_WHOLE_BYTES", 4096)
    monkeypatch.setattr(engine_attention, "SCORES_BLOCK_BYTES", 2048)
    with blocks_of_scores():
        yield


@pytest.mark.parametrize("shape", [(10, 2, 8, 8), (2, 3, 24, 24), (2, 2, 24, 12)], ids=["rows", "heads", "gqa-like"])
@pytest.mark.parametrize("kind", ["none", "keys", "per-head", "shared", "per-row"])
def test_blocks_match_torch(small_blocks, shape, kind):
    B, H, Lq, Lk = shape
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, H, Lq, 16)).astype(np.float32)
    k, v = (rng.normal(size=(B, H, Lk, 16)).astype(np.float32) for _ in range(2))
    mask = masks(B, H, Lq, Lk, rng)[kind]
    assert in_blocks(mx.array(q), mx.array(k), None if mask is None else mx.array(mask))
    cotangent = rng.normal(size=(B, H, Lq, 16)).astype(np.float32)

    def ours(q, k, v):
        return attention(q, k, v, None if mask is None else mx.array(mask), scale=0.3)

    (out,), grads = mx.vjp(ours, [mx.array(q), mx.array(k), mx.array(v)], [mx.array(cotangent)])
    tq, tk, tv, expected = reference(q, k, v, mask, 0.3)
    expected.backward(torch.tensor(cotangent, dtype=torch.float64))
    np.testing.assert_allclose(np.array(out), expected.detach().numpy(), rtol=TOL, atol=TOL)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad), strict=True):
        np.testing.assert_allclose(np.array(got), want.numpy(), rtol=TOL, atol=TOL * np.abs(want.numpy()).max())


def test_block_layout():
    """Whole rows while a row's scores fit a block; else a row's heads in groups that divide them; one head at a
    time at least. Every (row, head) exactly once, in memory order."""
    block = engine_attention.SCORES_BLOCK_BYTES

    def cover(B, H, Lq, Lk):
        seen = [(b, h) for rows, heads in score_blocks(B, H, Lq, Lk) for b in range(B)[rows] for h in range(H)[heads]]
        assert seen == [(b, h) for b in range(B) for h in range(H)]
        return list(score_blocks(B, H, Lq, Lk))

    side = int((block // 4 // 12) ** 0.5)  # 12 heads of side x side scores fit one block
    assert cover(5, 12, side, side)[0] == (slice(0, block // (4 * 12 * side * side)), slice(0, 12))
    per_head = 512  # 1 MB of scores a head: two heads a block
    assert {h.stop - h.start for _, h in cover(2, 12, per_head, per_head)} == {2}
    assert {h.stop - h.start for _, h in cover(1, 3, per_head, per_head)} == {1}  # 2 does not divide 3
    assert {h.stop - h.start for _, h in cover(1, 4, 2048, 2048)} == {1}  # one head past a block: alone


def test_whole_below_the_threshold_and_outside_the_runner():
    q = mx.zeros((32, 12, 64, 32))  # 6 MB of scores: one pass
    big = mx.zeros((16, 12, 128, 32))  # 12 MB
    assert not in_blocks(big, big, None)  # a caller's own pass (and any gradient): whole
    with blocks_of_scores():
        assert not in_blocks(q, q, None)
        assert in_blocks(big, big, None)
        assert not in_blocks(big, big, mx.zeros((12, 128, 128)))  # a 3-d bias: whole


def test_encode_runs_blocks_and_its_embeddings_match(checkpoint, monkeypatch):
    """`encode`'s passes (the batching runner's) take large scores in blocks, with the embeddings of whole ones."""
    folder = checkpoint("bert")
    encoder = SentenceEncoder(folder)
    texts = ["a short text", "a somewhat longer text with more words in it than the first", "x " * 40]
    whole = encoder.encode(texts)
    calls = []
    blocked = engine_attention.attention_in_blocks
    monkeypatch.setattr(engine_attention, "attention_in_blocks", lambda *a: calls.append(1) or blocked(*a))
    monkeypatch.setattr(engine_attention, "SCORES_WHOLE_BYTES", 1024)
    monkeypatch.setattr(engine_attention, "SCORES_BLOCK_BYTES", 512)
    assert_float32_close(encoder.encode(texts), whole, encoder_terms(folder, texts))
    assert calls, "encode's attention ran whole"
