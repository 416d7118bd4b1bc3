"""`fine_tune("classify")`: sequence classification of texts or text pairs (single-label, multi-label or regression,
as transformers' `...ForSequenceClassification` trains them), labels by name or id."""

from types import SimpleNamespace

from ..config import Trained
from ..data import sequence_classification_data
from ..options import Data
from . import CLASSIFY
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    problem_type = [run.problem_type]  # once the training data is read, its own: the eval data is read as that kind

    def read(data, tokenizer, label2id, seed):
        examples = sequence_classification_data(
            data, tokenizer, text_column=run.text_column or "text", text_pair_column=run.text_pair_column,
            label_column=run.label_column or "label", problem_type=problem_type[0], label2id=label2id,
            max_length=run.max_length,
        )  # fmt: skip
        problem_type[0] = examples.problem_type
        return examples

    return train_head(CLASSIFY, data, run, read, pairs=run.text_pair_column is not None)
