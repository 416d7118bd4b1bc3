"""The layers every model is built from: Linear, Embedding, LayerNorm and Dropout with the parameters and checkpoint
keys of MLX's own, computing through the engine's exact, fast forms, and the attention entry points. Model files
import these and never ask which device they run on. Quantizing (`nn.quantize`) turns Linear and Embedding into
the engine's quantized layers directly.
"""

import mlx.core as mx
import mlx.nn as nn

from ..engine.attention import attention, blockwise_attention
from ..engine.ops import (
    MAX_HASHED,
    drawing_from,
    gelu,
    layer_norm,
    linear,
    linear_in_eval,
    linear_with_bias,
    linear_without_bias,
    next_key,
    random_words,
)
from ..engine.quantized import QuantizedEmbedding, QuantizedLinear

__all__ = [
    "Dropout", "Embedding", "LayerNorm", "Linear",
    "attention", "blockwise_attention", "drawing_from", "gelu", "linear", "next_key",
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
    """nn.Embedding, quantized into the engine's QuantizedEmbedding."""

    def to_quantized(self, group_size=None, bits=None, mode: str = "affine", quantize_input: bool = False):
        if quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)  # MLX's error for embeddings
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)
