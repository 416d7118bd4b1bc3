"""A benchmark peer in a process of its own: a fresh interpreter with its own thread settings and allocator, so
that neither engine's warm-up or background threads share a process with the other's timed passes.

    engine = Isolated(build, *args)  # build(*args) runs in the child and returns a callable
    result = engine(*request)        # that callable's result, computed in the child

The child is a daemon that also ends when this process closes its end of the pipe.
"""

import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from collections.abc import Callable


class Isolated:
    """`build(*args)` in a spawned process; calling this object calls what it returned there. `build`, the
    arguments and the results cross by pickle, so `build` must be a module-level function."""

    def __init__(self, build: Callable, *args):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, build, args), daemon=True)
        self.process.start()
        self.receive()  # the child's "ready", or its failure to build

    def __call__(self, *request):
        self.connection.send(request)
        return self.receive()

    def receive(self):
        kind, value = self.connection.recv()
        if kind == "error":
            raise RuntimeError(f"isolated peer failed:\n{value}")
        return value


def serve(connection, build: Callable, args: tuple) -> None:
    os.environ["MLX_ENCODERS_BLAS"] = "0"  # should the peer import mlx_encoders, it must not load the BLAS
    try:
        engine = build(*args)
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        return
    connection.send(("ready", None))
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the parent is gone
            return
        try:
            connection.send(("ok", engine(*request)))
        except BaseException:
            connection.send(("error", traceback.format_exc()))


def worker_result(command: list[str], what: str, env: dict | None = None) -> dict:
    """Run `command` (a benchmark script's own `--worker` run) and return the JSON its last "RESULT " line prints;
    exit naming `what`, with the end of the worker's stderr, when it fails or prints none."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))
