"""BERT-family text encoders on MLX, numerically equal to Hugging Face transformers."""

from . import _blas  # noqa: F401  (first: on Linux it must load a fast BLAS before MLX loads its own)

# isort: split
import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .loading import load_model, resolve
from .models import MODEL_TYPES, TASKS, model_module
from .models.base import ModelOutput
from .tokenizer import Tokenizer

__version__ = "0.1.0"
__all__ = [
    "load", "load_model", "load_tokenizer", "ModelOutput", "Tokenizer", "MODEL_TYPES", "TASKS",
    "SentenceEncoder", "pipeline", "convert",
]  # fmt: skip

# Heavier front ends import on first use, so `import mlx_encoders` stays fast.
_LAZY = {"SentenceEncoder": "sentence", "pipeline": "pipelines", "convert": "conversion"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_tokenizer(model: nn.Module, path: str | Path | None = None) -> Tokenizer:
    """The tokenizer stored beside a loaded model (or in `path`), limited to the model's positions."""
    module = model_module(model.config["model_type"])
    return Tokenizer.from_pretrained(path or model.path, model.args.max_tokens, module.TOKEN_TYPES)


def load(
    path_or_repo: str | Path,
    dtype: str | mx.Dtype | None = None,
    task: str | None = None,
    revision: str | None = None,
) -> tuple[nn.Module, Tokenizer]:
    """Load a model and its tokenizer from a local folder or a Hugging Face hub id.

    The head comes from config.json `architectures[0]` unless `task` names another (one of `TASKS`,
    e.g. "encoder" for the bare encoder of an MLM checkpoint). `dtype=None` keeps the stored dtype.
    """
    path = resolve(path_or_repo, revision)
    model = load_model(path, dtype=dtype, task=task)
    return model, load_tokenizer(model)
