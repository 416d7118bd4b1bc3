"""BERT-family text encoders on MLX, numerically equal to Hugging Face transformers."""

import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .checkpoint import Checkpoint, load_model, save
from .engine import runtime
from .models import MODEL_TYPES, TASKS, model_module
from .models.base import ModelOutput
from .tokenizer import Tokenizer

__version__ = "0.1.0"
__all__ = [
    "load", "load_model", "load_tokenizer", "save", "ModelOutput", "Tokenizer", "MODEL_TYPES", "TASKS",
    "SentenceEncoder", "CrossEncoder", "quantize_embeddings", "pipeline", "convert", "generate", "stream_generate",
    "GenerationConfig",
]  # fmt: skip

# Heavier front ends import on first use, so `import mlx_encoders` stays fast.
_LAZY = {
    "SentenceEncoder": "sentence", "CrossEncoder": "cross_encoder", "quantize_embeddings": "vectors",
    "pipeline": "pipelines", "convert": "conversion", "generate": "generation",
    "stream_generate": "generation", "GenerationConfig": "generation",
}  # fmt: skip
_SUBPACKAGES = ("train", "quantization", "generation")
runtime.warn_if_slow_blas()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_tokenizer(model: nn.Module, path: str | Path | Checkpoint | None = None) -> Tokenizer:
    """The tokenizer in `path` (default: the folder `model` was loaded from), limited to the model's positions.

    A model built in code from its `ModelArgs` has no folder: pass the tokenizer's `path`.
    """
    path = path if path is not None else getattr(model, "path", None)
    if path is None:
        raise ValueError(
            f"{type(model).__name__} was not loaded from a folder; pass the tokenizer's folder: "
            "load_tokenizer(model, path)"
        )
    path = path.path if isinstance(path, Checkpoint) else path
    module = model_module(model.args.model_type)
    tokenizer = Tokenizer.from_pretrained(path, model.args.max_tokens, module.TOKEN_TYPES)
    check_vocab(tokenizer, model, path)
    return tokenizer


def check_vocab(tokenizer: Tokenizer, model: nn.Module, path: str | Path) -> None:
    """Fail when the tokenizer can produce ids the model has no embedding for (they would index past the table)."""
    size = getattr(model.args, "vocab_size", None)
    if size is not None and tokenizer.max_id >= size:
        raise ValueError(
            f"The tokenizer in {path} has {tokenizer.vocab_size} tokens (ids up to {tokenizer.max_id}), more than the "
            f"model's vocab_size of {size} embeddings in its config.json. Use the tokenizer the model was trained "
            "with, or a checkpoint whose vocab_size covers the tokenizer's."
        )


def load(
    path_or_repo: str | Path | Checkpoint,
    dtype: str | mx.Dtype | None = None,
    task: str | None = None,
    revision: str | None = None,
    *,
    num_labels: int | None = None,
    id2label: dict | None = None,
    label2id: dict | None = None,
    problem_type: str | None = None,
) -> tuple[nn.Module, Tokenizer]:
    """Load a model and its tokenizer from a local folder or a Hugging Face hub id.

    The head comes from config.json `architectures[0]` unless `task` names another (one of `TASKS`,
    e.g. "encoder" for the bare encoder of an MLM checkpoint). `dtype=None` keeps the stored dtype.
    `num_labels=`, `id2label=`, `label2id=` and `problem_type=` create a head the checkpoint lacks (see
    `load_model`).
    """
    checkpoint = Checkpoint.open(path_or_repo, revision)
    labels = dict(num_labels=num_labels, id2label=id2label, label2id=label2id, problem_type=problem_type)
    model = load_model(checkpoint, dtype=dtype, task=task, **labels)
    return model, load_tokenizer(model, checkpoint)
