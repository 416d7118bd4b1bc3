"""`pipeline(task, model=...)`: transformers-style task pipelines on MLX models.

Each task lives in its own module and matches the transformers pipeline of the same name field for field.
"""

from pathlib import Path

import mlx.nn as nn

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
ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification"}
# Stored heads each task can load from (fill-mask also runs on the MLM half of a pretraining checkpoint).
ACCEPTED = {
    "feature-extraction": ("encoder", "masked-lm", "pretraining", "sequence-classification",
                           "token-classification", "question-answering"),
    "fill-mask": ("masked-lm", "pretraining"),
    "text-classification": ("sequence-classification",),
    "token-classification": ("token-classification",),
    "question-answering": ("question-answering",),
    "text-generation": ("causal-lm",),
}  # fmt: skip

__all__ = ["pipeline", "Pipeline", "PIPELINES", *(cls.__name__ for cls in PIPELINES.values())]


def pipeline(
    task: str,
    model: str | Path | tuple[nn.Module, Tokenizer],
    batch_size: int = 8,
    dtype: str | None = None,
) -> Pipeline:
    """A pipeline for `task` over a checkpoint folder, hub id, or an already loaded (model, tokenizer).

    The head the task needs is loaded from the checkpoint (feature-extraction uses the bare encoder of any
    checkpoint); a checkpoint without it fails with the head it has and the task that head supports.
    Lists of inputs run through the model `batch_size` at a time.
    """
    name = ALIASES.get(task, task)
    if name not in PIPELINES:
        raise ValueError(f"Unknown task {task!r}; choose one of: {', '.join([*PIPELINES, *ALIASES])}")
    cls = PIPELINES[name]
    loaded, tokenizer = load_for(name, cls.head, model, ACCEPTED[name], dtype)
    return cls(loaded, tokenizer, batch_size=batch_size)
