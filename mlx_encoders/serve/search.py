"""Served indexes (`--index NAME=DIR`): an `mlx_encoders.index.Index` opened once per precision, searched with query
embeddings that the index's models compute on their workers (so queries share forward passes with the models' other
requests): the dense model's unit vector and, for an index with postings, the sparse model's query vector, as
`Index.search` of the query text computes them (`encode_query` of each).

HNSW graphs are built at start-up only, never inside a request: a precision first asked for later uses its saved
graph when it is current, else exact search; so does an index rebuilt while served, which is opened again (its
vectors read anew) at the first search that finds the new build."""

import sys
import threading
from pathlib import Path

from ..checkpoint import folder_digest, resolve
from ..index import Hit, Index, StaleIndex
from .models import ServedModel, default_name


class ServedIndex:
    """The index in `folder` under `name`, searched with `model` (the dense model it was built with; None for a
    sparse-only index) and `sparse` (its sparse model; None for a dense-only index)."""

    def __init__(
        self, name: str, folder: str | Path, index: Index, model: ServedModel | None, sparse: ServedModel | None = None
    ):
        self.name, self.folder, self.model, self.sparse = name, Path(folder), model, sparse
        self.check_models(index)
        self.opened = {index.precision: index}
        self.modes = tuple(m for m, has in (("dense", index.dense), ("sparse", index.sparse)) if has)
        self.modes += ("hybrid",) if len(self.modes) == 2 else ()
        self.lock = threading.Lock()

    def check_models(self, index: Index) -> None:
        """The served models must be the index's own (the same files)."""
        for served, encoder, kind in ((self.model, "encoder", "model"), (self.sparse, "sparse", "sparse_model")):
            files = None if served is None else folder_digest(getattr(served, encoder).path)
            if files is not None and files != index.meta.get(f"{kind}_fingerprint"):
                raise ValueError(
                    f"--index {self.name}={self.folder}: the index was built with the {kind.replace('_', ' ')} "
                    f"{index.meta.get(kind)!r}, and {served.source!r} is another model (its files differ); serve the "
                    "index's model, or rebuild the index"
                )

    def index(self, precision: str) -> Index:
        """The index searched at `precision`, opened on first use (int8 / binary codes are made when opened) with
        its saved graph, never building one."""
        with self.lock:
            if precision not in self.opened:
                self.opened[precision] = Index(self.folder, precision=precision, write=False)
            return self.opened[precision]

    def search(self, precision: str, query, k: int, **options) -> list[Hit]:
        """`Index.search` at `precision`; an index rebuilt since it was opened is opened again and searched."""
        index = self.index(precision)
        try:
            return index.search(query, k, **options)
        except StaleIndex:
            return self.reopen(precision, index).search(query, k, **options)

    def reopen(self, precision: str, stale: Index) -> Index:
        """The index at `precision` opened again (once, whichever request finds it stale first)."""
        with self.lock:
            if self.opened.get(precision) is stale:
                fresh = Index(self.folder, precision=precision, write=False)
                self.check_models(fresh)
                if (fresh.dense, fresh.sparse) != (stale.dense, stale.sparse):
                    raise ValueError(f"the index {self.folder} was rebuilt with other models; restart the server")
                self.opened[precision] = fresh
            return self.opened[precision]

    def describe(self) -> str:
        by = [f"{kind}model {m.name}" for m, kind in ((self.model, ""), (self.sparse, "sparse ")) if m is not None]
        return f"{self.name}: {self.folder}, queries embedded by {' and '.join(by)} ({', '.join(self.modes)})"


def served_model(name: str, folder, source: str, kind: str, models: list[ServedModel], dtype, batch_size: int):
    """The served model of `source`'s folder able to embed an index's queries (`kind` "dense" or "sparse"), else
    that model loaded and added to `models` (under its folder's name)."""
    try:
        path = resolve(source).resolve()
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--index {name}={folder}: its {kind} model {source!r} cannot be found ({e}); serve it"
        ) from None
    held = "encoder" if kind == "dense" else "sparse"
    for model in models:
        if getattr(model, held) is not None and Path(getattr(model, held).path).resolve() == path:
            return model
    model = ServedModel(default_name(source), source, dtype, batch_size)
    if getattr(model, held) is None:
        raise ValueError(f"--index {name}={folder}: its {kind} model {source!r} is a {model.kind} model")
    if any(m.name == model.name for m in models):
        raise ValueError(
            f"--index {name}={folder}: its {kind} model {source!r} would be served as {model.name!r}, a name another "
            f"model takes; serve it with --model OTHER_NAME={source}"
        )
    models.append(model)
    return model


def open_at_start(folder: str | Path) -> Index:
    """The index in `folder` opened at start-up: its HNSW graph built now where it is needed and missing or stale,
    and exact search where that graph cannot be written (a read-only folder)."""
    try:
        return Index(folder)
    except OSError as e:
        print(
            f"mlx-encoders serve: cannot write the HNSW graph of the index {folder} ({e}); searching it exactly. "
            f"For faster search, build it once with write access: mlx-encoders index search --index {folder} QUERY",
            file=sys.stderr,
        )
        return Index(folder, write=False)


def open_index(name: str, folder: str | Path, models: list[ServedModel], dtype, batch_size: int) -> ServedIndex:
    """The index in `folder`, served with the `--model` of each of its models' folders (dense, sparse), else with
    that model loaded once and added to `models`."""
    try:
        index = open_at_start(folder)
    except ValueError as e:  # StoreError: no index there, or a damaged one
        raise ValueError(f"--index {name}={folder}: {e}") from None
    dense, sparse = (
        served_model(name, folder, index.meta[key], kind, models, dtype, batch_size) if present else None
        for present, key, kind in ((index.dense, "model", "dense"), (index.sparse, "sparse_model", "sparse"))
    )
    return ServedIndex(name, folder, index, dense, sparse)
