"""Exact, fast forms of the elementwise functions and attention that encoders spend their time in, and the
CPU-only helpers of training's optimizer step (streams, a numpy norm, glibc's allocator settings).

MLX's CPU backend computes transcendental functions (exp, erf) one element at a time; the forms here are
multiply-adds and integer shifts that `mx.compile` fuses and the C++ compiler vectorises, and they stay
within float32 rounding of the exact function (tests/test_numerics.py). They are pure MLX and run unchanged
on every backend; `attention` alone picks MLX's fused kernel on a GPU, where one exists. Their gradients are
the exact functions' (custom vjps), within float32 rounding too (tests/test_gradients.py).
"""

import ctypes
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_encoders import _blas

# erf(z) = z N(z^2) / D(z^2) on [-4, 4], highest power first (Eigen's / XLA's float32 erf, within ~2 ulp;
# |erf| rounds to 1 beyond 4).
ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                 -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # fmt: skip
ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                   -1.42647390514189e-02)  # fmt: skip


def erf(z: mx.array) -> mx.array:
    """erf(z) for float32 z in [-4, 4], both polynomials of the ratio in Estrin's form, so their dependency chains
    are short enough for mx.compile to fuse all of it (it is inlined into the compiled functions below)."""
    n0, n1, n2, n3, n4, n5, n6 = ERF_NUMERATOR
    d0, d1, d2, d3, d4 = ERF_DENOMINATOR
    z2 = z * z
    z4 = z2 * z2
    z8 = z4 * z4
    numerator = (n6 + n5 * z2) + z4 * (n4 + n3 * z2) + z8 * (n2 + n1 * z2 + n0 * z4)
    denominator = (d4 + d3 * z2) + z4 * (d2 + d1 * z2) + z8 * d0
    return z * numerator / denominator


@mx.compile
def gelu_from(x: mx.array, z: mx.array) -> mx.array:
    """x (1 + erf(z)) / 2 for float32 x and z = x / sqrt(2) clipped to [-4, 4]."""
    return x * (1 + erf(z)) / 2


@mx.compile
def gelu_slope_from(x: mx.array, z: mx.array, density: mx.array) -> mx.array:
    """GELU'(x) = Phi(x) + x phi(x), from z as in gelu_from and density = exp(-x^2 / 2)."""
    return (1 + erf(z)) / 2 + x * density * (1 / math.sqrt(2 * math.pi))


def unfused(x: mx.array) -> mx.array:
    """`x` itself, as a kernel boundary on the CPU: mx.compile does not fuse through a bit-cast (`view`), which
    for a contiguous array shares its buffer (no copy). The training step compiles all of its graph as one, and
    there MLX fused these functions' stages into kernels its C++ compiler does not vectorise: one `maximum` or
    `where` in a loop makes all of it scalar. Apart, the stages run as in an eager call: on 8 x 64 x 3072 values
    in a compiled gradient, GELU's forward took 1.8 ms instead of 6.8, forward and backward 11.4 ms instead of
    15.8. Float32 only; only in graphs that are not differentiated (custom-vjp bodies); elsewhere (GPUs, other
    dtypes) a no-op."""
    if x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return x
    return x.view(mx.uint32).view(mx.float32)


@mx.compile
def clip_z(x32: mx.array) -> mx.array:
    """x / sqrt(2) clipped to [-4, 4] (NaN stays NaN), with selects: alone, they vectorise, where mx.clip's
    minimum and maximum do not (0.17 ms against 0.36 ms on 8 x 64 x 1536 values)."""
    z = x32 * (1 / math.sqrt(2))
    return mx.where(z > 4.0, 4.0, mx.where(z < -4.0, -4.0, z))


def clipped_z(x32: mx.array) -> mx.array:
    # Apart from the rest (`unfused`): fused with it, the selects made the whole kernel scalar.
    return unfused(clip_z(x32))


@mx.custom_function
def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, as torch's nn.GELU(): a fused rational erf replaces mx.erf, which is several times
    slower on MLX's CPU backend; within 1.1e-6 of the exact GELU on [-12, 12] (tests/test_numerics.py).
    Half-precision inputs are computed in float32 (the small coefficients underflow in float16), as torch does."""
    x32 = x.astype(mx.float32)
    return gelu_from(x32, clipped_z(x32)).astype(x.dtype)


@gelu.vjp
def gelu_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    """The exact GELU's derivative, within 2.6e-7 (differentiating the rational erf and its clip: 7.5e-6 off)."""
    x32 = x.astype(mx.float32)
    slope = gelu_slope_from(x32, clipped_z(x32), exp_nonpositive(unfused(x32 * x32 * -0.5)))
    return (cotangent.astype(mx.float32) * unfused(slope)).astype(x.dtype)


# exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2 in two parts);
# exp(r) = 1 + r + r^2 P(r), Cephes' float32 expf polynomial (within 1 ulp of exp).
LOG2E = 1.4426950408889634
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1)  # fmt: skip
ROUNDING = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer, in its low bits
# Below this, exp is 0: x rounds to n = -127, whose 2^n bit pattern is all zeros. Masked scores land here, and
# must give exactly 0, never a subnormal: x86 arithmetic on subnormals is slow enough to make a backward pass
# over padded batches 15-20x slower (torch's softmax gives 0 there too).
FLUSH_TO_ZERO = -88.0


@mx.compile
def exp_reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """(x / ln 2 + ROUNDING, whose low bits hold n; r)."""
    shifted = x * LOG2E + ROUNDING
    n = shifted - ROUNDING
    return shifted, (x - n * LN2_HIGH) - n * LN2_LOW


@mx.compile
def exp_small(r: mx.array, scale: mx.array) -> mx.array:
    """exp(r) * scale for |r| <= ln2 / 2, the polynomial in Estrin's form (short dependency chains)."""
    c0, c1, c2, c3, c4, c5 = EXP_POLYNOMIAL
    r2 = r * r
    p = (c5 + c4 * r) + r2 * (c3 + c2 * r) + (r2 * r2) * (c1 + c0 * r)
    return (p * r2 + r + 1) * scale


@mx.compile
def exponent_bits(shifted_bits: mx.array) -> mx.array:
    """The float32 bit pattern of 2^n, from the (uint32) bits of x / ln 2 + ROUNDING, whose low bits hold n."""
    return (shifted_bits + 127) << 23


@mx.custom_function
def exp_nonpositive(x: mx.array) -> mx.array:
    """exp of float32 x <= 0, within 1 ulp for x >= ln(2^-126) (about -87.34); below about -87.68 it is 0.
    Positive x are outside its contract (past 88 the exponent overflows); softmax only needs x <= 0.

    MLX's CPU backend computes mx.exp one element at a time, about 10 ns each (and up to 64 ulp off); these
    multiply-adds and integer shifts vectorise. They run as separate kernels (`unfused`), also inside a larger
    compiled graph: MLX's CPU kernels do not vectorise `maximum`, which therefore runs alone, and fusing the
    range reduction with the polynomial made both slower (5.2 ms against 2.8 ms on 1.6M values).
    """
    shifted, r = exp_reduce(unfused(mx.maximum(x, FLUSH_TO_ZERO)))
    scale = unfused(exponent_bits(shifted.view(mx.uint32)).view(mx.float32))
    return exp_small(unfused(r), scale)


@exp_nonpositive.vjp
def exp_nonpositive_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
    """exp' = exp. MLX cannot differentiate the bit-casts, and the range reduction would differentiate wrongly."""
    return cotangent * output


# Dropout masks. MLX's own (mx.random.bernoulli) draws a 32-bit threefry word for every element, on one thread on
# the CPU: 4.4-4.9 ns an element, about a twentieth of a BERT training step. Here MLX draws two 32-bit keys per
# call and each element's index is hashed, twice, in one compiled kernel: 3.5 ns for the whole dropout instead of
# 5.9 (a (8, 12, 64, 64) attention mask: 1.4 against 2.3 ms).
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
MAX_HASHED = 2**32  # elements a uint32 index tells apart


def mix32(h: mx.array) -> mx.array:
    """lowbias32 (Chris Wellons' hash-prospector): a bijection of uint32 words in which every input bit flips each
    output bit with probability close to 1/2."""
    h = (h ^ (h >> 16)) * HASH_MULTIPLIERS[0]
    h = (h ^ (h >> 15)) * HASH_MULTIPLIERS[1]
    return h ^ (h >> 16)


def random_words(shape: Sequence[int]) -> mx.array:
    """uint32 random words of `shape`: mix32(mix32(i + k1) ^ k2) of each element's index i, with two 32-bit keys
    drawn from MLX's global random key, so mx.random.seed, a compiled step's random state and gradient
    checkpointing's keyed recomputation govern them as they do mx.random's draws. Two calls' index windows
    i + k1 overlap with probability (elements) / 2^31, and even then the second key sets them apart."""
    halves = mx.random.randint(0, 1 << 16, (4,), dtype=mx.uint32)
    k1, k2 = (halves[0] << 16) | halves[1], (halves[2] << 16) | halves[3]
    index = mx.arange(math.prod(shape), dtype=mx.uint32).reshape(shape)
    return mix32(mix32(index + k1) ^ k2)


class Dropout(nn.Dropout):
    """nn.Dropout (zero each element with probability p in training, scale the rest by 1 / (1 - p), as torch's
    dropout), its mask from `random_words`: an element is dropped when its word is below round(p * 2^32), so p is
    met to 2^-32 (MLX's float32 uniforms compare at 2^-24). Dropped NaNs and infinities stay NaN, as in torch
    (x times a zero). The same parameters (none) and arguments as nn.Dropout."""

    def __call__(self, x: mx.array) -> mx.array:
        if self._p_1 == 1 or not self.training:
            return x
        if x.size > MAX_HASHED:  # the uint32 index would wrap around and repeat its masks: MLX's own draws
            return super().__call__(x)
        threshold = mx.array(min(round((1 - self._p_1) * 2**32), 2**32 - 1), mx.uint32)
        scale = mx.where(random_words(x.shape) >= threshold, mx.array(1 / self._p_1, x.dtype), mx.array(0, x.dtype))
        return x * scale


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
    if mx.default_device() == mx.cpu and q.shape[-2] > 1:  # one query (decoding): too few scores to matter
        return written_out_attention(q, k, v, mask, scale, dropout if active else None)
    if active:
        return dropped_out_attention(q, k, v, mask, dropout, scale)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@mx.compile
def scale_and_shift(centred: mx.array, inverse_std: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    return centred * inverse_std * weight + bias


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array:
    """mx.fast.layer_norm(x, weight, bias, eps). On the CPU, for float32 x, the mean and the variance over the last
    axis are matrix-vector products with a vector of 1 / H (BLAS): MLX's CPU layer norm is its composed fallback,
    whose row reductions run at about 2.3 ns an element, and this form takes 54-72% of its time at 128-256 tokens
    of width 384-768. It stays within 2e-6 of torch's float64 layer norm relative to the output's scale, gradients
    too (tests/test_numerics.py): the two passes (mean, then the centred values' mean square) are as stable as
    the fallback's."""
    if mx.default_device() != mx.cpu or x.dtype != mx.float32:
        return mx.fast.layer_norm(x, weight, bias, eps)
    average = mx.full((x.shape[-1], 1), 1.0 / x.shape[-1], mx.float32)
    centred = x - x @ average
    inverse_std = mx.rsqrt((centred * centred) @ average + eps)
    if weight is not None and bias is not None:
        return scale_and_shift(centred, inverse_std, weight, bias)
    y = centred * inverse_std
    return y if weight is None else y * weight


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm through `layer_norm`; the same parameters and checkpoint keys."""

    def __call__(self, x: mx.array) -> mx.array:
        return layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


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
    a row run 2.5-3x slower than down columns at 60-128 keys, and the sum is a product with ones (BLAS). The
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
# their softmax stay in the CPU's cache (1.6-1.9x faster than all (B, nh, L, L) scores at 1024-8192 tokens).
# Shorter inputs keep `attention`: their scores fit in memory, and its gradients need no recomputed softmax.
QUERY_BLOCK = 256
BLOCKWISE_FROM = 2048


def blockwise_attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, dropout: nn.Dropout | None = None
) -> mx.array:
    """`attention` of (B, nh, L, hd) q, k, v, in O(L) memory on the CPU for L > BLOCKWISE_FROM when `mask` is a
    (B|1, 1, 1, L) key mask (padding_mask's) or None: `attention_by_blocks`. Short inputs, masks over queries too,
    dropout that is on (it needs the probabilities) and GPUs (whose fused kernel never holds the scores) take
    `attention`."""
    active_dropout = dropout is not None and dropout.training and dropout._p_1 < 1
    keys_only = mask is None or mask.shape[1:3] == (1, 1)
    if mx.default_device() != mx.cpu or active_dropout or not keys_only or q.shape[-2] <= BLOCKWISE_FROM:
        return attention(q, k, v, mask, dropout)
    return attention_by_blocks(q, k, v, mask, scale=q.shape[-1] ** -0.5, block=QUERY_BLOCK)


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
def attention_by_blocks(q, k, v, mask, *, scale: float, block: int) -> mx.array:
    """written_out_attention of (B, nh, L, hd) q, k, v under a (B|1, 1, 1, L) additive key mask (or None),
    `block` queries of one head at a time: O(block L) live scores instead of B nh L^2. Its vjp recomputes each
    block's softmax rather than keep it (as flash attention does), so gradients take O(L) memory too."""
    if mask is not None and mask.shape[1:3] != (1, 1):
        raise ValueError(f"attention_by_blocks takes a (B|1, 1, 1, L) key mask, got shape {mask.shape}")
    blocks = []
    for b, h, rows in query_blocks(q.shape, block):
        qb = after(q[b : b + 1, h : h + 1, rows], blocks[-1:])
        blocks.append(
            written_out_attention(qb, k[b : b + 1, h : h + 1], v[b : b + 1, h : h + 1], key_mask(mask, b), scale)
        )
    return mx.concatenate(blocks, axis=2).reshape(q.shape)  # blocks in (b, h, query) order


@attention_by_blocks.vjp
def attention_by_blocks_vjp(primals, cotangent, output, *, scale: float, block: int):
    """With p = w / l (w = exp(s - max s) as the forward pass computed it, l = sum w), g' = g / l and d = g'.o:
    ds = w (g' v^T - d); dq = scale ds k, dk = scale ds^T q, dv = w^T g', dmask = ds summed over heads and queries.
    Each (b, h)'s dk and dv add up over its blocks."""
    q, k, v, mask = primals
    f32 = mx.float32
    dq, dk, dv, dmask, previous = [], {}, {}, {}, []
    for b, h, rows in query_blocks(q.shape, block):
        qb, kb, vb = q[b : b + 1, h : h + 1, rows], k[b : b + 1, h : h + 1], v[b : b + 1, h : h + 1]
        weights = softmax_weights(after(qb, previous), kb, key_mask(mask, b), scale)  # (1, 1, block, L)
        g = cotangent[b : b + 1, h : h + 1, rows].astype(f32) / weights.sum(axis=-1, keepdims=True)
        d = (g * output[b : b + 1, h : h + 1, rows].astype(f32)).sum(axis=-1, keepdims=True)
        ds = weights * (g @ vb.astype(f32).swapaxes(-1, -2) - d)
        dq.append((ds @ kb.astype(f32)) * scale)
        add_to(dk, (b, h), (ds.swapaxes(-1, -2) @ qb.astype(f32)) * scale)
        add_to(dv, (b, h), weights.swapaxes(-1, -2) @ g)
        add_to(dmask, b, ds.sum(axis=(1, 2), keepdims=True))  # built lazily: computed only if asked for
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


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias): nn.Linear's product."""
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def product_plus_bias(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """x @ weight.T + bias, in two ops. MLX's CPU addmm (nn.Linear's call) first copies the bias into every row of
    the output through its general strided copy, then accumulates the product onto it: the product alone and a
    contiguous add embed 2-3% faster (all-MiniLM-L6-v2, 200 docstrings, passes of both in turns: 83.0 against
    81.0 texts/s, faster in 5 of 6 pairs; in one of this machine's slow periods 61.4 against 61.7), within 2e-7 of
    it. Training keeps addmm (`linear_with_bias`): there the two ops ran slower."""
    return x @ weight.T + bias


@mx.custom_function
def linear_with_bias(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """`linear(x, weight, bias)`, its gradients laid out as the weights are (`Linear`)."""
    return linear(x, weight, bias)


@linear_with_bias.vjp
def _linear_with_bias_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
    x, weight, bias = primals
    dx, dw = _linear_cotangents(x, weight, cotangent)
    return dx, dw, cotangent.reshape(-1, cotangent.shape[-1]).sum(axis=0).astype(bias.dtype)


@mx.custom_function
def linear_without_bias(x: mx.array, weight: mx.array) -> mx.array:
    """`linear(x, weight)`, its gradients laid out as the weights are (`Linear`)."""
    return linear(x, weight)


@linear_without_bias.vjp
def _linear_without_bias_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
    return _linear_cotangents(*primals, cotangent)


def _linear_cotangents(x: mx.array, weight: mx.array, cotangent: mx.array) -> tuple[mx.array, mx.array]:
    """d/dx = g W and d/dW = g^T x over all leading axes at once: one (out, in) product in W's row-major layout.
    MLX's own is (x^T g)^T, a transposed view, which the optimizer's fused update then reads through strides
    and the gradient norm across the cache."""
    rows = cotangent.reshape(-1, cotangent.shape[-1])
    dw = rows.T @ x.reshape(-1, x.shape[-1])
    return (cotangent @ weight).astype(x.dtype), dw.astype(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear whose weight gradient comes out row-major (`linear_with_bias`): in training, the fused AdamW
    update reads it contiguously (it ran its strided kernel for every linear weight: 10.6 ms against 7.2 on a
    3072 x 768 weight), with no transposing copy. In eval mode it is nn.Linear's function: on the CPU the product
    and then the bias added (`product_plus_bias`), elsewhere nn.Linear's own call. The same parameters and keys."""

    def __call__(self, x: mx.array) -> mx.array:
        if not self.training:
            if "bias" in self and mx.default_device() == mx.cpu:
                return product_plus_bias(x, self["weight"], self["bias"])
            return super().__call__(x)
        if "bias" in self:
            return linear_with_bias(x, self["weight"], self["bias"])
        return linear_without_bias(x, self["weight"])


# Element-wise work over many independent arrays (an optimizer's per-parameter updates): MLX's CPU backend runs
# each stream's ops on one thread, so spreading the arrays over a few CPU streams puts every core to work.
MAX_CPU_STREAMS = 8


@functools.cache
def cpu_streams() -> tuple[mx.Stream, ...]:
    """One CPU stream per core (at most MAX_CPU_STREAMS), made once per process."""
    return tuple(mx.new_stream(mx.cpu) for _ in range(min(MAX_CPU_STREAMS, os.cpu_count() or 1)))


@contextmanager
def forward_lanes() -> Iterator[tuple[mx.Stream, ...]]:
    """Streams for independent forward passes that run at once, one per core on the CPU: MLX runs each stream's
    elementwise ops on one thread, and a multithreaded BLAS splits only the products (its threads wait
    between them), so one pass at a time leaves a core idle for a third or more of an encoder's time. Inside,
    the BLAS runs each product on its calling stream's thread (`_blas.one_thread_per_call`). Off the CPU, with
    one core, or with a BLAS that cannot be held to one thread: the default stream alone. The lanes are idle
    when the block ends, whether it raised or not."""
    if mx.default_device() != mx.cpu or len(cpu_streams()) < 2:
        yield (mx.default_stream(mx.default_device()),)
        return
    with _blas.one_thread_per_call() as one_thread:
        lanes = cpu_streams() if one_thread else (mx.default_stream(mx.cpu),)
        try:
            yield lanes
        finally:
            for lane in lanes:  # before the BLAS gets its threads back
                mx.synchronize(lane)


def spread_over_streams(arrays: Sequence[mx.array]) -> dict[int, mx.Stream] | None:
    """{id(array): stream} sharing `arrays` out over `cpu_streams()`, largest first onto the least loaded, so each
    stream gets about the same number of elements; None off the CPU or with one core, where the default stream
    serves (a GPU runs each kernel on all of its cores)."""
    if mx.default_device() != mx.cpu or len(cpu_streams()) < 2:
        return None
    loads = dict.fromkeys(cpu_streams(), 0)
    chosen = {}
    for x in sorted(arrays, key=lambda a: -a.size):
        stream = min(loads, key=loads.get)
        loads[stream] += x.size
        chosen[id(x)] = stream
    return chosen


def sum_of_squares(arrays: Sequence[mx.array]) -> mx.array:
    """The float32 sum of the squares of every element of `arrays` (a global gradient norm's square). On the CPU,
    float32 arrays are evaluated and read in place by numpy's BLAS dot product: one vectorised pass over each,
    on every core, where MLX would square each into a new array and reduce that on one thread."""
    if mx.default_device() != mx.cpu or any(x.dtype != mx.float32 for x in arrays):
        return sum((mx.square(x.astype(mx.float32)).sum() for x in arrays), mx.array(0.0))
    mx.eval(*arrays)
    # ravel in memory order ("K"): a view of MLX's buffer for any dense layout, transposed ones included (a linear
    # weight's gradient is the transpose of x^T g). reshape(-1) copied those in row order, reading them across
    # the cache: 18 ms for one 3072 x 768 gradient, 0.25 s of every BERT-base step.
    flat = (np.asarray(x).ravel(order="K") for x in arrays)
    return mx.array(sum(float(np.dot(a, a)) for a in flat), mx.float32)


# glibc's mallopt parameters (malloc.h); its values are C ints
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
DEFAULT_MMAP_MAX = 65536
NEVER_TRIM = 2**31 - 1
# After a block: setting any of these through mallopt turns off glibc's own adjustment of the mmap threshold for
# good (it raises it to the size of each mapped buffer freed, up to 32 MB, the trim threshold to twice that), and
# left at its 128 KB start every buffer above that would be mapped afresh and fault its pages in: 60-160 thousand
# page faults per encode of 200 texts afterwards, against 0-2000. So the block leaves the values glibc's own
# adjustment reaches in a process that frees large buffers.
LEFT_MMAP_THRESHOLD = 32 * 2**20
LEFT_TRIM_THRESHOLD = 2 * LEFT_MMAP_THRESHOLD


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None (macOS, other C libraries)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@contextmanager
def keep_freed_memory() -> Iterator[None]:
    """Inside, on Linux with glibc: large buffers come from the heap and freed memory stays with the process for
    the next one. MLX's CPU allocator caches only 32 MB of freed buffers (reused for nearly the same size), and
    glibc maps larger buffers (from 128 KB to 32 MB, depending on what was freed before) afresh and unmaps them
    when freed, so each use pays a page fault per 4 KB page, and each unmap interrupts the other threads to flush
    their address translations. A training step allocates the same large buffers (an embedding's gradient, its
    optimizer state) every time: with the faults the optimizer update on all-MiniLM-L6-v2 takes twice as long;
    SentenceEncoder's passes on several streams (lanes) ran 10-15% slower without this. The price is resident
    memory that is not handed back until the outermost block ends (then `malloc_trim` hands it back, and glibc is
    left as its own adjustment would leave it: LEFT_MMAP_THRESHOLD). Elsewhere it does nothing."""
    if _mallopt() is None:
        yield
        return
    with _keeping():
        yield


@functools.cache
def _keeping() -> _blas.Outermost:
    """The heap kept for the outermost of nested or concurrent keep_freed_memory blocks, handed back after it."""
    mallopt = _mallopt()

    def keep() -> None:
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)

    def hand_back() -> None:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        mallopt(M_MMAP_THRESHOLD, LEFT_MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, LEFT_TRIM_THRESHOLD)
        ctypes.CDLL(None).malloc_trim(0)

    return _blas.Outermost(keep, hand_back)
