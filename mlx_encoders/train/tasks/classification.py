"""`fine_tune("classify")`: sequence classification of texts or text pairs (single-label, multi-label or regression,
as transformers' `...ForSequenceClassification` trains them), labels by name or id."""

from types import SimpleNamespace

from ..config import Trained
from ..data import sequence_classification_data
from ..options import Data
from . import CLASSIFY
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    # once the training data is read, its own kind (problem type, and 0/1 vectors or not): the eval data is read so
    kind = {"problem_type": run.problem_type, "label_vectors": None}

    def read(data, tokenizer, label2id, seed):
        examples = sequence_classification_data(
            data, tokenizer, text_column=run.text_column or "text", text_pair_column=run.text_pair_column,
            label_column=run.label_column or "label", label2id=label2id, max_length=run.max_length, **kind,
        )  # fmt: skip
        kind.update(problem_type=examples.problem_type, label_vectors=examples.label_vectors)
        return examples

    return train_head(CLASSIFY, data, run, read, pairs=run.text_pair_column is not None)
