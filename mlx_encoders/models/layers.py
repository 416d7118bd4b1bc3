"""The layers every model is built from: Linear, Embedding, LayerNorm and Dropout with the parameters and checkpoint
keys of MLX's own, computing through the engine's exact, fast forms; the attention entry points, rotary positions
(`rope`), grouped-query attention and the gated MLP the decoder-shaped families share. Model files import these
and never ask which device they run on. Quantizing (`nn.quantize`) turns Linear and Embedding into the engine's
quantized layers directly.
"""

import contextvars
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..engine.attention import attention, blockwise_attention
from ..engine.ops import (
    MAX_HASHED,
    drawing_from,
    drawing_state,
    gelu,
    gelu_tanh,
    layer_norm,
    linear,
    linear_in_eval,
    linear_with_bias,
    linear_without_bias,
    next_key,
    random_words,
    rope,
    rope_wavelengths,
    silu,
)
from ..engine.quantized import QuantizedEmbedding, QuantizedLinear

__all__ = [
    "Dropout", "Embedding", "GatedMLP", "LayerNorm", "Linear",
    "attention", "blockwise_attention", "drawing_from", "drawing_state", "gelu", "gelu_tanh", "grouped_attention",
    "linear", "next_key", "one_lookup", "rope", "rope_wavelengths", "silu",
]  # fmt: skip


class Dropout(nn.Dropout):
    """nn.Dropout (zero each element with probability p in training, scale the rest by 1 / (1 - p), as torch's
    dropout), its mask from `random_words`: an element is dropped when its word is below round(p * 2^32), so p is
    met to 2^-32 (MLX's float32 uniforms compare at 2^-24). Dropped NaNs and infinities stay NaN, as in torch
    (x times a zero). The same parameters (none) and arguments as nn.Dropout."""

    def __call__(self, x: mx.array) -> mx.array:
        if self._p_1 == 1 or not self.training:
            return x
        if x.size > MAX_HASHED:  # the uint32 index would wrap around and repeat its masks: MLX's own draws
            return (mx.random.bernoulli(self._p_1, x.shape, key=next_key()) * x) * (1 / self._p_1)
        threshold = mx.array(min(round((1 - self._p_1) * 2**32), 2**32 - 1), mx.uint32)
        scale = mx.where(random_words(x.shape) >= threshold, mx.array(1 / self._p_1, x.dtype), mx.array(0, x.dtype))
        return x * scale


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm through `layer_norm`; the same parameters and checkpoint keys."""

    def __call__(self, x: mx.array) -> mx.array:
        return layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


class Linear(nn.Linear):
    """nn.Linear whose weight gradient comes out row-major in training (`linear_with_bias`), so the fused AdamW update
    reads it contiguously, with no transposing copy; in eval mode nn.Linear's function (`linear_in_eval`). The same
    parameters and keys."""

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.get("bias")
        if not self.training:
            return linear_in_eval(x, self["weight"], bias)
        if bias is not None:
            return linear_with_bias(x, self["weight"], bias)
        return linear_without_bias(x, self["weight"])

    def to_quantized(self, group_size=None, bits=None, mode: str = "affine", quantize_input: bool = False):
        if quantize_input:  # activations quantized too: MLX's own layer
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class Embedding(nn.Embedding):
    """nn.Embedding, quantized into the engine's QuantizedEmbedding; inside `one_lookup`, the ids it names share one
    lookup."""

    def __call__(self, x: mx.array) -> mx.array:
        shared = _LOOKUP.get()
        rows = None if shared is None else shared.rows(self, x)
        return super().__call__(x) if rows is None else rows

    def to_quantized(self, group_size=None, bits=None, mode: str = "affine", quantize_input: bool = False):
        if quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)  # MLX's error for embeddings
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)


class _SharedLookup:
    """The rows of every array of `ids` in one table, gathered at once per table (`one_lookup`)."""

    def __init__(self, ids: Sequence[mx.array]):
        self.ids = list(ids)  # held, so that no other array takes one of their ids meanwhile
        self.position = {id(a): i for i, a in enumerate(self.ids)}
        self.found: dict[int, tuple[nn.Embedding, list[mx.array]]] = {}  # the table held beside its rows, as the ids

    def rows(self, table: nn.Embedding, x: mx.array) -> mx.array | None:
        """table(x) when x is one of the ids, else None."""
        i = self.position.get(id(x))
        if i is None:
            return None
        if id(table) not in self.found:
            flat = nn.Embedding.__call__(table, mx.concatenate([a.reshape(-1) for a in self.ids]))
            ends = list(itertools.accumulate(a.size for a in self.ids))[:-1]
            width = flat.shape[-1]
            pieces = [p.reshape(*a.shape, width) for p, a in zip(mx.split(flat, ends), self.ids, strict=True)]
            self.found[id(table)] = (table, pieces)
        return self.found[id(table)][1][i]


_LOOKUP: contextvars.ContextVar[_SharedLookup | None] = contextvars.ContextVar("one_lookup", default=None)


@contextmanager
def one_lookup(ids: Sequence[mx.array]) -> Iterator[None]:
    """Inside, an `Embedding` called with one of `ids` (that very array) gathers the rows of all of them at once and
    returns its own: passes over several batches (a training step's length groups) then take one gradient of that
    table (one scatter into a zero table as large as the table) instead of one a batch. The same values. Every table
    called with one of `ids` must accept the ids of all of them (one model's word embeddings)."""
    token = _LOOKUP.set(_SharedLookup(ids) if len(ids) > 1 else None)
    try:
        yield
    finally:
        _LOOKUP.reset(token)


def grouped_attention(
    q: mx.array, k: mx.array, v: mx.array, mask, dropout: nn.Dropout | None = None,
    attend: Callable = blockwise_attention, **kwargs,
) -> mx.array:  # fmt: skip
    """`attend` of (B, nh, L, hd) queries over (B, nkv, L, hd) keys and values, query head h reading key/value head
    h // (nh // nkv), as transformers' repeat_kv. Under a key mask (or none), without `kwargs`, a group's queries are
    stacked onto their one key/value head instead: the same scores, with no copies of k and v."""
    B, heads, L, hd = q.shape
    groups = heads // k.shape[1]
    if groups == 1:
        return attend(q, k, v, mask, dropout, **kwargs)
    if not kwargs and (mask is None or (isinstance(mask, mx.array) and mask.shape[1:3] == (1, 1))):
        out = attend(q.reshape(B, k.shape[1], groups * L, hd), k, v, mask, dropout)  # (B, nkv, groups * L, hd)
        return out.reshape(B, heads, L, hd)
    k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
    return attend(q, k, v, mask, dropout, **kwargs)


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`: the SwiGLU / GeGLU MLP of Llama-shaped models, under their keys."""

    def __init__(self, dims: int, hidden_dims: int, act: Callable, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(dims, hidden_dims, bias=bias)
        self.up_proj = Linear(dims, hidden_dims, bias=bias)
        self.down_proj = Linear(hidden_dims, dims, bias=bias)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
