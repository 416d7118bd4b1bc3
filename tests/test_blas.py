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


def test_mlx_first_still_gets_the_blas_for_decoding_products():
    code = (
        "import mlx.core as mx, numpy as np, warnings; warnings.simplefilter('ignore'); import mlx_encoders; "
        "from mlx_encoders import _blas, kernels; w = mx.random.normal((96, 64)); x = mx.random.normal((1, 64)); "
        "ref = np.array(x @ w.T)\nwith kernels.eager_blas(): out = kernels.linear(x, w)\n"
        "print(_blas.gemv_library() is not None, np.abs(np.array(out) - ref).max() < 1e-5)"
    )
    assert run(code, MLX_ENCODERS_BLAS="").stdout.split() == ["True", "True"]


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out-view"])
@pytest.mark.parametrize("shape", [(64,), (1, 64), (2, 64), (1, 1, 64), (2, 1, 64), (3, 64)])
def test_blas_products_equal_mlx_matmul(shape, transposed):
    """Within `eager_blas`, rows of float32 products go through sgemv (up to GEMV_ROWS of them), for weights
    stored [out, in] and for transposed views of [in, out] ones (GPT-2's Conv1D weights after sanitize)."""
    import mlx.core as mx
    import numpy as np

    from mlx_encoders import kernels

    mx.random.seed(0)
    weight = mx.random.normal((64, 96)).T if transposed else mx.random.normal((96, 64))
    bias, x = mx.random.normal((96,)), mx.random.normal(shape)
    calls = []
    original = kernels.blas_rows
    kernels.blas_rows = lambda *a: calls.append(1) or original(*a)
    try:
        with kernels.eager_blas():
            out, biased = kernels.linear(x, weight), kernels.linear(x, weight, bias)
        plain = kernels.linear(x, weight)  # outside the context: MLX's own matmul
    finally:
        kernels.blas_rows = original
    rows = int(np.prod(shape[:-1]))
    assert len(calls) == (2 if rows <= kernels.GEMV_ROWS else 0)
    reference = np.array(x) @ np.array(weight).T
    assert out.shape == plain.shape == (*shape[:-1], 96)
    np.testing.assert_allclose(np.array(out), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(biased), reference + np.array(bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(plain), reference, rtol=1e-5, atol=1e-5)


def test_blas_products_leave_other_inputs_to_mlx():
    """Half precision, a strided weight that is neither layout, and a process without a fast BLAS: MLX's matmul."""
    import mlx.core as mx
    import numpy as np

    from mlx_encoders import _blas, kernels

    x, weight = mx.random.normal((1, 64)), mx.random.normal((96, 128))[:, ::2]
    with kernels.eager_blas():
        strided = kernels.linear(x, weight)
        half = kernels.linear(x.astype(mx.float16), weight.astype(mx.float16))
        saved, _blas.LIBRARY = _blas.LIBRARY, False
        try:
            without = kernels.linear(x, weight)
        finally:
            _blas.LIBRARY = saved
    reference = np.array(x) @ np.array(weight).T
    for out, tolerance in ((strided, 1e-5), (without, 1e-5), (half, 5e-2)):
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference, rtol=tolerance, atol=tolerance)
