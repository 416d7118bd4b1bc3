"""Where one training step's time goes: all-MiniLM-L6-v2 as a sequence classifier (8 labels, a new head), one
optimizer step (forward, backward, AdamW) on a fixed batch of random token ids, dropout off, in MLX (the step
compiled as `fine_tune` compiles it) and in torch, each on 1 and on every thread; then the step's matrix products
alone (the forward, input-gradient and weight-gradient products of its six layers' linears) in each library, and
the same products on one thread called straight into MLX's OpenBLAS on numpy's buffers (which numpy backs with 2 MB
transparent huge pages where the system allows them) and on 4 KB pages, and into MKL with `--mkl` (the libmkl_rt.so
of pip's `mkl` wheel, sequential): what MLX adds to its BLAS, and what torch's BLAS gains over it.

Each configuration runs in its own process (thread counts are fixed when a library starts); wall and CPU seconds a
step are the medians of `--steps` steps after 3 of warm-up. CPU above wall x 1 on one thread, or above the products'
share on every thread, is time a thread spends waiting busily (OpenBLAS's workers spin between products: MLX's
stream thread runs the element-wise work alone meanwhile).

    python benchmarks/train_step.py
    python benchmarks/train_step.py --batch-size 32 --max-length 64 --steps 8
    python benchmarks/train_step.py --mkl <venv>/lib/libmkl_rt.so.3   # after pip install mkl
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

from embed import model_folder  # the sibling benchmark's: the real MiniLM folder
from isolated import worker_result

LABELS = 8


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def timed(step, steps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        step()
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), cpu_seconds()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(cpu_seconds() - cpu)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def products(library: str, tokens: int) -> list:
    """Zero-argument callables for a step's linear products: (tokens x in) @ W^T, its input gradient and its
    weight gradient, for each linear of one BERT layer of all-MiniLM-L6-v2 (384 wide, 1536 inner)."""
    shapes = [(384, 384)] * 4 + [(384, 1536), (1536, 384)]
    calls = []
    if library == "torch":
        import torch

        for i, o in shapes:
            x, w, g = torch.randn(tokens, i), torch.randn(o, i), torch.randn(tokens, o)
            calls += [lambda x=x, w=w: x @ w.T, lambda g=g, w=w: g @ w, lambda g=g, x=x: g.T @ x]
        return calls
    import mlx.core as mx

    for i, o in shapes:
        x, w, g = mx.random.normal((tokens, i)), mx.random.normal((o, i)), mx.random.normal((tokens, o))
        mx.eval(x, w, g)
        calls += [lambda x=x, w=w: mx.eval(x @ w.T), lambda g=g, w=w: mx.eval(g @ w),
                  lambda g=g, x=x: mx.eval(g.T @ x)]  # fmt: skip
    return calls


def blas_products(path: str, tokens: int, huge_pages: bool) -> list:
    """`products`' calls straight into the BLAS at `path` (cblas_sgemm, row-major, on one thread) on numpy buffers,
    on 2 MB pages or (`huge_pages` off) 4 KB ones."""
    import numpy as np

    (getattr(np, "_core", None) or np.core).multiarray._set_madvise_hugepage(huge_pages)  # numpy 2 moved it
    library = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    prefix = "scipy_" if hasattr(library, "scipy_cblas_sgemm") else ""
    if hasattr(library, prefix + "openblas_set_num_threads"):
        getattr(library, prefix + "openblas_set_num_threads")(1)
    sgemm = getattr(library, prefix + "cblas_sgemm")
    pointer, size = ctypes.c_void_p, ctypes.c_int
    sgemm.argtypes = [size] * 6 + [ctypes.c_float, pointer, size, pointer, size, ctypes.c_float, pointer, size]
    row_major, plain, transposed = 101, 111, 112
    rng = np.random.default_rng(0)

    def product(a, b, a_t: bool, b_t: bool):
        m, k = (a.shape[1], a.shape[0]) if a_t else a.shape
        n = b.shape[0] if b_t else b.shape[1]
        c = np.empty((m, n), np.float32)
        flags = (transposed if a_t else plain, transposed if b_t else plain)
        return lambda: sgemm(row_major, *flags, m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1],
                             0.0, c.ctypes.data, n)  # fmt: skip

    calls = []
    for i, o in [(384, 384)] * 4 + [(384, 1536), (1536, 384)]:
        x, w, g = (rng.standard_normal(shape, dtype=np.float32) for shape in ((tokens, i), (o, i), (tokens, o)))
        calls += [product(x, w, False, True), product(g, w, False, False), product(g, x, True, False)]
    return calls


def worker(library: str, threads: int, batch: int, length: int, steps: int) -> dict:
    if library.startswith("blas:"):  # blas:<huge pages 0|1>:<path>: the products alone
        _, huge, path = library.split(":", 2)
        calls = blas_products(path, batch * length, huge == "1")
        return {"products": {k: 6 * v for k, v in timed(lambda: [c() for c in calls], steps).items()}}
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (batch, length))
    labels = rng.integers(0, LABELS, (batch,))
    if library == "torch":
        import torch
        import transformers

        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity_error()
        classifier = transformers.AutoModelForSequenceClassification
        model = classifier.from_pretrained(model_folder(), num_labels=LABELS).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
        x, y = torch.tensor(ids), torch.tensor(labels)

        def step():
            model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    else:
        import warnings

        import mlx.core as mx
        import mlx.optimizers as optim

        import mlx_encoders
        from mlx_encoders.train.compiling import compiled_value_and_grad

        warnings.simplefilter("ignore")  # the new head's "newly initialized" warning
        model, _ = mlx_encoders.load(model_folder(), task="sequence-classification", num_labels=LABELS)
        model.eval()
        optimizer = optim.AdamW(2e-4)
        batch_arrays = {"input_ids": ids.astype(np.int32), "attention_mask": np.ones_like(ids, np.int32),
                        "labels": labels.astype(np.int32)}  # fmt: skip
        loss_and_grad = compiled_value_and_grad(model, [mx.random.key(0)])

        def step():
            loss, grads = loss_and_grad(batch_arrays)
            optimizer.update(model, grads)
            mx.eval(loss, model.parameters(), optimizer.state)

    calls = products(library, batch * length)
    with mlx_blas_threads(library, threads):  # MLX's OpenBLAS, as the engine sets it for one thread
        result = {"step": timed(step, steps), "products": timed(lambda: [c() for c in calls], steps)}
    result["products"] = {k: 6 * v for k, v in result["products"].items()}  # six layers
    return result


def mlx_blas_threads(library: str, threads: int):
    """MLX's OpenBLAS on one thread where one is asked (`runtime.one_blas_thread`); nothing otherwise."""
    if library == "torch" or threads != 1:
        return nullcontext()
    from mlx_encoders.engine.runtime import one_blas_thread

    return one_blas_thread()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mkl", help="MKL's libmkl_rt.so: its products on one thread beside OpenBLAS's")
    p.add_argument("--worker", nargs=2, metavar=("LIBRARY", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        library, threads = args.worker[0], int(args.worker[1])
        result = worker(library, threads, args.batch_size, args.max_length, args.steps)
        print("RESULT " + json.dumps(result))
        return
    every = os.cpu_count() or 1
    print(f"all-MiniLM-L6-v2 classifier, batch {args.batch_size} x {args.max_length} tokens, median of {args.steps} "
          f"steps; {every} cores")  # fmt: skip
    print(f"{'library':<8}{'threads':>8}{'step wall s':>13}{'step CPU s':>12}{'products wall s':>17}"
          f"{'products CPU s':>16}")  # fmt: skip
    for library in ("mlx", "torch"):
        for threads in sorted({1, every}):
            env = os.environ | {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
            sizes = ["--batch-size", str(args.batch_size), "--max-length", str(args.max_length)]
            command = [sys.executable, __file__, "--worker", library, str(threads), *sizes, "--steps", str(args.steps)]
            r = worker_result(command, f"{library} on {threads} threads", env)
            print(f"{library:<8}{threads:>8}{r['step']['wall']:>13.3f}{r['step']['cpu']:>12.3f}"
                  f"{r['products']['wall']:>17.3f}{r['products']['cpu']:>16.3f}", flush=True)  # fmt: skip
    from mlx_encoders.engine.runtime import BLAS

    direct = []
    if BLAS is not None:
        direct += [("MLX's OpenBLAS, 2 MB pages", "1", BLAS.path), ("MLX's OpenBLAS, 4 KB pages", "0", BLAS.path)]
    direct += [("MKL (sequential)", "1", args.mkl)] if args.mkl else []
    print("\nthe same products on one thread, called straight into a BLAS on numpy's buffers")
    for name, huge, path in direct:
        # libmkl_rt opens its sequential and processor-specific parts by name, from the library path
        library_path = os.pathsep.join(filter(None, [os.path.dirname(path), os.environ.get("LD_LIBRARY_PATH")]))
        env = os.environ | {
            "MKL_THREADING_LAYER": "SEQUENTIAL",
            "OPENBLAS_NUM_THREADS": "1",
            "LD_LIBRARY_PATH": library_path,
        }
        sizes = ["--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--steps", str(args.steps)]
        r = worker_result([sys.executable, __file__, "--worker", f"blas:{huge}:{path}", "1", *sizes], name, env)
        print(f"{name:<30}{r['products']['wall']:>8.3f} s", flush=True)


if __name__ == "__main__":
    main()
