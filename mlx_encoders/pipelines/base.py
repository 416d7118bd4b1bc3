"""Shared machinery of the task pipelines: loading the right head, padding encodings and batching.

Mirrors the parts of transformers' `Pipeline` (pipelines/base.py) that change results: inputs are
tokenized one by one, then run through the model `batch_size` at a time with right padding.
"""

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding

from ..checkpoint import Checkpoint
from ..models import model_module
from ..tokenizer import Tokenizer, check_count, text_list

# The pipeline task each stored head serves (a bare encoder serves feature extraction).
HEAD_TASKS = {
    "encoder": "feature-extraction",
    "masked-lm": "fill-mask",
    "pretraining": "fill-mask",
    "sequence-classification": "text-classification",
    "token-classification": "token-classification",
    "question-answering": "question-answering",
    "causal-lm": "text-generation",
}


def batches(items: Sequence, batch_size: int) -> Iterator[Sequence]:
    check_count("batch_size", batch_size, 1)
    for start in range(0, len(items), batch_size):
        yield items[start : start + batch_size]


def to_numpy(x: mx.array) -> np.ndarray:
    """Float outputs as float32 numpy (transformers' pipelines also upcast half precision first)."""
    return np.array(x.astype(mx.float32)) if mx.issubdtype(x.dtype, mx.floating) else np.array(x)


class Pipeline:
    """A model with the head a task needs, its tokenizer, and `batch_size` for lists of inputs."""

    task = ""
    head = ""  # the models/ task name of the head this pipeline runs

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, batch_size: int = 8):
        self.check(model)
        check_count("batch_size", batch_size, 1)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    def check(self, model: nn.Module) -> None:
        check_head(model, self.task, self.head)

    @property
    def max_length(self) -> int:
        """The longest window the model takes: the tokenizer's limit, capped by the position table."""
        limit = self.model.args.max_tokens
        return min(self.tokenizer.model_max_length, limit) if limit else self.tokenizer.model_max_length

    @property
    def id2label(self) -> dict[int, str]:
        return self.model.args.id2label

    def run(self, batch: dict[str, mx.array]):
        return self.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids")
        )

    def forward(
        self, encodings: Sequence[Encoding], fields: Sequence[str] = ("logits",), per_token: bool = True
    ) -> list[list[np.ndarray]]:
        """Run encodings through the model `batch_size` at a time; per encoding, the numpy value of each
        ModelOutput field in `fields`, cut back to the encoding's own length when `per_token`."""
        results = []
        for chunk in batches(encodings, self.batch_size):
            out = self.run(self.tokenizer.pad(list(chunk)))
            values = [to_numpy(getattr(out, name)) for name in fields]
            for row, e in enumerate(chunk):
                n = len(e.ids) if per_token else None
                results.append([v[row, :n] for v in values])
        return results

    def texts(self, inputs) -> list[str]:
        """A str or a list of str as a non-empty list; a TypeError naming the first item that is not a str."""
        texts = text_list(inputs, f"The {self.task!r} pipeline")
        if not texts:
            raise ValueError(f"{self.task} needs at least one input: a text or a non-empty list of texts")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"The {self.task!r} pipeline takes strings; item {i} is {type(text).__name__}: {text!r:.60}"
                )
        return texts

    def encode(self, texts: Sequence, text_pairs: Sequence | None = None, truncation: bool = True) -> list[Encoding]:
        """Encodings truncated to `max_length`; without truncation, one longer than the position table fails."""
        encodings = self.tokenizer.encode_batch(texts, text_pairs, truncation=truncation, max_length=self.max_length)
        limit = self.model.args.max_tokens
        for i, (text, e) in enumerate(zip(texts, encodings, strict=True)):
            if not e.ids:
                raise ValueError(f"Input {text!r} produced no tokens; pass a non-empty text")
            if limit and len(e.ids) > limit:
                raise ValueError(
                    f"Item {i} has {len(e.ids)} tokens, more than the model's {limit}; pass truncation=True"
                )
        return encodings


def check_head(model: nn.Module, task: str, head: str) -> None:
    """Fail with the head the model has and the task it serves when it lacks the one `task` needs."""
    module = model_module(model.args.model_type)
    if isinstance(model, module.MODELS.get(head, ())):
        return
    have = next((name for name, cls in module.MODELS.items() if type(model) is cls), type(model).__name__)
    source = f" from {model.path}" if getattr(model, "path", None) else ""
    raise ValueError(
        f"The {task!r} pipeline needs a {head} head, but {type(model).__name__}{source} has a {have} "
        f"head, which supports the {HEAD_TASKS.get(have, '?')!r} task. Use a checkpoint fine-tuned for {task}."
    )


def load_for(task: str, head: str, model, accepted: Sequence[str], dtype=None) -> tuple[nn.Module, Tokenizer]:
    """(model, tokenizer) from a path / hub id (loading the `head` the task needs) or from a loaded pair."""
    from .. import load

    if isinstance(model, (tuple, list)):
        return model[0], model[1]
    checkpoint = Checkpoint.open(model)
    have = checkpoint.task
    if have not in accepted:
        architecture = (checkpoint.config.get("architectures") or ["a bare encoder"])[0]
        raise ValueError(
            f"The {task!r} pipeline needs a {head} head, but {checkpoint.path} holds {architecture} (a {have} head), "
            f"which supports the {HEAD_TASKS.get(have, '?')!r} task. Use a checkpoint fine-tuned for {task}."
        )
    return load(checkpoint, dtype=dtype, task=head)
