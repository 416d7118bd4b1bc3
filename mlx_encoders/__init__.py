"""BERT-family text encoders on MLX, numerically equal to Hugging Face transformers."""

import importlib
import sys
from pathlib import Path

# before MLX loads: see runtime.warn_if_usearch_first
_USEARCH_FIRST = "usearch.compiled" in sys.modules and "mlx.core" not in sys.modules

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from .checkpoint import Checkpoint, load_model, load_tokenizer, save  # noqa: E402
from .engine import runtime  # noqa: E402
from .engine.threads import on_own_thread  # noqa: E402
from .models import MODEL_TYPES, TASKS  # noqa: E402
from .models.base import ModelOutput  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "load", "load_model", "load_tokenizer", "save", "ModelOutput", "Tokenizer", "MODEL_TYPES", "TASKS",
    "SentenceEncoder", "CrossEncoder", "quantize_embeddings", "pipeline", "convert", "generate", "stream_generate",
    "GenerationConfig", "SparseEncoder", "SparseVectors",
    "MultiVectorEncoder", "Muvera", "BGEM3",
]  # fmt: skip

# Heavier front ends import on first use, so `import mlx_encoders` stays fast.
_LAZY = {
    "SentenceEncoder": "embeddings.sentence", "CrossEncoder": "embeddings.cross_encoder",
    "quantize_embeddings": "embeddings.vectors", "pipeline": "pipelines", "convert": "conversion",
    "generate": "generation", "stream_generate": "generation", "GenerationConfig": "generation",
    "SparseEncoder": "embeddings.sparse", "SparseVectors": "embeddings.sparse",
    "MultiVectorEncoder": "embeddings.multi_vector", "Muvera": "embeddings.muvera", "BGEM3": "embeddings.bge_m3",
}  # fmt: skip
_SUBPACKAGES = ("train", "quantization", "generation", "serve")
runtime.warn_if_slow_blas()
runtime.warn_if_usearch_first(_USEARCH_FIRST)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@on_own_thread
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
