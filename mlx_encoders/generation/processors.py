"""Logits processors and token selection, matching transformers' `generation/logits_process.py` class for class.

Each processor is a callable `(input_ids (B, T), scores (B, V) float32) -> scores`, as transformers' are, and
`processors(config, ...)` lists them in the order transformers' `_get_logits_processor` applies them: repetition
penalty, minimum lengths, then (sampling only) temperature, top-k, top-p.
"""

import mlx.core as mx
import numpy as np

from .config import GenerationConfig

NEG_INF = float("-inf")


class RepetitionPenalty:
    """Divide the positive and multiply the negative scores of tokens already in `input_ids` by `penalty`;
    positions before `prompt_start[b]` (row b's left padding) do not count (`RepetitionPenaltyLogitsProcessor`)."""

    def __init__(self, penalty: float, prompt_start: mx.array | None = None):
        self.penalty = float(penalty)
        self.prompt_start = prompt_start

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        B, V = scores.shape
        ids = mx.minimum(input_ids, V)  # ids past the logits' vocabulary land in column V, dropped below
        if self.prompt_start is not None:
            ids = mx.where(mx.arange(ids.shape[1])[None] < self.prompt_start[:, None], V, ids)
        seen = mx.put_along_axis(mx.zeros((B, V + 1), mx.bool_), ids, mx.array(True), axis=-1)[:, :V]
        penalized = mx.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return mx.where(seen, penalized, scores)


def eos_mask(eos_token_id: list[int], vocab_size: int) -> mx.array:
    return mx.array(np.isin(np.arange(vocab_size), eos_token_id))


class MinLength:
    """No eos while the sequence, padded prompt included, is shorter than `min_length` (`MinLengthLogitsProcessor`)."""

    def __init__(self, min_length: int, eos_token_id: list[int]):
        self.min_length, self.eos_token_id = min_length, eos_token_id

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        if input_ids.shape[-1] >= self.min_length:
            return scores
        return mx.where(eos_mask(self.eos_token_id, scores.shape[-1]), NEG_INF, scores)


class MinNewTokens:
    """No eos before `min_new_tokens` tokens follow the `prompt_length` prompt (`MinNewTokensLengthLogitsProcessor`)."""

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_token_id: list[int]):
        self.prompt_length, self.min_new_tokens, self.eos_token_id = prompt_length, min_new_tokens, eos_token_id

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        if input_ids.shape[-1] - self.prompt_length >= self.min_new_tokens:
            return scores
        return mx.where(eos_mask(self.eos_token_id, scores.shape[-1]), NEG_INF, scores)


class Temperature:
    """scores / temperature; a row whose scores that would overflow (a temperature near float32's smallest) is
    divided after its maximum is taken away, so its best tokens keep 0 and the rest fall to -inf: the greedy
    choice that temperatures approaching 0 tend to, where the overflow would make every positive score +inf."""

    def __init__(self, temperature: float):
        self.temperature = float(temperature)

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        scaled = scores / self.temperature
        overflows = mx.any(mx.isinf(scaled) & ~mx.isinf(scores), axis=-1, keepdims=True)
        below = scores - scores.max(axis=-1, keepdims=True)
        shifted = mx.where(below == 0, 0.0, below / self.temperature)  # 0 / 0 where float32 holds the temperature as 0
        return mx.where(overflows, shifted, scaled)


class TopK:
    """Keep the `top_k` highest scores (and any tied with the k-th); the rest become -inf (`TopKLogitsWarper`)."""

    def __init__(self, top_k: int):
        self.top_k = top_k

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        k = min(self.top_k, scores.shape[-1])
        kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)
        return mx.where(scores < kth, NEG_INF, scores)


class TopP:
    """Keep the smallest set of highest-probability tokens whose mass reaches `top_p`, at least one token
    (`TopPLogitsWarper`: drop, in ascending order, the tokens whose cumulative mass is <= 1 - top_p)."""

    def __init__(self, top_p: float):
        self.top_p = float(top_p)

    def __call__(self, input_ids: mx.array, scores: mx.array) -> mx.array:
        order = mx.argsort(scores, axis=-1)  # ascending
        ascending = mx.take_along_axis(scores, order, axis=-1)
        cumulative = mx.cumsum(mx.softmax(ascending, axis=-1), axis=-1)
        drop = cumulative <= 1 - self.top_p
        drop[:, -1] = False  # the most likely token always stays
        drop = mx.put_along_axis(mx.zeros_like(drop), order, drop, axis=-1)
        return mx.where(drop, NEG_INF, scores)


def processors(config: GenerationConfig, prompt_length: int, prompt_start: mx.array | None, eos: list[int]) -> list:
    """The processors `config` asks for, in transformers' order (see the module docstring)."""
    out = []
    if config.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(config.repetition_penalty, prompt_start))
    if config.min_length > 0 and eos:
        out.append(MinLength(config.min_length, eos))
    if config.min_new_tokens > 0 and eos:
        out.append(MinNewTokens(prompt_length, config.min_new_tokens, eos))
    if config.do_sample:
        if config.temperature != 1.0:
            out.append(Temperature(config.temperature))
        if config.top_k != 0:
            out.append(TopK(config.top_k))
        if config.top_p < 1.0:
            out.append(TopP(config.top_p))
    return out


def select(scores: mx.array, do_sample: bool, key: mx.array | None = None) -> mx.array:
    """The next token of each row: a draw from softmax(scores) when sampling, else the argmax (greedy)."""
    if do_sample:
        return mx.random.categorical(scores, axis=-1, key=key)
    return mx.argmax(scores, axis=-1)
