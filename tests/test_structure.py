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


def train_imports(file: Path) -> set[str]:
    """The modules of train/ that `file` imports (dotted, from mlx_encoders: "train.tasks.heads"), anywhere in it."""
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom):
            base = [*package[: len(package) - node.level + 1]] if node.level else []
            target = [*base, *(node.module.split(".") if node.module else [])]
            found |= {".".join(target[1:])} | {".".join([*target[1:], a.name]) for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("mlx_encoders.") for a in node.names}
    return {name for name in found if name.startswith("train") and name in TRAIN_MODULES}


TRAIN_MODULES = {
    ".".join(f.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for f in (PACKAGE / "train").rglob("*.py")
}


def test_train_has_no_import_circle():
    """The training modules import each other one way: a circle means one cannot be read (or changed) alone."""
    edges = {}
    for file in (PACKAGE / "train").rglob("*.py"):
        name = ".".join(file.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        edges[name] = train_imports(file) - {name}
    assert {"train.tasks.heads", "train.trainer"} <= edges["train.tasks.classification"] | edges["train.tasks.heads"]
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        path.append(module)
        for other in sorted(edges.get(module, ())):
            visit(other)
        path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)


# what serve/ may import from the rest of the package, module by module (see the test's docstring)
SERVE_MAY_IMPORT = {
    "mlx_encoders": {"__version__"},
    "mlx_encoders.errors": {"DEBUG_ENV"},
    "mlx_encoders.checkpoint": {"resolve", "folder_digest", "read_json_object"},
    "mlx_encoders.embeddings.auto": {"load_encoder", "folder_kind"},  # what a folder serves, before it loads
    "mlx_encoders.embeddings.sentence": {"SentenceEncoder"},
    "mlx_encoders.embeddings.cross_encoder": {"CrossEncoder"},
    "mlx_encoders.embeddings.sparse": {"SparseEncoder", "SparseVectors"},
    "mlx_encoders.embeddings.multi_vector": {"MultiVectorEncoder"},
    "mlx_encoders.embeddings.vectors": {"quantize_embeddings"},
    "mlx_encoders.pipelines.text_classification": {"TextClassificationPipeline", "FUNCTIONS"},
    "mlx_encoders.index": {"Hit", "Index", "StaleIndex", "DamagedStore"},
    "mlx_encoders.index.search": {"FUSIONS", "MAX_K", "RRF_K"},
}


def imported_names(file: Path) -> set[tuple[str, str]]:
    """(dotted module, name) of each `from M import name` in `file` (anywhere in it, relative imports resolved);
    (module, "*") for each `import mlx_encoders.M`."""
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found |= {(module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "*") for alias in node.names}
    return found


def test_serve_reaches_the_package_only_through_the_encoders_public_interface():
    """serve/ imports from the package only what SERVE_MAY_IMPORT lists: the encoders it serves and the
    text-classification pipeline that labels a classifier's scores (their classes; `load_encoder`, which picks the
    encoder a folder holds; `quantize_embeddings` for typed vectors; the pipeline's function names), the index it
    searches, the checkpoint layer's finding and reading of a model's files (a hub id's folder, its digest, the
    config.json Ollama's listing reads), the package version and the debug switch. Tokenization, prompts, pooling,
    normalisation and activations are the encoders' own: importing their helpers (`resolve_prompt`, `task_adapter`,
    `softmax`, ...) is how the server came to redo `encode`, so any other name fails here."""
    wrong = []
    for file in sorted((PACKAGE / "serve").rglob("*.py")):
        for module, name in sorted(imported_names(file)):
            if module.split(".")[0] != "mlx_encoders" or module.startswith("mlx_encoders.serve"):
                continue
            if name not in SERVE_MAY_IMPORT.get(module, ()):
                wrong.append(f"{file.relative_to(PACKAGE)} imports {name} from {module}")
    assert not wrong, "\n".join(wrong)


def test_the_serve_reader_resolves_what_serve_imports():
    """The check above would pass on a reader that found nothing: it finds known imports, relative and nested."""
    assert ("mlx_encoders.embeddings.auto", "load_encoder") in imported_names(PACKAGE / "serve" / "models.py")
    ollama = imported_names(PACKAGE / "serve" / "protocols" / "ollama.py")
    assert {("mlx_encoders", "__version__"), ("mlx_encoders.checkpoint", "read_json_object")} <= ollama
    assert ("mlx_encoders.serve.errors", "ApiError") in ollama
