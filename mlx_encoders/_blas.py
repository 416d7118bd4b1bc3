"""Give MLX's float matmuls a fast BLAS on Linux, where its CPU wheel bundles the reference (netlib) one.

A BLAS loaded into the global symbol scope before MLX is imported provides `cblas_sgemm` in place of the
bundled one (OpenBLAS runs an encoder's matmuls 10-15x faster; see README, Performance). It must happen
before the first `import mlx.core`, so `mlx_encoders/__init__.py` imports this module first.
`MLX_ENCODERS_BLAS=/path/to/libblas.so` picks the library; `MLX_ENCODERS_BLAS=0` turns this off.
"""

import ctypes
import ctypes.util
import os
import sys


def _candidates() -> list[str]:
    chosen = os.environ.get("MLX_ENCODERS_BLAS")
    if chosen:
        return [] if chosen == "0" else [chosen]
    found = ctypes.util.find_library("openblas")
    return [found] if found else []


def load_fast_blas() -> str | None:
    """Load the first usable BLAS; returns its name, or None when MLX is already loaded or none is found."""
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    for name in _candidates():
        try:
            library = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(library, "cblas_sgemm"):
            return name
    return None


LOADED = load_fast_blas()
