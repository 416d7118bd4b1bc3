"""`fine_tune("rerank")`: a cross-encoder (reranker) trained on (query, document, label) rows or (query, positive,
negatives) rows with BCE, ListNet, LambdaLoss or MNRL (`train/rerank.py`), evaluated as a reranker."""

from types import SimpleNamespace

from ..config import Trained
from ..options import Data
from ..rerank import RerankObjective, choose_loss, load_reranker, rerank_data
from . import RERANK as TASK
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        return rerank_data(data, tokenizer, run.max_length, run.columns)

    return train_head(
        TASK, data, run, read, pairs=True, build=lambda checkpoint, tokenizer, examples: load_reranker(checkpoint),
        objective=lambda examples, tokenizer: RerankObjective(choose_loss(run.loss, examples), tokenizer),
        own_metrics=True,
    )  # fmt: skip
