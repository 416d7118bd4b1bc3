"""Attention on (B, nh, L, hd) tensors: MLX's fused kernel on a GPU; on the CPU, written out with the exact, fast
exp of ops.py (the softmax's exp is most of an encoder's time there), with dropout, in cache-sized blocks of batch
rows and heads where a pass's scores are large, and by query blocks in O(L) memory for long inputs. Gradients of
every form match transformers' eager attention (tests/test_gradients.py, tests/test_attention_blocks.py).
"""

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .ops import exp_nonpositive
from .runtime import on_cpu


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    mask: mx.array | None,
    dropout: nn.Dropout | None = None,
    *,
    scale: float | None = None,
    bias: mx.array | None = None,
) -> mx.array:
    """softmax(q k^T * scale + mask + bias) v on (B, nh, L, hd) tensors; `scale` defaults to 1 / sqrt(hd),
    `mask` is additive (see padding_mask), `bias` an additive score term broadcastable to (B, nh, L, L) (the
    relative-position terms of DeBERTa and MPNet; it may carry gradients), and `dropout`, if given, applies
    to the softmax's probabilities (transformers' attention dropout).

    On a GPU, mx.fast.scaled_dot_product_attention: MLX's fused kernel. On the CPU, MLX runs that function
    as separate ops whose softmax exp costs most of an encoder's time, so the same math is written out here
    with exp_nonpositive: `written_out_attention`, which also applies dropout (training); a single query (a
    decoding step) has too few scores for that to pay for its extra ops, and takes MLX's. MLX's fused kernel
    has no dropout: with dropout on, other devices (and single queries) take `dropped_out_attention`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if bias is not None:
        mask = bias if mask is None else mask + bias
    active = dropout is not None and dropout.training and dropout._p_1 < 1  # nn.Dropout keeps 1 - p only
    if on_cpu() and q.shape[-2] > 1:  # one query (decoding): too few scores to matter
        if not active and in_blocks(q, k, mask):
            return attention_in_blocks(q, k, v, mask, scale)
        return written_out_attention(q, k, v, mask, scale, dropout if active else None)
    if active:
        return dropped_out_attention(q, k, v, mask, dropout, scale)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# On the CPU, in inference passes (`blocks_of_scores`), a pass's (B, nh, Lq, Lk) float32 scores beyond
# SCORES_WHOLE_BYTES run in blocks of batch rows and heads of at most SCORES_BLOCK_BYTES, one after another: the
# softmax's passes over a block's scores then read them from the core's cache instead of memory. Below the first
# size, blocks only add dispatch; under a gradient, the blocks' backward passes run slower than one whole.
SCORES_WHOLE_BYTES = 2**23
SCORES_BLOCK_BYTES = 2**21
_BLOCKS: contextvars.ContextVar[bool] = contextvars.ContextVar("blocks_of_scores", default=False)


@contextmanager
def blocks_of_scores() -> Iterator[None]:
    """Inside, `attention` may run large passes' scores in blocks (`in_blocks`): for forward passes that nothing
    differentiates (the batching runner's)."""
    token = _BLOCKS.set(True)
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def in_blocks(q: mx.array, k: mx.array, mask: mx.array | None) -> bool:
    """Whether `attention` runs these (B, nh, Lq, hd) queries over (B, nh, Lk, hd) keys by `score_blocks`: inside
    `blocks_of_scores`, without dropout (each block would draw its masks apart), past SCORES_WHOLE_BYTES."""
    B, heads, queries, _ = q.shape
    fits = mask is None or (mask.ndim == 4 and mask.shape[1] in (1, heads))
    return _BLOCKS.get() and fits and B * heads * queries * k.shape[-2] * 4 > SCORES_WHOLE_BYTES


def score_blocks(batch: int, heads: int, queries: int, keys: int) -> Iterator[tuple[slice, slice]]:
    """(batch rows, heads) of each block: whole rows when one row's scores fit SCORES_BLOCK_BYTES, else as many of
    a row's heads as fit (and divide its heads), at least one."""
    per_head = queries * keys * 4
    if per_head * heads <= SCORES_BLOCK_BYTES:
        rows = SCORES_BLOCK_BYTES // (per_head * heads)
        for b in range(0, batch, rows):
            yield slice(b, b + rows), slice(0, heads)
        return
    group = max(h for h in range(1, heads + 1) if heads % h == 0 and (h == 1 or h * per_head <= SCORES_BLOCK_BYTES))
    for b in range(batch):
        for h in range(0, heads, group):
            yield slice(b, b + 1), slice(h, h + group)


def attention_in_blocks(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, scale: float) -> mx.array:
    """written_out_attention by `score_blocks`, each block computed after the one before (`after`): MLX would
    otherwise run the independent blocks side by side, and their scores would leave the cache together."""
    rows_out: list[mx.array] = []
    row: list[mx.array] = []
    for rows, heads in score_blocks(q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
        part = None
        if mask is not None:
            part = mask[rows if mask.shape[0] > 1 else slice(None), heads if mask.shape[1] > 1 else slice(None)]
        previous = row[-1:] or rows_out[-1:]
        row.append(written_out_attention(after(q[rows, heads], previous), k[rows, heads], v[rows, heads], part, scale))
        if heads.stop >= q.shape[1]:  # the rows' last heads: their heads in one piece
            rows_out.append(row[0] if len(row) == 1 else mx.concatenate(row, axis=1))
            row = []
    return rows_out[0] if len(rows_out) == 1 else mx.concatenate(rows_out, axis=0)


def softmax_weights(q: mx.array, k: mx.array, mask: mx.array | None, scale: float | None = None) -> mx.array:
    """Unnormalised float32 softmax weights exp(s - max s) of the scores s = q k^T * scale + mask (scale
    1 / sqrt(hd) by default). The max only keeps exp in range (softmax does not depend on it), so no gradient
    flows through it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = ((q * scale) @ k.swapaxes(-1, -2)).astype(mx.float32)
    if mask is not None:
        scores = scores + mask
    return exp_nonpositive(scores - mx.stop_gradient(scores.max(axis=-1, keepdims=True)))


def written_out_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    mask: mx.array | None,
    scale: float | None = None,
    dropout: nn.Dropout | None = None,
) -> mx.array:
    """Attention as matmuls and a float32 softmax through exp_nonpositive. The scores are laid out keys by
    queries, (B, nh, Lk, Lq), so that the softmax's max and sum both run down columns: MLX's CPU reductions along
    a row run slower than down columns at encoder lengths, and the sum is a product with ones (BLAS). The
    weights are normalised after the product with v, which divides (B, nh, L, hd) values instead of
    (B, nh, L, L); that product runs in float32, as its unnormalised sums can pass float16's range. `dropout`
    (on, in training) drops weights before that product: each query's probabilities share one divisor, so
    dividing after the product gives transformers' dropped-out probabilities times v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (k @ (q * scale).swapaxes(-1, -2)).astype(mx.float32)  # (B, nh, Lk, Lq)
    if mask is not None:
        scores = scores + mask.swapaxes(-1, -2)
    weights = exp_nonpositive(scores - mx.stop_gradient(scores.max(axis=-2, keepdims=True)))
    sums = mx.ones((1, weights.shape[-2]), mx.float32) @ weights  # (B, nh, 1, Lq)
    if dropout is not None:
        weights = dropout(weights)
    return ((weights.swapaxes(-1, -2) @ v.astype(mx.float32)) / sums.swapaxes(-1, -2)).astype(v.dtype)


def dropped_out_attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, dropout: nn.Dropout, scale: float | None = None
) -> mx.array:
    """Attention with `dropout` on the (float32) probabilities, as transformers' eager attention."""
    weights = softmax_weights(q, k, mask, scale)
    probabilities = dropout(weights / weights.sum(axis=-1, keepdims=True))
    return (probabilities @ v.astype(mx.float32)).astype(v.dtype)


# Long inputs on the CPU: one head's QUERY_BLOCK queries at a time, whose (QUERY_BLOCK, L) float32 scores and
# their softmax stay in the CPU's cache, where all (B, nh, L, L) scores would not.
# Shorter inputs keep `attention`: their scores fit in memory, and its gradients need no recomputed softmax.
QUERY_BLOCK = 256
BLOCKWISE_FROM = 2048


def blockwise_attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, dropout: nn.Dropout | None = None,
    *, causal: bool = False,
) -> mx.array:  # fmt: skip
    """`attention` of (B, nh, L, hd) q, k, v, in O(L) memory on the CPU for L > BLOCKWISE_FROM when `mask` is a
    (B|1, 1, 1, L) key mask (padding_mask's) or None: `attention_by_blocks`. Short inputs, masks over queries too,
    dropout that is on (it needs the probabilities) and GPUs (whose fused kernel never holds the scores) take
    `attention`. `causal`: query i also sees only keys j <= i (a decoder's), each block only the keys up to its end."""
    active_dropout = dropout is not None and dropout.training and dropout._p_1 < 1
    keys_only = mask is None or mask.shape[1:3] == (1, 1)
    if not on_cpu() or active_dropout or not keys_only or q.shape[-2] <= BLOCKWISE_FROM:
        if causal:  # one masked value for padding and future keys alike, as transformers' boolean masks give
            future = future_keys(0, q.shape[-2], q.dtype)
            mask = future if mask is None else mx.minimum(mask, future)
        return attention(q, k, v, mask, dropout)
    return attention_by_blocks(q, k, v, mask, scale=q.shape[-1] ** -0.5, block=QUERY_BLOCK, causal=causal)


def future_keys(start: int, end: int, dtype: mx.Dtype) -> mx.array:
    """Additive (1, 1, end - start, end) mask of queries start..end-1 over keys 0..end-1: on the keys after each
    query, half the dtype's lowest value, padding_mask's (their minimum masks a key that either one masks)."""
    queries, keys = mx.arange(start, end)[:, None], mx.arange(end)[None]
    lowest = mx.array(float(mx.finfo(dtype).min) / 2, dtype)
    return mx.where(keys <= queries, mx.array(0, dtype), lowest)[None, None]


def block_keys(mask: mx.array | None, b: int, rows: slice, length: int, causal: bool, dtype) -> tuple[int, mx.array]:
    """(how many keys, their mask) for batch row b's queries `rows`: all L keys, or with `causal` those up to the
    block's last query, the later ones within the block masked. A query whose keys are all masked (left padding)
    weighs its block's keys alike, where transformers weighs all L alike: only padding positions differ."""
    if not causal:
        return length, key_mask(mask, b)
    end = min(rows.stop, length)
    future = future_keys(rows.start, end, dtype)
    return end, future if mask is None else mx.minimum(key_mask(mask, b)[..., :end], future)


def query_blocks(shape: tuple[int, ...], block: int) -> Iterator[tuple[int, int, slice]]:
    """(batch row, head, queries) of each block of a (B, nh, L, hd) tensor's queries, in memory order."""
    B, nh, L, _ = shape
    for b in range(B):
        for h in range(nh):
            for start in range(0, L, block):
                yield b, h, slice(start, start + block)


def key_mask(mask: mx.array | None, b: int) -> mx.array | None:
    """Batch row b's (1, 1, 1, L) key mask."""
    return mask if mask is None or mask.shape[0] == 1 else mask[b : b + 1]


def after(x: mx.array, previous: list[mx.array]) -> mx.array:
    """x, computed only once `previous` is: each block runs after the last, so MLX, which would otherwise run
    up to 20 independent blocks side by side, keeps one block's scores alive (in cache) at a time."""
    return mx.depends(x, previous) if previous else x


@mx.custom_function
def attention_by_blocks(q, k, v, mask, *, scale: float, block: int, causal: bool = False) -> mx.array:
    """written_out_attention of (B, nh, L, hd) q, k, v under a (B|1, 1, 1, L) additive key mask (or None),
    `block` queries of one head at a time: O(block L) live scores instead of B nh L^2. Its vjp recomputes each
    block's softmax rather than keep it (as flash attention does), so gradients take O(L) memory too.
    `causal`: each query sees the keys up to its own position (a block reads only the keys up to its end)."""
    if mask is not None and mask.shape[1:3] != (1, 1):
        raise ValueError(f"attention_by_blocks takes a (B|1, 1, 1, L) key mask, got shape {mask.shape}")
    blocks, L = [], q.shape[2]
    for b, h, rows in query_blocks(q.shape, block):
        qb = after(q[b : b + 1, h : h + 1, rows], blocks[-1:])
        end, m = block_keys(mask, b, rows, L, causal, q.dtype)
        blocks.append(written_out_attention(qb, k[b : b + 1, h : h + 1, :end], v[b : b + 1, h : h + 1, :end], m, scale))
    return mx.concatenate(blocks, axis=2).reshape(q.shape)  # blocks in (b, h, query) order


@attention_by_blocks.vjp
def attention_by_blocks_vjp(primals, cotangent, output, *, scale: float, block: int, causal: bool = False):
    """With p = w / l (w = exp(s - max s) as the forward pass computed it, l = sum w), g' = g / l and d = g'.o:
    ds = w (g' v^T - d); dq = scale ds k, dk = scale ds^T q, dv = w^T g', dmask = ds summed over heads and queries.
    Each (b, h)'s dk and dv add up over its blocks (a causal block's over the keys up to its end)."""
    q, k, v, mask = primals
    f32, L = mx.float32, q.shape[2]
    dq, dk, dv, dmask, previous = [], {}, {}, {}, []
    for b, h, rows in query_blocks(q.shape, block):
        end, m = block_keys(mask, b, rows, L, causal, q.dtype)
        qb, kb, vb = q[b : b + 1, h : h + 1, rows], k[b : b + 1, h : h + 1, :end], v[b : b + 1, h : h + 1, :end]
        weights = softmax_weights(after(qb, previous), kb, m, scale)  # (1, 1, block, end)
        g = cotangent[b : b + 1, h : h + 1, rows].astype(f32) / weights.sum(axis=-1, keepdims=True)
        d = (g * output[b : b + 1, h : h + 1, rows].astype(f32)).sum(axis=-1, keepdims=True)
        ds = weights * (g @ vb.astype(f32).swapaxes(-1, -2) - d)
        dq.append((ds @ kb.astype(f32)) * scale)
        rest = [(0, 0), (0, 0), (0, L - end), (0, 0)]  # the keys after the block's end: no gradient from it
        add_to(dk, (b, h), mx.pad((ds.swapaxes(-1, -2) @ qb.astype(f32)) * scale, rest))
        add_to(dv, (b, h), mx.pad(weights.swapaxes(-1, -2) @ g, rest))
        # built lazily: computed only if asked for
        add_to(dmask, b, mx.pad(ds.sum(axis=(1, 2), keepdims=True), rest[:2] + [(0, 0), (0, L - end)]))
        previous = [dq[-1], dk[b, h], dv[b, h]]
    dq = mx.concatenate(dq, axis=2).reshape(q.shape).astype(q.dtype)
    dk, dv = (mx.concatenate(list(t.values()), axis=1).reshape(x.shape).astype(x.dtype) for t, x in ((dk, k), (dv, v)))
    return dq, dk, dv, None if mask is None else mask_cotangent(list(dmask.values()), mask)


def add_to(totals: dict, key, part: mx.array) -> None:
    totals[key] = totals[key] + part if key in totals else part


def mask_cotangent(rows: list[mx.array], mask: mx.array) -> mx.array:
    """The (B|1, 1, 1, L) key mask's cotangent from each batch row's (1, 1, 1, L) one."""
    d = mx.concatenate(rows, axis=0)
    return (d.sum(axis=0, keepdims=True) if mask.shape[0] == 1 else d).astype(mask.dtype)
