"""One build at a time per index folder: an exclusive `flock` on `build.lock` in the folder (`FolderLock`), taken
before the store is opened and held to the end of the build (by rank 0 alone under `mlx.launch`); a `--shard` part's
build holds its part's lock in `shards/`, which a merging build takes too.

Two builds into one folder would each commit the other's staged vectors and then drop the texts its own documents
do not use, leaving documents without vectors.
"""

from pathlib import Path

from ..checkpoint.lock import FolderLock
from .store import StoreError

LOCK_NAME = "build.lock"
BUSY_ADVICE = (
    "Two builds into one index would lose documents: wait for that build to end (or stop it), then run this one "
    "again, or build into another --index folder."
)


class IndexBusy(StoreError):
    """Another build holds the index folder's lock: the message names it (pid, host, start time)."""


class BuildLock(FolderLock):
    """`with BuildLock(folder):` holds the folder's build lock, or raises `IndexBusy` at once; a lock left by a
    build that stopped is taken over, with a line on stderr unless `quiet`. `name`, `what` and `advice`: another
    lock in the folder (a `--shard` part's), what its holder writes, and what the refused build can do."""

    def __init__(
        self, folder: Path, quiet: bool = False, name: str = LOCK_NAME, what: str | None = None,
        advice: str = BUSY_ADVICE,
    ):  # fmt: skip
        super().__init__(
            folder, name, what or f"the index {Path(folder)}", advice, writer="build", program="mlx-encoders index",
            quiet=quiet, busy=IndexBusy, taken_over="; its committed chunks are kept", unlockable=StoreError,
        )  # fmt: skip
