"""The ranks' own sums over blocking sockets (`mlx_encoders.ring`), with ranks as threads of this process on
loopback: sums equal numpy's and carry the same bits on every rank, whatever the length against the world size
and the pieces; a neighbour that leaves or is not the one expected raises `PeerLost` naming it. Also which ranks
take this path (`distributed.ring_of`) and the row marks of embedding tables (`distributed.nonzero_rows`), against
MLX's own `any`. The two-rank training runs of test_distributed.py go through it end to end."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_encoders import distributed, ring


def threads(work, count: int) -> list:
    """`work(i)` for i < count, each on its own thread; the results, or the first exception raised."""
    results, errors = [None] * count, []

    def run(i):
        try:
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001  re-raised below
            errors.append(e)

    started = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in started:
        t.start()
    for t in started:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def rings(size: int) -> list[ring.Ring]:
    servers = [ring.listen("127.0.0.1") for _ in range(size)]
    ports = [s.getsockname()[1] for s in servers]
    return threads(lambda r: ring.connect(r, size, servers[r], ("127.0.0.1", ports[(r + 1) % size]), 30, 30), size)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("length", [1, 7, 3 * 2**18 + 5])  # fewer elements than ranks; several 1 MB pieces a part
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float16])
def test_every_rank_gets_the_sum_with_the_same_bits(size, length, dtype):
    rng = np.random.default_rng(length + size)
    values = [(rng.normal(size=length) * 100).astype(dtype) for _ in range(size)]
    joined = rings(size)
    try:
        buffers = [v.copy() for v in values]
        threads(lambda r: joined[r].all_sum(buffers[r]), size)
        expected = np.sum([v.astype(np.float64) for v in values], axis=0)
        for b in buffers:
            assert b.dtype == dtype and b.shape == (length,)
            np.testing.assert_array_equal(b, buffers[0])  # each part summed once, then copied
        if dtype == np.int32 or size == 2:  # integers, and a + b in any order: exact
            np.testing.assert_array_equal(buffers[0], np.sum(values, axis=0, dtype=dtype))
        else:
            tolerance = 2e-3 if dtype == np.float16 else 1e-6
            np.testing.assert_allclose(buffers[0], expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())
        # the same memory serves the next sum of that size
        assert joined[0].buffer(10, np.dtype(dtype)).ctypes.data == joined[0].buffer(4, np.dtype(dtype)).ctypes.data
    finally:
        for r in joined:
            r.close()


def test_buffers_of_other_lengths_are_refused_by_the_ranks_that_see_them():
    """Ranks whose models differ sum buffers of other lengths: cut into other parts, their sums were nonsense."""
    joined = rings(2)
    try:
        with pytest.raises(ValueError, match=r"rank \d sums (6|8) values and rank \d (8|6): the ranks' models or data"):
            threads(lambda r: joined[r].all_sum(np.ones(6 + 2 * r, np.float32)), 2)
    finally:
        for r in joined:
            r.close()


def test_a_neighbour_that_leaves_is_named():
    joined = rings(2)
    joined[1].close()
    with pytest.raises(ring.PeerLost, match="rank 1"):
        joined[0].all_sum(np.ones(2**20, np.float32))
    joined[0].close()


def test_a_connection_from_another_rank_than_the_left_neighbour_is_refused():
    """Rank 0 of 4 is reached by rank 2 where rank 3 belongs (a hostfile that differs between machines)."""
    servers = [ring.listen("127.0.0.1") for _ in range(2)]
    ports = [s.getsockname()[1] for s in servers]
    errors = []

    def rank(i: int, number: int) -> None:
        try:
            ring.connect(number, 4, servers[i], ("127.0.0.1", ports[1 - i]), 5, 5)
        except ring.PeerLost as e:
            errors.append(str(e))

    threads(lambda i: rank(i, (0, 2)[i]), 2)
    assert "rank 0 expected rank 3 on its ring socket, got rank 2" in errors
    assert "rank 2 expected rank 1 on its ring socket, got rank 0" in errors


def test_hosts_come_from_a_ring_hostfile_only(tmp_path):
    file = tmp_path / "hosts.json"
    file.write_text(json.dumps([["10.0.0.1:5000", "10.0.1.1:5000"], ["[fe80::1]:5001"]]))
    assert ring.hosts_of(str(file)) == ["10.0.0.1", "fe80::1"]
    for text in ('{"hosts": 2}', "[1, 2]", "not json", "[[]]"):
        file.write_text(text)
        assert ring.hosts_of(str(file)) is None, text
    assert ring.hosts_of(str(tmp_path / "missing.json")) is None and ring.hosts_of(None) is None


def test_which_ranks_sum_over_their_own_sockets(tmp_path, monkeypatch):
    """Only ranks started with a ring hostfile, unless MLX_ENCODERS_EXCHANGE is "mlx"; another value is refused."""
    distributed.ring_of.cache_clear()
    monkeypatch.delenv("MLX_RANK", raising=False)
    assert distributed.ring_of(distributed.World(None, 2, 0)) is None  # no MLX_RANK: not a ring rank
    monkeypatch.setenv(distributed.EXCHANGE_ENV, "nccl")
    with pytest.raises(ValueError, match='MLX_ENCODERS_EXCHANGE=\'nccl\': use "sockets" \\(the default\\) or "mlx"'):
        distributed.ring_of(distributed.World(None, 2, 1))
    monkeypatch.setenv(distributed.EXCHANGE_ENV, "mlx")
    monkeypatch.setenv("MLX_RANK", "0")
    (tmp_path / "hosts.json").write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    assert distributed.ring_of(distributed.World(None, 2, 0)) is None
    distributed.ring_of.cache_clear()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("width", [384, 3, 1])
def test_nonzero_rows_are_mlxs_any(dtype, width):
    rng = np.random.default_rng(width)
    table = np.zeros((300, width), np.float32)
    rows = rng.choice(300, 40, replace=False)
    table[rows, rng.integers(0, width, 40)] = rng.normal(size=40)  # one value in each changed row
    table[rows[:3]] = 1e-30  # float16's and bfloat16's subnormals or zeros: compared as MLX sees them
    t = mx.array(table).astype(dtype)
    np.testing.assert_array_equal(distributed.nonzero_rows(t), np.array(mx.any(t != 0, axis=1)))
    assert not distributed.nonzero_rows(mx.zeros((0, width), dtype)).size


@pytest.mark.parametrize("dtype", [mx.float32, mx.int32])
def test_socket_sum_weights_each_ranks_parts_as_mlx_would(dtype):
    """`distributed.socket_sum`: each rank's parts times its own weight, summed; integers times a weight come back in
    float32, as MLX's product of an integer array and a float gives."""
    joined = rings(2)
    rng = np.random.default_rng(3)
    parts = [[mx.array((rng.normal(size=n) * 10).astype(np.float32)).astype(dtype) for n in (5, 3 * 2**18)]
             for _ in range(2)]  # fmt: skip
    weights = (1 / 3, 0.7)  # not exact in binary: each is rounded to float32 once, as MLX rounds it
    mx.eval(parts)  # made on this thread's stream

    def rank(r: int) -> mx.array:
        with mx.stream(mx.new_stream(mx.cpu)):  # an MLX stream serves only the thread that made it
            world = distributed.World(None, 2, r)
            return distributed.socket_sum(
                parts[r], distributed.SOCKET_DTYPES[dtype], weights[r], joined[r], world, "a test"
            )

    try:
        sums = threads(rank, 2)
    finally:
        for r in joined:
            r.close()
    expected = sum(mx.concatenate(parts[r]) * weights[r] for r in range(2))
    for got in sums:
        assert got.dtype == mx.float32
        np.testing.assert_array_equal(np.array(got), np.array(expected))


RANK = """
import sys, warnings
import mlx.core as mx
from mlx_encoders import distributed, ring
distributed.CONNECT_SECONDS = 3  # the other rank waits this long for a connection that does not come
if sys.argv[1] == "fail":  # this rank cannot reach its neighbour's port (a firewall)
    def refused(rank, size, server, *args):
        server.close()
        raise ConnectionRefusedError("refused")
    ring.connect = refused
world = distributed.world()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    summed = distributed.all_sum({"x": mx.arange(5) * (world.rank + 1)}, world, "a test")
way = "sockets" if distributed.ring_of(world) else "mlx"
print("RESULT", way, summed["x"].tolist(), [str(w.message) for w in caught])
"""


@pytest.mark.parametrize(
    "settings",
    [({}, {distributed.EXCHANGE_ENV: "mlx"}), ({}, {}), ({}, {"FAIL": "1"})],
    ids=["one-rank-says-mlx", "both-sockets", "one-rank-cannot-connect"],
)
def test_every_rank_takes_the_same_way_whatever_its_own_setting(tmp_path, settings):
    """Two ranks of a ring hostfile: where one rank's environment says "mlx" (mlx.launch passes it only to the
    launching machine's ranks) or one cannot reach the other's port (and so the other gets no caller), both sum
    through MLX, each saying why, and the sums are right; otherwise both take the sockets."""
    from test_distributed import free_ports

    first = free_ports(2)
    (tmp_path / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(2)]))
    root = str(Path(__file__).parents[1])
    processes = []
    for rank, extra in enumerate(settings):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               "MLX_RANK": str(rank), "MLX_HOSTFILE": str(tmp_path / "hosts.json"), "OPENBLAS_NUM_THREADS": "1",
               distributed.TIMEOUT_ENV: "60", **{k: v for k, v in extra.items() if k != "FAIL"}}  # fmt: skip
        env.pop(distributed.EXCHANGE_ENV, None) if distributed.EXCHANGE_ENV not in extra else None
        mode = "fail" if "FAIL" in extra else "ok"
        processes.append(subprocess.Popen([sys.executable, "-c", RANK, mode], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=120) for p in processes]
    results = []
    for (out, err), p in zip(outputs, processes, strict=True):
        assert p.returncode == 0, err[-2000:]
        results.append(next(line for line in out.splitlines() if line.startswith("RESULT")))
    way = "sockets" if settings == ({}, {}) else "mlx"
    for line in results:
        assert line.startswith(f"RESULT {way} [0, 3, 6, 9, 12]"), results
    if "FAIL" in settings[1]:
        assert "could not join its neighbours' sockets (rank 0 at 127.0.0.1:" in results[1], results
        assert "set MLX_ENCODERS_EXCHANGE=mlx (mlx.launch --env MLX_ENCODERS_EXCHANGE=mlx" in results[1], results
        assert "could not join its neighbours' sockets (rank 1 at 127.0.0.1:" in results[0], results  # no caller
