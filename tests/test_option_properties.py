"""A property-based campaign (hypothesis, derandomized) over the options of training, generation and conversion:
`fine_tune` with drawn options and data rows (labels non-finite, huge or of the wrong kind, empty and one-token
documents, typed special tokens), for embed and rerank too (with every option of `options.READ_BY` they ignore),
`python -m mlx_encoders train` with drawn flags as typed, the text-generation pipeline with drawn sampling options,
and `convert` with drawn bits, group sizes, modes, recipes and calibration.
Every draw either runs and gives finite weights and valid outputs, or is refused before any work (nothing written)
with a ValueError naming the option or the data's line (exit 2 on the command line); never another exception,
never a NaN result. Each test records its case counts, printed at the end of the run."""

import itertools
import json
import math
import re
import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import mlx_encoders
import mlx_encoders.__main__
from mlx_encoders.quantization import OptionError as QuantizationOptionError
from mlx_encoders.train import fine_tune
from mlx_encoders.train.data import DataError
from mlx_encoders.train.fine_tune import TASK_NAMES
from mlx_encoders.train.options import READ_BY
from mlx_encoders.train.trainer import OptionError

NAN, INF = math.nan, math.inf


def campaign(cases: int) -> settings:
    return settings(
        max_examples=cases, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )


def finite(x) -> bool:
    return bool(np.isfinite(np.asarray(x, dtype=np.float64)).all())


def finite_weights(model) -> bool:
    return all(finite(v.astype(mx.float32)) for _, v in tree_flatten(model.parameters()))


def strict_json(text: str):
    """json.loads refusing NaN and Infinity, which are not JSON."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON output"))


def summary(record_property, name: str, counts: Counter) -> None:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    record_property("summary", f"{name}: {sum(counts.values())} cases ({parts})")


def one_of(*values):
    return st.sampled_from(values)


# ----- training -----

TEXTS = one_of("a fine film", "dull and long, too loud by half", "it was ok", "the cat sat on the mat. " * 5)
ODD_TEXTS = one_of("", " ", "a", "\x00", "it was [MASK] ok", "[CLS] [SEP]")  # empty, one token, typed specials
LABELS = {  # a data file's labels are of one kind
    "names": one_of("pos", "neg", "neutral"),
    "ids": one_of(0, 1, 2),
    "fractions": st.floats(-10, 10, allow_nan=False),
    "lists": st.lists(one_of("pos", "neg"), max_size=2),
}
ODD_LABELS = one_of(10**6, -1, NAN, INF, -INF, 1e30, None, True, "", 2.5, [0, 1], "pos")
TAGS = one_of("O", "B-PER", "I-PER")
ODD_TAGS = one_of(0, 10**6, NAN, None, "")
VALID = {  # each in its range
    "lr": one_of(1e-3, 1e-2, 0.1),
    "warmup_ratio": one_of(0.0, 0.5, 1.0),
    "warmup_steps": one_of(0, 1, 5),
    "max_grad_norm": one_of(None, 1.0, 0.0, -1.0, 1e-3),  # <= 0: no clipping
    "keep_last": one_of(None, 1, 2),
    "save_every": one_of(None, 1),
    "batch_size": one_of(1, 2, 3),
    "grad_accum": one_of(1, 2),
    "epochs": one_of(1, 2),
    "max_steps": one_of(None, 1, 3),
    "weight_decay": one_of(0.0, 0.01),
    "schedule": one_of("linear", "cosine", "constant"),
    "dtype": one_of("float32", "bfloat16"),
    "seed": one_of(0, 7),
    "group_by_length": st.booleans(),
    "max_length": one_of(None, 8, 16),
    "lora_rank": one_of(None, 2),
    "cores": one_of(None, 1, 2, 3),
}
EVALUATION = {"eval_every": one_of(None, 1, 2), "metric_for_best": one_of(None, "eval_loss", "eval_accuracy")}
PER_TASK = {  # the options each task reads
    "classify": {"text_pair_column": one_of(None, "pair"), "problem_type": one_of(None, "single_label_classification",
                 "multi_label_classification", "regression"), "metric_for_best": one_of(None, "eval_f1")},
    "tokens": {"label_all_tokens": st.booleans(), "metric_for_best": one_of(None, "eval_f1", "eval_recall")},
    "mlm": {"whole_word_mask": st.booleans(), "next_sentence": st.booleans()},
    "clm": {"metric_for_best": one_of(None, "eval_perplexity")},
}  # fmt: skip
INVALID = {  # out of range, non-finite or unknown for every task: always refused
    "lr": one_of(0.0, -1e-3, NAN, INF),
    "warmup_ratio": one_of(-0.1, 1.5, NAN),
    "warmup_steps": one_of(-1),
    "max_grad_norm": one_of(NAN, INF),
    "keep_last": one_of(0, -1),
    "eval_every": one_of(0, -2),
    "save_every": one_of(0),
    "batch_size": one_of(0, -1),
    "grad_accum": one_of(0),
    "epochs": one_of(0),
    "max_steps": one_of(0),
    "weight_decay": one_of(-0.1, NAN),
    "schedule": one_of("step"),
    "dtype": one_of("float16"),
    "seed": one_of(-1),
    "max_length": one_of(1, 0, -1),
    "lora_rank": one_of(0, -1),
    "cores": one_of(0, -1),
    "lora_alpha": one_of(0.0, NAN),
    "metric_for_best": one_of("eval_bogus"),
    "problem_type": one_of("bogus"),
}
IGNORED = {  # what a task does not read (PER_TASK), or an option without its companion: refused too
    "whole_word_mask": (True, ("mlm",)),
    "label_all_tokens": (True, ("tokens",)),
    "next_sentence": (True, ("mlm",)),
    "text_pair_column": ("pair", ("classify",)),
    "problem_type": ("regression", ("classify",)),
    "label2id": ({"pos": 0, "neg": 1}, ("classify", "tokens")),
    "lora_alpha": (4.0, ()),  # without lora_rank
    "lora_targets": (["query"], ()),
}


@st.composite
def training_draw(draw, task: str, evaluate: bool) -> tuple[dict, list[dict], str | None]:
    """(options, rows, bad): options in range and read by the task, with at most one out of range or one the task
    ignores (`bad`: the one, or None); rows of one label kind, with at most one odd text and one odd label."""
    pool = {**VALID, **(EVALUATION if evaluate else {}), **PER_TASK[task]}
    options = draw(st.fixed_dictionaries({}, optional=pool))
    bad, kind = None, draw(one_of(None, "invalid", "ignored"))
    if kind == "invalid":
        bad = draw(st.sampled_from(sorted(INVALID)))
        options[bad] = draw(INVALID[bad])
    elif kind == "ignored":
        options.pop("lora_rank", None)
        bad = draw(st.sampled_from([name for name, (_, tasks) in IGNORED.items() if task not in tasks]))
        options[bad] = IGNORED[bad][0]
    rows, n = [], draw(st.integers(1, 5))
    labels = LABELS[draw(st.sampled_from(sorted(LABELS)))]
    for _ in range(n):
        if task == "classify":
            rows.append({"text": draw(TEXTS), "pair": draw(TEXTS), "label": draw(labels)})
        elif task == "tokens":
            words = draw(TEXTS).split()
            rows.append({"tokens": words, "ner_tags": draw(st.lists(TAGS, min_size=len(words), max_size=len(words)))})
        else:
            rows.append({"text": draw(TEXTS)})
    row = draw(st.integers(0, n - 1))
    if draw(st.integers(0, 3)) == 0:
        rows[row]["text" if task != "tokens" else "tokens"] = draw(ODD_TEXTS) if task != "tokens" else []
    if draw(st.integers(0, 3)) == 0 and task in ("classify", "tokens"):
        if task == "classify":
            rows[row]["label"] = draw(ODD_LABELS)
        else:
            rows[row]["ner_tags"] = [draw(ODD_TAGS) for _ in rows[row]["tokens"]] or [draw(ODD_TAGS)]
    return options, rows, bad


def write_text(path, rows: list[dict]):
    """Language-model rows as a .txt file: one text a line, an empty text a blank line (a document break)."""
    path.write_text("".join(row["text"].replace("\n", " ") + "\n" for row in rows))
    return path


def names_option_or_line(error: Exception, options: dict, data) -> bool:
    message = str(error)
    if isinstance(error, DataError):
        return bool(re.search(r"item \d+|:\d+:", message)) or str(data) in message
    return any(re.search(rf"\b{name}\b", message) for name in options)


def check_trained(trained, out) -> None:
    assert finite_weights(trained.model), "NaN or infinite weights after training"
    assert all(finite(v) for v in trained.metrics.values() if isinstance(v, float)), trained.metrics
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = strict_json(line)
        assert all(finite(v) for v in record.values() if isinstance(v, float)), record
    saved = mlx_encoders.load_model(trained.path)
    assert finite_weights(saved)


@pytest.fixture(scope="module")
def sources(checkpoint):
    # BERT's pretraining checkpoint has both the masked-LM and the next-sentence head: mlm trains with and without
    return {"bert": checkpoint("bert", "pretraining"), "gpt2": checkpoint("gpt2", "causal-lm")}


def test_training_options_and_rows_run_or_are_refused_before_any_work(sources, tmp_path, record_property):
    counts, serial = Counter(), itertools.count()

    @campaign(50)
    @given(data=st.data(), task=one_of("classify", "tokens", "mlm", "clm"), evaluate=st.booleans())
    def run(data, task, evaluate):
        options, rows, bad = data.draw(training_draw(task, evaluate))
        options.setdefault("max_steps", 2)  # a few steps each (each new batch shape compiles the step again)
        options.setdefault("max_length", 16)
        out = tmp_path / f"run{next(serial)}"
        source = sources["gpt2" if task == "clm" else "bert"]
        train_data = write_text(out.with_suffix(".txt"), rows) if task in ("mlm", "clm") else rows
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trained = fine_tune(
                    task, train_data, out, model=source, eval_data=train_data if evaluate else None, **options
                )
        except (OptionError, DataError) as e:
            assert not out.exists(), f"refused after writing to {out}: {e}"
            assert bad is None or isinstance(e, OptionError), f"{bad}={options[bad]!r} not refused first: {e}"
            assert names_option_or_line(e, options, train_data), f"names no option or line: {e}"
            counts[f"refused ({type(e).__name__})"] += 1
            return
        assert bad is None, f"{bad}={options[bad]!r} was accepted for {task}"
        check_trained(trained, out)
        counts["trained"] += 1

    run()
    summary(record_property, "fine_tune options and rows", counts)
    assert counts["trained"] and len(counts) == 3  # each outcome was drawn


RETRIEVAL_OPTIONS = {  # the options embed and rerank read, each in its range
    "embed": {"loss": one_of(None, "mnrl", "symmetric-mnrl"), "query_prompt": one_of(None, "query: "),
              "document_prompt": one_of(None, "passage: "), "batch_sampler": one_of(None, "no_duplicates",
              "batch_sampler"), "columns": one_of(None, ["anchor", "positive"], {"anchor": "positive", "a": "anchor"})},
    "rerank": {"loss": one_of(None, "bce", "listnet", "lambda"),
               "columns": one_of(None, ["query", "document", "label"])},
}  # fmt: skip
SHARED = {name: VALID[name] for name in ("lr", "max_grad_norm", "batch_size", "max_steps", "seed", "max_length")}
# a value for every option of the one table (options.READ_BY): each task it is not read by must refuse it
TABLE_VALUES = {
    "config": {"hidden_size": 32}, "text_column": "text", "text_pair_column": "pair", "label_column": "label",
    "problem_type": "regression", "label2id": {"pos": 0}, "label_all_tokens": True, "whole_word_mask": True,
    "generator": "generator", "generator_size": 0.5, "discriminator_weight": 1.0, "share_embeddings": False,
    "loss": "mnrl", "query_prompt": "q: ", "document_prompt": "d: ", "batch_sampler": "batch_sampler",
    "columns": ["text"], "task_adapter": "retrieval_query", "cores": 2,
}  # fmt: skip
RETRIEVAL_TEXTS = one_of(  # mostly distinct texts, so that some drawn batches can learn; an empty and a special one
    "how do cats sleep", "cats sleep curled up", "what is python", "a language for scripts", "why dogs bark",
    "sorting a list in place", "", "[MASK] [SEP]",
)  # fmt: skip
RERANK_LABELS = one_of(0, 1, 0.5, 1.0, NAN, INF, "x", None, 10**6)


@st.composite
def retrieval_draw(draw, task: str) -> tuple[dict, list[dict], str | None]:
    """(options, rows, bad) for embed or rerank: as `training_draw`, with the table's options the task ignores."""
    options = draw(st.fixed_dictionaries({}, optional={**SHARED, **RETRIEVAL_OPTIONS[task]}))
    bad, kind = None, draw(one_of(None, None, "invalid", "ignored"))
    if kind == "invalid":
        bad = draw(one_of("lr", "batch_size", "max_length", "warmup_ratio", "keep_last", "metric_for_best"))
        options[bad] = draw(INVALID[bad])
    elif kind == "ignored":
        ignored = [name for name, tasks in READ_BY.items() if TASK_NAMES[task] not in tasks] + ["lora_alpha"]
        bad = draw(st.sampled_from(ignored))
        options[bad] = TABLE_VALUES.get(bad, 4.0)
    rows = []
    for _ in range(draw(st.integers(2, 4))):
        if task == "embed":
            rows.append({"anchor": draw(RETRIEVAL_TEXTS), "positive": draw(RETRIEVAL_TEXTS)})
        else:
            rows.append(
                {"query": draw(RETRIEVAL_TEXTS), "document": draw(RETRIEVAL_TEXTS), "label": draw(one_of(0, 1))}
            )
    if task == "rerank" and draw(st.integers(0, 2)) == 0:
        rows[draw(st.integers(0, len(rows) - 1))]["label"] = draw(RERANK_LABELS)
    return options, rows, bad


def test_embed_and_rerank_options_run_or_are_refused_before_any_work(checkpoint, tmp_path, record_property):
    assert set(TABLE_VALUES) == set(READ_BY), "give each option of the table a value to draw"
    sources = {"embed": checkpoint("bert"), "rerank": checkpoint("bert", "sequence-classification", num_labels=1)}
    counts, serial = Counter(), itertools.count()

    @campaign(40)
    @given(data=st.data(), task=one_of("embed", "rerank"), evaluate=st.booleans())
    def run(data, task, evaluate):
        options, rows, bad = data.draw(retrieval_draw(task))
        options.setdefault("max_steps", 1)
        options.setdefault("batch_size", 2)
        out = tmp_path / f"retrieval{next(serial)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trained = fine_tune(task, rows, out, model=sources[task], eval_data=rows if evaluate else None,
                                    **options)  # fmt: skip
        except ValueError as e:
            assert not out.exists(), f"refused after writing to {out}: {e}"
            assert bad is None or isinstance(e, OptionError), f"{bad}={options[bad]!r} not refused first: {e}"
            assert names_option_or_line(e, options, rows), f"names no option or line: {e}"
            counts[f"refused ({type(e).__name__})"] += 1
            return
        assert bad is None, f"{bad}={options[bad]!r} was accepted for {task}"
        check_trained(trained, out)
        counts[f"trained ({task})"] += 1

    run()
    summary(record_property, "embed and rerank options and rows", counts)
    assert counts["trained (embed)"] and counts["trained (rerank)"] and counts["refused (OptionError)"]


FLAGS = {  # the command's flags as typed: numbers in and out of range, non-finite, not numbers at all
    "--lr": one_of("1e-3", "0", "-1e-3", "nan", "inf", "abc"),
    "--warmup-ratio": one_of("0.1", "1.5", "-0.5", "nan"),
    "--max-grad-norm": one_of("1", "-1", "0", "inf"),
    "--keep-last": one_of("1", "0", "-1", "1.5"),
    "--batch-size": one_of("2", "0", "x"),
    "--max-length": one_of("16", "2", "0"),
    "--lora-rank": one_of("2", "0"),
    "--lora-alpha": one_of("4", "nan"),
    "--eval-every": one_of("1", "0"),
    "--metric-for-best": one_of("eval_loss", "eval_bogus"),
    "--whole-word-mask": one_of(None),
    "--label-all-tokens": one_of(None),
    "--schedule": one_of("cosine", "step"),
}


def test_train_command_runs_or_exits_2_naming_the_flag(sources, tmp_path, record_property, capsys):
    counts, serial = Counter(), itertools.count()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": t.split()[0]}) + "\n" for t in ["ok then", "dull"] * 2))

    @campaign(24)
    @given(flags=st.fixed_dictionaries({}, optional=FLAGS), evaluate=st.booleans())
    def run(flags, evaluate):
        out = tmp_path / f"cli{next(serial)}"
        argv = [
            "train",
            "classify",
            "-m",
            str(sources["bert"]),
            "--data",
            str(data),
            "-o",
            str(out),
            "--max-steps",
            "2",
        ]
        argv += ["--eval-data", str(data)] if evaluate else []
        argv += [part for flag, value in flags.items() for part in ([flag] if value is None else [flag, value])]
        capsys.readouterr()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                status = mlx_encoders.__main__.main(argv)
        except SystemExit as stop:  # argparse: a value that is not a number, or not a choice
            status = stop.code
        err = capsys.readouterr().err
        assert status in (0, 2), f"exit {status}: {err[-800:]}"
        assert "Traceback" not in err
        if status == 2:
            assert not out.exists(), f"refused after writing to {out}"
            line = next(x for x in err.splitlines() if "error:" in x)
            assert any(flag in line or flag[2:].replace("-", "_") in line for flag in flags), line
            counts["exit 2"] += 1
            return
        assert finite_weights(mlx_encoders.load_model(out / "model"))
        counts["exit 0"] += 1

    run()
    summary(record_property, "train command flags", counts)
    assert counts["exit 0"] and counts["exit 2"]


# ----- generation -----

GENERATION = {
    "temperature": one_of(NAN, INF, -1.0, 0.0, 0.7, 1.0, 1e6),
    "top_k": one_of(-1, 0, 1, 5, 50, 10**6),
    "top_p": one_of(NAN, -0.1, 0.0, 0.5, 1.0, 1.5),
    "repetition_penalty": one_of(NAN, INF, -1.0, 0.0, 0.5, 1.0, 1.3),
    "num_return_sequences": one_of(-1, 0, 1, 2),
    "do_sample": st.booleans(),
    "max_new_tokens": one_of(-1, 0, 1, 4, 10**6),
    "min_new_tokens": one_of(0, 2, 100),
    "seed": one_of(None, 0, 5, -1),
}


def test_generation_options_give_texts_or_are_refused_naming_the_option(checkpoint, record_property):
    generator = mlx_encoders.pipeline("text-generation", model=checkpoint("gpt2", "causal-lm"))
    counts = Counter()

    @campaign(60)
    @given(options=st.fixed_dictionaries({}, optional=GENERATION), prompt=one_of("The quick brown fox", "a", "x " * 20))
    def run(options, prompt):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results = generator(prompt, **options)
        except ValueError as e:
            assert any(name in str(e) for name in options), f"names no option: {e}"
            counts["refused (ValueError)"] += 1
            return
        assert len(results) == options.get("num_return_sequences", 1)
        assert all(isinstance(r["generated_text"], str) for r in results)
        counts["generated"] += 1

    run()
    summary(record_property, "text-generation options", counts)
    assert counts["generated"] and counts["refused (ValueError)"]


# ----- conversion -----

CONVERT = {
    "quantize": st.booleans(),
    "bits": one_of(None, 1, 2, 3, 4, 6, 8, 9),
    "group_size": one_of(None, 0, 7, 16, 32, 64, 128),
    "mode": one_of("affine", "mxfp4", "mxfp8", "nvfp4", "int3"),
    "recipe": one_of(
        None,
        "mixed_4_8",
        "mixed_2_9",
        "mixed",
        {"*": 4},
        {"*.query": 8, "*": False},
        {"nomatch.*": 4},
        {"*": {"bits": 4, "colour": 1}},
        {"*": "x"},
    ),  # fmt: skip
    "calibration": one_of(False, False, False, None, ["a short text to calibrate on"], []),  # None: GPTQ, slower
    "dtype": one_of(None, "float16", "bfloat16", "int8"),
}


def test_convert_options_give_a_working_model_or_are_refused_before_writing(checkpoint, tmp_path, record_property):
    source = checkpoint("bert", "sequence-classification")
    ids = mx.array([[101, 1996, 4937, 2938, 102]])
    counts, serial = Counter(), itertools.count()

    @campaign(30)
    @given(options=st.fixed_dictionaries({}, optional=CONVERT))
    def run(options):
        out = tmp_path / f"mlx{next(serial)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mlx_encoders.convert(source, out, **options)
        except ValueError as e:
            assert not out.exists(), f"refused after writing {out}: {e}"
            assert isinstance(e, QuantizationOptionError), f"not an option error (the command would exit 1): {e!r}"
            message = str(e).lower()
            assert any(name in message for name in [*options, "group size"]), f"names no option: {e}"
            counts["refused (OptionError)"] += 1
            return
        model = mlx_encoders.load_model(out)
        assert finite(model(ids).logits.astype(mx.float32))
        counts["converted"] += 1

    run()
    summary(record_property, "convert options", counts)
    assert counts["converted"] and counts["refused (OptionError)"]
