"""`pipeline(task, model=...)`: transformers-style task pipelines on MLX models.

Each task lives in its own module and matches the transformers pipeline of the same name field for field.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..engine.threads import on_own_thread
from ..tokenizer import Tokenizer
from .base import Pipeline, load_for
from .feature_extraction import FeatureExtractionPipeline
from .fill_mask import FillMaskPipeline
from .question_answering import QuestionAnsweringPipeline
from .text_classification import TextClassificationPipeline
from .text_generation import TextGenerationPipeline
from .token_classification import TokenClassificationPipeline

PIPELINES = {
    "feature-extraction": FeatureExtractionPipeline,
    "fill-mask": FillMaskPipeline,
    "text-classification": TextClassificationPipeline,
    "token-classification": TokenClassificationPipeline,
    "question-answering": QuestionAnsweringPipeline,
    "text-generation": TextGenerationPipeline,
}
# transformers' device names (a torch device's type) -> the MLX device; MLX has one GPU.
DEVICES = {"cpu": mx.cpu, "gpu": mx.gpu, "cuda": mx.gpu, "mps": mx.gpu}  # DeviceTypes: mx.Device(t) is the device
ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification"}
# Stored heads each task can load from (fill-mask also runs on the MLM half of a pretraining checkpoint, BERT's;
# ELECTRA's, a discriminator, has none: `check_not_discriminator`; Qwen3-Embedding's config names its causal LM).
ACCEPTED = {
    "feature-extraction": ("encoder", "masked-lm", "pretraining", "sequence-classification",
                           "token-classification", "question-answering", "causal-lm"),
    "fill-mask": ("masked-lm", "pretraining"),
    "text-classification": ("sequence-classification",),
    "token-classification": ("token-classification",),
    "question-answering": ("question-answering",),
    "text-generation": ("causal-lm",),
}  # fmt: skip

__all__ = ["pipeline", "Pipeline", "PIPELINES", *(cls.__name__ for cls in PIPELINES.values())]


@on_own_thread
def pipeline(
    task: str,
    model: str | Path | nn.Module | tuple[nn.Module, Tokenizer],
    tokenizer: Tokenizer | str | Path | None = None,
    batch_size: int = 8,
    dtype: str | None = None,
    device: str | int | mx.Device | None = None,
    revision: str | None = None,
    **kwargs,
) -> Pipeline:
    """A pipeline for `task` over a checkpoint folder, hub id, a loaded model, or a loaded (model, tokenizer).

    The head the task needs is loaded from the checkpoint (feature-extraction uses the bare encoder of any
    checkpoint); a checkpoint without it fails with the head it has and the task that head supports.
    As in transformers: `tokenizer` (a Tokenizer, or a folder / hub id) replaces the checkpoint's own; lists of
    inputs run through the model `batch_size` at a time; `dtype` casts the weights ("auto" or None: as
    stored); `device` is MLX's ("cpu" / -1, or "gpu" / "cuda" / "mps" / a GPU index); other keywords are the
    defaults of every call (`top_k=3`, `aggregation_strategy="simple"`, ...).
    """
    name = ALIASES.get(task, task)
    if name not in PIPELINES:
        raise ValueError(f"Unknown task {task!r}; choose one of: {', '.join([*PIPELINES, *ALIASES])}")
    cls = PIPELINES[name]
    target = mlx_device(device)
    dtype = None if dtype == "auto" else dtype
    loaded, tokenizer = load_for(name, cls.head, model, ACCEPTED[name], dtype, tokenizer, revision)
    return cls(loaded, tokenizer, batch_size=batch_size, device=target, **kwargs)


def mlx_device(device: str | int | mx.Device | None) -> mx.Device:
    """transformers' `device` values as an MLX device: -1 or "cpu" the CPU; a GPU index (0, 1, ...), "gpu",
    "cuda[:i]" or "mps[:i]" the GPU; None MLX's default device."""
    if device is None:
        return mx.default_device()
    if isinstance(device, (mx.Device, mx.DeviceType)):
        target = device
    elif isinstance(device, int) and not isinstance(device, bool):
        target = mx.cpu if device == -1 else mx.gpu if device >= 0 else None
    else:
        target = DEVICES.get(str(device).split(":")[0])  # str() also reads a torch.device
    if target is None:
        raise ValueError(
            f"Unknown device {device!r}: pass 'cpu' or -1 for the CPU, 'gpu' (or 'cuda', 'mps', a GPU index such as "
            "0) for the GPU, or an mlx.core.Device"
        )
    if not mx.is_available(target):
        raise ValueError(f"device={device!r} asks for the GPU, which this MLX build lacks; pass device='cpu' or -1")
    return target if isinstance(target, mx.Device) else mx.Device(target)
