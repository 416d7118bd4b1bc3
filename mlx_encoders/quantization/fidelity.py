"""How close a converted model stays to its source: its main output on built-in probe texts, compared per text
(cosine over the real tokens, max abs difference), and a causal LM's perplexity."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..tokenizer import Tokenizer

PROBE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "MLX is an array framework for machine learning on Apple silicon.",
    "Paris is the capital of France.",
    "A short one.",
    "Quantization stores weights in fewer bits, trading a little accuracy for a much smaller model.",
    "def add(a, b): return a + b",
    "How many parameters does this encoder have?",
    "Les modèles multilingues comprennent aussi le français, 12345 et les émojis 🙂.",
]


def probe_batch(model: nn.Module, tokenizer: Tokenizer | None) -> dict[str, mx.array]:
    """The built-in probe texts through the checkpoint's tokenizer (seeded ids when it has none)."""
    if tokenizer is not None:
        return tokenizer(PROBE_TEXTS, padding=True, truncation=True)
    ids = np.random.default_rng(0).integers(0, model.args.vocab_size, (len(PROBE_TEXTS), 16))
    return {"input_ids": mx.array(ids, dtype=mx.int32), "attention_mask": mx.ones(ids.shape, dtype=mx.int32)}


def main_output(model: nn.Module, batch: dict[str, mx.array]) -> tuple[str, mx.array]:
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids"))
    name = "logits" if out.logits is not None else "last_hidden_state"
    value = getattr(out, name).astype(mx.float32)
    mx.eval(value)
    return name, value


def fidelity(reference: mx.array, result: mx.array, attention_mask: mx.array) -> dict[str, float]:
    """Per-text cosine (over its real tokens' outputs) and max abs difference, result vs reference."""
    if reference.ndim == 3:  # token outputs: padding positions are not part of the text
        mask = attention_mask.astype(mx.float32)[..., None]
        reference, result = reference * mask, result * mask
    a, b = reference.reshape(reference.shape[0], -1), result.reshape(result.shape[0], -1)
    cosine = (a * b).sum(-1) / mx.maximum(mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1), 1e-12)
    return {
        "cosine_mean": cosine.mean().item(),
        "cosine_min": cosine.min().item(),
        "max_abs_diff": mx.abs(a - b).max().item(),
    }


def perplexity(logits: mx.array, batch: dict[str, mx.array]) -> float:
    """exp of the mean next-token cross-entropy over the real tokens of the batch (a causal LM's fidelity)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].astype(mx.float32)
    losses = nn.losses.cross_entropy(logits[:, :-1], ids[:, 1:], reduction="none")
    keep = mask[:, 1:] * mask[:, :-1]
    return math.exp(((losses * keep).sum() / keep.sum()).item())


def describe_perplexity(report: dict) -> str:
    before, after = report["perplexity"]["source"], report["perplexity"]["result"]
    return f"{before:.4f} -> {after:.4f} ({100 * (after / before - 1):+.2f}%)"
