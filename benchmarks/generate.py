"""Greedy generation speed: mlx_encoders (float32, 8-bit) vs transformers (torch CPU) and mlx-lm, in one run.

Models: GPT-2 small's shape (124M parameters) and a tiny one, random seeded weights saved with transformers'
`save_pretrained` (no weights ship offline). Prompts: random token ids, `--prompt-tokens` long, batch 1 and
batch 8 (equal lengths, so nothing is padded). Each engine prefills the prompt and decodes `--new-tokens`
tokens greedily with its key/value cache; prompt tokens/s = batch x prompt length / time to the first new
token, generated tokens/s = batch x (new tokens - 1) / the time after it. Best of `--repeats` runs, taken
round-robin so background load hits every engine alike. transformers runs in a spawned process of its own
(`isolated.py`), so that its products use torch's own BLAS, not the OpenBLAS mlx_encoders loads for MLX.

Decoding one sequence reads every weight once per token, so its physical limit is memory bandwidth, not
arithmetic: the run measures how fast a matrix-vector product streams a float32 matrix larger than the
last-level cache (numpy's BLAS, all cores) and prints each float32 engine's decoding at batch 1 as a share
of the rate that bandwidth allows (bytes of the weights a step reads / bandwidth).

    python benchmarks/generate.py                                    # every model, engine and batch size
    python benchmarks/generate.py --models tiny --new-tokens 32 --repeats 1
    python benchmarks/generate.py --device cuda --models small      # on a GPU: MLX's CUDA backend, torch's CUDA

mlx-lm is for this benchmark only (`pip install mlx-lm --no-deps`); it is skipped when absent. It runs its own
`generate_step` at batch 1 and, having no batched greedy loop of that shape, its model and cache in a plain
greedy loop at batch 8; its 8-bit model is `nn.quantize` at `--group-size`, as ours (convert, no GPTQ). On the
CPU its 8-bit model runs MLX's quantized matmul kernel, which is slow: the 124M model at batch 8 takes minutes
(`--engines` leaves it out).
"""

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = {
    "tiny": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=8192, n_positions=512),
    "small": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),  # GPT-2 small, 124M
}
ENGINES = ("mlx_encoders-fp32", "mlx_encoders-8bit", "transformers", "mlx-lm-fp32", "mlx-lm-8bit")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=64, help="8-bit group size, both MLX engines")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of: " + ", ".join(ENGINES))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every engine runs")
    return p.parse_args()


def make_checkpoint(shape: str, folder: Path) -> tuple[Path, int]:
    """(the folder of a seeded random GPT-2 of that shape, its parameter count: the tied head counted once)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(**SHAPES[shape], bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder / shape)
    return folder / shape, sum(p.numel() for p in model.parameters())


def stream_bandwidth(device: str, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second a float32 matrix-vector product reads, on a matrix of `megabytes` (past any cache): numpy's
    on the CPU, torch's on a GPU."""
    import numpy as np
    import torch

    shape = (megabytes * 2**20 // 4 // 4096, 4096)
    if device == "cuda":
        matrix, vector = torch.randn(shape, device=device), torch.randn(shape[1], device=device)
    else:
        matrix, vector = np.ones(shape, np.float32), np.ones(shape[1], np.float32)
    best = float("inf")
    for _ in range(repeats if device == "cpu" else 4 * repeats):
        start = time.perf_counter()
        matrix @ vector
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 4 * shape[0] * shape[1] / best


def stepwise(steps) -> tuple[float, float]:
    """(seconds to the first step of a generator of steps, seconds for the rest)."""
    start = time.perf_counter()
    steps = iter(steps)
    next(steps)
    first = time.perf_counter()
    for _ in steps:
        pass
    return first - start, time.perf_counter() - first


def mlx_encoders_engine(path: Path, bits: int | None, group_size: int, folder: Path) -> Callable:
    import mlx_encoders
    from mlx_encoders.generation import GenerationConfig, generate_steps

    if bits:
        path = mlx_encoders.convert(path, folder / f"{path.name}-q{bits}", bits=bits, group_size=group_size,
                                    calibration=False)  # fmt: skip
    model = mlx_encoders.load_model(path)
    config = GenerationConfig(eos_token_id=[])

    def run(prompts, new_tokens: int) -> tuple[float, float]:
        return stepwise(generate_steps(model, prompts, None, config.replace(max_new_tokens=new_tokens)))

    return run


def transformers_model(path: Path, threads: int, device: str) -> Callable:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval().to(device)

    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """The time of each `put`: the prompt's, then each new token's (put once it is chosen)."""

        def __init__(self):
            self.times = []

        def put(self, value):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(prompts, new_tokens: int) -> tuple[float, float]:
        """generate's own loop, timed within one call: the first token, then the rest (two separate calls' difference
        could come out negative)."""
        ids, clock = torch.tensor(prompts).long().to(device), Clock()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, eos_token_id=None, streamer=clock)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        return clock.times[1] - start, end - clock.times[1]

    return run


def transformers_engine(path: Path, threads: int, device: str) -> Callable:
    """transformers in a process of its own (`isolated.Isolated`), torch on its own BLAS: in this process the
    OpenBLAS that mlx_encoders loads for MLX would take torch's products too (1.8x slower for one row)."""
    from isolated import Isolated

    return Isolated(transformers_model, path, threads, device)


def mlx_lm_engine(path: Path, bits: int | None, group_size: int) -> Callable:
    import mlx.core as mx
    import mlx.nn as nn
    import transformers
    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as mlx_lm_cache
    from mlx_lm.models import gpt2

    config = transformers.GPT2Config.from_pretrained(path)
    args = gpt2.ModelArgs(model_type="gpt2", n_ctx=config.n_positions, n_embd=config.n_embd, n_head=config.n_head,
                          n_layer=config.n_layer, n_positions=config.n_positions,
                          layer_norm_epsilon=config.layer_norm_epsilon, vocab_size=config.vocab_size)  # fmt: skip
    model = gpt2.Model(args)
    weights = {k.removeprefix("transformer."): v for k, v in mx.load(str(path / "model.safetensors")).items()}
    model.load_weights(list(model.sanitize(weights).items()))
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())

    def steps(prompts, new_tokens: int):
        if len(prompts) == 1:  # mlx-lm's own loop (it evaluates one step ahead)
            sampler = lambda x: x.argmax(-1)  # noqa: E731
            yield from generate_step(mx.array(prompts[0]), model, max_tokens=new_tokens, sampler=sampler)
            return
        cache = mlx_lm_cache.make_prompt_cache(model)
        tokens = mx.array(prompts)
        for _ in range(new_tokens):
            tokens = model(tokens, cache=cache)[:, -1].argmax(-1, keepdims=True)
            mx.eval(tokens)
            yield tokens

    return lambda prompts, new_tokens: stepwise(steps(prompts, new_tokens))


def build(engine: str, path: Path, group_size: int, folder: Path, threads: int, device: str) -> Callable:
    if engine not in ENGINES:
        raise SystemExit(f"unknown engine {engine!r}; choose among {', '.join(ENGINES)}")
    if engine.startswith("mlx_encoders"):
        return mlx_encoders_engine(path, 8 if engine.endswith("8bit") else None, group_size, folder)
    if engine == "transformers":
        return transformers_engine(path, threads, device)
    return mlx_lm_engine(path, 8 if engine.endswith("8bit") else None, group_size)


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import numpy as np

    import mlx_encoders  # noqa: F401  (first: it gives MLX a fast BLAS on Linux)

    # isort: split
    import mlx.core as mx

    if args.device == "cpu":
        mx.set_default_device(mx.cpu)  # MLX's default is the GPU where there is one

    engines = [e for e in args.engines.split(",") if e]
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        print("mlx-lm is not installed (pip install mlx-lm --no-deps): skipping it")
        engines = [e for e in engines if not e.startswith("mlx-lm")]
    rng = np.random.default_rng(0)
    bandwidth = stream_bandwidth(args.device)
    print(f"memory bandwidth (float32 matrix-vector product, 1 GiB matrix, {args.device}): {bandwidth / 1e9:.1f} GB/s")
    print(f"{args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, greedy; best of {args.repeats}; "
          f"{os.cpu_count()} cores, torch threads {args.threads}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.models.split(","):
            path, parameters = make_checkpoint(shape, Path(tmp))
            runs = {e: build(e, path, args.group_size, Path(tmp), args.threads, args.device) for e in engines}
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = rng.integers(1, SHAPES[shape]["vocab_size"], (batch, args.prompt_tokens)).tolist()
                best = {engine: [float("inf")] * 2 for engine in engines}
                for run in runs.values():  # warm-up: compile, allocate, fill caches
                    run(prompts, 4)
                for _ in range(args.repeats):
                    for engine, run in runs.items():
                        times = run(prompts, args.new_tokens)
                        best[engine] = [min(a, b) for a, b in zip(best[engine], times, strict=True)]
                print(f"\n{shape} ({parameters / 1e6:.1f}M parameters), batch {batch}")
                print(f"  {'engine':<20}{'prompt tok/s':>14}{'generated tok/s':>17}")
                rates = {}
                for engine, (prefill, decode) in best.items():
                    rates[engine] = (batch * args.prompt_tokens / prefill, batch * (args.new_tokens - 1) / decode)
                    print(f"  {engine:<20}{rates[engine][0]:>14.0f}{rates[engine][1]:>17.1f}")
                if batch == 1:  # a step reads every weight but the position table's other rows, once
                    read = 4 * (parameters - SHAPES[shape]["n_positions"] * SHAPES[shape]["n_embd"])
                    limit = bandwidth / read
                    shares = ", ".join(f"{e} {rates[e][1] / limit:.0%}" for e in rates if "8bit" not in e)
                    print(f"  bandwidth limit for float32 decoding: {limit:.1f} tok/s ({read / 1e6:.0f} MB a "
                          f"step); share reached: {shares}")  # fmt: skip
                for ours in (e for e in rates if e.startswith("mlx_encoders")):
                    peers = [e for e in rates if not e.startswith("mlx_encoders")]
                    ratios = ", ".join(f"{rates[ours][1] / rates[p][1]:.2f}x {p}" for p in peers)
                    if ratios:  # no peer ran (mlx-lm not installed): nothing to compare
                        print(f"  {ours} decoding: {ratios}")


if __name__ == "__main__":
    main()
