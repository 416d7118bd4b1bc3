"""Give MLX's float matmuls a fast BLAS on Linux, where its CPU wheel bundles the reference (netlib) one.

A BLAS loaded into the global symbol scope before MLX is imported provides `cblas_sgemm` in place of the
bundled one (OpenBLAS runs an encoder's matmuls 10-15x faster; see README, Performance). It must happen
before the first `import mlx.core`, so `mlx_encoders/__init__.py` imports this module first; when user code
imported MLX earlier, it is too late (the reference BLAS is bound), and one warning names the fix.
`MLX_ENCODERS_BLAS=/path/to/libblas.so` picks the library; `MLX_ENCODERS_BLAS=0` turns this (and the warning) off.
"""

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Shared-object names of the BLAS libraries that give MLX fast float matmuls when mapped before it.
FAST_BLAS_NAMES = ("openblas", "mkl_rt", "blis")


def _candidates() -> list[str]:
    chosen = os.environ.get("MLX_ENCODERS_BLAS")
    if chosen:
        return [] if chosen == "0" else [chosen]
    found = ctypes.util.find_library("openblas")
    return [found] if found else []


def load_fast_blas() -> str | None:
    """Load the first usable BLAS; returns its name, or None when MLX is already loaded or none is found."""
    global LIBRARY
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    for name in _candidates():
        try:
            library = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(library, "cblas_sgemm"):
            LIBRARY = library
            return name
    return None


def mapped_fast_blas() -> str | None:
    """The path of a fast BLAS exporting `cblas_sgemm` already mapped into this process (by LD_PRELOAD, or loaded
    before MLX), if any; numpy's bundled OpenBLAS renames its symbols and does not count."""
    maps = Path("/proc/self/maps")
    paths = {line.split()[-1] for line in maps.read_text().splitlines()} if maps.exists() else set()
    for path in sorted(p for p in paths if any(name in Path(p).name for name in FAST_BLAS_NAMES)):
        try:
            if hasattr(ctypes.CDLL(path), "cblas_sgemm"):
                return path
        except OSError:
            continue
    return None


def warn_if_too_late() -> None:
    """One warning when MLX was imported first without a fast BLAS while one is available."""
    if not sys.platform.startswith("linux") or "mlx.core" not in sys.modules or mapped_fast_blas():
        return
    candidates = _candidates()
    if candidates:
        warnings.warn(
            "mlx.core was imported before mlx_encoders, so MLX's float matmuls use the reference BLAS bundled in its "
            "Linux wheel: 10-50x slower on the CPU. Import mlx_encoders before mlx (or start Python with "
            f"LD_PRELOAD={candidates[0]}); MLX_ENCODERS_BLAS=0 silences this warning.",
            UserWarning,
            stacklevel=2,
        )


class Outermost:
    """A process-wide setting for nested or concurrent blocks (`with setting:`): the first block to open calls
    `enter`, the last to close calls `leave`, whatever the order the threads leave in."""

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None]):
        self.enter, self.leave = enter, leave
        self.lock, self.open = threading.Lock(), 0

    def __enter__(self) -> None:
        with self.lock:
            if self.open == 0:
                self.enter()
            self.open += 1

    def __exit__(self, *exception) -> None:
        with self.lock:
            self.open -= 1
            if self.open == 0:
                self.leave()


@functools.cache
def library_in_use() -> ctypes.CDLL | None:
    """The fast BLAS answering MLX's `cblas_sgemm` on Linux (loaded here, or mapped before MLX), or None: MLX's
    bundled reference BLAS, or another platform."""
    if not sys.platform.startswith("linux"):
        return None
    if LIBRARY:
        return LIBRARY
    path = mapped_fast_blas()
    return ctypes.CDLL(path) if path else None


@contextmanager
def one_thread_per_call() -> Iterator[bool]:
    """Inside, MLX's BLAS runs each call on the calling thread alone, so that forward passes on several CPU streams
    at once each keep one core (sentence.py); yields whether that holds. It holds for OpenBLAS (its thread count is
    set to 1, then restored; meanwhile that is true of every call in the process) and for MLX's bundled reference
    BLAS on Linux, which never starts threads; not for other BLAS libraries or other platforms."""
    if not sys.platform.startswith("linux"):
        yield False
        return
    library = library_in_use()
    if library is None:
        yield True
        return
    if not hasattr(library, "openblas_set_num_threads"):
        yield False
        return
    with _one_openblas_thread(library):
        yield True


@functools.cache
def _one_openblas_thread(library: ctypes.CDLL) -> Outermost:
    """OpenBLAS on one thread for the outermost of nested or concurrent blocks, its thread count restored after."""
    threads = []

    def enter() -> None:
        threads[:] = [library.openblas_get_num_threads()]
        library.openblas_set_num_threads(1)

    return Outermost(enter, lambda: library.openblas_set_num_threads(threads[0]))


LIBRARY: ctypes.CDLL | None | bool = None  # the loaded fast BLAS; False once a search found none
LOADED = load_fast_blas()
warn_if_too_late()
