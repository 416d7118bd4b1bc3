"""Quantized linears and embeddings that run at float speed on MLX's CPU backend, weights kept quantized.

MLX's CPU `quantized_matmul` runs at about 1 GFLOP/s, while a float matmul goes through BLAS at 100-200: on the
CPU the weight is dequantized to float32 just before its matmul (a transient copy, freed after it) and
multiplied in float32. Elsewhere (Metal, CUDA) MLX's own fused kernels run. Both forms are differentiable
(QLoRA trains through them); the codes are unpacked with shifts and masks rather than `mx.dequantize`, which
is several times slower on the CPU (tests/test_quantized.py checks both against MLX's kernels).
models/layers.py's Linear and Embedding quantize into these (`nn.quantize`), so loading and quantizing make them.
"""

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn

from .runtime import on_cpu

QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
# Affine codes are packed little-endian into uint32 words: `bits` divides 8 (2, 4, 8) so that each byte holds
# whole codes, or 3 bytes hold a whole number of them (3, 6 bits).
UNIT_BYTES = {2: 1, 4: 1, 8: 1, 3: 3, 6: 3}
# Up to this many rows MLX's CPU quantized kernel beats dequantize-then-BLAS (a decoding step's few rows).
KERNEL_ROWS = 2
# The least tokens the CPU passes that share one dequantizing of every weight hold together, so that dequantizing
# stays a small share of their time: 8-bit codes only widen; narrower ones unpack too, so they need more tokens.
GROUP_TOKENS = {("affine", 8): 256}
DEFAULT_GROUP_TOKENS = 1024


def least_group_tokens(model: nn.Module) -> int:
    """The least tokens the CPU forward passes of `model` that share one dequantizing should hold together:
    GROUP_TOKENS by the mode and bits of its quantized linears (the largest over them), 0 for a model without any."""
    kinds = {(m.mode, m.bits) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    return max((GROUP_TOKENS.get(kind, DEFAULT_GROUP_TOKENS) for kind in kinds), default=0)


def freeze_quantized(model: nn.Module) -> None:
    """Freeze the packed weights, scales and biases of `model`'s quantized layers (they cannot train), as MLX's
    quantized layers start; a float parameter's state is left as it is."""
    for module in model.modules():
        if isinstance(module, QUANTIZED):
            module.freeze(keys=["weight", "scales", "biases"], strict=False)


def unpack(w: mx.array, bits: int) -> mx.array:
    """The float32 codes of a packed (out, in * bits / 32) uint32 weight, as (out, in)."""
    unit = UNIT_BYTES[bits]
    data = w.view(mx.uint8)
    if bits == 8:
        return data.astype(mx.float32)
    if unit == 3:
        data = data.reshape(*w.shape[:-1], -1, 3).astype(mx.uint32)
        data = data[..., 0] | (data[..., 1] << 8) | (data[..., 2] << 16)
    mask, top = (1 << bits) - 1, 8 * unit - bits  # the lowest code needs no shift, the top one no mask
    fields = [data & mask, *((data >> shift) & mask for shift in range(bits, top, bits)), data >> top]
    codes = mx.stack(fields, axis=-1)  # (out, units, codes per unit)
    return codes.reshape(*w.shape[:-1], -1).astype(mx.float32)


def dequantize(
    w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str
) -> mx.array:
    """The float32 weight of a quantized one: scale * code + bias per group, in float32 (scales widened first)."""
    if mode != "affine":  # mxfp4, mxfp8, nvfp4: integer scales, no biases
        return mx.dequantize(w, scales, biases, group_size, bits, mode=mode, dtype=mx.float32)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    if bits not in UNIT_BYTES:
        return mx.dequantize(w, scales, biases, group_size, bits, dtype=mx.float32)
    codes = unpack(w, bits)
    groups = codes.reshape(*codes.shape[:-1], -1, group_size)
    weight = groups * scales[..., None] + biases[..., None]
    return weight.reshape(codes.shape)


@functools.cache
def dequantized_matmul(group_size: int, bits: int, mode: str) -> Callable:
    """f(x, w, scales, biases) = x W^T through a float32 BLAS matmul, W dequantized on the fly. Its vjp
    dequantizes W again instead of keeping the float copy from the forward pass: a backward pass (QLoRA) would
    otherwise hold every layer's float weights at once, as much memory as the float model. The packed codes get
    a zero gradient; scales and biases their exact one (unused, hence never computed, while they are frozen)."""

    def weight(w: mx.array, scales: mx.array, biases: mx.array | None) -> mx.array:
        return dequantize(w, scales, None if biases is None or biases.size == 0 else biases, group_size, bits, mode)

    @mx.custom_function
    def matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return (x.astype(mx.float32) @ weight(w, scales, biases).T).astype(x.dtype)

    @matmul.vjp
    def matmul_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        x, w, scales, biases = primals
        dy = cotangent.astype(mx.float32)
        dx = (dy @ weight(w, scales, biases)).astype(x.dtype)
        if mode != "affine":
            return dx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)
        # dW = dy^T x per (out, group, in-group) entry; W = scale * code + bias, so dscale = sum dW code, dbias = sum dW
        dw = dy.reshape(-1, dy.shape[-1]).T @ x.astype(mx.float32).reshape(-1, x.shape[-1])
        dw = dw.reshape(*scales.shape, group_size)
        codes = unpack(w, bits).reshape(dw.shape)
        return dx, mx.zeros_like(w), (dw * codes).sum(-1).astype(scales.dtype), dw.sum(-1).astype(biases.dtype)

    return matmul


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str
) -> mx.array:
    """x W^T for a quantized W, as `mx.quantized_matmul(..., transpose=True)`; on the CPU through a float32 BLAS
    matmul (`dequantized_matmul`), cast back to x's dtype, except for at most KERNEL_ROWS rows (decoding one
    token per sequence), where dequantizing the whole weight costs more than MLX's own kernel reading it, given
    float32 scales (its CPU kernel is several times slower with float16 ones)."""
    if on_cpu() and mode == "affine" and x.size <= KERNEL_ROWS * x.shape[-1]:
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        y = mx.quantized_matmul(x.astype(mx.float32), w, scales, biases, True, group_size, bits, mode=mode)
        return y.astype(x.dtype)
    shared = getattr(_SHARING, "weights", None)
    if on_cpu() and shared is not None:
        return shared.matmul(x, (w, scales, biases, group_size, bits, mode))
    if on_cpu():
        no_biases = mx.zeros((0,), scales.dtype)  # a custom function's inputs are arrays; mx/nv-fp modes have none
        return dequantized_matmul(group_size, bits, mode)(x, w, scales, no_biases if biases is None else biases)
    return mx.quantized_matmul(x, w, scales, biases, True, group_size, bits, mode=mode)


class SharedFloatWeights:
    """The float copies of a model's quantized weights that a group of forward passes shares (`shared_dequantized`):
    the group's first pass built asks for each copy, made on `streams` in turn (the current stream without any),
    and the others use it."""

    def __init__(self, streams: tuple[mx.Stream, ...] = ()):
        self.weights: dict[int, mx.array] = {}  # this group's copies, by id(packed weight)
        self.streams = streams

    def next_group(self) -> None:
        """Start a new group: forget this group's copies once its passes are built. The passes hold them until they
        have run; kept here, every layer's copy would stay in memory at once."""
        self.weights = {}

    def matmul(self, x: mx.array, arguments: tuple) -> mx.array:
        """x W^T, W = dequantize(*arguments)."""
        key = id(arguments[0])
        if key not in self.weights:
            turn = self.streams[len(self.weights) % len(self.streams)] if self.streams else None
            with mx.stream(turn) if turn is not None else nullcontext():
                self.weights[key] = dequantize(*arguments)
        return (x.astype(mx.float32) @ self.weights[key].T).astype(x.dtype)


_SHARING = threading.local()  # .weights: the SharedFloatWeights of this thread's shared_dequantized block


@contextmanager
def shared_dequantized(streams: tuple[mx.Stream, ...] = ()) -> Iterator[SharedFloatWeights]:
    """Inside, the forward passes built on the CPU share one float copy of each quantized weight per group of
    passes (`next_group` ends one, once its passes are built): passes that run at once on several streams
    (SentenceEncoder's lanes, `streams`) dequantize every weight once between them, not once each, the copies
    made on each stream in turn. Inference only: these products have no custom vjp, so a gradient through them
    would hold every float copy. The copies are lazy, and freed once the passes that use them have run."""
    outer = getattr(_SHARING, "weights", None)
    _SHARING.weights = SharedFloatWeights(streams)
    try:
        yield _SHARING.weights
    finally:
        _SHARING.weights = outer


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear through `quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode
        )
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose gathered rows are dequantized in float32 on the CPU (MLX's CPU dequantize is
    several times slower from float16 scales), and whose `as_linear` goes through `quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        if not on_cpu():
            return super().__call__(x)
        biases = self.get("biases")
        return dequantize(
            self["weight"][x], self["scales"][x], None if biases is None else biases[x], self.group_size, self.bits,
            self.mode,
        )  # fmt: skip

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.mode
        )
