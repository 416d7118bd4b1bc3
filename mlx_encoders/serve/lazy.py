"""Models loaded on their first request and unloaded when idle, as Ollama does: each sub-folder of --models-dir is a
model named after its folder. It is loaded (and warmed) when a request first names it, kept while requests use it,
and unloaded once it has been idle for its keep-alive (--model-keep-alive seconds, or the last Ollama `keep_alive`
that named it; negative: never). Models given with --model are loaded at start-up and never unloaded."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ApiError

if TYPE_CHECKING:
    from .models import ServedModel
    from .server import Server

# the names of the lazy models the current request has taken, released when it is answered
TAKEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("mlx_encoders_serve_taken", default=None)
SWEEP_S = 0.25
log = logging.getLogger("mlx_encoders.serve")


class NotLoaded(Exception):
    """The request names a model of --models-dir that is not loaded: the route loads it, then runs again."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Loader:
    """One daemon thread that builds models. It runs MLX work, and a thread that did must not end before the
    process (MLX aborts at exit otherwise), so it waits for work for good rather than ending."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self.work, name="mlx-encoders serve loader", daemon=True).start()

    def submit(self, function: Callable, *args) -> Future:
        future: Future = Future()
        self.jobs.put((function, args, future))
        return future

    def work(self) -> None:
        while True:
            function, args, future = self.jobs.get()
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001  the request that asked for the model gets the failure
                future.set_exception(error)
            del function, args, future  # held while waiting, they would keep the last model built alive


def is_model_folder(path: Path) -> bool:
    """A folder a model loads from: a checkpoint's config.json, or a sentence-transformers folder's modules.json (a
    Router's transformer lies in a module folder)."""
    return (path / "config.json").is_file() or (path / "modules.json").is_file()


class ModelsDir:
    """The loadable models of one folder: their keep-alive, when each expires, and the requests using each."""

    def __init__(self, folder: str | Path, keep_alive: float, dtype: str | None, batch_size: int):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"--models-dir {folder} is not a folder; give the folder whose sub-folders are models")
        self.keep_alive = keep_alive
        self.dtype, self.batch_size = dtype, batch_size
        self.loader = Loader()
        self.locks: dict[str, asyncio.Lock] = {}
        self.loaded: set[str] = set()
        self.users: dict[str, int] = {}
        self.expires: dict[str, float] = {}
        self.keep: dict[str, float] = {}

    def names(self) -> list[str]:
        """The folder's model folders: those that hold a config.json or a sentence-transformers modules.json."""
        folders = (p for p in self.folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        return sorted(p.name for p in folders if self.path(p.name) is not None)  # an unreadable one is none

    def path(self, name) -> Path | None:
        """The folder of model `name`, when it is one of the folder's."""
        if not isinstance(name, str) or not name or name.startswith(".") or Path(name).name != name:
            return None
        path = self.folder / name
        try:
            return path if is_model_folder(path) else None
        except OSError:  # a name too long for the file system, or a folder it cannot read: no model of ours
            return None

    def capabilities(self, name: str) -> tuple[str, ...]:
        """What model `name` may serve, read from its files without loading it (a cross-encoder: ranking or
        classes, its head decides which); none where they say it cannot load (its requests name the error)."""
        from ..embeddings.auto import folder_kind
        from .models import CAPABILITIES

        path = self.path(name)
        try:
            return CAPABILITIES[folder_kind(path)] if path is not None else ()
        except (OSError, ValueError):
            return ()

    async def load(self, server: Server, name: str) -> None:
        """Load and warm model `name` unless it is loaded; one load at a time per name."""
        lock = self.locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in server.models:
                return
            build = self.loader.submit(built, name, self.path(name), self.dtype, self.batch_size)
            try:
                model, items = await asyncio.wrap_future(build)
            except Exception as e:  # noqa: BLE001  a folder that is not a model: its requests fail, the server stays
                raise ApiError(500, f"model {name!r} ({self.folder / name}) failed to load: {e}", "model") from None
            # Counted as loaded before any request can see it, so those that name it while it warms up hold it too.
            self.loaded.add(name)
            self.users[name] = 0
            self.expires[name] = time.monotonic()
            server.add(model)
            self.take(model)  # before the sweep can see it idle
            await asyncio.wrap_future(server.batchers[name].submit(items))

    def take(self, model: ServedModel) -> None:
        """The current request uses `model` (if it is one of these) until it is answered."""
        taken = TAKEN.get()
        if model.name in self.loaded and taken is not None:
            taken.append(model.name)
            self.users[model.name] += 1

    def release(self, names: list[str]) -> None:
        now = time.monotonic()
        for name in names:
            self.users[name] -= 1
            keep = self.keep.get(name, self.keep_alive)
            self.expires[name] = math.inf if keep < 0 else now + keep

    def set_keep_alive(self, name: str, seconds: float) -> None:
        """Ollama's `keep_alive` of a request: this model's keep-alive from now on."""
        if name in self.loaded:
            self.keep[name] = seconds

    def expiry(self, name: str) -> float | None:
        """When model `name` unloads (time.time() seconds; inf: never), None for a model given with --model."""
        if name not in self.loaded:
            return None
        left = self.expires[name] - time.monotonic()
        return math.inf if left == math.inf else time.time() + max(left, 0.0)

    async def sweep(self, server: Server) -> None:
        """Forever: unload each model idle past its expiry, with no request using or waiting for it."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for name in sorted(self.loaded):
                idle = self.users[name] == 0 and server.batchers[name].depth() == 0
                if idle and self.expires[name] <= now and not self.locks[name].locked():
                    self.loaded.discard(name)
                    self.keep.pop(name, None)
                    try:
                        await asyncio.get_running_loop().run_in_executor(None, server.remove(name))
                    except Exception:  # noqa: BLE001  its threads failed to stop: the sweep goes on for the others
                        log.exception("unloading model %s failed", name)


def built(name: str, path: Path, dtype: str | None, batch_size: int) -> tuple[ServedModel, list]:
    """The model, and the one input that warms its worker (as at start-up)."""
    from .models import ServedModel

    model = ServedModel(name, path, dtype, batch_size)
    items = model.tokenize(["warm"], True, ["up"]) if model.cross is not None else model.tokenize(["warm up"], True)
    return model, items
