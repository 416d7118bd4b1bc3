"""`fine_tune("rerank")`: a cross-encoder (reranker) trained on (query, document, label) rows or (query, positive,
negatives) rows with BCE, ListNet, LambdaLoss or MNRL (`train/rerank.py`), evaluated as a reranker."""

from pathlib import Path
from types import SimpleNamespace

import mlx.nn as nn

from ... import distributed
from ...checkpoint.files import Checkpoint, read_modules
from ...checkpoint.write import save
from ...embeddings.folder import copy_cross_encoder_files
from ...tokenizer import Tokenizer
from ..config import Trained
from ..options import Data
from ..rerank import RerankObjective, choose_loss, load_reranker, rerank_data
from . import RERANK as TASK
from .heads import train_head


def check_scoring(checkpoint: Checkpoint) -> None:
    """A reranker that scores with its language-model head's logits (sentence-transformers' LogitScore: Qwen3-Reranker)
    has no one-label head to train: training would put a new random one in its place."""
    if any(kind.rsplit(".", 1)[-1] == "LogitScore" for kind, _ in read_modules(checkpoint.path)):
        raise ValueError(
            f"{checkpoint.path / 'modules.json'} scores with a LogitScore module (the language-model head's logits "
            "of its chosen tokens); fine_tune('rerank') trains a one-label classification head and would replace it. "
            "Train such a reranker with sentence-transformers, or start from a checkpoint without a LogitScore module"
        )


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        return rerank_data(data, tokenizer, run.max_length, run.columns)

    def save_model(net: nn.Module, path: Path, tokenizer: Tokenizer) -> tuple[Path, nn.Module]:
        """The model as `save` writes it, its token limit the training's, and the source folder's CrossEncoder
        settings (activation, prompts) kept, as sentence-transformers' CrossEncoder.save keeps them."""
        if run.max_length:  # sentence-transformers reads a CrossEncoder's max_length from the tokenizer's
            tokenizer.model_max_length = run.max_length
        if distributed.is_main():
            path = save(net, path, tokenizer, dtype="float32", overwrite=True)
            if run.model is not None:
                copy_cross_encoder_files(Checkpoint.open(run.model).path, Path(path))
        return Path(path), net

    return train_head(
        TASK, data, run, read, pairs=True, build=lambda checkpoint, tokenizer, examples: load_reranker(checkpoint),
        objective=lambda examples, tokenizer: RerankObjective(choose_loss(run.loss, examples), tokenizer),
        own_metrics=True, save_model=save_model, check_checkpoint=check_scoring,
    )  # fmt: skip
