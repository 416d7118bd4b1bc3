"""Work evaluated on several CPU cores at once, one task per core, each from a thread of its own (`on_cores`).

MLX's CPU backend runs a stream's element-wise ops on that stream's one thread, and one evaluation hands work to its
streams in graph order with few tasks in flight, so two independent passes evaluated together overlap only a third
to a half of the time. Evaluated from two threads, each on a stream that thread made (an MLX stream belongs to the
thread that made it), they overlap throughout. The worker threads are made once and kept for the process: a thread
that ran MLX work must not end before the process does (MLX aborts at exit), so an idle worker parks on its queue.

`on_own_thread` runs the public entry points (`encode`, `predict`, a pipeline's call) that an application calls
from threads of its own (a web framework's pool, a thread per request) on a few such kept threads instead: each
thread that runs MLX makes streams MLX never frees, and may abort the process at exit once it has ended.
"""

import contextlib
import contextvars
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

import mlx.core as mx

from .runtime import one_blas_thread

T = TypeVar("T")
# The threads of the application a call may come from run at most this many package calls at once.
CALLER_THREADS = 4
_own = threading.local()  # `is_own` on the package's threads


def mark_own() -> None:
    """Mark the calling thread as one of the package's, kept for the process (`on_own_thread` runs on it)."""
    _own.thread = True


def is_own() -> bool:
    here = threading.current_thread() is threading.main_thread() or getattr(_own, "thread", False)
    return here or getattr(_own, "staying", 0) > 0


@contextlib.contextmanager
def stay_here():
    """Within the block, `on_own_thread` calls run on the calling thread: one holding a lock the call takes too
    (a model's adapter block) would wait for itself on a kept thread."""
    _own.staying = getattr(_own, "staying", 0) + 1
    try:
        yield
    finally:
        _own.staying -= 1


class Worker:
    """A thread with its own CPU stream that runs the tasks given to `submit`, one at a time, in order."""

    def __init__(self, number: int):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.work, name=f"mlx-encoders core {number}", daemon=True)
        self.thread.start()

    def submit(self, task: Callable[[], T]) -> Future:
        future: Future = Future()
        self.tasks.put((task, future))
        return future

    def work(self) -> None:
        mark_own()
        stream = mx.new_stream(mx.cpu)
        while True:
            task, future = self.tasks.get()
            try:
                with mx.stream(stream):
                    future.set_result(task())
            except BaseException as error:  # noqa: BLE001  the caller raises it; the worker lives on
                future.set_exception(error)
            del task, future  # a parked worker holds nothing of the last task (its arrays, a step's gradients)


_workers: list[Worker] = []
_workers_lock = threading.Lock()


def workers(count: int) -> list[Worker]:
    """`count` worker threads, made the first time they are asked for and shared by every later caller."""
    with _workers_lock:
        while len(_workers) < count:
            _workers.append(Worker(len(_workers) + 1))
        return _workers[:count]


def on_cores(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """The results of `tasks`, run at once: the first on the calling thread, each other on a worker thread, with
    MLX's BLAS running each product on its caller's thread alone. A task evaluates what it returns (arrays made on a
    worker's stream can only be evaluated there). When tasks fail, every task has ended before the first failure
    (in task order) is raised."""
    if not tasks:
        return []
    with one_blas_thread():
        futures = [worker.submit(task) for worker, task in zip(workers(len(tasks) - 1), tasks[1:], strict=True)]
        try:
            first = tasks[0]()
        finally:
            wait(futures)  # every task ends before the BLAS gets its threads back
        return [first, *(future.result() for future in futures)]


_callers: queue.SimpleQueue = queue.SimpleQueue()
_caller_threads: list[threading.Thread] = []


def _forget_callers() -> None:
    """In a forked child the kept threads are gone: the next call makes its own."""
    global _callers
    _caller_threads.clear()
    _callers = queue.SimpleQueue()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_callers)


def _serve_callers() -> None:
    mark_own()
    while True:
        run, future = _callers.get()
        try:
            future.set_result(run())
        except BaseException as error:  # noqa: BLE001  the caller raises it; the thread lives on
            future.set_exception(error)
        del run, future  # a parked thread holds nothing of the last call


def on_own_thread(function: Callable[..., T]) -> Callable[..., T]:
    """`function` run as called on the main thread and the package's own, and from any other thread on one of
    CALLER_THREADS threads kept for the process (with the caller's context variables), its result or exception
    returned to the caller."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        if is_own():
            return function(*args, **kwargs)
        with _workers_lock:
            if len(_caller_threads) < CALLER_THREADS:
                name = f"mlx-encoders caller {len(_caller_threads) + 1}"
                _caller_threads.append(threading.Thread(target=_serve_callers, name=name, daemon=True))
                _caller_threads[-1].start()
        future: Future = Future()
        _callers.put((functools.partial(contextvars.copy_context().run, function, *args, **kwargs), future))
        return future.result()

    return call
