"""Small C helpers the engine compiles on first need (`gemv.py`, `kernel_flags.py`), with the C compiler MLX's CPU
backend also needs for its compiled kernels, into the user's cache, keyed by the source, the machine and the
compiler's identity. Without a compiler there is no helper, which only costs speed.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-encoders"


def compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang", "g++") if c and shutil.which(c)), None)


def compiler_identity(cc: str) -> str:
    """The compiler's path and its own description of its version: a changed compiler builds anew."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return f"{shutil.which(cc)}\n{version}"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(source: str, stem: str) -> Path | None:
    """The shared library compiled from the C `source` (built on first use, written whole or not at all, kept as
    `stem-<key>.so` per source, machine and compiler), or None without a compiler or a usable cache of the user's
    own."""
    cc = compiler()
    if cc is None:
        return None
    try:
        key = hashlib.sha256(f"{source}{platform.machine()}{compiler_identity(cc)}".encode()).hexdigest()[:16]
        target = cache_folder() / f"{stem}-{key}.so"
        digest = target.with_suffix(".sha256")  # a damaged library would crash the process that loads it
        if not (digest.exists() and target.exists() and digest.read_text() == file_digest(target)):
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as work:
                written, built = Path(work) / f"{stem}.c", Path(work) / target.name
                written.write_text(source)
                command = [cc, "-O2", "-shared", "-fPIC", "-o", str(built), "-x", "c", str(written)]  # C, even by g++
                subprocess.run(command, check=True, capture_output=True, timeout=60)
                (Path(work) / digest.name).write_text(file_digest(built))
                os.replace(built, target)
                os.replace(Path(work) / digest.name, digest)
        owner = target.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o022:  # loaded code: the user's own, written by no other
            return None
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    return target
