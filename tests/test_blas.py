"""On Linux, importing mlx_encoders first gives MLX a fast system BLAS; it can be chosen or turned off."""

import ctypes.util
import os
import subprocess
import sys
import threading

import pytest

import mlx_encoders
from mlx_encoders._blas import one_thread_per_call

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


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, env={**os.environ, **env},
        check=True,
    )  # fmt: skip


# Prints the BLAS that gives MLX its cblas_sgemm, or None for the reference one bundled in MLX's wheel.
MLX_FIRST = "import mlx.core, numpy, mlx_encoders; print(mlx_encoders._blas.mapped_fast_blas())"


@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="no system OpenBLAS to load")
def test_importing_mlx_first_warns_once_naming_the_fix():
    result = run(MLX_FIRST)
    assert result.stdout.strip() == "None"  # too late: MLX bound its bundled BLAS
    assert result.stderr.count("UserWarning") == 1
    assert "Import mlx_encoders before mlx" in result.stderr and "LD_PRELOAD=" in result.stderr


@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="no system OpenBLAS to load")
def test_the_fix_the_warning_names_gives_the_fast_blas_without_a_warning():
    result = run(MLX_FIRST, LD_PRELOAD=ctypes.util.find_library("openblas"))
    assert "openblas" in result.stdout and "scipy" not in result.stdout
    assert "UserWarning" not in result.stderr
    assert "UserWarning" not in run(MLX_FIRST, MLX_ENCODERS_BLAS="0").stderr
    assert "UserWarning" not in run("import mlx_encoders, mlx.core").stderr


def openblas_threads() -> int:
    return mlx_encoders._blas.library_in_use().openblas_get_num_threads()


@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="no system OpenBLAS to load")
def test_one_thread_per_call_holds_openblas_to_one_thread_then_restores_it():
    """Forward passes on several CPU streams at once need each product on its own stream's thread; the outermost
    of nested or concurrent blocks restores OpenBLAS's thread count, also when the block raises."""
    before = openblas_threads()
    with one_thread_per_call() as held:
        assert held and openblas_threads() == 1
        with one_thread_per_call():
            assert openblas_threads() == 1
        assert openblas_threads() == 1  # the inner block's end does not hand the threads back early
    assert openblas_threads() == before
    with pytest.raises(RuntimeError), one_thread_per_call():
        raise RuntimeError
    assert openblas_threads() == before
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]

    def hold(i):
        with one_thread_per_call():
            entered[i].set()
            leave[i].wait()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):  # the first to enter is the first to leave
        t.start()
        entered[i].wait()
    leave[0].set()
    threads[0].join()
    assert openblas_threads() == 1  # the other thread is still inside
    leave[1].set()
    threads[1].join()
    assert openblas_threads() == before


def test_one_thread_per_call_with_the_bundled_reference_blas():
    """MLX's bundled reference BLAS never starts threads: the block holds without changing anything."""
    code = (
        "import mlx_encoders; from mlx_encoders._blas import library_in_use, one_thread_per_call\n"
        "with one_thread_per_call() as held: print(library_in_use(), held)"
    )
    assert run(code, MLX_ENCODERS_BLAS="0").stdout.split() == ["None", "True"]
