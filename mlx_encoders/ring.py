"""The ranks' sums of large buffers over blocking TCP sockets, one to each ring neighbour: `Ring.all_sum(buffer)`,
a ring reduce-scatter then all-gather in numpy, as MLX's ring backend does it. MLX's socket threads poll their
non-blocking sockets, so its all_sum costs a core's worth of CPU while bytes are on the way (0.7 GB/s between two
ranks on two cores); a blocking socket sleeps until the kernel has bytes, and the sum of one piece overlaps the
arrival of the next. `distributed.all_sum` takes this path where the ranks were started with a ring hostfile.
"""

import json
import os
import socket
import threading

import numpy as np

PIECE_BYTES = 2**20  # received and added a piece at a time: the add of one overlaps the arrival of the next


class PeerLost(RuntimeError):
    """A neighbour closed its socket (its rank ended) or the connection broke; `distributed.collective` names it."""


class Ring:
    """Rank `rank` of `size`, sending to its right neighbour (rank + 1) on `right`, receiving from its left (rank - 1)
    on `left`."""

    def __init__(self, rank: int, size: int, left: socket.socket, right: socket.socket):
        self.rank, self.size, self.left, self.right = rank, size, left, right
        self.buffers: dict[tuple[np.dtype, str], np.ndarray] = {}

    def buffer(self, size: int, dtype: np.dtype, use: str = "sum") -> np.ndarray:
        """A buffer of `size` elements of `dtype` for `use`, the same memory at every call that fits in it: a
        training step sums the same gradients each time, and fresh memory would fault its pages in every time."""
        kept = self.buffers.get((dtype, use))
        if kept is None or len(kept) < size:
            kept = self.buffers[dtype, use] = np.empty(size, dtype)
        return kept[:size]

    def all_sum(self, buffer: np.ndarray) -> None:
        """`buffer` (1-D, contiguous) summed over every rank, in place; the same bits on every rank (each part is
        summed once, by one rank, in ring order, then copied to the others)."""
        n, r = self.size, self.rank
        self.check_length(len(buffer))
        bounds = [len(buffer) * i // n for i in range(n + 1)]
        part = [buffer[bounds[i] : bounds[i + 1]] for i in range(n)]
        scratch = self.buffer(max(len(p) for p in part), buffer.dtype, "scratch")
        for step in range(n - 1):  # reduce-scatter: rank r ends with part r + 1 summed over every rank
            into = part[(r - step - 1) % n]
            self.exchange(part[(r - step) % n], scratch[: len(into)], add_into=into)
        for step in range(n - 1):  # all-gather: each summed part travels round the ring
            self.exchange(part[(r + 1 - step) % n], part[(r - step) % n])

    def check_length(self, length: int) -> None:
        """Fail unless the left neighbour sums a buffer of this `length` too: buffers of other lengths would be cut
        into other parts and summed into nonsense (ranks whose models or data differ)."""
        mine, theirs = np.array([length], np.int64), np.empty(1, np.int64)
        self.exchange(mine, theirs)
        if theirs[0] != length:
            raise ValueError(
                f"rank {self.rank} sums {length} values and rank {(self.rank - 1) % self.size} {int(theirs[0])}: the "
                "ranks' models or data differ; every rank must load the same model and read the same data"
            )

    def exchange(self, send: np.ndarray, receive: np.ndarray, add_into: np.ndarray | None = None) -> None:
        """Send `send` right while `receive` fills from the left; with `add_into`, each received piece is added
        into it as it arrives, while the piece is in the cache. Sending runs on its own thread: two ranks that
        only sent would fill both kernels' buffers and wait for each other forever."""
        failure: list[BaseException] = []

        def send_all() -> None:
            try:
                self.right.sendall(memoryview(send).cast("B"))
            except BaseException as e:  # noqa: BLE001  raised on the calling thread below
                failure.append(e)

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        try:
            view, step = memoryview(receive).cast("B"), PIECE_BYTES - PIECE_BYTES % receive.itemsize
            for start in range(0, len(view), step):
                self.receive_into(view[start : start + step])
                if add_into is not None:
                    piece = slice(start // receive.itemsize, min(start + step, len(view)) // receive.itemsize)
                    add_into[piece] += receive[piece]
        finally:
            sender.join()
        if failure:
            raise PeerLost(f"sending to rank {(self.rank + 1) % self.size} failed: {failure[0]}") from failure[0]

    def receive_into(self, view: memoryview) -> None:
        receive_exactly(self.left, view, (self.rank - 1) % self.size)

    def close(self) -> None:
        for s in (self.left, self.right):
            s.close()


def receive_exactly(source: socket.socket, view: memoryview, rank: int) -> None:
    """Fill `view` from `source`, the socket of rank `rank`; `PeerLost` names it if it closes or fails first."""
    got = 0
    while got < len(view):
        try:
            count = source.recv_into(view[got:])
        except OSError as e:  # reset, or silent past the socket's timeout
            raise PeerLost(f"receiving from rank {rank} failed: {e}") from e
        if not count:
            raise PeerLost(f"rank {rank} closed its connection")
        got += count


def listen(host: str) -> socket.socket:
    """A socket listening on `host` at a port the system picks: the one this rank's left neighbour connects to."""
    return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=1)


def connect(
    rank: int, size: int, server: socket.socket, right: tuple[str, int], seconds: float | None, connect_seconds: float
) -> Ring:
    """The ring, once every rank listens (`listen`) and knows its right neighbour's address: connect to it, say
    which rank this is, and take the left neighbour's connection from `server` (checked to be rank - 1), each
    within `connect_seconds`; later sums wait up to `seconds` for a neighbour. Nothing is left open on failure."""
    opened: list[socket.socket] = []
    try:
        try:
            opened.append(socket.create_connection(right, timeout=connect_seconds))
            opened[0].sendall(rank.to_bytes(4, "little"))
            server.settimeout(connect_seconds)
            opened.append(server.accept()[0])
        finally:
            server.close()
        inbound = opened[1]
        inbound.settimeout(connect_seconds)
        sender = bytearray(4)
        receive_exactly(inbound, memoryview(sender), (rank - 1) % size)
        if (found := int.from_bytes(sender, "little")) != (rank - 1) % size:
            raise PeerLost(f"rank {rank} expected rank {(rank - 1) % size} on its ring socket, got rank {found}")
    except BaseException:
        for s in opened:
            s.close()
        raise
    for s in opened:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(seconds)  # a neighbour that hangs: `distributed.collective`'s timer ends the rank first
    return Ring(rank, size, inbound, opened[0])


def hosts_of(hostfile: str | None) -> list[str] | None:
    """Each rank's host in an `mlx.launch` ring hostfile (JSON: per rank a list of "host:port"), or None where the
    file is not of that kind."""
    if not hostfile:
        return None
    try:
        with open(hostfile) as f:
            ranks = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(ranks, list) or not all(
        isinstance(a, list) and a and isinstance(a[0], str) and ":" in a[0] for a in ranks
    ):
        return None
    return [addresses[0].rsplit(":", 1)[0].strip("[]") for addresses in ranks]


def environment_hosts() -> list[str] | None:
    """The ranks' hosts where this process is a rank of MLX's ring backend (MLX_RANK and a ring MLX_HOSTFILE)."""
    if "MLX_RANK" not in os.environ:
        return None
    return hosts_of(os.environ.get("MLX_HOSTFILE"))
