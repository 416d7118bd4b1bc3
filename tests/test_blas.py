"""On Linux, MLX's own products get OpenBLAS privately (engine/runtime.py), whatever was imported first, and no other
library in the process binds to it: torch keeps its speed, numpy its threads; the engine's settings are restored."""

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from test_sentence import Pooling, bert, save_st  # noqa: F401  (bert: a fixture)

from mlx_encoders.engine import kernel_flags, runtime
from mlx_encoders.engine.runtime import one_blas_thread

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's bundled BLAS is Linux-only"),
    pytest.mark.cpu_only("the BLAS that MLX's CPU products use"),
]
OPENBLAS = ctypes.util.find_library("openblas")  # apt's, when installed
PIP_OPENBLAS = runtime.pip_openblas()  # scipy-openblas32, a dependency on Linux
needs_openblas = pytest.mark.skipif(not (OPENBLAS or PIP_OPENBLAS), reason="no OpenBLAS to give MLX")


def run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env={**os.environ, **env}, check=True, timeout=300,
    )  # fmt: skip


# MLX's float32 product rate (GFLOP/s) on 512 x 512 matrices: the reference BLAS gives a few, OpenBLAS tens or more.
# The fastest of 8 products: on a shared machine the others' load slows some products, rarely all of them.
MLX_RATE = """
import time, mlx.core as mx
a = mx.random.normal((512, 512)); mx.eval(a @ a)
fastest = float("inf")
for _ in range(8):
    start = time.perf_counter(); mx.eval(a @ a); fastest = min(fastest, time.perf_counter() - start)
print(2 * 512**3 / fastest / 1e9)
"""


def mlx_rate(imports: str, **env) -> float:
    """One BLAS thread: a multithreaded BLAS on a busy machine waits on its threads, and the bound is about BLAS."""
    return float(run(imports + MLX_RATE, OPENBLAS_NUM_THREADS="1", **env).stdout.split()[-1])


@needs_openblas
def test_mlx_gets_openblas_in_either_import_order_and_not_when_turned_off():
    reference = mlx_rate("import mlx_encoders\n", MLX_ENCODERS_BLAS="0")
    assert mlx_rate("import mlx_encoders\n") > 4 * reference
    assert mlx_rate("import mlx.core, numpy, mlx_encoders\n") > 4 * reference  # MLX imported first: same
    for library in filter(None, (OPENBLAS, PIP_OPENBLAS)):  # apt's and pip's, named
        assert mlx_rate("import mlx_encoders\n", MLX_ENCODERS_BLAS=library) > 4 * reference
    # The one switch: MLX's products stay on its bundled BLAS (read from its import slot, not timed, so that the
    # other test worker's load cannot make the reference BLAS look like OpenBLAS or the other way round).
    assert "openblas" in mlx_sgemm_library()
    assert "openblas" not in mlx_sgemm_library(MLX_ENCODERS_CPU_TUNING="0")


# The file of the shared library an address lies in (dladdr), for the scripts below.
LIBRARY_OF = """
import ctypes, os


class Found(ctypes.Structure):
    _fields_ = [
        ("file", ctypes.c_char_p), ("base", ctypes.c_void_p), ("name", ctypes.c_char_p), ("at", ctypes.c_void_p)
    ]


def library_of(address: ctypes.c_void_p) -> str:
    found = Found()
    assert ctypes.CDLL(None).dladdr(address, ctypes.byref(found)), address
    return os.path.basename(found.file.decode())
"""
# The library whose cblas_sgemm libmlx's import slot points at, after a product.
MLX_SGEMM = """
import mmap
import mlx.core as mx
import mlx_encoders
from mlx_encoders.engine import runtime

mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
library = runtime._mlx_library()
with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
    (slot, *_) = runtime.import_slots(data, ["cblas_sgemm"])["cblas_sgemm"]
print(library_of(ctypes.c_void_p.from_address(runtime._load_base(library) + slot)))
"""


def mlx_sgemm_library(**env) -> str:
    return run(LIBRARY_OF + MLX_SGEMM, **env).stdout.split()[-1]


def test_pip_openblas_is_installed_and_chosen_first():
    """The package's own dependency gives MLX a fast BLAS with no system package; apt's serves when it is missing."""
    assert PIP_OPENBLAS, "scipy-openblas32 is a dependency of the package on Linux"
    code = "from mlx_encoders.engine import runtime; print(runtime.BLAS.path, runtime.BLAS.prefix or '-')"
    assert run(code).stdout.split() == [PIP_OPENBLAS, "scipy_"]
    if OPENBLAS:
        assert run(code, MLX_ENCODERS_BLAS=OPENBLAS).stdout.split()[1] == "-"


def test_tuning_off_leaves_the_process_as_it_was(tmp_path):
    """MLX_ENCODERS_CPU_TUNING=0: no BLAS given, no helper compiled, no warning, BLAS threads untouched."""
    code = """
        import mlx_encoders
        from mlx_encoders.engine import gemv, runtime
        with runtime.one_blas_thread() as held: pass
        print(runtime.BLAS, runtime.one_row_products(), held, gemv.FORWARDING)
    """
    result = run(code, MLX_ENCODERS_CPU_TUNING="0", XDG_CACHE_HOME=str(tmp_path))
    assert result.stdout.split() == ["None", "False", "False", "[]"] and "Warning" not in result.stderr
    assert not list(tmp_path.rglob("*"))


def test_the_file_read_must_be_the_image_mapped():
    """The slots are written only when the libmlx file on disk is the image in memory: its headers, build id and the
    slots' current contents are checked, and any difference names itself."""
    import mmap

    library = runtime._mlx_library()
    base = runtime._load_base(library)
    data = Path(library).read_bytes()
    slots = runtime.import_slots(data, runtime.GEMMS)
    assert runtime.image_matches_file(library, base, data, slots) is None
    spans = runtime.identity_spans(data)
    note_offset, _, note_size = spans[-1]  # the last note segment: the build id, on this MLX
    for at in (0x18, note_offset + note_size - 1):  # the entry point in the ELF header; the note's last byte
        changed = bytearray(data)
        changed[at] ^= 0xFF
        assert "differ" in runtime.image_matches_file(library, base, changed, slots)
    assert "replaced" in runtime.image_matches_file(library + " (deleted)", base, data, slots)
    assert "load address" in runtime.image_matches_file(library, base + mmap.PAGESIZE, data, slots)
    header = {"cblas_sgemm": [0]}  # a "slot" over the ELF header's magic: no code address
    assert "code address" in runtime.image_matches_file(library, base, data, header)


REPLACED = """
import os, shutil, sys
sys.path.insert(0, {copy!r})
import mlx.core as mx  # the copy's libmlx, mapped
library = os.path.join({copy!r}, "mlx", "lib", "libmlx.so")
replacement = library + ".new"
shutil.copy(library, replacement)
os.replace(replacement, library)  # a reinstall while this process runs
import mlx_encoders
from mlx_encoders.engine import runtime
a = mx.ones((4, 4))
print(runtime.BLAS, float((a @ a).sum()))
"""


def test_a_libmlx_replaced_while_the_process_runs_is_left_alone(tmp_path):
    import mlx.core

    copy, installed = tmp_path / "site", Path(mlx.core.__file__).parent
    shutil.copytree(installed, copy / "mlx")
    for libs in installed.parent.glob("mlx_*.libs"):  # the backend's bundled libraries, found through its rpath
        shutil.copytree(libs, copy / libs.name)
    result = run(REPLACED.format(copy=str(copy)))
    assert result.stdout.split() == ["None", "64.0"]
    assert result.stderr.count("leaves MLX's BLAS as it is") == 1 and "replaced" in result.stderr


@needs_openblas
def test_openblas_stays_out_of_the_global_symbol_scope():
    code = """
        import ctypes, mlx_encoders
        print(hasattr(ctypes.CDLL(None), "cblas_sgemm"), mlx_encoders.engine.runtime.BLAS)
    """
    found, library = run(code).stdout.split(maxsplit=1)
    assert found == "False" and "openblas" in library


def test_one_warning_when_mlx_is_left_on_the_reference_blas():
    result = run("import mlx_encoders", MLX_ENCODERS_BLAS="/nonexistent/libopenblas.so")
    assert result.stderr.count("UserWarning") == 1 and "reference BLAS" in result.stderr
    assert "MLX_ENCODERS_BLAS=/nonexistent/libopenblas.so could not be loaded as a BLAS" in result.stderr  # a typo
    assert "UserWarning" not in run("import mlx_encoders", MLX_ENCODERS_BLAS="0").stderr
    if OPENBLAS:
        assert "UserWarning" not in run("import mlx_encoders").stderr


# What torch sees in each import order: the BLAS symbols in the process's global scope (a library there would be
# bound by torch's own BLAS calls: an OpenBLAS there made torch's one-row product 4x slower), torch's threads, the
# thread variables of the environment, and a product's bits. The speed itself: benchmarks/torch_beside.py.
TORCH_VIEW = """
import json
{before}
import torch
{after}

libc, symbols = ctypes.CDLL(None), {{}}
names = ("cblas_sgemm", "cblas_sgemv", "sgemm_", "sgemv_", "openblas_set_num_threads", "goto_set_num_threads")
for name in [prefix + name for prefix in ("", "scipy_") for name in names]:  # scipy-openblas32's carry scipy_
    if hasattr(libc, name):
        symbols[name] = library_of(ctypes.cast(getattr(libc, name), ctypes.c_void_p))
torch.manual_seed(0)
x, w = torch.randn(1, 768), torch.randn(768, 3072)
print(json.dumps({{
    "symbols": symbols, "threads": torch.get_num_threads(), "product": (x @ w).numpy().tobytes().hex(),
    "environment": {{k: v for k, v in os.environ.items() if "THREAD" in k}},
}}))
"""


@needs_openblas
def test_importing_mlx_encoders_before_or_after_torch_changes_nothing_torch_sees():
    pytest.importorskip("torch")
    seen = {
        order: json.loads(run(LIBRARY_OF + TORCH_VIEW.format(before=before, after=after)).stdout.splitlines()[-1])
        for order, before, after in [
            ("torch alone", "", ""), ("before", "import mlx_encoders", ""), ("after", "", "import mlx_encoders"),
        ]
    }  # fmt: skip
    assert not any("openblas" in library for library in seen["torch alone"]["symbols"].values())
    assert seen["before"] == seen["torch alone"] and seen["after"] == seen["torch alone"]


def blas_threads() -> int:
    return runtime.BLAS.openblas_get_num_threads()


@needs_openblas
def test_one_blas_thread_holds_mlx_openblas_to_one_thread_then_restores_it():
    """Passes on several CPU streams need each product on its own stream's thread; the outermost of nested or
    concurrent blocks restores the thread count, also when the block raises."""
    before = blas_threads()
    with one_blas_thread() as held:
        assert held and blas_threads() == 1
        with one_blas_thread():
            assert blas_threads() == 1
        assert blas_threads() == 1  # the inner block's end does not hand the threads back early
    assert blas_threads() == before
    with pytest.raises(RuntimeError), one_blas_thread():
        raise RuntimeError
    assert blas_threads() == before
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]

    def hold(i):
        with one_blas_thread():
            entered[i].set()
            leave[i].wait()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):  # the first to enter is the first to leave
        t.start()
        entered[i].wait()
    leave[0].set()
    threads[0].join()
    assert blas_threads() == 1  # the other thread is still inside
    leave[1].set()
    threads[1].join()
    assert blas_threads() == before


def test_tuning_off_or_the_reference_blas():
    """The reference BLAS never starts threads: the block holds without changing anything; with tuning off it does
    not hold (one stream then)."""
    code = "from mlx_encoders.engine.runtime import one_blas_thread\nwith one_blas_thread() as held: print(held)"
    assert run(code, MLX_ENCODERS_BLAS="0").stdout.split() == ["True"]
    assert run(code, MLX_ENCODERS_CPU_TUNING="0").stdout.split() == ["False"]


PROCESS_STATE = """
import json, threading, numpy as np, mlx.core as mx
from threadpoolctl import threadpool_info
import mlx_encoders
from mlx_encoders import SentenceEncoder
from mlx_encoders.engine import runtime

def numpy_threads():
    return [p["num_threads"] for p in threadpool_info() if p["internal_api"] == "openblas" and "numpy" in p["filepath"]]

def state():
    return dict(mlx_blas=runtime.BLAS.openblas_get_num_threads() if runtime.BLAS else None,
                numpy_blas=numpy_threads(), key=np.array(mx.random.state[0]).tolist())

encoder = SentenceEncoder({folder!r})  # building a model draws its initial weights from MLX's key
encoder.slice_bytes = 1
before = state()
seen, done = [], threading.Event()

def watch():  # numpy's BLAS, from another thread while encode runs
    while not done.is_set():
        seen.append(numpy_threads())
        a = np.ones((256, 256)); a @ a

watcher = threading.Thread(target=watch); watcher.start()
encoder.encode(["a text", "another text", "a third, longer text"] * 20, batch_size=4)
done.set(); watcher.join()
after_encode = state()
mlx_encoders.train.fine_tune("classify", {data!r}, {output!r}, model={model!r}, epochs=1, batch_size=4)
print(json.dumps(dict(before=before, after_encode=after_encode, after_training=state(), seen=seen)))
"""


def test_encode_and_fine_tune_leave_blas_threads_and_random_state_as_they_were(tmp_path, bert):  # noqa: F811
    """What they may touch while they run (MLX's BLAS threads, MLX's random key) is as it was afterwards, and a
    second thread using numpy's BLAS during encode keeps its own thread count."""
    pytest.importorskip("threadpoolctl")
    folder = save_st(tmp_path / "st", bert, Pooling(32))
    data = tmp_path / "train.jsonl"
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(["good", "bad"] * 8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = PROCESS_STATE.format(folder=str(folder), data=str(data), output=str(tmp_path / "run"), model=str(folder))
    result = json.loads(run(code).stdout.strip().splitlines()[-1])
    assert result["after_encode"] == result["before"]
    # fine_tune(seed=) seeds MLX's generator for the new weights, as transformers' Trainer seeds torch's
    assert result["after_training"]["mlx_blas"] == result["before"]["mlx_blas"]
    assert result["after_training"]["numpy_blas"] == result["before"]["numpy_blas"]
    assert result["seen"] and all(threads == result["before"]["numpy_blas"] for threads in result["seen"])


WARM_HEAP = """
import ctypes, mlx.core as mx
from mlx_encoders.engine import runtime

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def mapped_while_alive(elements):
    before = libc.mallinfo2().hblkhd
    x = mx.ones((elements,)); mx.eval(x)
    mapped = libc.mallinfo2().hblkhd - before
    del x
    return mapped

print(mapped_while_alive(1 << 18) > 0)  # 1 MB: mapped afresh at glibc's start
runtime.warm_heap()
print([mapped_while_alive((1 << 18) + 4096 * k) for k in range(1, 4)] == [0, 0, 0])
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's mallinfo2 only")
def test_warm_heap_serves_megabyte_buffers_from_the_heap_without_a_setting():
    assert run(WARM_HEAP).stdout.split() == ["True", "True"]


ONE_ROW = """
import json, numpy as np, mlx.core as mx
from mlx_encoders.engine import gemv, runtime
built_at_import = bool(gemv.FORWARDING)
runtime.one_row_products()  # what decoding calls first
rng = np.random.default_rng(0)
w = rng.standard_normal((96, 80)).astype(np.float32)
x = rng.standard_normal((1, 80)).astype(np.float32)
W, X = mx.array(w), mx.array(x)
cases = {  # every layout a one-row or one-column product reaches cblas_sgemm in
    "row @ W^T": (X @ W.T, x @ w.T), "row @ W": (X[:, :80] @ W[:80], x @ w[:80]),
    "W @ column": (W @ X.T, w @ x.T), "W^T @ column": (W[:80].T @ X.T, w[:80].T @ x.T),
    "strided row @ W^T": (W[3:4, :80] @ W[:, :80].T, w[3:4] @ w.T), "1 x 1": (X @ X.T, x @ x.T),
    "2 rows": (W[:2] @ W.T, w[:2] @ w.T),
}
errors = {k: float(np.abs(np.array(got, np.float64) - ref).max()) for k, (got, ref) in cases.items()}
print(json.dumps(dict(built_at_import=built_at_import, forwarding=bool(gemv.FORWARDING), errors=errors)))
"""


@needs_openblas
@pytest.mark.parametrize("compiler", ["default", "none"])
def test_one_row_products_go_through_gemv_and_equal_numpy(compiler, tmp_path):
    """Once decoding asks for it, with a C compiler, MLX's cblas_sgemm is the forwarding function (one-row and
    one-column products through sgemv); without one, OpenBLAS's own sgemm. Every layout gives numpy's product either
    way, and nothing is compiled at import."""
    env = {"XDG_CACHE_HOME": str(tmp_path)} | (
        {"CC": "/nonexistent/cc", "PATH": "/nonexistent"} if compiler == "none" else {}
    )
    result = json.loads(run(ONE_ROW, **env).stdout.strip().splitlines()[-1])
    assert not result["built_at_import"]
    assert result["forwarding"] == (compiler == "default")
    assert all(error < 1e-4 for error in result["errors"].values()), result["errors"]
    for library in tmp_path.rglob("forwarding-sgemm-*.so"):  # a cut library (a full disk) is built again
        library.write_bytes(library.read_bytes()[:4096])
        again = json.loads(run(ONE_ROW, **env).stdout.strip().splitlines()[-1])
        assert again["forwarding"] and again["errors"] == result["errors"]


@pytest.mark.parametrize("first", ["usearch", "mlx_encoders"])
def test_importing_usearch_before_mlx_is_named_before_a_compiled_kernel_breaks(first):
    """usearch's static C++ runtime, loaded before MLX's, breaks the C++ MLX writes for compiled CPU kernels: the
    package says so at import, in a fresh compile cache, and not when it came first."""
    pytest.importorskip("usearch")
    order = ["usearch.index", "mlx_encoders"] if first == "usearch" else ["mlx_encoders", "usearch.index"]
    code = (
        f"import {', '.join(order)}\n"
        "import mlx.core as mx\n"
        "print(mx.compile(lambda a: mx.exp(a) * 2 + 1)(mx.ones(3)).tolist())\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "TMPDIR": cache},
        )
    warned = "usearch was imported before MLX" in run.stderr
    if first == "usearch":
        assert warned, run.stderr[-2000:]
    else:
        assert not warned and run.returncode == 0 and "6.43" in run.stdout, run.stderr[-2000:]


def test_the_blas_loads_with_its_threads_sleeping_when_idle_and_the_environment_is_left_as_it_was(monkeypatch):
    """The BLAS given to MLX is loaded with OPENBLAS_THREAD_TIMEOUT at its least (idle threads sleep instead of
    spinning for a tenth of a second after each product), unless the environment holds a value, which it then
    keeps (an empty one is none); afterwards the environment is as it was (numpy's BLAS and child processes read
    their own)."""
    seen = []
    monkeypatch.setattr(runtime, "Blas", lambda path: seen.append(os.environ.get("OPENBLAS_THREAD_TIMEOUT")))
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    runtime.load_blas("libopenblas.so")
    assert seen == [runtime.BLAS_THREAD_TIMEOUT] and "OPENBLAS_THREAD_TIMEOUT" not in os.environ
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    runtime.load_blas("libopenblas.so")
    assert seen[-1] == "28" and os.environ["OPENBLAS_THREAD_TIMEOUT"] == "28"
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "")  # OpenBLAS reads an empty value as its default spin
    runtime.load_blas("libopenblas.so")
    assert seen[-1] == runtime.BLAS_THREAD_TIMEOUT and os.environ["OPENBLAS_THREAD_TIMEOUT"] == ""

    def failing(path):
        raise OSError(f"{path}: no such file")

    monkeypatch.setattr(runtime, "Blas", failing)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT")
    with pytest.raises(OSError):
        runtime.load_blas("missing.so")
    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ


NATIVE = """
import hashlib, json, numpy as np, mlx.core as mx, mlx.nn as nn
from mlx_encoders.engine import kernel_flags, ops, runtime
runtime.claim_mlx()  # the package's first computation
x = mx.array(np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32))
fused = mx.compile(lambda x: nn.gelu(x) * 3 - x)
got, plain = np.array(fused(x)), np.array(nn.gelu(x) * 3 - x)
softmax = np.array(ops.exp_nonpositive(-mx.abs(x)))
from mlx_encoders.engine.optim import adamw_update  # compiled: a square root among 4 arrays, 3 written
inf = float("inf")  # square roots of these too, in whole vectors at the front
special = mx.tile(mx.array([-1.0, -0.0, inf, -inf, float("nan"), 4.0, 0.0, 1.0]), 4)
v = mx.concatenate([special, x * x, -x * x])
g = mx.concatenate([mx.zeros_like(special), x * 0.5, x * 0.5])  # zero: the special second moments reach sqrt as given
update = adamw_update(v, g, v * 0.25, v, *map(mx.array, (0.9, 1e-3, 2e-3, 1.1)), 0.01, 0.9, 0.999, 1e-8)
adamw = b"".join(np.array(a).tobytes() for a in update)
build = 'g++ -std=c++17 -O3 -Wall -fPIC -shared "k.cpp" -o "k.so" 2>&1'
others = ["g++ --version > /dev/null 2>&1", "ls"]
commands = [kernel_flags.command(c) for c in [build, *others]] if kernel_flags.FORWARDING else []
print(json.dumps(dict(native=bool(kernel_flags.FORWARDING), rewritten=kernel_flags.rewritten(), commands=commands,
                      error=float(np.abs(got - plain).max() / np.abs(plain).max()),
                      values=hashlib.sha256(got.tobytes() + softmax.tobytes() + adamw).hexdigest())))
"""


@pytest.mark.skipif(
    runtime.platform.machine() not in runtime.NATIVE_FLAGS or not shutil.which("g++")
    or not runtime.NATIVE_CPU_FEATURES[runtime.platform.machine()] <= runtime.cpu_features(),
    reason="MLX's compiled CPU kernels built by g++ for AVX2, on an x86-64 processor that has it",
)  # fmt: skip
def test_compiled_kernels_are_built_for_avx2_and_round_as_before(tmp_path):
    """From the package's first computation, MLX's kernel build command (and no other command MLX runs) gets the
    AVX2 flags; the kernels it builds in a fresh kernel folder are other code than those built with tuning off (in a
    folder of their own), and give the same bits (a fused GELU, the package's exp, its AdamW update), equal to the
    unfused ops."""
    results, kernels = {}, {}
    for tuning in ("1", "0"):
        folder = tmp_path / tuning
        folder.mkdir()
        env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(folder), "MLX_ENCODERS_CPU_TUNING": tuning}
        results[tuning] = json.loads(run(NATIVE, **env).stdout.strip().splitlines()[-1])
        kernels[tuning] = {path.name: path.read_bytes() for path in folder.glob("mlx/*/cpu/*.so")}
    tuned, plain = results["1"], results["0"]
    assert tuned["error"] < 1e-6 and tuned["values"] == plain["values"]  # each element rounded as before
    assert not plain["native"] and plain["rewritten"] == 0
    flags = runtime.accepted_flags(runtime.NATIVE_FLAGS[runtime.platform.machine()])
    assert tuned["native"] and tuned["rewritten"] >= 1
    assert tuned["commands"] == [
        f'g++ {flags} -std=c++17 -O3 -Wall -fPIC -shared "k.cpp" -o "k.so" 2>&1',
        "g++ --version > /dev/null 2>&1",
        "ls",
    ]
    shared = set(kernels["1"]) & set(kernels["0"])
    assert shared and all(kernels["1"][name] != kernels["0"][name] for name in shared)  # built differently


def test_a_flag_the_compiler_rejects_is_not_given_to_mlx():
    assert not runtime._compiler_accepts("-fno-such-flag-anywhere")


@pytest.mark.skipif(not shutil.which("g++"), reason="asks g++")
def test_a_compiler_refusing_the_vectorizing_flags_still_gets_the_next_set():
    assert runtime.accepted_flags(["-O2 -fno-such-flag-anywhere", "-O2"]) == "-O2"
    assert runtime.accepted_flags(["-fno-such-flag-anywhere"]) is None


def test_every_set_of_kernel_flags_fits_the_helper():
    """kernel_flags' C helper holds FLAGS_BYTES - 1 bytes of flags; a longer set is refused, never cut short."""
    sets = [flags for candidates in runtime.NATIVE_FLAGS.values() for flags in candidates]
    assert sets and all(len(flags.encode()) < kernel_flags.FLAGS_BYTES for flags in sets)
    with pytest.raises(ValueError, match="longer than"):
        kernel_flags.forwarding_popen("-O2 " * kernel_flags.FLAGS_BYTES)


def test_evaluation_width_is_set_at_import_on_several_cores_unless_the_environment_gives_one():
    """MLX_BFS_MAX_WIDTH: LANES_BFS_WIDTH on the CPU with two or more usable cores, so a group's passes alternate in
    MLX's order; the environment's value is kept; nothing with one core or with tuning off."""
    code = """
        import os, sys
        if len(sys.argv) > 1:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import mlx_encoders
        from mlx_encoders.engine import runtime
        print(os.environ.get("MLX_BFS_MAX_WIDTH"), runtime.BFS_WIDTH)
    """
    env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}

    def width(*args, **settings) -> list[str]:
        command = [sys.executable, "-c", textwrap.dedent(code), *args]
        done = subprocess.run(command, capture_output=True, text=True, env={**env, **settings}, check=True, timeout=300)
        return done.stdout.split()

    expected = str(runtime.LANES_BFS_WIDTH)
    assert width() == ([expected, expected] if runtime.usable_cores() > 1 else ["None", "None"])
    assert width(MLX_BFS_MAX_WIDTH="7") == ["7", "None"]
    assert width(MLX_ENCODERS_CPU_TUNING="0") == ["None", "None"]
    assert width("one core") == ["None", "None"]
    # a parent's import set it: a child decides for itself; a value of the user's own stays
    inherited = {"MLX_BFS_MAX_WIDTH": expected, runtime.BFS_WIDTH_SET: expected}
    assert width(MLX_ENCODERS_CPU_TUNING="0", **inherited) == ["None", "None"]
    assert width("one core", **inherited) == ["None", "None"]
    assert width(**{**inherited, "MLX_BFS_MAX_WIDTH": "9"}) == ["9", "None"]
