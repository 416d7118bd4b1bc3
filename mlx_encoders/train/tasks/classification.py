"""`fine_tune("classify")`: sequence classification of texts or text pairs (single-label, multi-label or regression,
as transformers' `...ForSequenceClassification` trains them), labels by name or id."""

from types import SimpleNamespace

from ..config import Trained
from ..data import sequence_classification_data
from ..options import Data
from . import CLASSIFY
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        return sequence_classification_data(
            data, tokenizer, text_column=run.text_column or "text", text_pair_column=run.text_pair_column,
            label_column=run.label_column or "label", problem_type=run.problem_type, label2id=label2id,
            max_length=run.max_length,
        )  # fmt: skip

    return train_head(CLASSIFY, data, run, read, pairs=run.text_pair_column is not None)
