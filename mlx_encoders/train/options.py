"""Which options each training task reads, in one table: an option given to a task that would ignore it is refused
before any work (`OptionError`, exit 2 on the command line), and one that another option replaces is warned about,
so that nothing the user asked for vanishes. `metric_for_best` is checked here too, before the data is read, and
every option's range (`config.RANGES`, the table the losses, `TrainingConfig` and mining check too)."""

import warnings
from collections.abc import Mapping

from ..models.base import PROBLEM_TYPES
from .config import OptionError, TrainingConfig, check_options_in
from .data import Examples
from .metrics import eval_metric_names
from .rerank import METRIC_NAMES as RERANK_METRICS
from .rerank import TASK as RERANK
from .rtd import DISCRIMINATOR_WEIGHT, GENERATOR_SIZE
from .rtd import METRICS as RTD_METRICS
from .rtd import TASK as RTD

CLASSIFY, TOKENS, MLM, PRETRAINING, CLM = (
    "sequence-classification", "token-classification", "masked-lm", "pretraining", "causal-lm",
)  # fmt: skip
EMBED, SPARSE, MULTIVECTOR = "sentence-embedding", "sparse-embedding", "multi-vector-embedding"
RETRIEVAL = (EMBED, SPARSE, MULTIVECTOR)  # they read the embed task's columns by name, and its options

# option -> the tasks that read it; every other task would ignore it. "pretraining" is mlm with next_sentence, which
# only mlm takes (`fine_tune.task_name` refuses it elsewhere, as it picks the task)
READ_BY = {
    "config": (MLM, PRETRAINING, CLM, RTD),  # training from scratch; the others start from a model
    "text_column": (CLASSIFY, TOKENS, MLM, PRETRAINING, CLM, RTD),
    "text_pair_column": (CLASSIFY,),
    "label_column": (CLASSIFY, TOKENS),
    "problem_type": (CLASSIFY,),
    "label2id": (CLASSIFY, TOKENS),
    "label_all_tokens": (TOKENS,),
    "whole_word_mask": (MLM, PRETRAINING, RTD),
    "generator": (RTD,),
    "generator_size": (RTD,),
    "discriminator_weight": (RTD,),
    "loss": (*RETRIEVAL, RERANK),
    "query_prompt": RETRIEVAL,
    "document_prompt": RETRIEVAL,
    "batch_sampler": RETRIEVAL,
    "columns": (*RETRIEVAL, RERANK),
}
API_ONLY = ("label2id",)  # options with no command-line flag
# option -> (another option, its value with which the first means nothing, why)
VOID_WITH = {"label2id": ("problem_type", "regression", "regression targets are numbers, not label names")}
# option -> (the option it needs, said for a message): without that one it has no effect
NEEDS = {
    "lora_alpha": ("lora_rank", "lora_rank (--lora-rank): it scales LoRA adapters"),
    "lora_targets": ("lora_rank", "lora_rank (--lora-rank): it names the linears LoRA adapts"),
    "eval_every": ("eval_data", "evaluation data (eval_data / --eval-data)"),
    "metric_for_best": ("eval_data", "evaluation data (eval_data / --eval-data)"),
}
# option -> the option that replaces it when both are given (documented, as in transformers): a warning
REPLACED_BY = {"warmup_ratio": "warmup_steps", "epochs": "max_steps"}
DEFAULTS = {name: field.default for name, field in TrainingConfig.__dataclass_fields__.items()} | {
    "generator_size": GENERATOR_SIZE, "discriminator_weight": DISCRIMINATOR_WEIGHT,  # fine_tune's, for rtd
}  # fmt: skip


def given(options: Mapping, name: str) -> bool:
    """Whether `name` was set: not None or False (a call option's default), nor TrainingConfig's default."""
    value = options.get(name)
    if value is None or value is False:
        return False
    return name not in DEFAULTS or value != DEFAULTS[name]


def words(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def flag(name: str) -> str:
    """The option's name, with its command-line spelling where it has one."""
    return name if name in API_ONLY else f"{name} (--{name.replace('_', '-')})"


def check_task_options(task: str, options: Mapping) -> None:
    """Refuse an option `task` would ignore, one whose companion option is missing, or one out of its range
    (`config.RANGES`); warn when an option is replaced by another given with it; check `metric_for_best` and
    `problem_type`. `options` holds fine_tune's arguments (eval_data included) by name."""
    if options.get("problem_type") not in (None, *PROBLEM_TYPES):
        raise OptionError(f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {options['problem_type']!r}")
    for name, tasks in READ_BY.items():
        if given(options, name) and task not in tasks:
            raise OptionError(
                f"{flag(name)} is for {words(tasks)}; {task} would ignore it, so drop it (or train the task "
                "it belongs to)"
            )
    for name, (other, value, why) in VOID_WITH.items():
        if given(options, name) and options.get(other) == value:
            raise OptionError(f"{flag(name)} means nothing with {other}={value!r} ({why}); drop it")
    check_needs(options)
    check_options_in(options)
    for name, replacement in REPLACED_BY.items():
        if given(options, name) and given(options, replacement):
            warnings.warn(
                f"{flag(name)} is ignored: {flag(replacement)} replaces it; give only one", UserWarning, stacklevel=3
            )
    check_metric_name(task, options.get("metric_for_best"), options.get("problem_type"))


def check_needs(options: Mapping) -> None:
    """Refuse an option given without the one it needs (`NEEDS`); `trainer.train` checks its config this way too."""
    for name, (needed, what) in NEEDS.items():
        if given(options, name) and not given(options, needed):
            raise OptionError(f"{name}={options[name]!r} needs {what}; without it the option would be ignored")


def check_metric_name(task: str, metric: str | None, problem_type: str | None) -> None:
    """`metric_for_best` is a metric `task` can report (before the data says exactly which: `check_metric_for_best`
    then checks the evaluation data's own)."""
    if metric is None or task in RETRIEVAL:  # their objective's metrics: `trainer.train` checks them
        return
    labels = {"B-X": 0, "O": 1}  # BIO tags: the most metrics token classification reports
    most = Examples(task, [], [], labels, [], problem_type or "single_label_classification")
    names = {RTD: list(RTD_METRICS), RERANK: RERANK_METRICS}.get(task) or eval_metric_names(most)
    if metric not in names:
        raise OptionError(
            f"metric_for_best={metric!r} is not a metric {task} reports; choose one of {', '.join(names)}"
        )
