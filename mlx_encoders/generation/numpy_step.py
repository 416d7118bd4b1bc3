"""GPT-2's decoding steps in numpy, on the CPU: the CPU seam of generation.

A decoding step multiplies every weight by one row per sequence, so reading the weights is its floor (about
14 ms for GPT-2 small on this project's 2-core machine). Through MLX, each of a step's several hundred small ops
costs 5-20 microseconds of dispatch, and each product waits for its input to be evaluated: 9-12 ms a step in all.
numpy runs the same small ops on the calling thread in about a microsecond each, and its BLAS streams each
weight once per product. So on the CPU, once MLX's forward pass has put the prompt in the key/value cache,
`generate_steps` takes every new token through `NumpyDecoder.step`: the computation of GPT2LMHeadModel with a
cache, on zero-copy views of the model's float32 weights (GPT-2 small: about 32 ms a step through MLX, 20 here).

GPUs, quantized or half-precision weights, more than GEMV_ROWS sequences and models in training mode (dropout)
keep MLX's path. tests/test_numpy_step.py compares the steps' logits with transformers' and their greedy tokens
with MLX's path.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..models import gpt2, layers
from ..models.base import ACTIVATIONS, mask_value


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), exp's argument capped where float32's exp overflows (the result is 0 there anyway)."""
    return 1 / (1 + np.exp(np.minimum(-x, 88.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """transformers' gelu_new (and MLX's gelu_approx), x (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (x + 0.044715 x^3),
    as the equal x sigmoid(2u): numpy's float32 exp is vectorised, its tanh and x**3 call libm element by element
    (2.5 ms of a 22 ms GPT-2 small step)."""
    return x * sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x)))


# The activations numpy computes here; the others (the exact, erf GELU) go through MLX's own function.
NUMPY_ACTIVATIONS = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": lambda x: x * sigmoid(1.702 * x),
    "relu": lambda x: np.maximum(x, 0),
    "silu": lambda x: x * sigmoid(x),
    "swish": lambda x: x * sigmoid(x),
    "tanh": np.tanh,
}
GEMV_ROWS = 2  # up to this many rows, one matrix-vector product per row: numpy's 2-D product packs the weight
# Exactly these classes (quantized and LoRA layers are others): GPT-2's own and the plain layers it is made of.
MODULES = (gpt2.GPT2LMHeadModel, gpt2.GPT2Model, gpt2.GPT2Block, gpt2.GPT2Attention, gpt2.GPT2MLP, layers.Linear,
           nn.Embedding, layers.LayerNorm, layers.Dropout)  # fmt: skip


def supported(model: nn.Module, batch: int) -> bool:
    """Whether `NumpyDecoder` computes `model`'s steps for `batch` sequences: up to GEMV_ROWS of them (more share
    each weight's reading better in MLX's matrix products), a GPT2LMHeadModel in eval mode on the CPU, built of its
    own blocks and plain float32 Linear, Embedding and LayerNorm modules (not quantized, not LoRA-adapted)."""
    if batch > GEMV_ROWS or mx.default_device() != mx.cpu or type(model) is not gpt2.GPT2LMHeadModel or model.training:
        return False
    return all(type(m) in MODULES for _, m in model.named_modules()) and all(
        p.dtype == mx.float32 for _, p in tree_flatten(model.parameters())
    )


def view(x: mx.array) -> np.ndarray:
    """A read-only numpy view of an evaluated MLX array's buffer (no copy)."""
    out = np.asarray(x)
    out.flags.writeable = False
    return out


class LayerNorm:
    def __init__(self, norm: nn.LayerNorm):
        self.weight, self.bias, self.eps = view(norm.weight), view(norm.bias), norm.eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        centred = x - x.mean(axis=-1, keepdims=True)
        variance = (centred * centred).mean(axis=-1, keepdims=True)
        return centred / np.sqrt(variance + self.eps) * self.weight + self.bias


def product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """(B, in) x @ weight.T for an (out, in) weight: a matrix-vector product per row for a few rows (the BLAS's
    gemv streams the weight once; its gemm would copy it into blocks first), else one matrix product."""
    if len(x) == 1:
        return (weight @ x[0])[None]
    if len(x) <= GEMV_ROWS:
        return np.stack([weight @ row for row in x])
    return x @ weight.T


class Linear:
    def __init__(self, layer: nn.Linear):
        self.weight = view(layer.weight)
        self.bias = view(layer.bias) if "bias" in layer else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = product(x, self.weight)
        if self.bias is not None:
            y += self.bias
        return y


def mlx_activation(function):
    return lambda x: np.asarray(function(mx.array(x)))


class Block:
    """One GPT2Block's step: its weights as numpy views, its keys and values in preallocated buffers."""

    def __init__(self, block: nn.Module, activation_name: str, keys: np.ndarray, values: np.ndarray):
        attn, mlp = block.attn, block.mlp
        self.ln_1, self.ln_2 = LayerNorm(block.ln_1), LayerNorm(block.ln_2)
        self.c_attn, self.c_proj = Linear(attn.c_attn), Linear(attn.c_proj)
        self.c_fc, self.mlp_proj = Linear(mlp.c_fc), Linear(mlp.c_proj)
        self.n_head = attn.n_head
        head_dim = keys.shape[-1]
        self.scale = attn.query_factor * head_dim**-0.5  # GPT2Attention's whole score scale
        self.act = NUMPY_ACTIVATIONS.get(activation_name) or mlx_activation(ACTIVATIONS[activation_name])
        self.keys, self.values = keys, values  # (B, nh, capacity, hd)

    def __call__(self, x: np.ndarray, offset: int, key_mask: np.ndarray | None) -> np.ndarray:
        """x: (B, E) hidden states of the new tokens at position `offset` of the cache; key_mask: additive
        (B, 1, offset + 1) float32 or None."""
        B, E = x.shape
        q, k, v = np.split(self.c_attn(self.ln_1(x)), 3, axis=-1)
        self.keys[:, :, offset] = k.reshape(B, self.n_head, -1)
        self.values[:, :, offset] = v.reshape(B, self.n_head, -1)
        keys, values = self.keys[:, :, : offset + 1], self.values[:, :, : offset + 1]
        scores = keys @ (q.reshape(B, self.n_head, -1, 1) * self.scale)  # (B, nh, T, 1)
        scores = scores[..., 0] if key_mask is None else scores[..., 0] + key_mask
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        h = (weights[:, :, None, :] @ values).reshape(B, E)  # (B, nh, 1, hd) -> (B, E)
        x = x + self.c_proj(h)
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class NumpyDecoder:
    """Decoding steps of a GPT2LMHeadModel (`supported(model)`) whose MLX cache holds the prompt: its keys and
    values are copied into numpy buffers with room for `capacity` positions in all."""

    def __init__(self, model: nn.Module, cache: list, capacity: int):
        transformer = model.transformer
        mx.eval(model.parameters(), [(c.keys, c.values) for c in cache])
        self.offset = cache[0].offset
        blocks = []
        for block, layer in zip(transformer.h, cache, strict=True):
            stored = [np.array(t[..., : self.offset, :]) for t in (layer.keys, layer.values)]
            B, nh, _, hd = stored[0].shape
            buffers = [np.zeros((B, nh, capacity, hd), np.float32) for _ in stored]
            for buffer, t in zip(buffers, stored, strict=True):
                buffer[:, :, : self.offset] = t
            blocks.append(Block(block, transformer.args.activation_function, *buffers))
        self.blocks = blocks
        self.wte, self.wpe = view(transformer.wte.weight), view(transformer.wpe.weight)
        self.ln_f = LayerNorm(transformer.ln_f)
        self.head = view(model.lm_head.weight) if "lm_head" in model else self.wte
        self.mask_value = np.float32(mask_value(mx.float32))

    def step(self, ids: np.ndarray, attention_mask: np.ndarray | None, positions: np.ndarray | None) -> np.ndarray:
        """(B, V) float32 logits of the next token after `ids` (B,), at `positions` (B,) (default: the cache's
        length); `attention_mask` (B, cached + 1), 0 on padding, as GPT2Model takes it."""
        position = np.full(len(ids), self.offset) if positions is None else positions
        x = self.wte[ids] + self.wpe[position]
        key_mask = None
        if attention_mask is not None:
            key_mask = np.where(attention_mask[:, None, :] == 0, self.mask_value, np.float32(0))
        for block in self.blocks:
            x = block(x, self.offset, key_mask)
        self.offset += 1
        return product(self.ln_f(x), self.head)
