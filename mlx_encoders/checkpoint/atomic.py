"""Writing a folder atomically: a locked temporary folder beside the target, renamed into place only when
complete, cleaned on errors, Ctrl-C, SIGTERM and SIGHUP, and, after a SIGKILL, by the next write.

Replacing an existing folder never deletes data the writer does not rewrite (`check_replaceable`), and the old
folder stays recoverable until the new one is in place (`put_in_place`, `remove_stale`).
"""

import errno
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .adapters import CONFIG as ADAPTER_CONFIG
from .adapters import WEIGHTS as ADAPTER_WEIGHTS
from .files import GENERATION_FILE, INDEX, TOKENIZER_FILES

LOW_SPACE = 1 << 20  # bytes free under which a failed write is taken for a full disk


def is_checkpoint_file(name: str) -> bool:
    """Files `save` writes or replaces: weights, config.json, generation_config.json, tokenizer files."""
    return name in ("config.json", INDEX, GENERATION_FILE, *TOKENIZER_FILES) or name.endswith(
        (".safetensors", ".model")
    )


def is_adapter(folder: Path, adapters: tuple[str, ...]) -> bool:
    """One of the task adapters (`adapters`, by name) that `save` writes beside the weights (jina-embeddings-v3's):
    a PEFT folder of its two files."""
    files = {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    return folder.name in adapters and folder.is_dir() and {p.name for p in folder.iterdir()} == files


def check_replaceable(target: Path, whole: bool, parts: tuple[str, ...] = (), adapters: tuple[str, ...] = ()) -> None:
    """Replacing a folder deletes it: only a checkpoint folder (one with config.json) may be replaced, and
    unless the writer writes a `whole` folder (convert), only one that holds checkpoint files alone (and the task
    `adapters` it writes, by name). A folder of
    `parts` (an ELECTRA pair's discriminator/ and generator/) holds those checkpoint folders alone, each checked."""
    if parts:
        if others := sorted(p.name + "/" * p.is_dir() for p in target.iterdir() if p.name not in parts):
            raise FileExistsError(
                f"{target} holds {', '.join(others)} besides {', '.join(parts)}; replacing the folder would delete "
                "them. Save into another folder."
            )
        for name in parts:
            if (target / name).exists():  # a missing part holds nothing to lose
                check_replaceable(target / name, whole)
        return
    if not (target / "config.json").is_file():
        raise FileExistsError(f"{target} is not a checkpoint folder (no config.json); refusing to replace it")
    entries = [] if whole else target.iterdir()
    kept = [p for p in entries if not (is_checkpoint_file(p.name) or is_adapter(p, adapters))]
    others = sorted(p.name + "/" * p.is_dir() for p in kept)
    if others:
        raise FileExistsError(
            f"{target} holds files that save() does not write ({', '.join(others)}); replacing the folder would "
            "delete them. Save into another folder."
        )


def user_mode() -> int:
    """Permissions a new folder gets from the user's umask (mkdtemp's folders are private, 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def lock_folder(folder: Path, wait: bool) -> int | None:
    """An open descriptor of `folder` holding an exclusive `flock` on it, or None when another process holds
    it (non-blocking), the folder is gone, or the filesystem has no `flock`. The kernel releases the lock when
    its process ends, however it ends (SIGKILL included), so a locked folder is one a live process writes."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        if os.path.samestat(os.stat(folder, follow_symlinks=False), os.fstat(fd)):  # not removed meanwhile
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def owned_folder(target: Path, suffix: str) -> tuple[Path, int | None]:
    """A new `.NAME.xxxxxxxx<suffix>` folder beside `target`, locked (`lock_folder`) so that no other run
    removes it as stale; the lock is None only on a filesystem without `flock`."""
    while True:
        folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent))
        fd = lock_folder(folder, wait=True)
        if fd is not None or folder.is_dir():  # else another run's `remove_stale` took it before the lock
            return folder, fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def release_old(old: Path, target: Path) -> None:
    """Remove an `.old` folder, first putting the previous `target` it holds back when `target` is missing
    (the writer died between its two renames, or the second one failed)."""
    kept = old / target.name
    if kept.exists() and not target.exists():
        kept.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def leftovers(names: str) -> re.Pattern:
    """The `.NAME.xxxxxxxx.partial` / `.old` folders (mkdtemp's names) of interrupted writes of targets whose names
    match the regular expression `names` (group 1: the target's name)."""
    return re.compile(rf"\.({names})\.[a-z0-9_]{{8}}\.(partial|old)")


def stale_targets(folder: Path, names: str) -> set[str]:
    """The names of targets in `folder` (matching `names`) that interrupted writes left something of."""
    found = (leftovers(names).fullmatch(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return {m[1] for m in found if m}


def remove_stale(target: Path) -> None:
    """Remove what interrupted writes of `target` left beside it (killed by SIGKILL, power loss): their
    `.NAME.xxxxxxxx.partial` folders, and `.NAME.xxxxxxxx.old` ones after putting the previous `target` back.
    A folder whose writer still runs holds its lock and is left alone."""
    target = Path(os.path.abspath(target))  # "." has itself for parent; its real parent holds the temporary folder
    stale = leftovers(re.escape(target.name))
    if not target.parent.is_dir():
        return
    for folder in sorted(target.parent.iterdir()):
        if stale.fullmatch(folder.name) and (fd := lock_folder(folder, wait=False)) is not None:
            try:
                if folder.suffix == ".old":
                    release_old(folder, target)
                else:
                    shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)


@contextmanager
def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise SystemExit(128 + signal), as Ctrl-C raises KeyboardInterrupt,
    so the cleanup of `atomic_folder` runs before the process ends. Only signals left at their default (which
    kill the process: `nohup`'s ignored SIGHUP and a program's own handlers are kept) and only in the main
    thread (Python runs handlers there alone); the previous handlers come back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame) -> None:
        nonlocal raised
        if not raised:  # a second signal must not cut the cleanup the first one started
            raised = True
            raise SystemExit(128 + signum)

    defaults = [s for s in signals if signal.getsignal(s) is signal.SIG_DFL]
    for s in defaults:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s in defaults:
            signal.signal(s, signal.SIG_DFL)


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left, a quota reached


def disk_full(error: BaseException, folder: Path) -> bool:
    """ENOSPC or EDQUOT; the tokenizers library's error naming one of them; MLX's write error (a RuntimeError without
    errno) on a disk with no space left."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in FULL_ERRNOS
    if any(f"(os error {number})" in str(error) for number in FULL_ERRNOS):
        return True
    try:
        return isinstance(error, RuntimeError) and shutil.disk_usage(folder).free < LOW_SPACE
    except OSError:
        return False


def write_failed(error: BaseException) -> bool:
    """A write refused with space left: a file size limit (EFBIG: ulimit -f, a FAT32 disk's 4 GB), or MLX's errno-less
    write error."""
    if isinstance(error, OSError):
        return error.errno == errno.EFBIG or f"(os error {errno.EFBIG})" in str(error)
    return isinstance(error, RuntimeError) and str(error).startswith("[write] Unable to write")


def put_in_place(tmp: Path, target: Path, replace: bool, option: str = "overwrite=True (--force)") -> None:
    """Rename the complete `tmp` to `target`. An existing `target` is first moved into a locked `.old` folder
    and removed only once `tmp` is in its place; a process killed between the two renames leaves it there,
    and the next write of `target` moves it back (`remove_stale`). An empty `target` is replaced by the one
    rename (POSIX renames a folder over an empty one)."""
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        tmp.rename(target)
        return
    if not replace:
        raise FileExistsError(f"{target} appeared while it was being written; pass {option} to replace it")
    old, lock = owned_folder(target, ".old")
    try:
        target.rename(old / target.name)
        tmp.rename(target)
    finally:
        release_old(old, target)
        unlock(lock)


def is_cwd(folder: Path) -> bool:
    try:
        return os.path.samefile(folder, os.getcwd())
    except OSError:  # no working directory (deleted): it is not this folder
        return False


def check_target(
    target: Path, replace: bool, whole: bool = True, parts: tuple[str, ...] = (),
    option: str = "overwrite=True (--force)", holds: tuple[str, ...] = (), adapters: tuple[str, ...] = (),
) -> bool:  # fmt: skip
    """Whether writing `target` replaces a folder (`atomic_folder`'s arguments); FileExistsError where it may not:
    a file, a folder that no option lets us delete (said first), or one that `replace` is not given for. An empty
    folder holds nothing to lose: it is replaced without asking."""
    if not target.exists():
        return False
    if not target.is_dir():  # no option replaces it: say so first
        raise FileExistsError(f"{target} is a file, not a folder; write the checkpoint folder to another path")
    fixed = "a mount point" if os.path.ismount(target) else "the working directory" if is_cwd(target) else None
    if fixed:  # a rename cannot replace it (or would leave the process in a deleted folder)
        raise FileExistsError(f"{target} is {fixed}, which cannot be replaced: write into a new folder inside it")
    if not any(target.iterdir()):
        return True
    if not holds:
        check_replaceable(target, whole, parts, adapters)
    elif others := sorted(p.name for p in target.iterdir() if p.name not in holds):
        raise FileExistsError(f"{target} holds {', '.join(others)}; replacing the folder would delete them")
    if not replace:
        raise FileExistsError(f"{target} already exists; pass {option} to replace it")
    return True


@contextmanager
def atomic_folder(
    target: Path, replace: bool, whole: bool = True, parts: tuple[str, ...] = (),
    option: str = "overwrite=True (--force)", holds: tuple[str, ...] = (), adapters: tuple[str, ...] = (),
) -> Iterator[Path]:  # fmt: skip
    """A temporary folder beside `target`, renamed into place only if the block completes. An existing
    `target` is replaced only when `replace` (see `check_replaceable`, `parts` the checkpoint folders that a
    folder of several holds), once the new folder is complete; if that fails, the old folder is put back.
    `option` names, in errors, the setting that replaces it; a folder of other files than checkpoints' replaces
    a target that `holds` those files alone. The temporary folder is removed on any error,
    Ctrl-C, SIGTERM or SIGHUP (`exit_on_signals`); after a SIGKILL the next write of `target` removes it
    (`remove_stale`). A `target` that is a link is written where it points, the link kept."""
    target = Path(os.path.abspath(target))  # "." has itself for parent; its real parent holds the temporary folder
    target = target.resolve() if target.is_symlink() else target
    remove_stale(target)
    replace = check_target(target, replace, whole, parts, option, holds, adapters)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:  # a file where a folder of the path belongs
        blocking = next((p for p in target.parents if p.exists() and not p.is_dir()), e.filename)
        raise FileExistsError(f"cannot write {target}: {blocking} is a file, not a folder; write elsewhere") from e
    with exit_on_signals():
        tmp, lock = owned_folder(target, ".partial")
        try:
            tmp.chmod(user_mode())
            yield tmp
            put_in_place(tmp, target, replace, option)
        except BaseException as error:
            full, failed = disk_full(error, target.parent), write_failed(error)
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise OSError(
                    errno.ENOSPC,
                    f"disk full while writing {target}; nothing was written. Free space on that disk (or write "
                    "elsewhere) and run again",
                ) from error
            if failed:
                message = (
                    f"could not write {target} ({error}): a file size limit (ulimit -f, the file system's largest "
                    "file) or a quota stopped it; nothing was written"
                )
                raise (OSError(errno.EFBIG, message) if isinstance(error, OSError) else OSError(message)) from error
            raise
        finally:
            unlock(lock)
