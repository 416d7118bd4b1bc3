"""Checks at every model's entry: inputs the embedding tables cannot take fail with the value and its limit.

MLX does not range-check indices: an id past a table reads stray memory (or crashes the process) and -1 reads
the last row, so the encoders check their inputs before any lookup.
"""

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .base import BaseArgs

_UNCHECKED = contextvars.ContextVar("unchecked_inputs", default=False)  # set within `unchecked_inputs`


def check_inputs(
    args: BaseArgs,
    input_ids: mx.array,
    attention_mask: mx.array | None = None,
    token_type_ids: mx.array | None = None,
    max_length: int | None = None,
    pad_token_id: int | None = None,
) -> None:
    """Fail, naming the value and its limit, on inputs the embedding tables cannot take: MLX does not range-check
    indices, so an id past a table reads stray memory (or crashes the process) and -1 reads the last row.

    `max_length` is the number of positions in the table (None: no table, as with RoPE); with `pad_token_id`,
    positions count only the other tokens (RoBERTa). Costs a host read of the ids' min and max.
    """
    check_shapes(input_ids, attention_mask, token_type_ids)
    if checking_off() or input_ids.size == 0:
        return
    check_length(args, input_ids, max_length, pad_token_id)
    type_vocab_size = getattr(args, "type_vocab_size", 0)  # 0 or absent: the model reads no token types
    types = token_type_ids if token_type_ids is not None and type_vocab_size else None
    bad = outside(input_ids, args.vocab_size)
    if bad is not None:
        raise ValueError(
            f"input_ids holds token id {bad}, outside the vocabulary of {args.vocab_size} tokens (vocab_size="
            f"{args.vocab_size}: ids 0..{args.vocab_size - 1}); tokenize with this model's own tokenizer, or check "
            "vocab_size in its config.json"
        )
    bad = outside(types, type_vocab_size) if types is not None else None
    if bad is not None:
        hint = "; this model takes no text-pair segments: pass token_type_ids=None" if type_vocab_size == 1 else ""
        raise ValueError(
            f"token_type_ids holds token type {bad}, but the model has type_vocab_size={type_vocab_size} "
            f"(types 0..{type_vocab_size - 1}){hint}"
        )


@contextmanager
def unchecked_inputs() -> Iterator[None]:
    """Within the block (this thread or task only), check_inputs checks shapes only, not values: mx.compile traces
    a function with inputs that cannot be read on the host. The caller checks the same inputs outside first."""
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def checking_off() -> bool:
    """Whether inputs go unchecked here (`unchecked_inputs`)."""
    return _UNCHECKED.get()


def outside(ids: mx.array, size: int) -> int | None:
    """The lowest id if it is below 0, else the highest if it is size or more, else None. numpy reads the ids in
    place: a few microseconds, where MLX's reductions wait tens or hundreds on its scheduler."""
    ids = np.asarray(ids)
    low, high = int(ids.min()), int(ids.max())
    return low if low < 0 else high if high >= size else None


def check_shapes(input_ids: mx.array, attention_mask: mx.array | None, token_type_ids: mx.array | None) -> None:
    """input_ids is a (B, L) integer mx.array; the mask and token types, when given, have its shape."""
    for name, x in (("input_ids", input_ids), ("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if x is not None and not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}; convert it with mx.array({name})")
    if input_ids.ndim != 2:
        raise ValueError(
            f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}; add a batch axis to a single "
            "sequence (input_ids[None])"
        )
    for name, x in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if x is not None and x.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but input_ids has shape {tuple(input_ids.shape)}; they must match"
            )
    for name, x in (("input_ids", input_ids), ("token_type_ids", token_type_ids)):
        if x is not None and not mx.issubdtype(x.dtype, mx.integer):
            dtype = str(x.dtype).rsplit(".", 1)[-1]
            raise ValueError(f"{name} must hold integers, got {dtype}; cast it with {name}.astype(mx.int32)")


def check_length(args: BaseArgs, input_ids: mx.array, max_length: int | None, pad_token_id: int | None) -> None:
    """Fail on an input longer than the position table; counting its non-padding tokens only when the
    length alone exceeds it keeps the common case free of any reduction."""
    if max_length is None or input_ids.shape[1] <= max_length:
        return
    length, what, table = input_ids.shape[1], "tokens", f"max_position_embeddings={args.max_position_embeddings}"
    if pad_token_id is not None:
        length = (input_ids != pad_token_id).sum(axis=1).max().item()
        what, table = "tokens besides padding", f"{table}, positions starting after pad_token_id={pad_token_id}"
    if length > max_length:
        raise ValueError(
            f"input of {length} {what} is longer than the {max_length} positions of the model's position table "
            f"({table}); truncate it, e.g. tokenizer(..., truncation=True, max_length={max_length})"
        )


def checked_inputs(model, batches: list[dict]) -> None:
    """`model`'s checks of each batch's inputs (token ids in range...), which read values on the host, before a
    compiled pass that cannot: a forward graph built in eval mode (no dropout draws) and never evaluated."""
    training = model.training
    model.eval()
    try:
        for f in batches:
            model(f["input_ids"], f["attention_mask"], f.get("token_type_ids"))
    finally:
        model.train(training)
