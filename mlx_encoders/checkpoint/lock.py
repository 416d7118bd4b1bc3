"""One writer at a time per folder: an exclusive `flock` on a lock file in the folder, held while the writer runs
(an index build, a training run). The OS releases the lock when its holder exits, killed or not. The file records
the holder (pid, host, start time, command) for the message a refused writer prints, and is removed when the writer
ends: a file found by the next holder was left by one that stopped without releasing it."""

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class FolderBusy(OSError):
    """Another process holds the folder's lock: the message names it (pid, host, start time)."""


def holder(record: bytes) -> str:
    """Who a lock record names, in words."""
    try:
        info = json.loads(record)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']} ({info['command']})"
    except (ValueError, TypeError, KeyError):
        return "a process whose record is not written yet"


class FolderLock:
    """`with FolderLock(folder, name, what, advice, writer, program):` holds the lock file `name` in `folder`, or
    raises `busy` at once, naming the holder (another `writer`: build, run), `what` it writes and the `advice` for
    the refused one. A lock left by a writer that stopped is taken over, with a line from `program` on stderr
    unless `quiet` (`taken_over` says what was kept)."""

    def __init__(
        self, folder: Path, name: str, what: str, advice: str, writer: str, program: str, quiet: bool = False,
        busy: type = FolderBusy, taken_over: str = "", unlockable: type = OSError,
    ):  # fmt: skip
        self.path, self.quiet, self.fd = Path(folder) / name, quiet, None
        self.what, self.advice, self.writer, self.program = what, advice, writer, program
        self.busy, self.taken_over, self.unlockable = busy, taken_over, unlockable

    def __enter__(self) -> "FolderLock":
        fd = self.lock()
        while not same_file(fd, self.path):  # locked just as its holder removed it: lock the file there now
            os.close(fd)
            fd = self.lock()
        if (record := os.pread(fd, 4096, 0)) and not self.quiet:
            print(
                f"{self.program}: taking over the lock of {self.path.parent}, left by a {self.writer} that stopped "
                f"without releasing it ({holder(record)}){self.taken_over}",
                file=sys.stderr,
                flush=True,
            )
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200],
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
        except OSError as e:  # a full disk: release the lock, or it stays held for the rest of this process
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(fd)
            raise OSError(e.errno, f"could not write the lock file {self.path}: {e.strerror or e}") from e
        self.fd = fd
        return self

    def lock(self) -> int:
        """A descriptor of the lock file, locked; `busy` naming the holder when another process has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = os.pread(fd, 4096, 0)
            os.close(fd)
            raise self.busy(
                f"Another {self.writer} is writing {self.what}: {holder(record)} holds {self.path}. {self.advice}"
            ) from None
        except OSError as e:
            os.close(fd)
            raise self.unlockable(
                f"Could not lock {self.path} ({e}): writing {self.what} needs a filesystem with file locks (flock), "
                "so that no other process writes it meanwhile. Write on a local disk and copy the folder."
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
