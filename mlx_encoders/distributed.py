"""Data parallelism on `mx.distributed`, after mlx-lm's `tuner/trainer.py` (rank-strided batches, gradients summed
with `all_sum` inside the step): the world this process belongs to, each rank's slice of a global batch, gradients
reduced over ranks, and an `all_gather` whose gradient reaches every rank (for in-batch negatives).

Every rank builds the same global batch (same order, same masks), takes rows `rank::size` and weights its loss by
its share of the batch's labelled items, so the summed gradients equal one process's on the whole batch. A loss
over the whole batch (in-batch negatives, pairs of pairs) instead takes this rank's `gathered_part`, and every
rank computes the global loss over every rank's outputs (`gather_rows`); its share is that loss over the world
size. Evaluation is shared out by batches instead (`shared_map`: each rank runs every world-size-th one, and every
rank gets all the results). A collective that fails (a rank died: the ring backend reports a lost connection) or
stalls past `TIMEOUT_ENV` seconds ends this rank with an error naming the rank(s) it lost. Where the ranks have a
ring hostfile, `all_sum` goes over their own blocking sockets (`ring_of`, `ring.Ring`), not MLX's polling ones.
"""

import math
import os
import pickle
import re
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from . import ring
from .errors import CommandError

T, R = TypeVar("T"), TypeVar("R")
BARRIER_ENV = "MLX_ENCODERS_BARRIER"  # "ARRIVE:GO": the pipes `wait_for_all` uses, from `mlx-encoders launch`
TIMEOUT_ENV = "MLX_ENCODERS_COLLECTIVE_TIMEOUT"  # seconds a collective may wait for the other ranks
DEFAULT_TIMEOUT = 600.0  # generous: the others wait at the next step while rank 0 writes a checkpoint
MAX_TIMER_S = 2**31 / 1000  # longer waits (inf among them) have no limit: timers and sockets take no more
# An embedding table's gradient travels as the rows some rank changed when they are at most this share of its rows:
# a fine-tuning batch touches a few thousand of a vocabulary's 30k or more words (a tied output layer, all of them).
SPARSE_ROWS_SHARE = 0.5
EXCHANGE_ENV = "MLX_ENCODERS_EXCHANGE"  # "sockets" (default: `ring.Ring` where ranks have a ring hostfile) or "mlx"
CONNECT_SECONDS = 30.0  # to join the ranks' sockets: every rank has just left the same collective
# dtypes `all_sum` can send over the ranks' own sockets (numpy's); others (bfloat16) go through mx.distributed
SOCKET_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32, mx.int64: np.int64}


class RankLost(ConnectionError):
    """Another rank stopped (or its connection dropped) while this one waited for it in a collective."""


@dataclass(frozen=True)
class World:
    """This process's place among the processes `mlx.launch` started: `size` ranks, this one `rank`."""

    group: mx.distributed.Group | None
    size: int
    rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and prints progress."""
        return self.rank == 0


@cache
def world() -> World:
    """The world of `mx.distributed.init()`: size 1 (no group) when the process was not started by `mlx.launch`."""
    try:
        group = mx.distributed.init()
    except RuntimeError as e:  # MLX's message alone names neither the address nor what to do
        where = ""
        if os.environ.get("MLX_HOSTFILE"):
            try:
                with open(os.environ["MLX_HOSTFILE"]) as f:
                    where = " at " + ", ".join(re.findall(r"[\w.\-\[\]:]+:\d+", f.read()))
            except OSError:
                where = f" (the addresses in {os.environ['MLX_HOSTFILE']})"
        raise CommandError(
            f"rank {os.environ.get('MLX_RANK', '?')} could not join the other ranks{where}: {e}. If a port is in "
            "use, start the ranks on another one (mlx-encoders launch -p PORT, or another hostfile)"
        ) from e
    if group.size() == 1:
        return World(None, 1, 0)
    return World(group, group.size(), group.rank())


def is_main() -> bool:
    return world().is_main


@contextmanager
def warnings_on_main_rank() -> Iterator[None]:
    """Inside, Python's warnings are shown by rank 0 alone: every rank runs the same call on the same data and
    options, so each would print the same warnings, and `mlx.launch` forwards every rank's output."""
    if is_main():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def rows(batch: dict[str, np.ndarray], world: World) -> dict[str, np.ndarray]:
    """This rank's rows (`rank::size`) of a collated global batch; the padded width stays the batch's."""
    return {name: array[world.rank :: world.size] for name, array in batch.items()}


def weighted_rows(
    batch: dict[str, np.ndarray], count: Callable[[dict], int], world: World, micro_batches: int
) -> tuple[dict[str, np.ndarray], float]:
    """This rank's `rows` of a micro-batch and their weight in the step's mean loss: their share of the micro-batch's
    `count`ed items over the number of micro-batches (0 where it counts none)."""
    mine, total = rows(batch, world), count(batch)
    return mine, count(mine) / total / micro_batches if total else 0.0


@mx.compile
def weighted_add(a: mx.array, a_weight: mx.array, b: mx.array, b_weight: mx.array) -> mx.array:
    return a * a_weight + b * b_weight  # one pass over the arrays, not three


class WeightedSum:
    """Σ weight_i * tree_i over trees of arrays (a step's loss and gradients, part by part), with as few passes over
    them as can be: the first part is kept whole beside its weight (no pass), each later one costs one fused pass, and
    `weight` is left for the caller to apply where it copies the arrays anyway (`all_sum`'s flat buffer), or by
    `result()`. `tree` is None until a part is added. A caller that lets go of its parts once added lets MLX write
    each sum into their buffers."""

    def __init__(self):
        self.tree, self.weight = None, 1.0

    def add(self, tree, weight: float) -> None:
        if self.tree is None:
            self.tree, self.weight = tree, weight
            return
        first, weight = self.weight, weight
        self.tree = tree_map(
            lambda a, b: weighted_add(a, mx.array(first, a.dtype), b, mx.array(weight, b.dtype)), self.tree, tree
        )
        self.weight = 1.0

    def result(self):
        """The weighted sum, lazy (None when nothing was added); the sum lets go of its tree, so that the last
        multiplication, if any, can write into its buffers."""
        tree, weight = self.tree, self.weight
        self.tree, self.weight = None, 1.0
        if tree is None or weight == 1.0:
            return tree
        return tree_map(lambda a: a * weight, tree)


def check_batch_size(batch_size: int, world: World) -> str | None:
    """Why `batch_size` cannot be split over the world (each rank takes an equal share of every batch), or None."""
    if batch_size % world.size == 0:
        return None
    lower, upper = batch_size - batch_size % world.size, batch_size + world.size - batch_size % world.size
    return (
        f"batch_size {batch_size} is not divisible by the world size {world.size} (the number of ranks "
        f"mlx.launch started): the batch size is the global one, split equally over ranks; use "
        f"{lower or upper} or {upper}, or launch a number of ranks that divides {batch_size}"
    )


def step_gradients(
    loss_and_grad: Callable[[dict], tuple[mx.array, dict]],
    batches: list[dict[str, np.ndarray]],
    count: Callable[[dict[str, np.ndarray]], int] | None,
    parameters: dict,
    world: World,
    what: str,
    part: Callable[[dict, World], dict] | None = None,
    tables: Collection[str] = (),
) -> tuple[mx.array, dict]:
    """The loss and gradients of one optimizer step over global micro-batches, equal on every rank to one process's:
    each micro-batch's loss is the mean over its `count`ed labelled items, so this rank's part is weighted by its
    share of them (a part with none adds zeros), parts are averaged over micro-batches, then summed over ranks.
    `parameters` are the trainable ones (the gradients' structure). With `part` (a batch's part for this rank, whose
    loss gathers over ranks and is already this rank's share of the global loss: `gathered_part`), every rank runs
    every micro-batch, as the gathers inside its loss wait for all ranks. `tables` name the embedding tables among
    `parameters` (tree_flatten's names): `all_sum` sends the rows of their gradients that some rank changed; a set
    loses the names of tables found whole (`all_sum`)."""
    total = WeightedSum()
    for batch in batches:
        if part is not None:
            mine, share = part(batch, world), 1 / len(batches)
        else:
            mine, share = weighted_rows(batch, count, world, len(batches))
        if share:
            part_loss, part_grads = loss_and_grad(mine)
            # float32 on every rank, as the zeros of a rank without counted items are: one buffer layout for all
            total.add((part_loss.astype(mx.float32), part_grads), share)
            del part_loss, part_grads
        if total.tree is None:
            continue
        if part is not None:
            with collective(world, what):  # the loss's gathers
                mx.eval(total.tree)
        else:
            mx.eval(total.tree)  # one micro-batch's graph at a time, as `accumulate_gradients`
    if total.tree is None:  # no counted item on this rank: it adds zeros
        total.add((mx.array(0.0), tree_map(mx.zeros_like, parameters)), 1.0)
    named = {f"1.{name}" for name in tables}  # the names of (loss, grads)'s leaves
    summed = all_sum(total.tree, world, what, named, weight=total.weight)
    if isinstance(tables, set):  # a table found whole stays whole: its later steps skip the exchange of marks
        tables.intersection_update(name[2:] for name in named)
    return summed


def gathered_part(n: int, world: World) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's rows of a global batch of `n` rows, where each global row lies in the gathered parts): rows
    `rank::size`, padded with row 0 to `ceil(n / size)` so every rank's part has the same shape (`all_gather` needs
    it, and a rank with no row still takes part); `gather_rows` drops the padding, whose rows get no gradient."""
    share = -(-n // world.size)
    mine = np.arange(world.rank, n, world.size)
    mine = np.concatenate([mine, np.zeros(share - len(mine), dtype=mine.dtype)])
    everywhere = np.arange(n)
    return mine, (everywhere % world.size) * share + everywhere // world.size


def gather_rows(x: mx.array, order: np.ndarray | None, world: World | None = None) -> mx.array:
    """The global batch's rows of `x` (this rank's `gathered_part` rows, computed), in the global order; `x` itself
    where `order` is None (one process)."""
    if order is None:
        return x
    return all_gather(x, world)[mx.array(order)]


def all_sum(tree, world: World, what: str, tables: Collection[str] = (), weight: float = 1.0):
    """`tree` (arrays) summed over ranks, evaluated; a rank lost meanwhile raises `RankLost` naming it. The arrays
    of each dtype travel as one flat buffer: one collective per step, not one per weight (each has a latency).
    Of the 2-D arrays `tables` names (tree_flatten's names: embedding tables' gradients), only the rows some rank
    changed travel, when they are few (`changed_rows`); the others are zeros on every rank, and stay so. A table
    found whole (a tied output layer's) leaves `tables` when it is a set: every rank decides alike. This rank's
    arrays are multiplied by `weight` on their way into the flat buffer (`WeightedSum`)."""
    named = tree_flatten(tree)
    arrays = [a for _, a in named]
    mx.eval(arrays)  # this rank's part, computed before it waits for the others
    candidates = [i for i, (name, a) in enumerate(named) if name in tables and a.ndim == 2]
    rows = dict(zip(candidates, changed_rows([arrays[i] for i in candidates], world, what), strict=True))
    if isinstance(tables, set):
        tables.difference_update(named[i][0] for i, r in rows.items() if r is None)
    rows = {i: mx.array(r) for i, r in rows.items() if r is not None}
    parts = [a[rows[i]] if i in rows else a for i, a in enumerate(arrays)]
    summed = list(parts)
    sockets, through_mlx = ring_of(world), False
    if sockets is not None:
        mx.eval(parts)  # the tables' rows, read by numpy
    for dtype in {a.dtype for a in parts}:
        chosen = [i for i, a in enumerate(parts) if a.dtype == dtype]
        if sockets is not None and dtype in SOCKET_DTYPES:
            flat = socket_sum([parts[i] for i in chosen], SOCKET_DTYPES[dtype], weight, sockets, world, what)
        else:
            flat = mx.concatenate([parts[i].reshape(-1) for i in chosen])
            flat = mx.distributed.all_sum(flat if weight == 1.0 else flat * weight, group=world.group)
            through_mlx = True
        start = 0
        for i in chosen:
            summed[i] = flat[start : start + parts[i].size].reshape(parts[i].shape)
            start += parts[i].size
    for i, changed in rows.items():  # a table's summed rows back in place among zeros
        summed[i] = mx.zeros_like(arrays[i]).at[changed].add(summed[i])
    if through_mlx:
        with collective(world, what):
            wait_for_all(world, what)
            mx.eval(summed)
    else:
        mx.eval(summed)
    leaves = iter(summed)
    return tree_map(lambda _: next(leaves), tree)  # tree_map walks the tree in tree_flatten's order


def socket_sum(
    parts: list[mx.array], dtype: type, weight: float, sockets: ring.Ring, world: World, what: str
) -> mx.array:
    """The sum over ranks of `parts` (evaluated) times `weight` (this rank's) as one flat array: numpy copies them
    into the ring's own buffer for their dtype, kept from step to step (memory already mapped in; MLX's
    concatenate into a fresh array cost 2-3 times as long), the ranks sum it in place, and MLX copies it back."""
    if weight != 1.0 and not np.issubdtype(dtype, np.floating):  # integers times a weight: MLX's float32, as below
        parts, weight, dtype = [p * weight for p in parts], 1.0, np.float32
        mx.eval(parts)
    buffer = sockets.buffer(sum(p.size for p in parts), np.dtype(dtype))
    start = 0
    for p in parts:
        view = np.asarray(p).reshape(-1)  # MLX's memory, no copy
        if weight == 1.0:
            buffer[start : start + p.size] = view
        else:
            np.multiply(view, weight, out=buffer[start : start + p.size])
        start += p.size
    with collective(world, what):
        sockets.all_sum(buffer)
    return mx.array(buffer)


@cache
def ring_of(world: World) -> ring.Ring | None:
    """The ranks' own sockets for `all_sum` (`ring.Ring`), connected on first use, where the ranks were started with a
    ring hostfile (`mlx-encoders launch`, `mlx.launch --backend ring`) and EXCHANGE_ENV is not "mlx"; else None.
    Every rank listens on its hostfile address at a port of the system's choosing and learns the others' from one
    MLX all_gather, which every rank of a ring hostfile joins whatever its own EXCHANGE_ENV (`mlx.launch` passes
    the environment only to this machine's ranks): a rank that cannot or will not listen sends port 0, and then
    every rank keeps MLX's all_sum. So does every rank where one could not connect (a firewall), after a warning."""
    choice = os.environ.get(EXCHANGE_ENV, "sockets")
    invalid = None
    if choice not in ("sockets", "mlx"):
        invalid = ValueError(f'{EXCHANGE_ENV}={choice!r}: use "sockets" (the default) or "mlx"')
    hosts = ring.environment_hosts()
    if world.size == 1 or hosts is None or len(hosts) != world.size:
        if invalid is not None:
            raise invalid
        return None
    server, port, why = None, 0, None
    if choice == "sockets":
        try:
            server = ring.listen(hosts[world.rank])
            port = server.getsockname()[1]
        except OSError as e:
            why = f"cannot listen on {hosts[world.rank]} ({e})"
    what = "connecting the ranks' sockets"
    with collective(world, what):
        wait_for_all(world, what)
        ports = np.array(mx.distributed.all_gather(mx.array([port]), group=world.group, stream=mx.cpu))
    if invalid is not None:  # after the gather, which the other ranks wait in
        raise invalid
    if not ports.all():
        if server is not None:
            server.close()
        if why is not None:
            warnings.warn(f"rank {world.rank} {why}: sums go through MLX's all_sum", stacklevel=2)
        return None
    right = (world.rank + 1) % world.size
    address = (hosts[right], int(ports[right]))
    try:
        seconds = timeout()
        joined = ring.connect(
            world.rank, world.size, server, address, seconds if seconds < MAX_TIMER_S else None,
            min(CONNECT_SECONDS, seconds),
        )  # fmt: skip
    except (OSError, ring.PeerLost) as e:
        joined, why = None, f"could not join its neighbours' sockets (rank {right} at {address[0]}:{address[1]}: {e})"
    with collective(world, what):  # every rank learns whether every rank joined
        wait_for_all(world, what)
        failed = mx.distributed.all_sum(mx.array([int(joined is None)]), group=world.group, stream=mx.cpu).item()
    if not failed:
        return joined
    if joined is not None:
        joined.close()
    if why is not None:
        warnings.warn(
            f"rank {world.rank} {why}: sums go through MLX's all_sum; let the ranks reach each other's ports, or "
            f"set {EXCHANGE_ENV}=mlx (mlx.launch --env {EXCHANGE_ENV}=mlx across machines)",
            stacklevel=2,
        )
    return None


def changed_rows(tables: list[mx.array], world: World, what: str) -> list[np.ndarray | None]:
    """Per 2-D array, the rows (sorted int32 indices) that are not all zeros on some rank, or None where more than
    SPARSE_ROWS_SHARE of its rows are: then the whole array travels. The same on every rank (one all_sum of the
    ranks' marks), so every rank sends the same rows in the same layout."""
    if not tables or world.size == 1:
        return [None] * len(tables)
    marks = np.concatenate([nonzero_rows(t) for t in tables]).astype(np.int32)
    sockets = ring_of(world)
    with collective(world, what):
        if sockets is not None:
            sockets.all_sum(marks)
            counts = marks
        else:
            wait_for_all(world, what)
            counts = np.array(mx.distributed.all_sum(mx.array(marks), group=world.group))
    out, start = [], 0
    for t in tables:
        changed = np.flatnonzero(counts[start : start + t.shape[0]]).astype(np.int32)
        out.append(changed if len(changed) <= SPARSE_ROWS_SHARE * t.shape[0] else None)
        start += t.shape[0]
    return out


def nonzero_rows(table: mx.array) -> np.ndarray:
    """Whether each row of 2-D `table` (evaluated) has a bit set: the maximum of its bytes seen as the widest unsigned
    integers that tile a row, 2.5x faster than `mx.any(table != 0, axis=1)` over a vocabulary's table. A row of
    -0.0 counts as changed (it travels; the sum is the same)."""
    try:
        rows = np.asarray(table)
    except (TypeError, ValueError, RuntimeError):  # a dtype numpy lacks (bfloat16)
        return np.array(mx.any(table != 0, axis=1))
    if not rows.size:
        return np.zeros(rows.shape[0], bool)
    width = next(w for w in (8, 4, 2, 1) if rows.shape[1] * rows.itemsize % w == 0)
    return np.ascontiguousarray(rows).view(f"u{width}").max(axis=1) != 0


def broadcast(tree, world: World, what: str):
    """Rank 0's arrays of `tree` on every rank (a sum of rank 0's values and the others' zeros is exact)."""
    return all_sum(tree if world.is_main else tree_map(mx.zeros_like, tree), world, what)


def shared_map(
    fn: Callable[[T], R], items: Iterable[T], within: World | None = None, what: str = "evaluation"
) -> list[R]:
    """`[fn(item) for item in items]`, the work shared by the ranks: every rank walks all of `items` (a generator that
    draws masks advances alike on each) and runs `fn` on every world-size-th (`rank::size`); every rank gets all the
    results (picklable: numbers, numpy arrays), in `items`' order, so what it computes from them is one process's.
    Every rank must call it with the same items, as it ends in a collective (`what` names it in errors)."""
    ranks = within or world()
    if ranks.size == 1:
        return [fn(item) for item in items]
    mine = [fn(item) for i, item in enumerate(items) if i % ranks.size == ranks.rank]
    parts = gather_objects(mine, ranks, what)
    return [parts[i % ranks.size][i // ranks.size] for i in range(sum(map(len, parts)))]


def gather_objects(value, world: World, what: str) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    with collective(world, what):
        wait_for_all(world, what)
        sizes = np.array(mx.distributed.all_gather(mx.array([data.size]), group=world.group, stream=mx.cpu))
        padded = np.zeros(sizes.max(), dtype=np.uint8)
        padded[: data.size] = data
        gathered = mx.distributed.all_gather(mx.array(padded), group=world.group, stream=mx.cpu)
        gathered = np.array(gathered).reshape(world.size, -1)
    lost = RankLost(f"rank {world.rank}: lost {peers(world)} during {what}: it stopped or disconnected")
    if (sizes <= 0).any():  # a peer gone before the gather: MLX can hand back zeros for its part, not an error
        raise lost
    try:
        return [pickle.loads(row[:size].tobytes()) for row, size in zip(gathered, sizes, strict=True)]
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise lost from e


def check_same(world: World, facts: dict, what: str) -> None:
    """Fail on every rank, naming what differs, unless every rank has the same `facts` (say, its model's layout and
    its data's digest): ranks that differ would sum other layouts' buffers, or train on other data, silently."""
    if world.size == 1:
        return
    every = gather_objects(facts, world, what)
    differ = [key for key in facts if any(f.get(key) != every[0].get(key) for f in every)]
    if differ:
        values = {key: ", ".join(f"rank {r} {f.get(key)}" for r, f in enumerate(every)) for key in differ}
        found = "; ".join(f"{key}: {v}" for key, v in values.items())
        raise ValueError(
            f"rank {world.rank}: the ranks differ at {what} ({found}); every rank must load the same model and read "
            "the same data with the same options"
        )


def wait_for_all(world: World, what: str) -> None:
    """Sleep until every rank has come here, where `mlx-encoders launch` gave the ranks pipes for it (`BARRIER_ENV`),
    so that the collective after it waits for no rank: MLX's ring backend polls its sockets while it waits, a
    core's worth of CPU for as long as the slowest rank takes. Elsewhere (mlx.launch), nothing. Rank 0 reads one
    byte from each other rank, then writes one to each; a pipe closed instead (its rank ended) raises `RankLost`."""
    value = os.environ.get(BARRIER_ENV, "")
    if world.size == 1 or not value:
        return
    arrive, go = value.split(":")
    other = ("rank 1" if world.size == 2 else "a rank") if world.is_main else "rank 0"
    lost = f"rank {world.rank}: lost {other} during {what}: it stopped before reaching it"
    try:
        if world.is_main:
            if len(read_bytes(int(arrive), world.size - 1)) < world.size - 1:
                raise RankLost(lost)
            for fd in go.split(","):
                os.write(int(fd), b"g")
        else:
            os.write(int(arrive), b"a")
            if not read_bytes(int(go), 1):
                raise RankLost(lost)
    except BrokenPipeError:  # the reader's end closed: its rank ended
        raise RankLost(lost) from None


def read_bytes(fd: int, count: int) -> bytes:
    """Up to `count` bytes of pipe `fd`, blocking until they came or every writer closed it."""
    data = b""
    while len(data) < count and (chunk := os.read(fd, count - len(data))):
        data += chunk
    return data


def peers(world: World) -> str:
    """The ranks a failed collective on this rank can have lost: its ring neighbours (or the one other rank)."""
    if world.size == 2:
        return f"rank {1 - world.rank}"
    left, right = (world.rank - 1) % world.size, (world.rank + 1) % world.size
    return f"rank {left} or rank {right} (this rank's neighbours in the ring, or a rank beyond them)"


def timeout() -> float:
    """TIMEOUT_ENV's seconds (inf: no limit), DEFAULT_TIMEOUT when unset."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds above 0 (inf: wait as long as it takes)")
    return seconds


@contextmanager
def collective(world: World, what: str, seconds: float | None = None) -> Iterator[None]:
    """Wait for the other ranks in a collective (`what` names it in errors). A lost connection raises `RankLost`;
    a wait past `seconds` (default `TIMEOUT_ENV`) ends the process with status 1, as a blocked collective cannot be
    interrupted."""
    seconds = timeout() if seconds is None else seconds

    def stalled() -> None:
        print(
            f"rank {world.rank}: no answer from {peers(world)} for {seconds:g} s during {what}: it stopped or "
            f"hangs; stopping this rank too (set {TIMEOUT_ENV} to wait longer)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(seconds, stalled) if seconds < MAX_TIMER_S else None  # beyond: no limit
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    except RuntimeError as e:  # the ring backend's "[ring] connection to a peer was lost", and the like
        raise RankLost(f"rank {world.rank}: lost {peers(world)} during {what}: it stopped or disconnected ({e})") from e
    finally:
        if timer is not None:
            timer.cancel()


class RanksFailed(RuntimeError, CommandError):
    """Another rank failed a step (its own message names why); this one stopped with it."""


def agree(world: World, error: BaseException | None, what: str, seconds: float | None = None) -> None:
    """Every rank says whether step `what` went well; each raises when any rank failed (its own error, else one
    naming the ranks that failed), so no rank waits forever for a rank that stopped; a rank lost or stalled during
    the exchange ends this one with an error naming it (`collective`)."""
    if world.size > 1:
        flags = mx.array([float(error is not None and r == world.rank) for r in range(world.size)])
        flags = mx.distributed.all_sum(flags, group=world.group, stream=mx.cpu)
        with collective(world, what, seconds):
            mx.eval(flags)
        failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        if failed and error is None:
            raise RanksFailed(f"{what} failed on rank(s) {failed}; see their messages")
    if error is not None:
        raise error


def all_gather(x: mx.array, within: World | None = None) -> mx.array:
    """Every rank's `x` (same shape on each) concatenated along axis 0 in rank order, with the gradient of the sum
    of every rank's loss: `mx.distributed.all_gather`'s own VJP keeps only this rank's loss's part of the cotangent,
    so in-batch negatives from other ranks would get no gradient from them. Every rank must take this gradient
    (it sums over ranks) with the same weight (equal slices of the global batch), so that the gradients summed over
    ranks are the global batch's."""
    ranks = within or world()
    if ranks.size == 1:
        return x

    @mx.custom_function
    def gather(x: mx.array) -> mx.array:
        return mx.distributed.all_gather(x, group=ranks.group)

    @gather.vjp
    def gather_vjp(x: mx.array, cotangent: mx.array, output: mx.array) -> mx.array:
        n = x.shape[0]
        return mx.distributed.all_sum(cotangent, group=ranks.group)[ranks.rank * n : (ranks.rank + 1) * n]

    return gather(x)
