"""The package's import arrows point from the front ends to the core: read with `ast`, never by importing."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_encoders"
# the core: what may be imported by everything, and may import none of the front ends
CORE = ("models", "engine", "checkpoint", "quantization", "tokenizer", "spm", "jsonfile", "errors", "records", "corpus")
FRONT_ENDS = (
    "embeddings", "conversion", "pipelines", "generation", "train", "index", "serve", "__main__", "distributed",
    "launch",
)  # fmt: skip


def imported(file: Path) -> set[str]:
    """The top-level package modules `file` imports (`mlx_encoders.X` for X), relative imports resolved."""
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [[*target, alias.name] for alias in node.names] if not node.module else [target]
            else:
                names = [(node.module or "").split(".")]
            found |= {n[1] for n in names if len(n) > 1 and n[0] == "mlx_encoders"}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mlx_encoders.")}
    return found


def module_of(file: Path) -> str:
    return file.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_the_core_imports_no_front_end():
    wrong = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if module_of(file) in CORE:
            wrong += [f"{file.relative_to(PACKAGE)} imports mlx_encoders.{m}" for m in imported(file) & set(FRONT_ENDS)]
    assert not wrong, "\n".join(wrong)


def test_the_layers_below_checkpoint_do_not_import_it():
    """models/ and engine/ sit under the checkpoint reader, the tokenizer beside it."""
    wrong = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if module_of(file) in ("models", "engine", "tokenizer", "spm", "jsonfile"):
            wrong += [f"{file.relative_to(PACKAGE)} imports mlx_encoders.checkpoint" for m in imported(file)
                      if m == "checkpoint"]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_reader_sees_relative_imports():
    """The check above would pass on a reader that found nothing: it finds the imports of a known module."""
    assert {"checkpoint", "tokenizer", "embeddings"} <= imported(PACKAGE / "embeddings" / "sentence.py")
    assert "jsonfile" in imported(PACKAGE / "tokenizer.py")
