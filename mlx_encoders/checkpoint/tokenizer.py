"""The tokenizer of a checkpoint, fitted to its model: limited to the model's positions, and refused when it can
produce ids past the model's embedding table. `load`, the pipelines, `SentenceEncoder`, convert and `fine_tune`
all read their tokenizer here.
"""

from pathlib import Path

import mlx.nn as nn

from ..models import reads_token_types
from ..models.base import BaseArgs
from ..tokenizer import Tokenizer
from .files import Checkpoint


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
    return tokenizer_for(model.args, path)


def tokenizer_for(args: BaseArgs, path: str | Path | Checkpoint, check_vocab: bool = True) -> Tokenizer:
    """The tokenizer in `path` for a model of `args`, before or without building the model. `check_vocab=False`
    only where the model's vocab_size is still to be taken from this tokenizer (training from scratch)."""
    path = path.path if isinstance(path, Checkpoint) else path
    tokenizer = Tokenizer.from_pretrained(path, args.max_tokens, reads_token_types(args), args.model_type)
    if check_vocab:
        fits_vocab(tokenizer, args, path)
    return tokenizer


def fits_vocab(tokenizer: Tokenizer, args: BaseArgs, path: str | Path) -> None:
    """Fail when the tokenizer can produce ids the model has no embedding for (they would index past the table)."""
    size = getattr(args, "vocab_size", None)
    if size is not None and tokenizer.max_id >= size:
        raise ValueError(
            f"The tokenizer in {path} has {tokenizer.vocab_size} tokens (ids up to {tokenizer.max_id}), more than the "
            f"model's vocab_size of {size} embeddings in its config.json. Use the tokenizer the model was trained "
            "with, or a checkpoint whose vocab_size covers the tokenizer's."
        )
