"""`mlx-encoders launch -n 2`: the ranks join one ring on loopback, each on its own share of the cores with as many
BLAS threads, the launcher sleeps while they run, and a rank that fails sets the launcher's exit status and stops
the others. Runs are judged by what each rank wrote and by the launcher's status."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed import free_ports

from mlx_encoders import distributed
from mlx_encoders.engine import runtime
from mlx_encoders.launch import core_shares

RANK = """
import json, os, sys, time
from pathlib import Path
import mlx.core as mx
from mlx_encoders import distributed
from mlx_encoders.engine import runtime

world, out = distributed.world(), Path(sys.argv[1])
squares = distributed.shared_map(lambda i: i * i, range(5))  # each rank squares its share; all get every square
(out / f"ready-{world.rank}").touch()
time.sleep(float(sys.argv[2]))
if world.rank == 1 and sys.argv[3] == "fail":
    sys.exit(3)
if world.rank == 1:
    time.sleep(1.0)  # rank 0 waits for it in the all_sum
wall, cpu = time.perf_counter(), time.process_time()
distributed.all_sum(mx.zeros(1), world, "the end")
status = {"size": world.size, "squares": squares, "cores": sorted(os.sched_getaffinity(0)),
          "threads": os.environ.get("OPENBLAS_NUM_THREADS"), "lanes": len(runtime.cpu_streams()),
          "waited": time.perf_counter() - wall, "waiting_cpu": time.process_time() - cpu}
(out / f"status-{world.rank}.json").write_text(json.dumps(status))
"""


def start(tmp_path: Path, seconds: float, outcome: str) -> subprocess.Popen:
    (tmp_path / "rank.py").write_text(RANK)
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("OPENBLAS_NUM_THREADS", None)
    command = [sys.executable, "-m", "mlx_encoders", "launch", "-n", "2", "-p", str(free_ports(2)), sys.executable,
               str(tmp_path / "rank.py"), str(tmp_path), str(seconds), outcome]  # fmt: skip
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


def cpu_seconds(pid: int) -> float:
    """The user and system CPU time process `pid` has used (/proc/PID/stat's utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(paths: list[Path], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"no {[p.name for p in paths if not p.exists()]} after {seconds} s"
        time.sleep(0.05)


def test_two_ranks_share_the_cores_and_the_launcher_sleeps(tmp_path):
    """The launcher and a rank that waits for the other in an all_sum both sleep (MLX's ring backend alone would
    poll its socket: a core's worth of CPU while rank 0 waits)."""
    launcher = start(tmp_path, 2.0, "ok")
    wait_for([tmp_path / f"ready-{rank}" for rank in (0, 1)], 60)
    used = cpu_seconds(launcher.pid)
    time.sleep(1.5)
    used = cpu_seconds(launcher.pid) - used  # mlx.launch's forwarding threads spin: about a core's 1.5 s
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    statuses = [json.loads((tmp_path / f"status-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(s["size"] == 2 and s["squares"] == [0, 1, 4, 9, 16] for s in statuses), statuses
    assert used < 0.2, used
    assert statuses[0]["waited"] > 0.5 and statuses[0]["waiting_cpu"] < 0.2, statuses[0]
    shares = core_shares(2)
    assert [s["cores"] for s in statuses] == [sorted(share) if share else statuses[0]["cores"] for share in shares]
    if shares[0] is not None:  # two cores or more: disjoint halves, as many BLAS threads
        assert not set(statuses[0]["cores"]) & set(statuses[1]["cores"])
        assert [s["threads"] for s in statuses] == [str(len(share)) for share in shares]
        assert [s["lanes"] for s in statuses] == [min(runtime.MAX_CPU_STREAMS, len(share)) for share in shares]


def test_a_failed_rank_sets_the_status_and_stops_the_others(tmp_path):
    launcher = start(tmp_path, 0.0, "fail")
    _, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == 3, stderr
    assert "mlx-encoders launch: rank 1 exited with status 3; stopping the other ranks" in stderr
    assert not list(tmp_path.glob("status-*.json"))  # rank 0, which waited for rank 1, wrote nothing


def test_a_rank_that_ended_before_the_collective_is_named(monkeypatch):
    """The barrier's pipe closed at the other end (its rank ended): the waiting rank stops, naming it, whether it
    waits to read (rank 0) or writes first (rank 1)."""
    cases = [(distributed.World(None, 2, 0), 1, "rank 0: lost rank 1"), (distributed.World(None, 2, 1), 0,
             "rank 1: lost rank 0")]  # fmt: skip
    for world, closed, message in cases:
        arrive, go = os.pipe(), os.pipe()
        os.close(arrive[closed])  # the other rank's end of the pipe this rank arrives through
        mine = (arrive[1 - closed], go[1] if world.is_main else go[0])
        monkeypatch.setenv(distributed.BARRIER_ENV, f"{mine[0]}:{mine[1]}")
        with pytest.raises(distributed.RankLost, match=f"{message} during step 3: it stopped before reaching it"):
            distributed.wait_for_all(world, "step 3")
        for fd in (arrive[1 - closed], *go):
            os.close(fd)


def test_cores_are_split_evenly():
    """Every core this process may use goes to one rank, the ranks' counts within one of each other."""
    cores = os.sched_getaffinity(0)
    for ranks in range(1, len(cores) + 1):
        shares = core_shares(ranks)
        assert set().union(*shares) == cores and sum(map(len, shares)) == len(cores)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert core_shares(len(cores) + 1) == [None] * (len(cores) + 1)  # more ranks than cores: none pinned


JOIN = """
import sys
from mlx_encoders import distributed
from mlx_encoders.errors import run_command
sys.exit(run_command("rank", lambda: None if distributed.world().size == 2 else 5))
"""


def test_a_port_in_use_is_a_one_line_error_naming_the_addresses(tmp_path):
    import socket

    first = free_ports(2)
    (tmp_path / "join.py").write_text(JOIN)
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as held:  # another program listens on rank 1's port
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        command = [sys.executable, "-m", "mlx_encoders", "launch", "-n", "2", "-p", str(first), sys.executable,
                   str(tmp_path / "join.py")]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = next(line for line in done.stderr.splitlines() if line.startswith("rank: error: "))
    assert f"could not join the other ranks at 127.0.0.1:{first}, 127.0.0.1:{first + 1}" in line, line
    assert "mlx-encoders launch -p PORT" in line


@pytest.mark.parametrize("port", ["65535", "70000", "0"])
def test_ports_past_the_range_are_refused(port, capsys):
    from mlx_encoders.__main__ import main

    assert main(["launch", "-n", "2", "-p", port, "true"]) == 2
    assert f"-p {port}: ranks listen at ports" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_collective_timeout_that_is_no_wait_is_refused(monkeypatch, value):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{distributed.TIMEOUT_ENV}='{value}' is not a number of seconds above 0"):
        distributed.timeout()
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "inf")
    with distributed.collective(distributed.World(None, 2, 0), "a step"):  # no timer: nothing to overflow
        pass
