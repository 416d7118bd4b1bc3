"""A benchmark peer in a process of its own, free of the BLAS that mlx_encoders gives MLX.

`import mlx_encoders` loads the system OpenBLAS with RTLD_GLOBAL so that MLX's matmuls use it (mlx_encoders/_blas.py),
and a library loaded that way answers every later call to the same symbol anywhere in the process: torch's BLAS
calls then run OpenBLAS rather than the MKL that torch ships. Measured on this project's 2-core machine, that made
a one-row torch product 1.8x slower and a BERT-base training step in torch 1.9x slower. So peers built on torch
(sentence-transformers, transformers) run in a spawned process: a fresh interpreter, which maps none of this
process's libraries and is told not to load the BLAS should it import mlx_encoders.

    engine = Isolated(build, *args)  # build(*args) runs in the child and returns a callable
    result = engine(*request)        # that callable's result, computed in the child

The child is a daemon that also ends when this process closes its end of the pipe.
"""

import multiprocessing
import os
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
