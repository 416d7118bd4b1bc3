"""`mlx-encoders launch -n N COMMAND ...`: N ranks of COMMAND on this machine, joined by `mx.distributed`'s ring
backend over loopback, started as `mlx.launch --backend ring -n N COMMAND` starts them (MLX_RANK, and the ring's
addresses in the file MLX_HOSTFILE names), with four differences (docs/scaling-out.md):

- The ranks write straight to this terminal, read no stdin, and the launcher sleeps in `wait()` until one ends.
  mlx.launch (MLX 0.32) forwards each rank's output through a thread whose `select` also waits on the rank's stdin
  pipe, which is always writable, so it never sleeps, and its CPU time is taken from the ranks.
- Each rank runs on its own share of the cores (its CPU affinity) and its BLAS on as many threads, so N ranks do
  not start N times as many threads as there are cores.
- It exits with the status of the first rank that failed, after stopping the others; mlx.launch exits 0.
- The ranks get pipes that let them wait for each other asleep before an MLX collective, in which MLX's ring
  backend polls its sockets while it waits for the slowest rank (`distributed.wait_for_all`); the gradient sum
  goes over the ranks' own blocking sockets (`ring`) instead.

Across machines, mlx.launch with a hostfile starts the ranks over ssh.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .distributed import BARRIER_ENV
from .errors import OptionError

DEFAULT_PORT = 32323  # mlx.launch's: rank r listens on this port + r
STOP_GRACE_S = 10.0  # ranks asked to stop (SIGTERM) have this long to end before SIGKILL


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "launch", help="run a command on N ranks of this machine (mx.distributed's ring backend, as mlx.launch -n N)"
    )
    p.add_argument("-n", "--ranks", type=int, required=True, help="the number of ranks (processes) to start")
    port_help = f"rank r listens on 127.0.0.1 at this port + r (default {DEFAULT_PORT}, as mlx.launch)"
    p.add_argument("-p", "--starting-port", type=int, default=DEFAULT_PORT, help=port_help)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments, run by every rank")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise OptionError(
            "give the command every rank runs after the options: mlx-encoders launch -n 2 mlx-encoders train ..."
        )
    if args.ranks < 1:
        raise OptionError(f"-n {args.ranks}: the number of ranks must be at least 1")
    if not 1 <= args.starting_port <= 65536 - args.ranks:
        raise OptionError(
            f"-p {args.starting_port}: ranks listen at ports {args.starting_port} to "
            f"{args.starting_port + args.ranks - 1}, which must lie within 1-65535"
        )
    return launch(command, args.ranks, args.starting_port)


def core_shares(ranks: int) -> list[set[int] | None]:
    """Each rank's cores: the ones this process may run on, cut into `ranks` runs of equal length (the first ranks
    take one more where they do not divide); None (no pinning) where there are fewer cores than ranks, or the
    platform cannot pin (macOS)."""
    if not hasattr(os, "sched_setaffinity"):
        return [None] * ranks
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return [None] * ranks
    size, extra = divmod(len(cores), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        shares.append(set(cores[start:end]))
        start = end
    return shares


def rank_environment(rank: int, hostfile: str | None, cores: set[int] | None, barrier: str) -> dict[str, str]:
    """The environment of `rank`: mlx.launch's two variables and its barrier's pipes (none for a world of one,
    which needs no ring), and BLAS threads as many as its cores unless the user chose a number
    (OPENBLAS_NUM_THREADS)."""
    env = dict(os.environ)
    if hostfile:
        env |= {"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile, BARRIER_ENV: barrier}
    if cores is not None and not os.environ.get("OPENBLAS_NUM_THREADS"):
        env["OPENBLAS_NUM_THREADS"] = str(len(cores))
    return env


def launch(command: Sequence[str], ranks: int, port: int = DEFAULT_PORT) -> int:
    """Run `command` on `ranks` ranks of this machine; 0 when every rank exits 0, else the first failed rank's exit
    status (128 + the signal for one a signal ended), the others stopped."""
    with tempfile.TemporaryDirectory(prefix="mlx-encoders-launch-") as folder:
        hostfile = os.path.join(folder, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{port + rank}"] for rank in range(ranks)], f)
        processes: dict[int, tuple[int, subprocess.Popen]] = {}
        arrive, go = os.pipe(), [os.pipe() for _ in range(ranks - 1)]  # `distributed.wait_for_all`'s pipes
        pipes = {fd for pair in [arrive, *go] for fd in pair}
        ends = [(arrive[0], *(w for _, w in go))] + [(arrive[1], r) for r, _ in go]  # each rank's ends
        stop_on_term = signal.signal(signal.SIGTERM, terminated)
        try:
            for rank, cores in enumerate(core_shares(ranks)):
                fds = ends[rank]
                barrier = f"{fds[0]}:{','.join(map(str, fds[1:]))}"
                try:
                    with affinity(cores):  # the rank inherits this thread's cores from its first instruction
                        process = subprocess.Popen(
                            list(command), stdin=subprocess.DEVNULL, pass_fds=fds,
                            env=rank_environment(rank, hostfile if ranks > 1 else None, cores, barrier),
                        )  # fmt: skip
                except OSError as e:
                    raise OptionError(f"cannot start {command[0]!r} for rank {rank}: {e}") from None
                processes[process.pid] = (rank, process)
            close(pipes)  # the ranks hold their ends now, which close when they end
            return wait(processes)
        finally:
            close(pipes)
            stop(processes)
            signal.signal(signal.SIGTERM, stop_on_term)


def close(fds: set[int]) -> None:
    while fds:
        os.close(fds.pop())


@contextmanager
def affinity(cores: set[int] | None) -> Iterator[None]:
    """Inside, this thread runs on `cores` alone (None: unchanged); a process started meanwhile inherits them."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def terminated(signum: int, frame) -> None:
    """SIGTERM: leave through `launch`'s cleanup, which stops the ranks, with the shell's status for it."""
    raise SystemExit(128 + signum)


def wait(processes: dict[int, tuple[int, subprocess.Popen]]) -> int:
    """Block until every rank has ended (0), or until one fails: its exit status, the others then stopped."""
    while processes:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid not in processes:
            continue
        rank, process = processes.pop(pid)
        process.returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            ended = f"was ended by signal {-code}" if code < 0 else f"exited with status {code}"
            print(f"mlx-encoders launch: rank {rank} {ended}; stopping the other ranks", file=sys.stderr, flush=True)
            stop(processes)
            return 128 - code if code < 0 else code
    return 0


def stop(processes: dict[int, tuple[int, subprocess.Popen]]) -> None:
    """End the ranks still running: SIGTERM, then SIGKILL those still there after STOP_GRACE_S."""
    for _, process in processes.values():
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for _, process in list(processes.values()):
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    processes.clear()
