"""Every training option, declared once (`OPTIONS`: the loop's are `TrainingConfig`'s fields, the others `CALL`):
`fine_tune`'s keywords and their defaults, the command's flags and help (`add_flags`), which tasks read each option
(`READ_BY`, checked before any work: `OptionError`, exit 2 on the command line) and the option table of
docs/training.md (`markdown_table`, compared with the page by a test) are all read from it. An option another
replaces is warned about, so that nothing the user asked for vanishes; `metric_for_best` is checked here too,
before the data is read, and every option's range (`config.RANGES`, the table the losses and mining check too)."""

import argparse
import inspect
import json
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..models.base import PROBLEM_TYPES
from .config import OptionError, TrainingConfig, check_options_in, check_switch
from .data import Examples
from .embedding import SAMPLERS
from .losses.contrastive import LOSSES
from .losses.rerank import LOSSES as RERANK_LOSSES
from .metrics import eval_metric_names
from .rerank import METRIC_NAMES as RERANK_METRICS
from .rtd import DISCRIMINATOR_WEIGHT, GENERATOR_SIZE
from .rtd import METRICS as RTD_METRICS
from .tasks import (
    CLASSIFY,
    CLM,
    EMBED,
    MLM,
    PRETRAINING,
    RERANK,
    RETRIEVAL,
    RTD,
    SPARSE,
    TASK_NAMES,
    TOKENS,
)  # fmt: skip

SCRATCH = (MLM, PRETRAINING, CLM, RTD)  # tasks trained from a config of sizes; the others start from a model
TEXT = (CLASSIFY, TOKENS, MLM, PRETRAINING, CLM, RTD)  # tasks of one text column
# "pretraining" is mlm with next_sentence: an option mlm reads, pretraining reads too
Path_ = str | Path
Data = str | Path | Iterable[Mapping]


@dataclass(frozen=True)
class Option:
    """One option: `fine_tune`'s keyword `name` (unless `api` is False: a flag that builds the loss) and the flag
    `--name-with-dashes` (unless `flag` is False), read by `tasks` (None: every task; `flag_tasks` where the flag
    is read by fewer). `kind` parses the flag (bool: a switch); `hint` is the keyword's type."""

    name: str
    help: str
    hint: object = str | None
    default: object = None
    tasks: tuple[str, ...] | None = None
    kind: type = str
    nargs: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    group: str = "data"
    short: str | None = None
    api: bool = True
    flag: bool = True
    flag_tasks: tuple[str, ...] | None = None
    switch_off: bool = False  # a True default the flag `--no-NAME` turns off

    @property
    def dashed(self) -> str:
        return f"--{'no-' if self.switch_off else ''}{self.name.replace('_', '-')}"


# The options of `fine_tune` besides the loop's, and the flags that build a loss. A new option is one line here (or
# one field of `TrainingConfig`) and what reads it.
CALL = (
    Option("model", "checkpoint folder or hub id to start from", Path_ | None, group="model", short="-m"),
    Option("config", "for mlm/clm/rtd from scratch: a JSON file of sizes (config.json keys) or a preset "
           "(bert-base, ...)", Path_ | Mapping | None, tasks=SCRATCH, group="model"),
    Option("tokenizer", "folder holding tokenizer.json (default: the model's)", Path_ | None, group="model"),
    Option("lora_rank", "train rank-r LoRA adapters over the frozen model", int | None, kind=int, group="model"),
    Option("lora_alpha", "LoRA scale numerator (default 2 x rank)", float | None, kind=float, group="model"),
    Option("lora_targets", "linears to adapt (default: the attention projections): names (`query`), ends of paths "
           "(`attention.self.query`, as PEFT) or regular expressions", list[str] | None, nargs="+", group="model"),
    Option("eval_data", "evaluation data, same format", Data | None),
    Option("text_column", 'text column (default "text"; "tokens" for tokens)', tasks=TEXT),
    Option("text_pair_column", "second text column, for classify on text pairs", tasks=(CLASSIFY,)),
    Option("label_column", 'label column (default "label"; "ner_tags" for tokens)', tasks=(CLASSIFY, TOKENS)),
    Option("columns", "embed, rerank, sparse, multivector: the columns to read, in order, each COLUMN or NAME=COLUMN "
           "(read as NAME), e.g. anchor=question positive=answer (default: anchor/positive/negative... by name, else "
           "by position)", Mapping[str, str] | Sequence[str] | None, tasks=(*RETRIEVAL, RERANK), nargs="+",
           metavar="NAME=COLUMN"),
    Option("problem_type", "classify: default from the first label (a list: multi-label; a fraction: regression)",
           tasks=(CLASSIFY,), choices=PROBLEM_TYPES),
    Option("label2id", "classify, tokens: the label names' ids", Mapping[str, int] | None, tasks=(CLASSIFY, TOKENS),
           flag=False),
    Option("max_length", "tokens per example (default: the model's limit)", int | None, kind=int),
    Option("label_all_tokens", "tokens: label every sub-token of a word", bool, False, (TOKENS,), bool),
    Option("whole_word_mask", "mlm, rtd: mask whole words", bool, False, (MLM, PRETRAINING, RTD), bool),
    Option("next_sentence", "mlm: BERT pretraining with next-sentence pairs", bool, False, (MLM,), bool),
    Option("generator", "masked-LM checkpoint to start the generator from (default: a new one)", Path_ | None,
           tasks=(RTD,), group="rtd"),
    Option("generator_size", "a new generator's share of the width", float, GENERATOR_SIZE, (RTD,), float, group="rtd"),
    Option("discriminator_weight", "the discriminator loss's weight", float, DISCRIMINATOR_WEIGHT, (RTD,), float,
           group="rtd"),
    Option("share_embeddings", "whether the generator reads the discriminator's embeddings (ELECTRA's tying; off, "
           "--no-share-embeddings: its own, the paper's ablation)", bool, True, (RTD,), bool, group="rtd",
           switch_off=True),
    Option("loss", "embed: default mnrl (anchor/positive rows), cosent (scored pairs); rerank: bce, listnet (default "
           "for rows of several documents), lambda or mnrl; sparse, multivector: a loss object (API only)", object,
           tasks=(*RETRIEVAL, RERANK), flag_tasks=(EMBED, RERANK), group="embed",
           choices=tuple(dict.fromkeys([*LOSSES, *RERANK_LOSSES]))),
    Option("mini_batch_size", "embed, cached-mnrl: rows per GradCache pass (default 32)", int | None, tasks=(EMBED,),
           kind=int, group="embed", api=False),
    Option("matryoshka_dims", "embed: train the loss at these widths too", list[int] | None, tasks=(EMBED,), kind=int,
           nargs="+", group="embed", api=False),
    Option("matryoshka_weights", "embed: one weight per dim (default 1)", list[float] | None, tasks=(EMBED,),
           kind=float, nargs="+", group="embed", api=False),
    Option("query_prompt", "embed: text put before each anchor / sentence1 (default: the folder's query prompt)",
           tasks=RETRIEVAL, group="embed"),
    Option("document_prompt", "embed: text put before each positive and negative / sentence2 (default: the "
           "folder's document prompt)", tasks=RETRIEVAL, group="embed"),
    Option("task_adapter", "embed: train this task adapter of the model (jina-embeddings-v3's retrieval_query, "
           "retrieval_passage, separation, classification, text_matching): its LoRA A and B alone, the rest frozen; "
           "every text goes through it", tasks=(EMBED,), group="embed"),
    Option("batch_sampler", "embed: default no_duplicates for mnrl losses", tasks=RETRIEVAL, group="embed",
           choices=tuple(SAMPLERS)),
    Option("document_regularizer_weight", "sparse: FLOPS weight of documents (3e-5)", float | None, tasks=(SPARSE,),
           kind=float, group="sparse", api=False),
    Option("query_regularizer_weight", "sparse: FLOPS weight of queries (5e-5; 0: off)", float | None,
           tasks=(SPARSE,), kind=float, group="sparse", api=False),
    Option("resume", "a checkpoint-STEP folder of this run to continue", Path_ | None, group="training"),
)  # fmt: skip


def loop_option(field) -> Option:
    """A `TrainingConfig` field as an option: its help and flag from the field's metadata, its type and default."""
    kinds = (bool, int, float, str)
    hint = field.type
    kind = next(k for k in kinds if k is hint or k in typing.get_args(hint))
    meta = field.metadata
    return Option(field.name, meta["help"], hint, field.default, meta.get("tasks"), kind=kind,
                  choices=meta.get("choices"), group="training", switch_off=field.default is True)  # fmt: skip


LOOP = tuple(f.name for f in fields(TrainingConfig) if "help" in f.metadata)
OPTIONS = {o.name: o for o in (*CALL, *(loop_option(f) for f in fields(TrainingConfig) if f.name in LOOP))}
# The call's options a resumed run may change: where the weights and data come from (the checkpoint holds them)
RESUMABLE_CHANGES = ("model", "config", "tokenizer", "generator", "eval_data", "resume")
# option -> the tasks that read it; every other task would ignore it. next_sentence picks mlm's pretraining head,
# so `fine_tune.task_name` refuses it elsewhere as it picks the task


def read_by() -> dict[str, tuple[str, ...]]:
    return {o.name: o.tasks for o in OPTIONS.values() if o.api and o.tasks is not None and o.name != "next_sentence"}


READ_BY = read_by()
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
DEFAULTS = {o.name: o.default for o in OPTIONS.values() if o.default is not None}


def signature(function) -> inspect.Signature:
    """`function`'s signature with every option of the table as a keyword (for `help(fine_tune)`)."""
    head = [p for p in inspect.signature(function).parameters.values() if p.kind != p.VAR_KEYWORD]
    keywords = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.hint)
                for o in OPTIONS.values() if o.api]  # fmt: skip
    return inspect.Signature([*head, *keywords], return_annotation=inspect.signature(function).return_annotation)


def as_json(values: dict) -> dict:
    """`values` as JSON writes and reads them back (tuples as lists, paths as strings), an object (a loss) as its
    class and settings and a function by name, so that the same options give the same record in every process."""
    return json.loads(json.dumps(values, default=described))


def described(value) -> object:
    kind = type(value)
    if isinstance(value, Path):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):  # a function or class
        return f"{value.__module__}.{value.__qualname__}"
    if hasattr(value, "__dict__"):
        return {"class": f"{kind.__module__}.{kind.__qualname__}", **vars(value)}
    return repr(value) if kind.__repr__ is not object.__repr__ else f"{kind.__module__}.{kind.__qualname__}"


def read_options(function: str, output_dir: str | Path, options: Mapping) -> SimpleNamespace:
    """`options` (keywords of `function`) with every other option at its default, as attributes, and `training`,
    the loop's `TrainingConfig`: an unknown name is a TypeError, as Python gives for an unknown keyword."""
    known = [o.name for o in OPTIONS.values() if o.api]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{function}() got unknown options {', '.join(unknown)}; the options are: "
                        f"{', '.join(sorted(known))}")  # fmt: skip
    options = {name: value.item() if isinstance(value, np.generic) else value for name, value in options.items()}
    for name, value in options.items():  # the loop's switches are TrainingConfig's to check
        if OPTIONS[name].kind is bool and name not in LOOP and value is not None:
            check_switch(name, value)
    values = {name: options.get(name, OPTIONS[name].default) for name in known}
    task = {o.name: values[o.name] for o in CALL if o.api and o.name not in RESUMABLE_CHANGES}
    training = TrainingConfig(output_dir, **{name: values[name] for name in LOOP}, task_settings=as_json(task))
    return SimpleNamespace(**values, training=training)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every option's flag, in groups, with its help, type and default."""
    groups = {}
    for o in OPTIONS.values():
        if not o.flag:
            continue
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(GROUPS[o.group])
        names = (o.dashed, o.short) if o.short else (o.dashed,)
        if o.kind is bool:
            action = "store_false" if o.switch_off else "store_true"
            groups[o.group].add_argument(*names, dest=o.name, action=action, help=o.help)
            continue
        groups[o.group].add_argument(*names, dest=o.name, type=o.kind, nargs=o.nargs, choices=o.choices,
                                     metavar=o.metavar, default=o.default, help=o.help)  # fmt: skip


GROUPS = {
    "model": "model",
    "data": "data",
    "rtd": "rtd (ELECTRA's replaced-token detection; --model/--config: the discriminator)",
    "embed": "embed",
    "sparse": "sparse (SPLADE) and multivector (ColBERT): the embed data, prompts and sampler",
    "training": "training",
}


def reads_flag(option: Option, task: str) -> bool:
    """Whether `task` reads `option`'s flag: the ones it does not are left out of its help."""
    tasks = option.flag_tasks or option.tasks
    return tasks is None or task in tasks


def markdown_table() -> str:
    """docs/training.md's option table: each option's keyword and flag, the tasks reading it (by the command's
    short names), its default and help."""
    short_names = {task: short for short, task in TASK_NAMES.items()}
    rows = ["| keyword | flag | tasks | default | what it does |", "|---|---|---|---|---|"]
    for o in OPTIONS.values():
        tasks = "all" if o.tasks is None else ", ".join(dict.fromkeys(short_names.get(t, "mlm") for t in o.tasks))
        keyword = f"`{o.name}`" if o.api else "(flag only)"
        flag = f"`{o.dashed}`" if o.flag else "(API only)"
        default = "" if o.default is None else f"`{o.default!r}`"
        rows.append(f"| {keyword} | {flag} | {tasks} | {default} | {o.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def given(options: Mapping, name: str) -> bool:
    """Whether `name` was set: not None or False (a call option's default), nor its declared default."""
    value = options.get(name)
    if value is None or value is False:
        return False
    return name not in DEFAULTS or value != DEFAULTS[name]


def words(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def flag(name: str) -> str:
    """The option's name, with its command-line spelling where it has one."""
    option = OPTIONS.get(name)
    return name if option is not None and not option.flag else f"{name} (--{name.replace('_', '-')})"


def check_task_options(task: str, options: Mapping) -> None:
    """Refuse an option `task` would ignore, one whose companion option is missing, or one out of its range
    (`config.RANGES`); warn when an option is replaced by another given with it; check `metric_for_best` and
    `problem_type`. `options` holds fine_tune's arguments (eval_data included) by name."""
    if options.get("problem_type") not in (None, *PROBLEM_TYPES):
        raise OptionError(f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {options['problem_type']!r}")
    for name, tasks in read_by().items():
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
