"""What a training run is given and what it returns, checked before any work: `RANGES` (what every numeric and list
option accepts, for the loop, `fine_tune`, the losses and mining), `TrainingConfig` (the loop's options, after
transformers' `TrainingArguments`), `OptionError` (an option out of range, from errors.py: exit 2 on the command
line) and `Trained` (what `fine_tune` returns). Both the loop (`trainer`) and the option table (`options`) build
on it.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import OptionError
from ..tokenizer import Tokenizer
from .optim import SCHEDULES
from .tasks import CLASSIFY, CLM, MLM, TOKENS

COMPUTE_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def is_number(value) -> bool:
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


@dataclass(frozen=True)
class Number:
    """What a numeric option accepts: a finite number in [low, high] ((low, high] when `low_open`), an integer when
    `integer`; None too when `optional`. `note` says what a value means where the range alone would not."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    integer: bool = False
    optional: bool = False
    note: str = ""

    def accepts(self, value) -> bool:
        if self.integer and (isinstance(value, bool) or not isinstance(value, int | np.integer)):
            return False
        if not is_number(value) or not math.isfinite(value):
            return False
        return self.low <= value <= self.high and not (self.low_open and value == self.low)

    @property
    def wanted(self) -> str:
        if self.integer:
            wanted = f"an integer >= {self.low:g}"
        elif math.isfinite(self.low) or math.isfinite(self.high):
            low, high = (
                f"{'(' if self.low_open else '['}{self.low:g}",
                f"{self.high:g}{']' if math.isfinite(self.high) else ')'}",
            )
            wanted = f"a finite number in {low}, {high}"
        else:
            wanted = "a finite number"
        return wanted + (f" ({self.note})" if self.note else "") + (" or None" if self.optional else "")

    def problem(self, value) -> str | None:
        """What is wrong with `value`, after the option's name ("must be ..."), or None."""
        if value is None and self.optional:
            return None
        return None if self.accepts(value) else f"must be {self.wanted}, got {value!r}"


@dataclass(frozen=True)
class Numbers:
    """What a list option accepts: one `each` or more, each value once when `distinct`, not all 0 when `some`."""

    each: Number
    distinct: bool = False
    some: bool = False

    def problem(self, value) -> str | None:
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple) or not value:
            return f"must be a list of one or more numbers, each {self.each.wanted}, got {value!r}"
        if not all(self.each.accepts(v) for v in value):
            return f"must each be {self.each.wanted}, got {list(value)}"
        if self.distinct and len(set(value)) != len(value):
            return f"must differ from each other, got {list(value)}"
        if self.some and not any(value):
            return f"must not all be 0, got {list(value)}"
        return None


@dataclass(frozen=True)
class Names:
    """A list option of names: one or more non-empty strings, each once."""

    optional: bool = False

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
            return f"must be a list of one or more names, got {value!r}"
        if not all(isinstance(v, str) and v.strip() for v in value):
            return f"must be non-empty names, got {list(value)}"
        if len(set(value)) != len(value):
            return f"must each be given once, got {list(value)}"
        return None


@dataclass(frozen=True)
class LabelIds:
    """label2id (None, or class names each mapped to its own id, the ids 0..n-1: the head's outputs)."""

    def problem(self, value) -> str | None:
        if value is None:
            return None
        ids = list(value.values()) if isinstance(value, Mapping) else None
        if not ids or not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
            return f"must map each label name to an integer id, got {value!r}"
        if sorted(ids) != list(range(len(ids))):
            return f"must give the labels the ids 0..{len(ids) - 1}, each once, got {dict(value)!r}"
        return None


POSITIVE, AT_LEAST_0 = Number(0.0, low_open=True), Number(0.0)
COUNT, SOME = Number(1, integer=True), Number(1, integer=True, optional=True)
# Every numeric and list option of training, of the embedding losses and of mining, with what it accepts: checked
# here (`check_option`) by `TrainingConfig`, `fine_tune` (`options.check_task_options`), the losses and `mine`,
# before any work, for the library and the command alike.
RANGES = {
    "epochs": COUNT, "max_steps": SOME, "cores": SOME, "batch_size": COUNT, "grad_accum": COUNT, "eval_every": SOME,
    "save_every": SOME, "keep_last": SOME, "warmup_steps": Number(0, integer=True),
    "seed": Number(0, integer=True),  # numpy's generators refuse negative seeds
    "lr": POSITIVE, "weight_decay": AT_LEAST_0, "warmup_ratio": Number(0.0, 1.0),
    # a negative norm would scale the gradients by a negative factor and step uphill: <= 0 turns clipping off
    "max_grad_norm": Number(optional=True, note="<= 0 turns clipping off"),
    "max_length": SOME, "lora_rank": SOME, "lora_alpha": Number(0.0, low_open=True, optional=True),
    "lora_targets": Names(optional=True), "label2id": LabelIds(),
    "generator_size": Number(0.0, 1.0, low_open=True), "discriminator_weight": AT_LEAST_0,
    "scale": POSITIVE, "mini_batch_size": COUNT,
    "matryoshka_dims": Numbers(COUNT, distinct=True), "matryoshka_weights": Numbers(AT_LEAST_0, some=True),
    "document_regularizer_weight": AT_LEAST_0, "query_regularizer_weight": Number(0.0, optional=True),
    "document_regularizer_threshold": Number(0, integer=True, optional=True),
    "query_regularizer_threshold": Number(0, integer=True, optional=True),
    "num_negatives": COUNT, "range_min": Number(0, integer=True), "range_max": SOME,
    "absolute_margin": Number(optional=True), "relative_margin": Number(optional=True),
    "max_score": Number(optional=True), "min_score": Number(optional=True),
}  # fmt: skip


def check_option(name: str, value, owner: str = "") -> None:
    """Refuse `value` outside what option `name` accepts (`RANGES`) with an `OptionError` naming it (and `owner`,
    the loss it belongs to)."""
    problem = RANGES[name].problem(value)
    if problem is not None:
        raise OptionError(f"{owner + ' ' if owner else ''}{name} {problem}")


def check_switch(name: str, value) -> None:
    """A True/False option: anything else (a string "false" is truthy) would do what it does not say."""
    if not isinstance(value, bool | np.bool_):
        raise OptionError(f"{name} must be True or False, got {value!r}")


def check_options_in(options: Mapping) -> None:
    """`check_option` for each option of `options` that `RANGES` has."""
    for name, value in options.items():
        if name in RANGES:
            check_option(name, value)


def option(default, help: str, choices: tuple | None = None, tasks: tuple[str, ...] | None = None):
    """A `TrainingConfig` field declared as an option: `options.OPTIONS` reads its help, choices and the tasks that
    read it (None: every task) from here for the command's flag and the docs table (a True default is a
    `--no-NAME` switch)."""
    return field(default=default, metadata={"help": help, "choices": choices, "tasks": tasks})


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
    epochs: int = option(3, "default 3")
    max_steps: int | None = option(None, "optimizer steps, instead of epochs")
    batch_size: int = option(8, "examples per micro-batch, over all ranks (default 8)")
    lr: float = option(5e-5, "peak learning rate (default 5e-5)")
    warmup_ratio: float = option(0.0, "share of steps warming up (default 0)")
    warmup_steps: int = option(0, "warmup steps; > 0 replaces --warmup-ratio")
    weight_decay: float = option(0.0, "AdamW decay (default 0)")
    grad_accum: int = option(1, "micro-batches per optimizer step (default 1)")
    max_grad_norm: float | None = option(1.0, "clip the global norm; <= 0: off (default 1)")
    schedule: str = option("linear", "after warmup", choices=tuple(SCHEDULES))
    seed: int = option(42, "default 42")
    eval_every: int | None = option(None, "evaluate every N steps (always at each epoch end)")
    save_every: int | None = option(None, "checkpoint every N steps (and at the end)")
    keep_last: int | None = option(2, "checkpoints kept, besides the best (default 2)")
    final_checkpoint: bool = option(
        True, "no checkpoint at the end (model/ holds the weights; a checkpoint adds 2x their size of optimizer state)"
    )
    metric_for_best: str | None = option(None, "eval metric choosing the best checkpoint, e.g. eval_loss")
    group_by_length: bool = option(False, "batch examples of similar lengths together")
    dtype: str = option("float32", "compute dtype", choices=tuple(COMPUTE_DTYPES))
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass: less memory")
    cores: int | None = option(
        None, "CPU cores a step's rows are split over (default: every usable one; each holds its own gradients; "
        "BERT pretraining's next-sentence steps stay whole)",
        tasks=(CLASSIFY, TOKENS, MLM, CLM),
    )  # fmt: skip
    overwrite: bool = option(False, "clear another run's files from OUTPUT first")
    # `fine_tune`'s options that shape the batches and the loss, as JSON writes them: a resume must share them
    task_settings: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        check_options(self)
        self.output_dir = Path(self.output_dir)


def check_options(config: TrainingConfig) -> None:
    """Every option in its range (`RANGES`), before any work."""
    check_options_in({name: getattr(config, name) for name in TrainingConfig.__dataclass_fields__})
    for f in fields(TrainingConfig):
        if f.type in (bool, "bool"):
            check_switch(f.name, getattr(config, f.name))
    if config.schedule not in SCHEDULES:
        raise OptionError(f"schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    if config.dtype not in COMPUTE_DTYPES:
        raise OptionError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {config.dtype!r}")
    if Path(config.output_dir).exists() and not Path(config.output_dir).is_dir():
        raise OptionError(f"output_dir {config.output_dir} is a file, not a folder; name a folder (new or a run's)")


@dataclass
class Trained:
    """What `fine_tune` returns: the trained model and its tokenizer (ready to use), the last evaluation's metrics
    (or the last step's record), and `path`, the saved model folder (`output_dir/model`)."""

    model: nn.Module
    tokenizer: Tokenizer
    metrics: dict
    path: Path
