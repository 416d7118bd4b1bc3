"""Peak resident memory and speed of a BERT-base-shaped model while embedding: float32 against 8-bit and 4-bit.

A random BERT-base-shaped encoder (12 layers, width 768, feed-forward 3072, vocabulary 30522) is saved once in
float32 and once quantized (convert's layout: `quantize_model`, group size 32, rounded to nearest); each then runs
in its own process (so peak memory is that engine's alone): `load_model`, a warm-up pass, then `--repeats` timed
passes of `--batch` sequences of `--length` tokens, mean-pooled, in forward passes of as many rows as
SentenceEncoder gives that model on the CPU (`engine.batching.slice_rows`: activations within CPU_SLICE_BYTES, and a
quantized model at least `quantized.least_group_tokens` tokens a group of passes), or of `--rows` rows for every
engine, run as SentenceEncoder runs them (`engine.batching.run_in_lanes`: a group's passes on every core at
once). The peak
resident set (`ru_maxrss`) covers loading and embedding; the process's peak after its imports, before loading,
is printed beside it. On the CPU the quantized weights stay quantized in memory: each is dequantized just before
its matmul and freed after.

    python benchmarks/quantized_memory.py
    python benchmarks/quantized_memory.py --bits 8 --batch 16 --length 256
    python benchmarks/quantized_memory.py --rows 4          # the same rows per pass for every engine
    python benchmarks/quantized_memory.py --slice-tokens 1024   # quantized passes of at least 1024 tokens

The speeds of separate processes move 10-20% between runs here. `--alternate ROUNDS` times the engines in one
process instead, taking turns ROUNDS times over the same tokens, the quantized ones at each token floor of
`--floors`, and prints each one's median pass (speed only: memory needs a process per engine):

    python benchmarks/quantized_memory.py --alternate 4 --floors 256,512
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BERT_BASE = dict(
    model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
)  # fmt: skip


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def write_models(folder: Path, bits: list[str]) -> dict[str, Path]:
    import mlx_encoders  # noqa: F401  (first: the fast BLAS)

    # isort: split
    import mlx.core as mx

    from mlx_encoders import save
    from mlx_encoders.models import model_class, model_module
    from mlx_encoders.quantization import quantize_model

    def build():
        mx.random.seed(0)
        args = model_module("bert").ModelArgs.from_dict(BERT_BASE)
        return model_class("bert", "encoder")(args, add_pooling_layer=False)

    folders = {"float32": save(build(), folder / "float32")}
    for b in bits:
        model = build()
        quantize_model(model, bits=int(b))
        folders[f"{b}-bit"] = save(model, folder / f"{b}bit")
    return folders


def embed(model, ids, rows: int | None, tokens: int) -> tuple[float, int]:
    """(seconds to embed `ids` mean-pooled, rows a pass) as SentenceEncoder runs it on the CPU: passes of `rows` rows
    (default: `engine.batching.slice_rows`, with the `tokens` floor spread over a group's passes) in
    `engine.batching.run_in_lanes`,
    which runs a group's passes on every core at once and dequantizes a quantized model's weights once a group."""
    import numpy as np

    from mlx_encoders.engine.batching import CPU_SLICE_BYTES, run_in_lanes, slice_rows

    length, used = ids.shape[1], []

    def groups(size: int):
        used.append(rows or slice_rows(model.args, length, CPU_SLICE_BYTES, -(-tokens // size)))
        starts = [slice(first, first + used[-1]) for first in range(0, ids.shape[0], used[-1])]
        return [starts[i : i + size] for i in range(0, len(starts), size)]

    start = time.perf_counter()
    run_in_lanes(groups, lambda r: [model(ids[r]).last_hidden_state.mean(axis=1)], lambda r, a: np.array(a[0]))
    return time.perf_counter() - start, used[-1]


def worker(folder: str, batch: int, rows: int | None, slice_tokens: int | None, length: int, repeats: int) -> None:
    import mlx_encoders  # noqa: F401

    # isort: split
    import mlx.core as mx

    from mlx_encoders import load_model
    from mlx_encoders.engine.quantized import least_group_tokens

    imported = peak_mb()
    model = load_model(folder)
    ids = mx.random.randint(1000, 30000, (batch, length), key=mx.random.key(0))
    tokens = least_group_tokens(model)
    tokens = slice_tokens if tokens and slice_tokens is not None else tokens

    _, used = embed(model, ids, rows, tokens)
    seconds = sum(embed(model, ids, rows, tokens)[0] for _ in range(repeats)) / repeats
    print(json.dumps({"imported_mb": imported, "peak_mb": peak_mb(), "seconds": seconds, "rows": used}))


def alternate(folders: dict[str, str], batch: int, length: int, rounds: int, floors: list[int]) -> None:
    import mlx_encoders  # noqa: F401

    # isort: split
    import mlx.core as mx

    from mlx_encoders import load_model

    ids = mx.random.randint(1000, 30000, (batch, length), key=mx.random.key(0))
    engines = {}
    for name, folder in folders.items():
        model = load_model(folder)
        for floor in [0] if name == "float32" else floors:
            engines[f"{name}, {floor}-token floor" if floor else name] = (model, floor)

    times, used = {name: [] for name in engines}, {}
    for name, (model, floor) in engines.items():
        used[name] = embed(model, ids, None, floor)[1]  # warm-up
    for _ in range(rounds):
        for name, (model, floor) in engines.items():
            times[name].append(embed(model, ids, None, floor)[0])
    base = statistics.median(times["float32"])
    print(f"BERT-base-shaped encoder, {batch} x {length} tokens, engines taking turns {rounds} times in one process")
    print(f"{'engine':<30}{'rows/pass':>10}{'median s':>10}{'speed / fp32':>14}  passes (s)")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"{name:<30}{used[name]:>10}{median:>10.2f}{base / median:>13.2f}x  "
              f"{' '.join(f'{x:.2f}' for x in t)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", default="8,4", help="comma-separated bit widths (default 8,4)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rows", type=int, help="rows per forward pass for every engine (default: SentenceEncoder's)")
    p.add_argument("--slice-tokens", type=int, help="least tokens a group of passes of a quantized model holds")
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alternate", type=int, metavar="ROUNDS", help="time the engines in turns in one process")
    p.add_argument("--floors", default="256,512", help="--alternate's token floors of the quantized models")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--write", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.batch, args.rows, args.slice_tokens, args.length, args.repeats)
        return
    if args.write:
        print(json.dumps({k: str(v) for k, v in write_models(Path(args.write), args.bits.split(",")).items()}))
        return
    # Every step in its own process, this one importing nothing large: Linux carries ru_maxrss over fork + exec.
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, __file__, "--write", tmp, "--bits", args.bits]
        written = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        folders = json.loads(written.strip().splitlines()[-1])
        if args.alternate:
            floors = [int(f) for f in args.floors.split(",")]
            alternate(folders, args.batch, args.length, args.alternate, floors)
            return
        results = {}
        for name, folder in folders.items():
            command = [sys.executable, __file__, "--worker", str(folder), "--batch", str(args.batch), "--length",
                       str(args.length), "--repeats", str(args.repeats)]  # fmt: skip
            command += ["--rows", str(args.rows)] if args.rows else []
            command += ["--slice-tokens", str(args.slice_tokens)] if args.slice_tokens is not None else []
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
    base = results["float32"]
    print(f"BERT-base-shaped encoder, {args.batch} x {args.length} tokens per pass, one process per engine")
    print(f"{'engine':<10}{'rows/pass':>10}{'peak MB':>9}{'after imports':>15}{'peak / fp32':>13}{'s/pass':>8}"
          f"{'speed / fp32':>14}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<10}{r['rows']:>10}{r['peak_mb']:>9.0f}{r['imported_mb']:>15.0f}"
              f"{r['peak_mb'] / base['peak_mb']:>13.2f}{r['seconds']:>8.2f}"
              f"{base['seconds'] / r['seconds']:>13.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
