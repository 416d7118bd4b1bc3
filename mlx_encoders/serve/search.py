"""Served indexes (`--index NAME=DIR`): an `mlx_encoders.index.Index` opened once per precision, searched with a
query vector that the index's model computes on its worker (so queries share forward passes with the model's
other requests), as `Index.search` of the query text would."""

import threading
from pathlib import Path

from ..checkpoint import folder_digest, resolve
from ..index import Index
from .models import ServedModel, default_name


class ServedIndex:
    """The index in `folder` under `name`, searched with `model` (the dense model it was built with)."""

    def __init__(self, name: str, folder: str | Path, index: Index, model: ServedModel):
        self.name, self.folder, self.model = name, Path(folder), model
        if folder_digest(model.encoder.path) != index.meta.get("model_fingerprint"):
            raise ValueError(
                f"--index {name}={folder}: the index was built with the model {index.meta.get('model')!r}, and "
                f"{model.source!r} is another model (its files differ); serve the index's model, or rebuild the index"
            )
        self.opened = {index.precision: index}
        self.lock = threading.Lock()

    def index(self, precision: str) -> Index:
        """The index searched at `precision`, opened on first use (int8 / binary codes are made when opened)."""
        with self.lock:
            if precision not in self.opened:
                self.opened[precision] = Index(self.folder, precision=precision)
            return self.opened[precision]


def open_index(name: str, folder: str | Path, models: list[ServedModel], dtype, batch_size: int) -> ServedIndex:
    """The index in `folder`, served with the `--model` of its model's folder, else with its model loaded once and
    added to `models` (under its folder's name)."""
    try:
        index = Index(folder)
    except ValueError as e:  # StoreError: no index there, or a damaged one
        raise ValueError(f"--index {name}={folder}: {e}") from None
    source = index.meta["model"]
    try:
        path = resolve(source).resolve()
    except (OSError, ValueError) as e:
        raise ValueError(f"--index {name}={folder}: its model {source!r} cannot be found ({e}); serve it") from None
    model = next((m for m in models if m.encoder is not None and Path(m.encoder.path).resolve() == path), None)
    if model is None:
        model = ServedModel(default_name(source), source, dtype, batch_size)
        if model.encoder is None:
            raise ValueError(f"--index {name}={folder}: its model {source!r} is a {model.kind} model, not a dense one")
        if any(m.name == model.name for m in models):
            raise ValueError(
                f"--index {name}={folder}: its model {source!r} would be served as {model.name!r}, a name another "
                f"model takes; serve it with --model OTHER_NAME={source}"
            )
        models.append(model)
    return ServedIndex(name, folder, index, model)
