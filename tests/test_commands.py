"""Every command as a user meets it: a known error is one line, `PROGRAM: error: MESSAGE`, exit 1 (2 on a refused
option) and no traceback, which `--debug` or MLX_ENCODERS_DEBUG=1 shows; `--help` lists every training task and
each task's own options; docs/command-line.md's option table names exactly the options of each command's parser.
The commands run in a subprocess, as from a shell."""

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_encoders.__main__ import main, parser
from mlx_encoders.errors import CommandError, OptionError, run_command
from mlx_encoders.train.fine_tune import TASK_NAMES

ROOT = Path(__file__).parents[1]
MISSING = "/nonexistent/mlx-encoders-test"
TRAINING_TASKS = ["mlm", "classify", "tokens", "clm", "rtd", "embed", "rerank", "sparse", "multivector"]


def command(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env}
    )


# argv after `python`, exit status, the one line on stderr
ERRORS = {
    "embed": (["-m", "mlx_encoders", "embed", "-m", MISSING, "text"], 1,
              f"mlx-encoders embed: error: No checkpoint folder at {MISSING}"),
    "train": (["-m", "mlx_encoders", "train", "sparse", "-m", MISSING, "--data", f"{MISSING}.jsonl", "-o",
               f"{MISSING}/run", "--loss", "mnrl"], 2,
              "mlx-encoders train: error: --loss names an embed or rerank loss; sparse trains with its own"),
    "index": (["-m", "mlx_encoders", "index", "search", "--index", MISSING, "a query"], 1,
              f"mlx-encoders index: error: {MISSING}/index.sqlite does not exist; build the index first"),
    "generate": (["-m", "mlx_encoders", "generate", "-m", MISSING, "Once"], 1,
                 f"mlx-encoders generate: error: No checkpoint folder at {MISSING}"),
    "serve": (["-m", "mlx_encoders", "serve"], 1, "mlx-encoders serve: error: "),
    "evaluate": (["-m", "mlx_encoders", "evaluate", "rerank", "-m", MISSING, "--samples", f"{MISSING}.jsonl"], 1,
                 "mlx-encoders evaluate: error: "),
    "mine": (["-m", "mlx_encoders", "mine", "-m", MISSING, "--data", f"{MISSING}.jsonl", "-o", f"{MISSING}.out"], 1,
             "mlx-encoders mine: error: /nonexistent is not a folder; create it first"),  # before the model loads
    "convert": (["-m", "convert", MISSING], 1, f"python -m convert: error: No checkpoint folder at {MISSING}"),
    "convert option": (["-m", "convert", MISSING, "-q", "--bits", "7"], 2,
                       "python -m convert: error: affine quantization supports bits [2, 3, 4, 5, 6, 8], not 7"),
    "example": (["examples/search.py", "--model", MISSING, "--index", MISSING, "-q", "query"], 1,
                f"search.py: error: No checkpoint folder at {MISSING}"),
}  # fmt: skip


@pytest.mark.parametrize("name", ERRORS)
def test_a_known_error_is_one_line_and_an_exit_status(name):
    argv, status, line = ERRORS[name]
    done = command(*argv)
    assert done.returncode == status, done.stderr
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("name, how", [("embed", "--debug"), ("convert", "--debug"), ("index", "environment")])
def test_debug_shows_the_traceback(name, how):
    argv, _, line = ERRORS[name]
    done = command(*argv, "--debug") if how == "--debug" else command(*argv, MLX_ENCODERS_DEBUG="1")
    assert done.returncode == 1 and done.stderr.startswith("Traceback (most recent call last):")
    assert line.split(": error: ")[1] in done.stderr.splitlines()[-1]


def test_only_known_errors_lose_their_traceback(capsys, monkeypatch):
    monkeypatch.delenv("MLX_ENCODERS_DEBUG", raising=False)

    def fail(error):
        def command():
            raise error

        return command

    assert run_command("prog", fail(OptionError("--x must be 1 or more"))) == 2
    assert run_command("prog", fail(CommandError("rank 1 failed"))) == 1
    assert run_command("prog", fail(OSError(28, "No space left on device"))) == 1
    assert capsys.readouterr().err.splitlines() == [
        "prog: error: --x must be 1 or more",
        "prog: error: rank 1 failed",
        "prog: error: No space left on device",  # no `[Errno 28]`: it names no file
    ]
    with pytest.raises(KeyError):  # a bug: its traceback stays
        run_command("prog", fail(KeyError("x")))
    with pytest.raises(OSError):
        run_command("prog", fail(OSError("no")), debug=True)
    assert run_command("prog", lambda: None) == 0 and run_command("prog", lambda: 141) == 141


def help_text(*argv: str) -> str:
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        main([*argv, "--help"])
    return out.getvalue()


def test_the_help_lists_every_training_task():
    assert list(TASK_NAMES) == TRAINING_TASKS
    done = command("-m", "mlx_encoders", "--help")
    train = " ".join(done.stdout.split("\n    train ", 1)[1].split("\n    evaluate ")[0].split())
    assert train == f"train or fine-tune: {', '.join(TRAINING_TASKS)}"
    listed = help_text("train")
    assert all(re.search(rf"^    {task}\b", listed, re.M) for task in TRAINING_TASKS), listed


# options each task's help shows, and options of other tasks it leaves out (they are still refused with a reason)
OWN_HELP = {
    "mlm": (["--config", "--whole-word-mask", "--next-sentence", "--text-column"], ["--loss", "--problem-type"]),
    "classify": (["--problem-type", "--text-pair-column", "--label-column"], ["--whole-word-mask", "--loss"]),
    "tokens": (["--label-all-tokens", "--label-column"], ["--problem-type", "--next-sentence"]),
    "clm": (["--config", "--text-column"], ["--whole-word-mask", "--label-column"]),
    "rtd": (["--generator", "--discriminator-weight", "--whole-word-mask"], ["--next-sentence", "--loss"]),
    "embed": (["--loss", "--matryoshka-dims", "--mini-batch-size", "--query-prompt"],
              ["--whole-word-mask", "--problem-type", "--generator", "--document-regularizer-weight"]),
    "rerank": (["--loss"], ["--matryoshka-dims", "--query-prompt", "--config"]),
    "sparse": (["--document-regularizer-weight", "--query-prompt", "--batch-sampler"], ["--loss", "--mini-batch-size"]),
    "multivector": (["--query-prompt", "--batch-sampler"], ["--loss", "--document-regularizer-weight"]),
}  # fmt: skip


@pytest.mark.parametrize("task", TRAINING_TASKS)
def test_each_training_task_has_its_own_help(task):
    shown, hidden = OWN_HELP[task]
    text = help_text("train", task)
    assert text.startswith(f"usage: mlx-encoders train {task} ") and f"\nTrain {task}: " in text
    options = set(re.findall(r"^  (--[a-z-]+)", text, re.M))
    assert {"--model", "--data", "--output", "--lr", "--resume", "--debug", *shown} <= options
    assert not options & set(hidden)


def subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def parser_options(name: str) -> set[str]:
    p = parser()
    for word in name.split():
        p = subcommands(p)[word]
    return {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def documented_options() -> dict[str, set[str]]:
    """docs/command-line.md's option table: command -> the `--options` of its rows (a row may name several)."""
    text = (ROOT / "docs" / "command-line.md").read_text()
    rows = re.findall(r"^\| (`.+?) \| (.+) \|$", text, re.M)
    documented = {}
    for names, options in rows:
        for name in re.findall(r"`([a-z][a-z -]*)`", names):
            documented.setdefault(name, set()).update(re.findall(r"`(--[a-z][a-z-]*)", options))
    return documented


def test_the_option_table_names_each_option_of_each_command():
    documented = documented_options()
    assert {"fill-mask", "classify", "tokens", "answer", "embed", "index build", "index search"} <= set(documented)
    for name, options in documented.items():
        assert options == parser_options(name), name
