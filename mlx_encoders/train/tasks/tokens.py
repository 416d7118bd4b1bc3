"""`fine_tune("tokens")`: token classification (named entities, tags) of pre-split words, their labels aligned to
the first sub-token of each word (or every one, `label_all_tokens`); columns default to the Hugging Face datasets'
"tokens" and "ner_tags". RoBERTa's, DeBERTa's and GPT-2's tokenizers read each word after a space, as
transformers' example (run_ner.py) loads them, and are saved so."""

from types import SimpleNamespace

from ...checkpoint import Checkpoint
from ..config import Trained
from ..data import token_classification_data, with_prefix_space
from ..options import Data
from . import TOKENS
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    model_type = Checkpoint.open(run.model).config.get("model_type") if run.model is not None else None

    def read(data, tokenizer, label2id, seed):
        with_prefix_space(tokenizer, model_type)  # as run_ner.py loads RoBERTa's: saved so with the model
        return token_classification_data(
            data, tokenizer, text_column=run.text_column or "tokens", label_column=run.label_column or "ner_tags",
            label2id=label2id, label_all_tokens=run.label_all_tokens, max_length=run.max_length,
        )  # fmt: skip

    return train_head(TOKENS, data, run, read)
