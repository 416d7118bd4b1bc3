"""An offline corpus of real English text: the docstrings of the installed Python standard library.

Collected with `ast` (nothing is imported or executed), walking the standard library's .py files in sorted
order, so the same Python version always yields the same texts in the same order. The tests, the benchmark,
convert's calibration and `examples/search.py` share it. The walk parses some 650 files (4-6 s on a 2-core
machine), so its result is kept in the user's cache folder (`cache_file()`) and read from there after.
"""

import ast
import contextlib
import functools
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Test suites and vendored packages are not the library's own prose.
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
MIN_CHARS = 40


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> Iterator[Path]:
    for file in sorted(root.rglob("*.py")):
        if not SKIP_PARTS.intersection(file.relative_to(root).parts):
            yield file


def _module_name(file: Path, root: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstrings(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) of `node` and the classes and functions nested in it."""
    doc = ast.get_docstring(node, clean=True)
    if doc:
        yield qualname, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(child, f"{qualname}.{child.name}")


def _walk() -> list[tuple[str, str]]:
    """Every (qualified name, docstring) of the standard library with at least MIN_CHARS characters."""
    root, out = stdlib_root(), []
    for file in _source_files(root):
        try:
            tree = ast.parse(file.read_bytes(), filename=str(file))
        except (SyntaxError, ValueError):  # a few files are templates or target other Python versions
            continue
        out.extend((name, doc) for name, doc in _docstrings(tree, _module_name(file, root)) if len(doc) >= MIN_CHARS)
    return out


def cache_file() -> Path:
    """Where the walk is kept: `$XDG_CACHE_HOME` (else ~/.cache)/mlx-encoders, under a name made from all the
    walk depends on (the Python build, its standard library's folder, this module's code)."""
    sources = (sys.version, str(stdlib_root()), Path(__file__).read_bytes())
    digest = hashlib.sha256(repr(sources).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-encoders"
    return folder / f"stdlib-docstrings-{digest}.json"


def valid_pair(pair) -> bool:
    return isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair)


@functools.cache
def _documents() -> tuple[tuple[str, str], ...]:
    """`_walk()`, read from `cache_file()` when a valid one is there, else walked and written there (renamed
    into place, so a reader never sees half a file; an unwritable cache folder only costs the walk)."""
    file = cache_file()
    with contextlib.suppress(OSError, ValueError):
        pairs = json.loads(file.read_text(encoding="utf-8"))
        if isinstance(pairs, list) and pairs and all(valid_pair(pair) for pair in pairs):
            return tuple(map(tuple, pairs))
    pairs = _walk()
    with contextlib.suppress(OSError):
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f".{file.name}.{os.getpid()}")
        partial.write_text(json.dumps(pairs), encoding="utf-8")
        partial.replace(file)
    return tuple(pairs)


def stdlib_documents(n: int | None = None, max_chars: int | None = None) -> list[tuple[str, str]]:
    """Up to `n` (source id, text) pairs, e.g. ("json.decoder.JSONDecoder.decode", "Return the Python ...").

    Docstrings shorter than 40 characters and exact repeats are skipped; `max_chars` cuts each text.
    """
    seen, out = set(), []
    for name, doc in _documents():
        text = doc[:max_chars] if max_chars else doc
        if text in seen:
            continue
        seen.add(text)
        out.append((name, text))
        if n is not None and len(out) >= n:
            break
    return out


def stdlib_docstrings(n: int | None = None, max_chars: int | None = None) -> list[str]:
    """Up to `n` docstring texts of the standard library (see `stdlib_documents`)."""
    return [text for _, text in stdlib_documents(n, max_chars)]
