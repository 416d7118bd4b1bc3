"""On Linux, importing mlx_encoders first gives MLX a fast system BLAS; it can be chosen or turned off."""

import ctypes.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's bundled BLAS is Linux-only")


def loaded(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code + "; print(mlx_encoders._blas.LOADED)"],
        capture_output=True, text=True, env={**os.environ, **env}, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def test_default_loads_system_openblas_when_present():
    expected = ctypes.util.find_library("openblas")
    assert loaded("import mlx_encoders") == str(expected)


def test_env_turns_it_off_or_names_the_library():
    assert loaded("import mlx_encoders", MLX_ENCODERS_BLAS="0") == "None"
    assert loaded("import mlx_encoders", MLX_ENCODERS_BLAS="/nonexistent/libblas.so") == "None"


def test_nothing_is_loaded_once_mlx_is_imported():
    assert loaded("import mlx.core, mlx_encoders") == "None"
