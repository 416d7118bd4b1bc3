"""Evaluation scores: macro-F1 as scikit-learn computes it, and entity-level precision, recall and F1 of BIO
(IOB2, IOBES) tag sequences as seqeval counts them (reference: seqeval 1.2.2 `metrics/sequence_labeling.py`, its
default lenient mode: `get_entities`, `end_of_chunk`, `start_of_chunk`, micro-averaged `precision_score`...);
the names of the metrics a task's evaluation reports (`eval_metric_names`).
"""

import numpy as np

from .data import Examples
from .tasks import EMBED as EMBEDDING_TASK

CHUNK_PREFIXES = ("B-", "I-", "E-", "S-")


def macro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """sklearn's `f1_score(labels, predictions, average="macro")`: the mean F1 over the classes that occur in
    either array, F1 = 2TP / (2TP + FP + FN)."""
    scores = []
    for c in np.union1d(predictions, labels):
        tp = np.sum((predictions == c) & (labels == c))
        wrong = np.sum((predictions == c) != (labels == c))
        scores.append(2 * tp / (2 * tp + wrong))
    return float(np.mean(scores))


def is_chunk_scheme(labels: list[str]) -> bool:
    """Whether label names are chunk tags ("O", "B-PER", "I-LOC", ...), so entity scores mean something."""
    return any(label.startswith(CHUNK_PREFIXES) for label in labels) and all(
        label == "O" or label.startswith(CHUNK_PREFIXES) for label in labels
    )


def split_tag(label: str) -> tuple[str, str]:
    """("B", "PER") for "B-PER"; ("O", "_") for "O", as seqeval splits a tag into its prefix and type."""
    return label[0], label[1:].split("-", maxsplit=1)[-1] or "_"


def chunk_ends(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """seqeval's `end_of_chunk`: whether an entity ended between the previous tag and this one."""
    if prev_tag in ("E", "S") or (prev_tag in ("B", "I") and tag in ("B", "S", "O")):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def chunk_starts(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """seqeval's `start_of_chunk`: an I- or E- after O (or after a finished entity) starts an entity too."""
    if tag in ("B", "S") or (prev_tag in ("E", "S", "O") and tag in ("E", "I")):
        return True
    return tag not in ("O", ".") and prev_type != type_


def entities(sequence: list[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of every entity in one tag sequence."""
    found, prev_tag, prev_type, begin = set(), "O", "", 0
    for i, label in enumerate([*sequence, "O"]):
        tag, type_ = split_tag(label)
        if chunk_ends(prev_tag, tag, prev_type, type_):
            found.add((prev_type, begin, i - 1))
        if chunk_starts(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return found


def entity_scores(true: list[list[str]], predicted: list[list[str]]) -> dict[str, float]:
    """Micro-averaged entity precision, recall and F1 over sentences of word tags: an entity counts as found only
    when its type and both ends match (seqeval's `precision_score`, `recall_score`, `f1_score`; 0 when undefined)."""
    n_true = n_predicted = n_correct = 0
    for number, (t, p) in enumerate(zip(true, predicted, strict=True)):
        if len(t) != len(p):
            raise ValueError(f"Sentence {number}: {len(t)} true tags but {len(p)} predicted tags")
        t, p = entities(t), entities(p)
        n_true, n_predicted, n_correct = n_true + len(t), n_predicted + len(p), n_correct + len(t & p)
    precision = n_correct / n_predicted if n_predicted else 0.0
    recall = n_correct / n_true if n_true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def eval_metric_names(examples: Examples) -> list[str]:
    """The metrics `trainer.evaluate` reports for `examples`' task and labels, to check `metric_for_best` before
    training."""
    names = ["eval_loss"]
    if examples.task == EMBEDDING_TASK:
        return names
    if examples.task != "sequence-classification" or examples.problem_type == "single_label_classification":
        names.append("eval_accuracy")  # the tasks whose labels are class ids
    if examples.task == "sequence-classification" and examples.problem_type == "single_label_classification":
        names.append("eval_f1")
    if examples.task == "token-classification" and is_chunk_scheme(list(examples.label2id)):
        names += ["eval_precision", "eval_recall", "eval_f1"]
    if examples.task in ("masked-lm", "causal-lm"):
        names.append("eval_perplexity")
    return names
