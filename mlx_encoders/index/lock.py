"""One build at a time per index folder: an exclusive `flock` on `build.lock` in the folder, taken before the store
is opened and held to the end of the build (by rank 0 alone under `mlx.launch`).

Two builds into one folder would each commit the other's staged vectors and then drop the texts its own documents
do not use, leaving documents without vectors. The OS releases the lock when its holder exits, killed or not. The
file records the holder (pid, host, start time, command) for the message a refused build prints, and is removed
when the build ends: a file found by the next holder was left by a build that stopped without releasing it.
"""

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .store import StoreError

LOCK_NAME = "build.lock"


class IndexBusy(StoreError):
    """Another build holds the index folder's lock: the message names it (pid, host, start time)."""


def holder(record: bytes) -> str:
    """Who a lock record names, in words."""
    try:
        info = json.loads(record)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']} ({info['command']})"
    except (ValueError, TypeError, KeyError):
        return "a process whose record is not written yet"


BUSY_ADVICE = (
    "Two builds into one index would lose documents: wait for that build to end (or stop it), then run this one "
    "again, or build into another --index folder."
)


class BuildLock:
    """`with BuildLock(folder):` holds the folder's build lock, or raises `IndexBusy` at once; a lock left by a
    build that stopped is taken over, with a line on stderr unless `quiet`. `name`, `what` and `advice`: another
    lock in the folder (a `--shard` part's), what its holder writes, and what the refused build can do."""

    def __init__(
        self, folder: Path, quiet: bool = False, name: str = LOCK_NAME, what: str | None = None,
        advice: str = BUSY_ADVICE,
    ):  # fmt: skip
        self.path, self.quiet, self.fd = Path(folder) / name, quiet, None
        self.what, self.advice = what or f"the index {Path(folder)}", advice

    def __enter__(self) -> "BuildLock":
        fd = self.lock()
        while not same_file(fd, self.path):  # locked just as its holder removed it: lock the file there now
            os.close(fd)
            fd = self.lock()
        if (record := os.pread(fd, 4096, 0)) and not self.quiet:
            print(
                f"mlx-encoders index: taking over the lock of {self.path.parent}, left by a build that stopped "
                f"without releasing it ({holder(record)}); its committed chunks are kept",
                file=sys.stderr,
                flush=True,
            )
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        self.fd = fd
        return self

    def lock(self) -> int:
        """A descriptor of the lock file, locked; `IndexBusy` naming the holder when another process has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = os.pread(fd, 4096, 0)
            os.close(fd)
            raise IndexBusy(
                f"Another build is writing {self.what}: {holder(record)} holds {self.path}. {self.advice}"
            ) from None
        except OSError as e:
            os.close(fd)
            raise StoreError(
                f"Could not lock {self.path} ({e}): a build needs a filesystem with file locks (flock), so that no "
                "other build writes the index meanwhile. Build on a local disk and copy the folder."
            ) from None
        return fd

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # while locked: after a clean end the next holder finds no record
        os.close(self.fd)  # and releases the lock
        self.fd = None


def same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), path.stat())
    except FileNotFoundError:
        return False
