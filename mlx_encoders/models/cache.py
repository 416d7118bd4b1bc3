"""The key/value cache of causal language models, mlx-lm's cache protocol: each layer's `update_and_fetch(keys,
values)` stores a pass's new keys and values and returns all the keys and values attention reads, and `offset`
counts the positions the model treats as cached (its mask and positions start there).
"""

import mlx.core as mx


class KVCache:
    """One layer's keys and values, (B, nh, capacity, hd). By default the buffers grow by whole blocks of `step`
    positions (mlx-lm's KVCache), the new keys written after the `offset` cached ones, and attention reads those
    written. `KVCache.fixed` wraps buffers that do not grow, for a compiled decoding step: see there."""

    step = 256

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0
        self.index: mx.array | None = None  # fixed buffers: where the new keys go
        self.length = 0  # fixed buffers: how many positions attention reads

    @classmethod
    def fixed(cls, keys: mx.array, values: mx.array, index: mx.array, length: int) -> "KVCache":
        """Buffers of fixed capacity, the new token's keys written at `index` (an array, so a compiled graph does not
        depend on it); attention reads the first `length` positions. The model sees them all as cached (`offset`
        is length - 1, one new token a step): the attention mask hides the positions not yet written."""
        cache = cls()
        cache.keys, cache.values, cache.index, cache.length = keys, values, index, length
        cache.offset = length - 1
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.index is not None:
            self.keys = mx.slice_update(self.keys, keys, self.index, axes=(2,))
            self.values = mx.slice_update(self.values, values, self.index, axes=(2,))
            return self.keys[..., : self.length, :], self.values[..., : self.length, :]
        start, length = self.offset, keys.shape[2]
        if self.keys is None or start + length > self.keys.shape[2]:
            B, nh, _, hd = keys.shape
            blocks = (length + self.step - 1) // self.step
            new_k, new_v = (mx.zeros((B, nh, blocks * self.step, hd), x.dtype) for x in (keys, values))
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :start, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :start, :], new_v], axis=2)
        self.offset += length
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
