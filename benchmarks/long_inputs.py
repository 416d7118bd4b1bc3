"""Long inputs on ModernBERT: the sliding-window layers as a band (`modernbert.banded_attention`) and the global
layers a block of queries at a time (`engine.attention.blockwise_attention`), against the full L x L scores and mask, in
seconds per forward pass, peak memory and outputs.

A ModernBERT-base-shaped encoder with random weights (hidden 768, 22 layers, 12 heads, intermediate 1152,
local_attention 128, a global layer every 3, max_position_embeddings 8192) embeds `--batch` sequences of each
of `--lengths` tokens. Each form at each length runs in its own process (so its peak memory is its own): the
banded form as the library runs it, and the full form as short inputs still run: `modernbert.attention_masks`
patched to return the (B, 1, L, L) sliding mask at every length, and `engine.attention.BLOCKWISE_FROM` raised past L, so
the global layers hold all (B, heads, L, L) float32 scores at once (printed beside the results: they bound the
full form's peak from below). Both build the same weights (one seed) and inputs; a warm-up pass (whose output
is saved, to compare the forms), then `--repeats` timed passes. Peak memory is the process's resident set
(`ru_maxrss`: imports, weights and activations) and MLX's own peak (`mx.get_peak_memory`: weights and
activations). MLX's float32 matmul GFLOP/s, measured at the end of the same run, says how fast the machine was.

    python benchmarks/long_inputs.py                                   # 1024, 4096 and 8192 tokens
    python benchmarks/long_inputs.py --lengths 8192 --repeats 2
    python benchmarks/long_inputs.py --lengths 8192 --layers 3         # one global and two sliding layers
    python benchmarks/long_inputs.py --lengths 512 --layers 2          # a quick check
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODERNBERT_BASE = dict(
    model_type="modernbert", hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
    local_attention=128, global_attn_every_n_layers=3, max_position_embeddings=8192,
)  # fmt: skip
FORMS = ("banded", "full")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192", help="comma-separated token counts (default 1024,4096,8192)")
    p.add_argument("--layers", type=int, default=22, help="encoder layers (default 22; layer 0, 3, 6, ... global)")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward pass (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes after the warm-up (default 1)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats < 1 or args.batch < 1 or args.layers < 1:
        p.error("--repeats, --batch and --layers must be at least 1")
    return args


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def force_full_masks() -> None:
    """Patch `modernbert.attention_masks` so that the sliding layers get the additive (B|1, 1, L, L) mask at
    every length, never a Band, and the global layers attend in one block: the form before banded and blockwise
    attention, which short inputs still get."""
    import mlx.core as mx

    from mlx_encoders.engine import attention as kernels
    from mlx_encoders.models import modernbert

    kernels.BLOCKWISE_FROM = sys.maxsize

    original = modernbert.attention_masks

    def full_masks(attention_mask, L: int, half_window: int, dtype):
        global_mask, sliding = original(attention_mask, L, half_window, dtype)
        if isinstance(sliding, modernbert.Band):
            idx = mx.arange(L)
            keep = mx.abs(idx[:, None] - idx[None]) <= half_window  # (L, L)
            if attention_mask is not None:
                keep = keep & attention_mask.astype(mx.bool_)[:, None, None, :]  # (B, 1, L, L)
            sliding = mx.where(keep, mx.array(0, dtype), mx.array(modernbert.mask_value(dtype), dtype))
        return global_mask, sliding

    modernbert.attention_masks = full_masks


def worker(job: dict) -> None:
    import mlx_encoders  # noqa: F401  (gives MLX the system OpenBLAS)

    # isort: split
    import mlx.core as mx

    from mlx_encoders.models import model_class, modernbert

    if job["form"] == "full":
        force_full_masks()
    mx.random.seed(0)
    args = modernbert.ModelArgs.from_dict({**MODERNBERT_BASE, "num_hidden_layers": job["layers"]})
    model = model_class("modernbert", "encoder")(args)
    ids = mx.random.randint(5, 50000, (job["batch"], job["length"]), key=mx.random.key(1))
    mask = mx.ones(ids.shape, mx.int32)
    mx.eval(model.parameters(), ids, mask)
    mx.reset_peak_memory()
    hidden = model(ids, mask).last_hidden_state
    mx.eval(hidden)
    np.save(job["out"], np.array(hidden))
    del hidden
    start = time.perf_counter()
    for _ in range(job["repeats"]):
        mx.eval(model(ids, mask).last_hidden_state)
    seconds = (time.perf_counter() - start) / job["repeats"]
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb(), "mlx_peak_mb": mx.get_peak_memory() / 2**20}))


def run_worker(job: dict) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{job['form']} at {job['length']} tokens failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    heads = MODERNBERT_BASE["num_attention_heads"]
    print(f"ModernBERT-base-shaped encoder, {args.layers} layers, batch {args.batch}, one process per form and "
          f"length; {args.repeats} timed passes after a warm-up")  # fmt: skip
    print(f"{'tokens':>7}{'form':>8}{'s/forward':>11}{'peak RSS MB':>13}{'MLX peak MB':>13}{'global scores MB':>18}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            results = {}
            for form in FORMS:
                out = str(Path(tmp) / f"{form}-{length}.npy")
                job = dict(form=form, length=length, layers=args.layers, batch=args.batch, repeats=args.repeats,
                           out=out)  # fmt: skip
                results[form] = r = run_worker(job)
                scores_mb = args.batch * heads * length * length * 4 / 2**20
                print(f"{length:>7}{form:>8}{r['seconds']:>11.2f}{r['peak_mb']:>13.0f}{r['mlx_peak_mb']:>13.0f}"
                      f"{scores_mb:>18.0f}", flush=True)  # fmt: skip
            outputs = [np.load(Path(tmp) / f"{form}-{length}.npy") for form in FORMS]
            rows.append((length, results, float(np.abs(outputs[0] - outputs[1]).max())))
    print("\nbanded against full (speed: full s / banded s; memory: banded peak / full peak)")
    print(f"{'tokens':>7}{'speed':>9}{'RSS':>8}{'MLX peak':>10}{'max |diff|':>13}")
    for length, r, diff in rows:
        banded, full = r["banded"], r["full"]
        print(f"{length:>7}{full['seconds'] / banded['seconds']:>8.2f}x{banded['peak_mb'] / full['peak_mb']:>8.2f}"
              f"{banded['mlx_peak_mb'] / full['mlx_peak_mb']:>10.2f}{diff:>13.2e}")  # fmt: skip
    import mlx_encoders  # noqa: F401  (after the workers: none inherits its memory; before MLX: the BLAS)

    # isort: split
    from embed import mlx_blas, sgemm_limit  # the sibling benchmark's: MLX's float32 matmul rate, the BLAS mapped

    print(f"\nsgemm measured now: {sgemm_limit():.1f} GFLOP/s; BLAS mapped: {mlx_blas()}")


if __name__ == "__main__":
    main()
