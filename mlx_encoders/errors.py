"""How every command (`mlx-encoders ...`, `python -m convert`, examples/search.py) ends on an error.

An error whose message is for the user (a ValueError such as our OptionError, StoreError or CorpusError, an OSError,
an ImportError naming what to install, a `CommandError`) prints `PROGRAM: error: MESSAGE` on stderr and exits with
2 for an `OptionError` (as argparse does on a malformed option), else 1. Any other exception is a bug and keeps its
traceback; `--debug` or MLX_ENCODERS_DEBUG=1 shows the traceback of every error.
"""

import argparse
import contextlib
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path

DEBUG_ENV = "MLX_ENCODERS_DEBUG"


def outside_stacklevel() -> int:
    """The `warnings.warn` stacklevel, called from the function that warns, of the first frame outside this package,
    generated code (a dataclass's __init__) and contextlib's wrappers (a decorator's): the user's line, however deep
    the call came."""
    package, wrappers = str(Path(__file__).parent), contextlib.__file__
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith((package, "<")) or frame.f_code.co_filename ==
                                 wrappers):  # fmt: skip
        frame, level = frame.f_back, level + 1
    return level


class OptionError(ValueError):
    """An option outside what it accepts, or in conflict with another (training, quantization): a command exits with
    status 2 on it, as on a malformed option."""


class CommandError(Exception):
    """Base of our errors that are neither ValueErrors nor OSErrors but whose message is for the user (a training run
    that diverged, a rank that failed): a command prints it as it prints those."""


KNOWN = (ValueError, OSError, ImportError, CommandError)


def positive(text: str) -> int:
    """An argparse type: a whole number of 1 or more (a refused value exits with 2, as argparse's own)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text!r}")
    return value


def non_negative(text: str) -> int:
    """An argparse type: a whole number of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number (0 or more), got {text!r}")
    return value


def add_debug_option(parser: argparse.ArgumentParser) -> None:
    """`--debug` on `parser`, or on each command at the ends of its subcommand tree."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not commands:
        parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or {DEBUG_ENV}=1)")
    for action in commands:
        for sub in dict.fromkeys(action.choices.values()):  # an alias maps to the same parser
            add_debug_option(sub)


def describe(error: BaseException) -> str:
    """The error's message; an OSError's without the `[Errno N]` prefix when it names no file (a full disk)."""
    if isinstance(error, OSError) and error.strerror and not error.filename:
        return error.strerror
    return str(error)


def run_command(program: str, command: Callable[[], int | None], debug: bool = False) -> int:
    """`command()`'s exit status (None: 0). A known error prints one line, `PROGRAM: error: MESSAGE`, and gives 2 for
    an OptionError, else 1; with `debug` (or MLX_ENCODERS_DEBUG=1) it propagates, traceback and all. Ctrl-C ends
    with 130, as the shell reports a command SIGINT stopped."""
    debug = debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe fails here, where it is handled, not in Python's flush at exit
    except BrokenPipeError as e:  # the reader stopped early (`| head`): end quietly, as other Unix tools do
        if not stdout_closed():  # another pipe than the output's: an error like any other
            if debug:
                raise
            print(f"{program}: error: {describe(e)}", file=sys.stderr)
            return 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python's flush at exit fails again
        return 141  # 128 + SIGPIPE, what the shell reports for a tool the closed pipe stopped
    except KNOWN as e:
        if debug:
            raise
        print(f"{program}: error: {describe(e)}", file=sys.stderr)
        return 2 if isinstance(e, OptionError) else 1
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{program}: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else status


def stdout_closed() -> bool:
    """Whether the reader of standard output has gone: a pipe whose read end is closed polls as an error."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no file behind stdout
        return True
