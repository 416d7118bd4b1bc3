"""Reranker (cross-encoder) training: data, batches and evaluation; the losses, as sentence-transformers'
cross-encoder losses define them, are `losses/rerank.py`.

A row is one query with its documents: (`query`, `document`, `label`) rows give one pair each (a binary or graded
label in [0, 1]); (`query`, `positive`, `negative` or `negative_1` ... `negative_n`) rows give the positive
(label 1) and its negatives (label 0); (`query`, `documents`, `labels`) rows give lists. Each (query, document)
pair is one input of a one-label sequence classifier. "bce" is `BinaryCrossEntropyLoss` (BCE-with-logits over
every pair); "listnet" is `ListNetLoss` (per query, cross-entropy of softmax(labels) against softmax(logits));
"lambda" is `LambdaLoss` (pairwise logistic losses weighted by their NDCG change, NDCGLoss2++); "mnrl" is the
cross-encoder `MultipleNegativesRankingLoss` with every in-batch document as a negative.
`RerankObjective` plugs these into `trainer.train` (its `objective=`).
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Encoding

from .. import distributed
from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint
from ..tokenizer import Tokenizer
from .data import (
    LABEL_COLUMNS,
    PICKED_COLUMNS,
    DataError,
    Row,
    by_position,
    in_first_row_order,
    read_rows,
    select_columns,
)
from .evaluators import reranking_metrics
from .losses.rerank import LOSSES
from .objective import Objective
from .tasks import RERANK as TASK

AT_K = 10  # MRR@10 and NDCG@10, as sentence-transformers' CrossEncoderRerankingEvaluator
LOSS_KEYS = ("pair_index", "labels")  # a collated batch's arrays the loss reads, over all its rows
METRIC_NAMES = ["eval_loss", "eval_map", f"eval_mrr@{AT_K}", f"eval_ndcg@{AT_K}"]


@dataclass
class RerankExamples:
    """Tokenized rows: `groups[i]` holds row i's (query, document) pair encodings, `labels[i]` their labels."""

    queries: list[str]
    groups: list[list[Encoding]]
    labels: list[list[float]]
    rows: list[Row]
    documents: list[list[str]] = field(default_factory=list)  # the texts of `groups`, for in-batch pairs
    max_length: int | None = None
    task: str = TASK
    label2id: dict = field(default_factory=dict)  # none: the labels are relevance, not classes

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def encodings(self) -> list[Encoding]:
        """The longest pair of each row: what `group_by_length` sorts by."""
        return [max(group, key=lambda e: len(e.ids)) for group in self.groups]


def negatives(row: Row) -> list[str]:
    if "negative" in row.values:
        value = row.get("negative", PICKED_COLUMNS)
        return [value] if isinstance(value, str) else list(value)
    numbered = sorted(
        (k for k in row.values if k.startswith("negative_") and k[9:].isdigit()), key=lambda k: int(k[9:])
    )
    return [row.text(k, PICKED_COLUMNS) for k in numbered]


def documents_and_labels(row: Row) -> tuple[list[str], list[float]]:
    """A row's documents and their labels, from whichever of the three layouts it has (the labels in the first of
    `data.LABEL_COLUMNS` it holds, as sentence-transformers finds them). A 'positive' column with a label column is
    `mine`'s labeled-pair (one text and a number, no negatives) or labeled-list (a list of texts and theirs) row,
    read as the document(s) with their label(s), as sentence-transformers reads those rows by position; a positive
    with negatives is 1 and 0s whatever scores the row carries (mine's similarities)."""
    labelled = next((c for c in LABEL_COLUMNS if c in row.values), None)
    label = labelled or ("labels" if "documents" in row.values else "label")
    listed = "documents" if "documents" in row.values else "positive"
    if "documents" in row.values or (labelled and isinstance(row.values.get("positive"), list)):
        documents, labels = row.get(listed, PICKED_COLUMNS), row.get(label, PICKED_COLUMNS)
        if not isinstance(documents, list) or not isinstance(labels, list) or len(documents) != len(labels):
            raise DataError(f"{row.where}: '{listed}' and '{label}' must be lists of the same length")
    elif "positive" in row.values and labelled and not isinstance(row.values[label], list) and not negatives(row):
        documents, labels = [row.text("positive", PICKED_COLUMNS)], [row.get(label, PICKED_COLUMNS)]
    elif "positive" in row.values:  # a positive and its negatives (`mine`'s triplets: their scores are similarities)
        documents = [row.text("positive", PICKED_COLUMNS), *negatives(row)]
        labels = [1.0] + [0.0] * (len(documents) - 1)
    else:  # `named` gave it one of the three
        documents, labels = [row.text("document", PICKED_COLUMNS)], [row.get(label, PICKED_COLUMNS)]
    return documents, [relevance(label, row) for label in labels]


def relevance(label, row: Row) -> float:
    """A label as a number in [0, 1]; CSV and TSV cells hold it as text."""
    number = label
    if isinstance(label, str):
        try:
            number = float(label)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= 1:
        raise DataError(f"{row.where}: labels must be numbers in [0, 1] (1 relevant, 0 not), found {label!r}")
    return float(number)


def named(row: Row) -> Row:
    """`row` with the column names `documents_and_labels` reads: its own when it has 'query' and a document
    column, else its columns by position (`data.by_position`), as sentence-transformers' cross-encoder losses read
    them: the query, then a list of documents (with a list of labels), a document with a label, or a positive and
    its negatives."""
    if "query" in row.values and any(c in row.values for c in ("documents", "positive", "document")):
        return row
    layout = (
        "a reranking row has 'query' and 'document' + 'label', or 'positive' (+ 'negative' or 'negative_1' ...), "
        "or 'documents' + 'labels'"
    )
    texts, label = by_position(row, layout, "query=question positive=answer")
    values = {"query": row.values[texts[0]]}
    second = row.values[texts[1]]
    if isinstance(second, list) and len(texts) == 2:
        values |= {"documents": second, "labels": row.values.get(label)}
    elif label is not None and len(texts) == 2:
        values |= {"document": second, "label": row.values[label]}
    else:
        values |= {"positive": second} | {f"negative_{i}": row.values[c] for i, c in enumerate(texts[2:], 1)}
    return Row(values, row.source, row.line)


def rerank_data(
    data: str | Path | Iterable[Mapping],
    tokenizer: Tokenizer,
    max_length: int | None = None,
    columns: Mapping[str, str] | Sequence[str] | None = None,
) -> RerankExamples:
    """The rows of `data` as (query, document) pairs, tokenized as sentence-transformers' CrossEncoder does (one
    input per pair, longest-first truncation to `max_length`); `columns` picks and renames the data's columns
    first (`data.select_columns`)."""
    queries, groups, labels, texts = [], [], [], []
    rows = [named(row) for row in in_first_row_order(select_columns(read_rows(data), columns))]
    for row in rows:
        query = row.text("query", PICKED_COLUMNS)
        documents, row_labels = documents_and_labels(row)
        if not documents:
            raise DataError(f"{row.where}: no documents to score for the query")
        for i, document in enumerate(documents):
            if not isinstance(document, str):
                raise DataError(f"{row.where}: document {i} is a {type(document).__name__}, not a text")
        queries.append(query)
        texts.append(documents)
        groups.append(tokenizer.encode_batch([query] * len(documents), documents, max_length=max_length))
        labels.append(row_labels)
    return RerankExamples(queries, groups, labels, rows, texts, max_length)


def choose_loss(loss: str | None, examples: RerankExamples) -> str:
    """`loss`, checked; by default "listnet" when rows hold several documents, else "bce"."""
    if loss is None:
        return "listnet" if any(len(g) > 1 for g in examples.groups) else "bce"
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)} for reranking, got {loss!r}")
    if loss == "mnrl":
        size = len(examples.groups[0])
        for row, labels in zip(examples.rows, examples.labels, strict=True):
            if labels != [1.0] + [0.0] * (size - 1):
                raise DataError(
                    f"{row.where}: loss 'mnrl' takes (query, positive, negatives) rows, each with the same number "
                    f"of negatives ({size - 1}, as the first row)"
                )
    return loss


class RerankObjective(Objective):
    """The batches, loss and evaluation of reranker training, for `trainer.train(..., objective=)`."""

    def __init__(self, loss: str, tokenizer: Tokenizer):
        self.loss_name, self.tokenizer = loss, tokenizer
        self.pair_loss = LOSSES[loss]

    def collate(
        self, examples: RerankExamples, indices, rng: np.random.Generator | None = None
    ) -> dict[str, np.ndarray]:
        """The batch the loss takes: for "mnrl" every query against every document of the rows, else each row's
        own pairs."""
        return self.in_batch(examples, indices) if self.loss_name == "mnrl" else self.own_pairs(examples, indices)

    def in_batch(self, examples: RerankExamples, indices) -> dict[str, np.ndarray]:
        """Each of the B queries paired with all M documents of the B rows (every in-batch document a negative,
        sentence-transformers' `num_negatives=None`); `labels` (B, M) marks each query's own positive."""
        documents = [d for i in indices for d in examples.documents[i]]
        queries = [examples.queries[i] for i in indices for _ in documents]
        encodings = self.tokenizer.encode_batch(queries, documents * len(indices), max_length=examples.max_length)
        batch = self.tokenizer.pad(encodings, return_tensors="np")
        rows, width = len(indices), len(documents)
        batch["pair_index"] = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
        batch["labels"] = np.zeros((rows, width), dtype=np.float32)
        batch["labels"][np.arange(rows), np.arange(rows) * (width // rows)] = 1.0
        return batch

    def own_pairs(self, examples: RerankExamples, indices) -> dict[str, np.ndarray]:
        """Every pair of the rows as one padded batch, with `pair_index` (B, N): each row's pairs' places in it
        (-1 past a row's documents) and `labels` (B, N)."""
        groups = [examples.groups[i] for i in indices]
        width = max(len(g) for g in groups)
        batch = self.tokenizer.pad([e for g in groups for e in g], return_tensors="np")
        batch["pair_index"] = np.full((len(groups), width), -1, dtype=np.int32)
        batch["labels"] = np.zeros((len(groups), width), dtype=np.float32)
        start = 0
        for row, (i, group) in enumerate(zip(indices, groups, strict=True)):
            batch["pair_index"][row, : len(group)] = np.arange(start, start + len(group))
            batch["labels"][row, : len(group)] = examples.labels[i]
            start += len(group)
        return batch

    def no_signal(self, examples: RerankExamples, indices) -> str | None:
        """Why the batch of `indices` gives the loss no gradient, or None. BCE learns from each pair's label; ListNet
        from a query's documents of different texts; LambdaLoss from two of different labels and texts (a query with
        two labels and two texts has such a pair); MNRL from each query against two documents of different texts."""
        groups = [examples.groups[i] for i in indices]
        texts = [{tuple(e.ids) for e in group} for group in groups]
        if self.loss_name == "bce":
            return None
        if self.loss_name == "listnet" and any(len(t) > 1 for t in texts):
            return None
        labels = [set(examples.labels[i]) for i in indices]
        if self.loss_name == "lambda" and any(len(t) > 1 and len(l) > 1 for t, l in zip(texts, labels, strict=True)):
            return None
        if self.loss_name == "mnrl" and len({d for i in indices for d in examples.documents[i]}) > 1:
            return None
        several = (
            "rows of several documents with different labels (query, positive, negative_1...; or documents, labels)"
        )
        why = {
            "listnet": "ListNet compares each query's documents with each other, but every query of a batch has one "
            f"document (or documents of one text); give it {several}",
            "lambda": "LambdaLoss learns from pairs of a query's documents with different labels, but no query of a "
            f"batch has two (one document, equal labels, or documents of one text); give it {several}",
            "mnrl": "MNRL ranks each query's positive above the batch's other documents, but each batch holds one "
            "document text; give it rows with negatives, or batch_size (--batch-size) >= 2",
        }[self.loss_name]
        return f"{why}, or use loss bce, which learns from each pair's label alone"

    def batcher(self, examples: RerankExamples, batch_size: int) -> None:
        """Consecutive batches of the trainer's order (no sampler of its own)."""
        return None

    def value_and_grad(
        self, model: nn.Module, make: Callable, random: list[mx.array], trace: Callable | None = None
    ) -> Callable:
        """`batch -> (loss, gradients)`; `make(loss_fn)` is the trainer's `value_and_grad` for a loss of one batch
        (`trace`, the trainer's compiler, is not used: the pairs of a batch run in one eager pass)."""
        return make(lambda batch: self.loss(model, *self.split(batch)))

    def part(self, batch: dict[str, np.ndarray], world: distributed.World) -> dict[str, np.ndarray]:
        """This rank's pairs of a collated global batch under `mlx.launch` (`distributed.gathered_part`); the loss
        arrays stay global, as the loss is computed on every rank over every rank's logits."""
        mine, order = distributed.gathered_part(batch["input_ids"].shape[0], world)
        part = {k: v if k in LOSS_KEYS else v[mine] for k, v in batch.items()}
        return {**part, "order": order}

    def split(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict]:
        """(model inputs, loss arrays) of a collated batch (with a rank's part's `order`)."""
        inputs = {k: mx.array(v) for k, v in batch.items() if k not in (*LOSS_KEYS, "order")}
        labels = {"pair_index": mx.array(batch["pair_index"]), "labels": mx.array(batch["labels"])}
        return inputs, {**labels, "order": batch.get("order")}

    def loss(self, model: nn.Module, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> mx.array:
        return self.scored(model, inputs, labels)[0]

    def scored(self, model: nn.Module, inputs: dict, labels: dict) -> tuple[mx.array, mx.array]:
        """(the batch's loss, the (pairs,) logits). Of a rank's `part`: the global batch's loss over every rank's
        logits divided by the world size (this rank's share of the summed gradients), and the global logits."""
        order = labels.get("order")
        logits = distributed.gather_rows(model(**inputs).logits[:, 0].astype(mx.float32), order)
        index = labels["pair_index"]
        loss = self.pair_loss(logits[mx.maximum(index, 0)], labels["labels"], index >= 0)
        return (loss if order is None else loss / distributed.world().size), logits

    def metric_names(self, examples: RerankExamples) -> list[str]:
        return METRIC_NAMES

    def evaluate(self, model: nn.Module, examples: RerankExamples, batch_size: int) -> dict[str, float]:
        """The mean loss per row and sentence-transformers' reranking metrics of the logits, each query's distinct
        documents gathered over its rows (a label > 0 is relevant; a document in several rows, as a positive in
        each of a query's triplets, counts once, at its highest label), as CrossEncoderRerankingEvaluator ranks
        a query's positives and negatives."""
        model.eval()

        def scored(start: int) -> tuple[float, np.ndarray]:  # (a batch's summed loss, its own pairs' logits)
            indices = range(start, min(start + batch_size, len(examples)))
            loss, scores = self.scored(model, *self.split(self.collate(examples, indices)))
            if self.loss_name == "mnrl":  # the loss paired each query with every document; the metrics take its own
                scores = self.scored(model, *self.split(self.own_pairs(examples, indices)))[1]
            return loss.item() * len(indices), np.array(scores)

        starts = range(0, len(examples), batch_size)  # each rank scores its share of the batches
        losses, logits = zip(*distributed.shared_map(scored, starts), strict=True)
        total, logits = sum(losses), np.concatenate(logits)
        per_query: dict[str, dict[str, tuple[bool, float]]] = {}  # query -> document -> (relevant, score)
        offset = 0
        for query, documents, row_labels in zip(examples.queries, examples.documents, examples.labels, strict=True):
            seen = per_query.setdefault(query, {})
            for document, label, score in zip(documents, row_labels, logits[offset:], strict=False):
                relevant = label > 0 or seen.get(document, (False, 0.0))[0]
                seen[document] = (relevant, seen.get(document, (False, score))[1])
            offset += len(row_labels)
        found = [
            reranking_metrics(
                np.array([r for r, _ in d.values()], dtype=int), np.array([s for _, s in d.values()]), AT_K
            )
            for d in per_query.values()
        ]
        mrr, ndcg, ap = np.mean(found, axis=0)
        return {"eval_loss": total / len(examples), "eval_map": float(ap), f"eval_mrr@{AT_K}": float(mrr),
                f"eval_ndcg@{AT_K}": float(ndcg)}  # fmt: skip


def load_reranker(checkpoint: Checkpoint) -> nn.Module:
    """The checkpoint as a one-label sequence classifier in float32: its own head when it has one, else a new one."""
    if checkpoint.task != "sequence-classification":
        return load_model(checkpoint, dtype="float32", task="sequence-classification", num_labels=1)
    model = load_model(checkpoint, dtype="float32", task="sequence-classification")
    if model.args.num_labels != 1:
        raise ValueError(
            f"{checkpoint.path} has a classification head of {model.args.num_labels} labels; a reranker scores with "
            "one: start from a checkpoint without a classification head, or from a one-label cross-encoder"
        )
    return model
