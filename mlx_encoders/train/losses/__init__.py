"""Task losses, computed from `labels` exactly as transformers' heads compute them (reference: the `forward` of
each `*For*` class in `modeling_bert.py` and friends, and `loss/loss_utils.py`). Models return logits only;
`task_loss` picks the head's loss, the functions below it are its parts; `loss_arrays` and `batch_loss` give it a
collated batch. The other tasks' losses are this package's modules: `contrastive` (embeddings), `sparse` (SPLADE),
`multi_vector` (ColBERT) and `rerank` (cross-encoders).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...models import task_of_model
from ...models.base import ModelOutput, infer_problem_type

IGNORE_INDEX = -100  # torch's CrossEntropyLoss default: targets equal to it add nothing to the loss
# Architectures whose classifiers read float labels of no configured problem_type as class probabilities (a soft
# cross-entropy), where the others infer multi-label classification: DeBERTa's `ForSequenceClassification`.
SOFT_LABEL_TYPES = ("deberta", "deberta-v2")


def task_loss(
    model: nn.Module,
    output: ModelOutput,
    labels: mx.array | None = None,
    *,
    start_positions: mx.array | None = None,
    end_positions: mx.array | None = None,
    next_sentence_label: mx.array | None = None,
) -> mx.array:
    """The loss transformers' head of the same task returns for `model(**batch, labels=...)`: the keyword names
    are transformers' (`start_positions`/`end_positions` for question answering, `next_sentence_label` beside
    `labels` for BERT pretraining). `output` is `model`'s output for the batch."""
    task = task_of_model(model)
    if task == "sequence-classification":
        args = model.args
        soft = args.model_type in SOFT_LABEL_TYPES and args.problem_type is None and args.num_labels > 1
        if soft and labels.ndim == 2 and labels.shape[-1] > 1:
            return soft_cross_entropy(output.logits, labels)
        return sequence_classification_loss(output.logits, labels, args.num_labels, args.problem_type)
    if task in ("token-classification", "masked-lm"):
        return cross_entropy(output.logits, labels)
    if task == "causal-lm":  # position t predicts token t + 1 (transformers' `ForCausalLMLoss`)
        return cross_entropy(output.logits[:, :-1], labels[:, 1:])
    if task == "question-answering":
        return span_loss(output.start_logits, output.end_logits, start_positions, end_positions)
    if task == "pretraining" and output.seq_relationship_logits is None:  # ELECTRA's discriminator
        return replaced_token_loss(output.logits, labels)
    if task == "pretraining":
        return cross_entropy(output.logits, labels) + cross_entropy(output.seq_relationship_logits, next_sentence_label)
    raise ValueError(f"{type(model).__name__} is a bare encoder: it has no task loss; train it through a head")


def cross_entropy(logits: mx.array, targets: mx.array, ignore_index: int = IGNORE_INDEX) -> mx.array:
    """Mean cross-entropy of (..., C) logits over the targets that are not `ignore_index`, in float32: torch's
    `CrossEntropyLoss(ignore_index=...)` (NaN when every target is ignored, as there)."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(mx.float32)
    targets = targets.reshape(-1)
    kept = targets != ignore_index
    losses = nn.losses.cross_entropy(logits, mx.where(kept, targets, 0))
    return mx.where(kept, losses, 0).sum() / kept.sum()


def soft_cross_entropy(logits: mx.array, probabilities: mx.array) -> mx.array:
    """-sum(p log softmax(logits)) per row, the mean over rows, in float32 (DeBERTa's loss for float labels)."""
    log_p = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    return -(log_p * probabilities.astype(mx.float32)).sum(axis=-1).mean()


def mse(predictions: mx.array, targets: mx.array) -> mx.array:
    """torch's MSELoss: the mean squared error, in float32."""
    return nn.losses.mse_loss(predictions.astype(mx.float32), targets.astype(mx.float32))


def binary_cross_entropy_with_logits(logits: mx.array, targets: mx.array) -> mx.array:
    """torch's BCEWithLogitsLoss: the mean over every logit, in float32."""
    return nn.losses.binary_cross_entropy(
        logits.astype(mx.float32), targets.astype(mx.float32), with_logits=True, reduction="mean"
    )


def replaced_token_loss(logits: mx.array, labels: mx.array) -> mx.array:
    """ELECTRA's discriminator: BCE-with-logits of (B, L) logits against 1 (replaced) / 0 (original), the mean over
    tokens whose label is not IGNORE_INDEX. transformers averages over the attention mask's tokens instead: label
    padding IGNORE_INDEX for the same loss."""
    kept = labels != IGNORE_INDEX
    targets = mx.where(kept, labels, 0).astype(mx.float32)
    losses = nn.losses.binary_cross_entropy(logits.astype(mx.float32), targets, with_logits=True, reduction="none")
    return mx.where(kept, losses, 0).sum() / kept.sum()


def sequence_classification_loss(
    logits: mx.array, labels: mx.array, num_labels: int, configured: str | None = None
) -> mx.array:
    """transformers' `ForSequenceClassification` loss: MSE, cross-entropy or BCE-with-logits by `problem_type`."""
    kind = infer_problem_type(configured, num_labels, mx.issubdtype(labels.dtype, mx.integer))
    if kind == "regression":
        # transformers squeezes a single label's (B, 1) logits and labels alike
        return mse(logits.squeeze(), labels.squeeze()) if num_labels == 1 else mse(logits, labels)
    if kind == "single_label_classification":
        return cross_entropy(logits, labels)
    return binary_cross_entropy_with_logits(logits, labels)


def span_loss(
    start_logits: mx.array, end_logits: mx.array, start_positions: mx.array, end_positions: mx.array
) -> mx.array:
    """Question answering: (CE(start) + CE(end)) / 2 over (B, L) logits. As in transformers, positions are
    clamped to [0, L] and L is ignored, so answers outside the input add nothing."""
    length = start_logits.shape[1]
    start, end = (mx.clip(p.reshape(-1), 0, length) for p in (start_positions, end_positions))
    return (cross_entropy(start_logits, start, length) + cross_entropy(end_logits, end, length)) / 2


# ----- batches: what the loop hands a head task's loss -----


LABEL_KEYS = ("labels", "next_sentence_label", "start_positions", "end_positions")


def split_batch(batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(model inputs, loss labels) of a collated batch, as MLX arrays."""
    inputs = {k: mx.array(v) for k, v in batch.items() if k not in LABEL_KEYS}
    return inputs, {k: mx.array(v) for k, v in batch.items() if k in LABEL_KEYS}


def loss_arrays(model: nn.Module, batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """`split_batch`, the labels of a masked-LM batch also giving `masked`: the flat positions of its masked
    tokens (a loss under mx.compile reads nothing on the host)."""
    inputs, labels = split_batch(batch)
    if task_of_model(model) == "masked-lm":
        labels["masked"] = mx.array(np.flatnonzero(batch["labels"].reshape(-1) != IGNORE_INDEX))
    return inputs, labels


def batch_loss(model: nn.Module, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> mx.array:
    """The loss of a batch given as `loss_arrays`, in MLX operations only."""
    if task_of_model(model) == "masked-lm":
        return masked_lm_loss(model, inputs, labels["labels"], labels["masked"])
    return task_loss(model, model(**inputs), **labels)


def masked_lm_loss(model: nn.Module, inputs: dict[str, mx.array], labels: mx.array, masked: mx.array) -> mx.array:
    """The masked-LM loss with vocabulary logits computed at the `masked` (flat) positions only (about 15% of the
    tokens): the same loss and gradients as scoring every position, as the others add nothing (ModernBERT's
    `sparse_prediction`), at a fraction of the decoder's cost, which dominates small models' steps."""
    hidden = model.encode(**inputs).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[masked]
    return cross_entropy(model.predict_tokens(hidden), labels.reshape(-1)[masked])
