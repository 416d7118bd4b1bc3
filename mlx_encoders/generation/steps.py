"""Decoding steps through the model's own forward pass, compiled: `CompiledSteps`.

A step's graph is the same every token but for the cache's length, so the keys and values live in buffers of a
fixed number of positions (`KVCache.fixed`), written in place at a position held in an array: `mx.compile` then
traces the forward pass once and replays it each step, with its element-wise ops fused, instead of rebuilding
several hundred ops in Python. Attention reads the buffers up to the next multiple of BLOCK positions, one
traced function per such length. Any causal LM whose `make_cache` layers hold (B, heads, T, head_dim) `keys` and
`values` and take `update_and_fetch` (mlx-lm's cache protocol), and whose forward takes `attention_mask`,
`position_ids`, `cache` and `logits_to_keep`, decodes so; models in training mode (dropout draws) do not.
"""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.cache import KVCache
from ..models.inputs import unchecked_inputs

BLOCK = 256  # attention reads the buffers in lengths of this many positions (mlx-lm's cache grows so)


def applies(model: nn.Module) -> bool:
    """Whether `CompiledSteps` decodes for `model`: not in training mode, where dropout draws random masks."""
    return not model.training


class CompiledSteps:
    """Decoding steps of `model` whose cache (`make_cache`'s, after the prompt's forward pass) holds the prompt:
    its keys and values move into buffers with room for `capacity` positions in all (the cache is emptied)."""

    def __init__(self, model: nn.Module, cache: list, capacity: int):
        self.model, self.index = model, cache[0].offset
        self.keys, self.values = [], []
        for layer in cache:
            for buffers, stored in ((self.keys, layer.keys), (self.values, layer.values)):
                B, heads, _, head_dim = stored.shape
                room = mx.zeros((B, heads, capacity - self.index, head_dim), stored.dtype)
                buffers.append(mx.concatenate([stored[..., : self.index, :], room], axis=2))
            layer.keys = layer.values = None  # not held twice while decoding
        self.capacity = capacity
        self.written = np.zeros((B, capacity), np.int32)  # 1 where a key is written and is not padding
        self.functions = {}  # attention length -> the step compiled for it (traced anew for each generation)

    def forward(self, length, ids, mask, positions, index, keys, values):
        cache = [KVCache.fixed(k, v, index, length) for k, v in zip(keys, values, strict=True)]
        with unchecked_inputs():  # traced arrays cannot be read on the host; the loop's inputs are in range
            out = self.model(ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
        return out.logits[:, -1], [c.keys for c in cache], [c.values for c in cache]

    def step(self, ids: mx.array, attention_mask: np.ndarray | None, positions: np.ndarray | None) -> mx.array:
        """(B, V) logits of the next token after `ids` (B,), at `positions` (B,) (default: the cache's length);
        `attention_mask` (B, cached + 1), 0 on padding, as the model takes it."""
        B = len(ids)
        if attention_mask is None:
            self.written[:, : self.index + 1] = 1
        else:
            self.written[:, : self.index + 1] = attention_mask
        positions = np.full((B, 1), self.index) if positions is None else positions.reshape(B, 1)
        length = min(-(-(self.index + 1) // BLOCK) * BLOCK, self.capacity)
        if length not in self.functions:
            self.functions[length] = mx.compile(partial(self.forward, length))
        logits, self.keys, self.values = self.functions[length](
            ids.reshape(B, 1).astype(mx.int32), mx.array(self.written[:, :length]), mx.array(positions, mx.int32),
            mx.array(self.index, mx.int32), self.keys, self.values,
        )  # fmt: skip
        self.index += 1
        return logits
