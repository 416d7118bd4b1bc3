"""GPTQ's calibration: the texts, and the input Hessians of every Linear measured on them.

The Hessian is that of GPTQ's layer-wise objective (Frantar et al. 2022: the layer's inputs X^T X), with
padding left out and every text weighted alike, as sentence embeddings average each text's tokens. The
default texts are standard-library docstrings (`mlx_encoders.corpus`), disjoint from those the tests and
benchmarks evaluate on.
"""

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from tqdm import tqdm

from ..tokenizer import Tokenizer

# The built-in GPTQ calibration set: standard-library docstrings from this index on (disjoint from the first
# thousands, which the benchmarks and tests evaluate on), each cut to CALIBRATION_TOKENS tokens. 128 texts give
# the fidelity of 256 in half the time (benchmarks/quantize.py): the input Hessians cost as many FLOPs as the
# forward passes that feed them.
CALIBRATION_START, CALIBRATION_TEXTS, CALIBRATION_TOKENS, CALIBRATION_CHARS = 4000, 128, 256, 4096
# Padded tokens per calibration batch: on the CPU a batch of 16 texts of 256 tokens runs at half the speed per
# token of 4 such texts, its attention scores and wide activations falling out of cache.
BATCH_TOKENS = 1024


class InputRecorder(nn.Module):
    """Wraps a Linear and accumulates X^T W X of its inputs (the GPTQ Hessian, up to a factor).

    `weights["sqrt"]` holds the square roots of the current batch's (B, L) token weights: 0 on padding,
    1/length on a text's tokens, so every calibration text counts the same whatever its length (sentence
    embeddings average a text's tokens; without this, long texts would outweigh short ones). Inputs of
    shape (B, D), such as a pooler's, weigh each text once; rows that are not the batch's tokens (DeBERTa's
    relative-position table through the query and key projections) weigh as much as the batch's texts together.
    """

    def __init__(self, linear: nn.Linear, hessians: dict, path: str, weights: dict):
        super().__init__()
        self.linear = linear
        self._hessians, self._path, self._weights = hessians, path, weights

    def __call__(self, x: mx.array) -> mx.array:
        last = self._weights.get("last")  # (input, its X^T X): query, key and value read the same input
        if last is None or last[0] is not x:
            flat = x.astype(mx.float32)
            sqrt = self._weights["sqrt"]
            if flat.ndim == 3 and flat.shape[:2] == sqrt.shape:
                flat = flat * sqrt[..., None]
            elif flat.ndim == 3:
                flat = flat * math.sqrt(sqrt.shape[0] / (flat.shape[0] * flat.shape[1]))
            flat = flat.reshape(-1, x.shape[-1])
            last = self._weights["last"] = (x, flat.T @ flat)
        self._hessians[self._path] = self._hessians.get(self._path, 0) + last[1]
        return self.linear(x)


def token_batches(lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices of texts, shortest first, in batches of at most `batch_size` texts and `batch_tokens` tokens
    once padded (a longer text alone when it has more)."""
    batches = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if not batches or len(batches[-1]) == batch_size or (len(batches[-1]) + 1) * lengths[i] > batch_tokens:
            batches.append([])
        batches[-1].append(i)
    return batches


def input_hessians(
    model: nn.Module,
    tokenizer: Tokenizer,
    texts: list[str],
    batch_size: int = 16,
    max_length: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> dict[str, np.ndarray]:
    """Input Hessians of every Linear on calibration texts (sorted by length so batches pad little)."""
    hessians, weights = {}, {}
    limits = [n for n in (max_length, tokenizer.model_max_length, getattr(model.args, "max_tokens", None)) if n]
    max_length = min(limits) if limits else None  # never past the position table
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    model.update_modules(tree_unflatten([(p, InputRecorder(m, hessians, p, weights)) for p, m in linears]))
    try:
        encodings = tokenizer.encode_batch(texts, truncation=True, max_length=max_length)
        batches = token_batches([len(e.ids) for e in encodings], batch_size, batch_tokens)
        for rows in tqdm(batches, desc="calibrating", unit="batch", leave=False):
            batch = tokenizer.pad([encodings[i] for i in rows])
            mask = batch["attention_mask"].astype(mx.float32)
            weights["sqrt"] = mx.sqrt(mask / mx.maximum(mask.sum(axis=1, keepdims=True), 1))  # once per batch
            model(
                batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids")
            )
            mx.eval(list(hessians.values()))  # once per batch: MLX runs the batch's forward and products in one go
    finally:
        weights.clear()
        model.update_modules(tree_unflatten(linears))
    return {path: np.array(h) for path, h in hessians.items()}


@functools.cache
def builtin_calibration() -> tuple[str, ...]:
    """The default GPTQ calibration texts: CALIBRATION_TEXTS standard-library docstrings (see the constants)."""
    from ..corpus import stdlib_docstrings

    texts = stdlib_docstrings(CALIBRATION_START + CALIBRATION_TEXTS, max_chars=CALIBRATION_CHARS)
    return tuple(texts[CALIBRATION_START:] or texts[-CALIBRATION_TEXTS:])


def calibration_texts(
    calibration: list[str] | bool | None, spec: dict | None, tokenizer: Tokenizer | None
) -> list[str]:
    """The texts to calibrate GPTQ on, or [] for rounding to nearest.

    `None` means the built-in set for affine quantization of a checkpoint with a tokenizer; `False` rounds.
    """
    if calibration is False or calibration is None and (spec is None or spec["mode"] != "affine"):
        return []
    if calibration is None:
        return list(builtin_calibration()) if tokenizer is not None else []  # no tokenizer: round to nearest
    return list(calibration)
