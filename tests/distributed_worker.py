"""What each rank runs when tests/test_distributed.py starts `mlx.launch ... python distributed_worker.py SPEC`.

SPEC is a JSON file: `fine_tune` (name -> keyword arguments, each call's outcome, returned metrics and count of
evaluation batches this rank scored recorded; a `loss` may name a loss class and its options), `gather` (an .npz of
anchors, positives and a weight matrix: this rank's gradient of an MNRL-like loss, summed over ranks, is saved),
`sums` (an .npz of each rank's arrays: their `distributed.all_sum` is saved, with the sizes of the buffers sent),
`cli` (arguments of `mlx-encoders`, "{RANK}" replaced by the rank, its exit status recorded) and
`kill_rank`/`kill_at_step` (that rank kills itself with SIGKILL before that step). Each rank writes
`status-RANK.json` beside SPEC, as mlx.launch can exit 0 when a rank failed.
"""

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_encoders import distributed, ring
from mlx_encoders.__main__ import main
from mlx_encoders.train import fine_tune, trainer
from mlx_encoders.train.losses import contrastive


def run_fine_tune(jobs: dict, status: dict) -> None:
    """Each job's outcome (`fine_tune`), what it returned (`returned`), how many items of `shared_map` (evaluation
    batches) this rank scored (`scored`) and the size of the last buffer it gave `mx.distributed.all_sum` (`last_sum`:
    its last step's gradients); a `loss` given as {"class": NAME, **options} is that class of
    `train.losses.contrastive`."""
    outcomes, returned, scored = status["fine_tune"], status["returned"], status["scored"]
    share = distributed.shared_map

    def counting(fn, items, *args, **kwargs):
        def counted(item):
            scored[name] = scored.get(name, 0) + 1
            return fn(item)

        return share(counted, items, *args, **kwargs)

    distributed.shared_map = counting
    for name, job in jobs.items():
        if "data_by_rank" in job:  # each rank its own copy of the data
            mine = job["data_by_rank"][distributed.world().rank]
            job = {k: v for k, v in job.items() if k != "data_by_rank"} | {"data": mine}
        if isinstance(job.get("loss"), dict):
            options = dict(job["loss"])
            job = {**job, "loss": getattr(contrastive, options.pop("class"))(**options)}
        with recorded_sums() as sent:
            try:
                trained = fine_tune(**job)
                returned[name] = {k: float(v) for k, v in trained.metrics.items()}
                outcomes[name] = "ok" if Path(trained.path).is_dir() else f"returned before {trained.path} was saved"
            except Exception as e:  # recorded for the test to judge
                outcomes[name] = f"{type(e).__name__}: {e}"
        flags = distributed.world().size  # `agree`'s buffers: a flag a rank
        status["last_sum"][name] = next((n for n in reversed(sent) if n != flags), 0)  # the last step's gradients


@contextmanager
def recorded_sums() -> Iterator[list[int]]:
    """Inside, the size of every buffer summed over ranks (by `mx.distributed.all_sum` or the ranks' own sockets,
    `ring.Ring.all_sum`), in order."""
    all_sum, socket_sum, sizes = mx.distributed.all_sum, ring.Ring.all_sum, []

    def recorded(x, *args, **kwargs):
        sizes.append(x.size)
        return all_sum(x, *args, **kwargs)

    def recorded_socket_sum(self, buffer):
        sizes.append(buffer.size)
        return socket_sum(self, buffer)

    mx.distributed.all_sum, ring.Ring.all_sum = recorded, recorded_socket_sum
    try:
        yield sizes
    finally:
        mx.distributed.all_sum, ring.Ring.all_sum = all_sum, socket_sum


def mnrl(weights: mx.array, anchors: mx.array, positives: mx.array, first: int, gather) -> mx.array:
    """In-batch-negatives loss of this rank's anchors against every rank's positives (cosine scores x 20)."""
    a, p = mx.tanh(anchors @ weights), gather(mx.tanh(positives @ weights))
    a = a / mx.linalg.norm(a, axis=-1, keepdims=True)
    p = p / mx.linalg.norm(p, axis=-1, keepdims=True)
    return nn.losses.cross_entropy(20 * a @ p.T, mx.arange(len(a)) + first).mean()


def gather_gradients(path: str, out: Path, world: distributed.World) -> None:
    data = np.load(path)
    b = len(data["anchors"]) // world.size
    mine = slice(world.rank * b, (world.rank + 1) * b)
    anchors, positives = mx.array(data["anchors"][mine]), mx.array(data["positives"][mine])
    gathers = {"ours": distributed.all_gather, "mlx": lambda x: mx.distributed.all_gather(x, group=world.group)}
    grads = {}
    for name, gather in gathers.items():
        grad = mx.grad(mnrl)(mx.array(data["weights"]), anchors, positives, world.rank * b, gather) / world.size
        grads[name] = np.array(mx.distributed.all_sum(grad, group=world.group))
    np.savez(out / f"gradients-{world.rank}.npz", **grads)


def sum_tables(path: str, out: Path, world: distributed.World) -> None:
    """`distributed.all_sum` of this rank's arrays in the .npz at `path` (`NAME-RANK`), "table" and "full" named as
    embedding tables; saves the sums and the size of each buffer given to `mx.distributed.all_sum`."""
    data = np.load(path)
    tree = {name: mx.array(data[f"{name}-{world.rank}"]) for name in ("table", "dense", "full")}
    with recorded_sums() as sizes:
        summed = distributed.all_sum(tree, world, "the test's sum", tables={"table", "full"})
    np.savez(out / f"sums-{world.rank}.npz", sizes=np.array(sizes), **{k: np.array(v) for k, v in summed.items()})


def kill_at(rank: int, step: int, world: distributed.World) -> None:
    """Make `rank` die (SIGKILL: no cleanup, as a crash or a lost machine) just before `step`."""
    take_step = trainer.Loop.step

    def step_or_die(self, indices):
        if world.rank == rank and self.state.step + 1 == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return take_step(self, indices)

    trainer.Loop.step = step_or_die


def run(spec_path: Path) -> dict:
    spec = json.loads(spec_path.read_text())
    world = distributed.world()
    status = {"rank": world.rank, "size": world.size}
    if "kill_rank" in spec:
        kill_at(spec["kill_rank"], spec["kill_at_step"], world)
    if "fine_tune" in spec:
        status |= {"fine_tune": {}, "returned": {}, "scored": {}, "last_sum": {}}
        run_fine_tune(spec["fine_tune"], status)
    if "gather" in spec:
        gather_gradients(spec["gather"], spec_path.parent, world)
    if "sums" in spec:
        sum_tables(spec["sums"], spec_path.parent, world)
        status["exchange"] = "sockets" if distributed.ring_of(world) is not None else "mlx"
    if "cli" in spec:  # "{RANK}" in an argument: this rank's number (each rank its own file)
        status["cli"] = main([a.replace("{RANK}", str(world.rank)) for a in spec["cli"]])
    return status


if __name__ == "__main__":
    spec_path = Path(sys.argv[1])
    status = run(spec_path)
    part = spec_path.parent / f"status-{status['rank']}.part"
    part.write_text(json.dumps(status))
    part.replace(part.with_suffix(".json"))  # whole or absent: mlx.launch may kill this rank meanwhile
    sys.exit(status.get("cli", 0))
