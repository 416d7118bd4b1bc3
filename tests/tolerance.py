"""How far two float32 results of the same function may differ when only the order of their sums changes: another
batch shape or slicing, another BLAS build or thread count, another library (torch, sentence-transformers)."""

import math
from pathlib import Path

import numpy as np

EPS = float(np.finfo(np.float32).eps)
# Each float32 addition rounds by up to eps/2 of the running sum, a uniform error of deviation eps / sqrt(12): over n
# additions, two orders differ by a random walk of deviation eps * sqrt(n / 6) of the magnitude. Six deviations
# (eps * sqrt(6 n)) bound the largest of the many values a test compares.
DEVIATIONS = 6


def float32_tolerance(terms: int, scale: float) -> float:
    """The absolute bound for values of magnitude `scale` reached through sums of `terms` float32 terms in all."""
    return DEVIATIONS * EPS * math.sqrt(terms / 6) * scale


def assert_float32_close(actual, desired, terms: int, err_msg: str = "") -> None:
    """`actual` equals `desired` up to float32 rounding of sums of `terms` terms taken in another order: within
    `float32_tolerance` of the largest |desired|."""
    desired = np.asarray(desired, np.float64)
    bound = float32_tolerance(terms, float(np.nanmax(np.abs(desired), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=0, atol=bound, err_msg=err_msg)


def encoder_terms(folder: Path, texts: list) -> int:
    """The terms summed along one path through the encoder saved in `folder` (its config and tokenizer) over the
    longest of `texts` (strings or pairs): per layer, sums over the hidden size, intermediate size and tokens."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = max(len(tokenizer(*([t] if isinstance(t, str) else t))["input_ids"]) for t in texts)
    config = AutoConfig.from_pretrained(folder)
    inner = config.hidden_dim if config.model_type == "distilbert" else config.intermediate_size
    return config.num_hidden_layers * (config.hidden_size + inner + tokens)
