"""Token embeddings -> one sentence embedding, as sentence-transformers' `Pooling` module computes it.

Matches `sentence_transformers/sentence_transformer/modules/pooling.py` (`_forward_padded`): the modes
cls, max, mean, mean_sqrt_len_tokens, weightedmean and lasttoken, concatenated in the order given.
Inputs are (B, L, H) token embeddings and a (B, L) 1/0 mask of the tokens to pool; folder.py reads the module's
config.json.
"""

import mlx.core as mx

from ..models.base import masked_mean

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
ALIASES = {"mean_sqrt_len": "mean_sqrt_len_tokens", "mean_tokens": "mean", "max_tokens": "max", "cls_token": "cls"}


def parse_modes(modes: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'mean' or ['cls', 'mean'] (or 'cls+mean') -> a checked tuple of mode names."""
    if isinstance(modes, str):
        modes = modes.split("+")
    names = tuple(ALIASES.get(m, m) for m in modes)
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"Unknown pooling mode(s) {unknown or modes}; choose from {', '.join(MODES)}")
    return names


def first_token(x: mx.array, mask: mx.array) -> mx.array:
    index = mx.argmax(mask, axis=1)  # the first 1: position 0 with right padding
    return mx.take_along_axis(x, index[:, None, None], axis=1)[:, 0]


def last_token(x: mx.array, mask: mx.array) -> mx.array:
    L = mask.shape[1]
    index = L - 1 - mx.argmax(mask[:, ::-1], axis=1)  # an all-zero row gives position L - 1, as in the reference
    return mx.take_along_axis(x * mask[..., None], index[:, None, None], axis=1)[:, 0]


def masked_max(x: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask[..., None].astype(mx.bool_), x, mx.array(-mx.inf, x.dtype)).max(axis=1)


def mean_sqrt_len(x: mx.array, mask: mx.array) -> mx.array:
    m = mask.astype(x.dtype)[..., None]
    return (x * m).sum(axis=1) / mx.sqrt(mx.maximum(m.sum(axis=1), 1e-9))


def weighted_mean(x: mx.array, mask: mx.array, positions_mask: mx.array) -> mx.array:
    """Mean weighted by position 1, 2, ... counted from the first real token of `positions_mask`."""
    start = mx.argmax(positions_mask, axis=1)[:, None]
    weights = (mx.arange(1, x.shape[1] + 1)[None] - start).astype(x.dtype) * mask.astype(x.dtype)
    weighted = (x * weights[..., None]).sum(axis=1)
    return weighted / mx.maximum(weights.sum(axis=1, keepdims=True), 1e-9)


def pool(x: mx.array, mask: mx.array, modes: tuple[str, ...], attention_mask: mx.array | None = None) -> mx.array:
    """(B, L, H) -> (B, len(modes) * H). `mask` marks the pooled tokens (the attention mask, minus the prompt
    when it is excluded); `attention_mask` (default `mask`) anchors weightedmean's positions."""
    attention_mask = mask if attention_mask is None else attention_mask
    pooled = {
        "cls": lambda: first_token(x, mask),
        "max": lambda: masked_max(x, mask),
        "mean": lambda: masked_mean(x, mask),
        "mean_sqrt_len_tokens": lambda: mean_sqrt_len(x, mask),
        "weightedmean": lambda: weighted_mean(x, mask, attention_mask),
        "lasttoken": lambda: last_token(x, mask),
    }
    return mx.concatenate([pooled[m]() for m in modes], axis=-1)
