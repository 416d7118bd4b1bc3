"""`fine_tune("tokens")`: token classification (named entities, tags) of pre-split words, their labels aligned to
the first sub-token of each word (or every one, `label_all_tokens`); columns default to the Hugging Face datasets'
"tokens" and "ner_tags"."""

from types import SimpleNamespace

from ..config import Trained
from ..data import token_classification_data
from ..options import Data
from . import TOKENS
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        return token_classification_data(
            data, tokenizer, text_column=run.text_column or "tokens", label_column=run.label_column or "ner_tags",
            label2id=label2id, label_all_tokens=run.label_all_tokens, max_length=run.max_length,
        )  # fmt: skip

    return train_head(TOKENS, data, run, read)
