"""An offline corpus of real English text: the docstrings of the installed Python standard library.

Collected with `ast` (nothing is imported or executed), walking the standard library's .py files in sorted
order, so the same Python version always yields the same texts in the same order. The tests, the benchmark
and `examples/search.py` share it.
"""

import ast
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


def stdlib_documents(n: int | None = None, max_chars: int | None = None) -> list[tuple[str, str]]:
    """Up to `n` (source id, text) pairs, e.g. ("json.decoder.JSONDecoder.decode", "Return the Python ...").

    Docstrings shorter than 40 characters and exact repeats are skipped; `max_chars` cuts each text.
    """
    root, seen, out = stdlib_root(), set(), []
    for file in _source_files(root):
        try:
            tree = ast.parse(file.read_bytes(), filename=str(file))
        except (SyntaxError, ValueError):  # a few files are templates or target other Python versions
            continue
        for name, doc in _docstrings(tree, _module_name(file, root)):
            text = doc[:max_chars] if max_chars else doc
            if len(doc) < MIN_CHARS or text in seen:
                continue
            seen.add(text)
            out.append((name, text))
            if n is not None and len(out) >= n:
                return out
    return out


def stdlib_docstrings(n: int | None = None, max_chars: int | None = None) -> list[str]:
    """Up to `n` docstring texts of the standard library (see `stdlib_documents`)."""
    return [text for _, text in stdlib_documents(n, max_chars)]
