"""What a training run is given and what it returns, checked before any work: `TrainingConfig` (the loop's options,
after transformers' `TrainingArguments`), `OptionError` (an option out of range, from errors.py: exit 2 on the
command line) and `Trained` (what `fine_tune` returns). Both the loop (`trainer`) and the option table (`options`)
build on it.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import OptionError
from ..tokenizer import Tokenizer
from .optim import SCHEDULES

COMPUTE_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def at_least(name: str, value, low: int, optional: bool = False) -> None:
    """`value` is an integer >= `low` (or None when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        allowed = f"an integer >= {low}" + (" or None" if optional else "")
        raise OptionError(f"{name} must be {allowed}, got {value!r}")


def in_range(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """`value` is a finite number in [low, high] ((low, high] when `low_open`); NaN and infinities are refused."""
    number = isinstance(value, int | float | np.number) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise OptionError(f"{name} must be a finite number in {bounds}, got {value!r}")


@dataclass
class TrainingConfig:
    """What `train` does; the names and defaults follow `TrainingArguments` (`lr` is its `learning_rate`,
    `grad_accum` its `gradient_accumulation_steps`). `max_steps`, when set, replaces `epochs` and is also the
    length of the learning-rate schedule; `eval_every`/`save_every` count optimizer steps (None: never, besides
    each epoch end for evaluation and the end of training for both). An epoch is every batch its sampler builds:
    `no_duplicates` may build more than ceil(examples / batch_size), and the run's steps (and the schedule) count
    them all, so every example is trained on in every epoch and an epoch ends where its batches run out.
    `metric_for_best` names an eval metric (e.g. "eval_loss", "eval_accuracy"); lower is better for losses and
    perplexity, higher for the rest. `warmup_steps` > 0 replaces `warmup_ratio`; `max_grad_norm` None or <= 0 turns
    clipping off. Every option's range is checked here (`check_options`).
    `group_by_length` batches examples of similar lengths together (transformers' `LengthGroupedSampler`), so
    less compute goes to padding. `dtype="bfloat16"` runs forward and backward passes in bfloat16 over float32
    weights and optimizer state (transformers' `bf16=True`); evaluation runs in float32. `gradient_checkpointing`
    recomputes each layer's activations in the backward pass instead of keeping them: less memory (with QLoRA,
    close to the quantized weights), about a third more compute, the same gradients. `overwrite` clears another
    run's files from `output_dir` first (transformers' `overwrite_output_dir`); without it they are refused.
    `final_checkpoint=False` writes no checkpoint at the last step (the saved model holds those weights, and a
    checkpoint adds the optimizer state, twice the weights' size), only the `save_every` ones before it."""

    output_dir: str | Path
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 8
    lr: float = 5e-5
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    schedule: str = "linear"
    seed: int = 42
    eval_every: int | None = None
    save_every: int | None = None
    keep_last: int | None = 2
    final_checkpoint: bool = True
    metric_for_best: str | None = None
    group_by_length: bool = False
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    overwrite: bool = False

    def __post_init__(self):
        check_options(self)
        self.output_dir = Path(self.output_dir)


def check_options(config: TrainingConfig) -> None:
    """Every option in its range, before any work. `max_grad_norm` <= 0 turns clipping off (as transformers' 0 and
    None do): a negative norm would otherwise scale the gradients by a negative factor and step uphill."""
    for name in ("epochs", "batch_size", "grad_accum"):
        at_least(name, getattr(config, name), 1)
    for name in ("max_steps", "eval_every", "save_every", "keep_last"):
        at_least(name, getattr(config, name), 1, optional=True)
    at_least("warmup_steps", config.warmup_steps, 0)
    at_least("seed", config.seed, 0)  # numpy's generators refuse negative seeds
    in_range("lr", config.lr, 0.0, low_open=True)
    in_range("weight_decay", config.weight_decay, 0.0)
    in_range("warmup_ratio", config.warmup_ratio, 0.0, 1.0)
    norm = config.max_grad_norm
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int | float) or not math.isfinite(norm)):
        raise OptionError(f"max_grad_norm must be a finite number (<= 0 turns clipping off) or None, got {norm!r}")
    if config.schedule not in SCHEDULES:
        raise OptionError(f"schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    if config.dtype not in COMPUTE_DTYPES:
        raise OptionError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {config.dtype!r}")


@dataclass
class Trained:
    """What `fine_tune` returns: the trained model and its tokenizer (ready to use), the last evaluation's metrics
    (or the last step's record), and `path`, the saved model folder (`output_dir/model`)."""

    model: nn.Module
    tokenizer: Tokenizer
    metrics: dict
    path: Path
