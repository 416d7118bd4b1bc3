"""Evaluation of the head tasks (masked-LM, causal LM, sequence and token classification): eval loss, accuracy,
perplexity, macro-F1 and entity scores, as transformers' examples report them; `check_metric_for_best` checks that
the metric choosing the best checkpoint is one the evaluation reports.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import distributed
from ..tokenizer import Tokenizer
from .config import OptionError, TrainingConfig
from .data import Examples, collate
from .losses import IGNORE_INDEX, split_batch, task_loss
from .masking import Masker
from .metrics import entity_scores, eval_metric_names, is_chunk_scheme, macro_f1


def labelled(target: np.ndarray, task: str) -> np.ndarray:
    """What a loss averages over: the labelled positions of (B, L) token ids (for causal LM, those a token before
    them predicts), else every example."""
    if target.ndim == 2 and np.issubdtype(target.dtype, np.integer):
        return (target[:, 1:] if task == "causal-lm" else target) != IGNORE_INDEX
    return np.ones(len(target), dtype=bool)


def predictions(logits: mx.array, task: str) -> np.ndarray:
    """Argmax class ids, aligned with `labelled`'s positions."""
    ids = np.array(logits.argmax(-1))
    return ids[:, :-1] if task == "causal-lm" else ids


def targets(labels: np.ndarray, task: str) -> np.ndarray:
    return labels[:, 1:] if task == "causal-lm" else labels


def tag_scores(sentences: list[tuple[np.ndarray, np.ndarray]], label2id: dict[str, int]) -> dict[str, float]:
    """Entity precision, recall and F1 over (true ids, predicted ids) of each sentence's labelled tokens (a word's
    first sub-token, as transformers' token-classification example evaluates), when the labels are BIO tags."""
    names = {i: name for name, i in label2id.items()}
    if not is_chunk_scheme(list(names.values())):
        return {}
    true = [[names[int(i)] for i in t] for t, _ in sentences]
    predicted = [[names.get(int(i), "O") for i in p] for _, p in sentences]
    return {f"eval_{name}": value for name, value in entity_scores(true, predicted).items()}


def eval_order(examples: Examples, tokenizer: Tokenizer) -> np.ndarray:
    """The order evaluation batches `examples` in: shortest first (stable) for the classification tasks, so that a
    batch pads little; each example's outputs do not depend on the padding after it (it is masked), so only the
    order of summing changes. Masked-LM draws its masks batch after batch, and left padding moves the positions:
    those keep their order."""
    if examples.task not in ("sequence-classification", "token-classification") or tokenizer.padding_side != "right":
        return np.arange(len(examples))
    return np.argsort([len(e.ids) for e in examples.encodings], kind="stable")


def evaluate(
    model: nn.Module,
    tokenizer: Tokenizer,
    examples: Examples,
    config: TrainingConfig,
    masker: Masker | None = None,
) -> dict[str, float]:
    """Mean eval loss (per labelled token for token-level tasks, per example otherwise) with the model in eval
    mode; accuracy over masked (labelled) positions or examples wherever labels are class ids, perplexity =
    exp(loss) for masked-LM and causal LM, macro-F1 for sequence classification, entity-level precision, recall
    and F1 (as seqeval counts them) for BIO tags. Masks come from `default_rng(seed)`, the same at every
    evaluation, and leave the training generators alone."""
    model.eval()
    rng = np.random.default_rng(config.seed)
    task = examples.task
    total, weight, predicted, expected, sentences = 0.0, 0, [], [], []

    def scored(batch: dict) -> tuple:  # (labelled positions, loss, predicted ids, label ids) of one batch
        kept = labelled(batch["labels"], task)
        if not kept.any():  # a masked-LM batch where no token was drawn for masking: nothing to score
            return kept, 0.0, None, None
        inputs, labels = split_batch(batch)
        output = model(**inputs)
        found = predictions(output.logits, task) if np.issubdtype(batch["labels"].dtype, np.integer) else None
        return kept, task_loss(model, output, **labels).item(), found, targets(batch["labels"], task)

    order = eval_order(examples, tokenizer)
    batches = (collate(examples, order[start : start + config.batch_size], tokenizer, masker, rng)
               for start in range(0, len(examples), config.batch_size))  # fmt: skip
    for kept, loss, found, wanted in distributed.shared_map(scored, batches):  # each rank scores its share of batches
        if not kept.any():
            continue
        total += loss * int(kept.sum())
        weight += int(kept.sum())
        if found is not None:
            predicted.append(found[kept])
            expected.append(wanted[kept])
            if task == "token-classification":
                sentences += [(t[k], p[k]) for t, p, k in zip(wanted, found, kept, strict=True)]
    metrics = {"eval_loss": total / weight if weight else math.nan}
    if predicted:
        predicted, expected = np.concatenate(predicted), np.concatenate(expected)
        metrics["eval_accuracy"] = float(np.mean(predicted == expected))
        if task == "sequence-classification":
            metrics["eval_f1"] = macro_f1(predicted, expected)
        if task == "token-classification":
            metrics |= tag_scores(sentences, examples.label2id)
    if task in ("masked-lm", "causal-lm"):
        metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
    return metrics


def check_metric_for_best(config: TrainingConfig, eval_examples: Examples | None, objective=None) -> None:
    """`metric_for_best` is a metric the evaluation reports: the objective's (`Objective.metric_names`), else the
    head tasks' for these examples."""
    if config.metric_for_best is None:
        return
    if eval_examples is None:
        raise OptionError(f"metric_for_best={config.metric_for_best!r} needs evaluation data (eval_data / --eval-data)")
    names = objective.metric_names(eval_examples) if objective is not None else eval_metric_names(eval_examples)
    if config.metric_for_best not in names:
        raise OptionError(
            f"metric_for_best={config.metric_for_best!r} is not a metric {eval_examples.task} reports; choose one "
            f"of {', '.join(names)}"
        )
