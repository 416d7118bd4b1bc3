"""The training options are declared once (`train/options.py`): `fine_tune`'s keywords, the command's flags, the tasks
that read each option and docs/training.md's table all follow the declaration, so an option added there reaches each
of them (`test_a_new_option_reaches_the_call_the_command_and_the_docs`)."""

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest

from mlx_encoders.__main__ import parser
from mlx_encoders.train import TrainingConfig, fine_tune, options
from mlx_encoders.train.options import OPTIONS, TASK_NAMES, Option, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def train_parser(kind: str) -> argparse.ArgumentParser:
    p = parser()
    for word in ("train", kind):
        [action] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        p = action.choices[word]
    return p


def test_docs_table_is_the_declaration():
    text = (ROOT / "docs" / "training.md").read_text()
    assert markdown_table() in text, "docs/training.md's option table differs from train/options.py: regenerate it"


def test_fine_tune_keywords_are_the_declared_options():
    keywords = [name for name, p in inspect.signature(fine_tune).parameters.items() if p.kind == p.KEYWORD_ONLY]
    assert keywords == [o.name for o in OPTIONS.values() if o.api]
    # every field but the folder and what fine_tune records of its own options (task_settings)
    loop = [f.name for f in dataclasses.fields(TrainingConfig) if f.name not in ("output_dir", "task_settings")]
    assert set(loop) <= set(keywords)
    defaults = {name: p.default for name, p in inspect.signature(fine_tune).parameters.items()}
    assert all(defaults[name] == getattr(TrainingConfig("x"), name) for name in loop)


@pytest.mark.parametrize("kind", list(TASK_NAMES))
def test_each_flag_parses_to_its_option_with_its_default(kind):
    args = train_parser(kind).parse_args(["--data", "d.jsonl", "--output", "out"])
    assert all(getattr(args, o.name) == o.default for o in OPTIONS.values() if o.flag)
    flags = {s for a in train_parser(kind)._actions for s in a.option_strings}
    assert {o.dashed for o in OPTIONS.values() if o.flag} <= flags


def test_a_new_option_reaches_the_call_the_command_and_the_docs(monkeypatch, tmp_path):
    """One `Option` line: fine_tune takes it (and refuses it for a task that does not read it), the command parses
    it, shows it in the help of the tasks that read it alone, and the docs table lists it."""
    new = Option("pooling_note", "embed: a note kept with the run", tasks=(options.EMBED,), group="embed")
    monkeypatch.setitem(OPTIONS, new.name, new)
    assert "| `pooling_note` | `--pooling-note` | embed |" in markdown_table()
    args = train_parser("embed").parse_args(["--data", "d", "--output", "o", "--pooling-note", "hi"])
    assert args.pooling_note == "hi"
    assert "--pooling-note" in train_parser("embed").format_help()
    assert "--pooling-note" not in train_parser("classify").format_help()
    with pytest.raises(options.OptionError, match=r"pooling_note \(--pooling-note\) is for sentence-embedding"):
        fine_tune("classify", [{"text": "a", "label": 0}], tmp_path / "run", model="unused", pooling_note="hi")
    assert not (tmp_path / "run").exists()


def test_unknown_keyword_names_the_known_ones(tmp_path):
    with pytest.raises(TypeError, match="unknown options mini_batch_size; the options are: .*batch_sampler"):
        fine_tune("embed", [], tmp_path, model="unused", mini_batch_size=4)
