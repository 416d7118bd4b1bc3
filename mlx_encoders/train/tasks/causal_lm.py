"""`fine_tune("clm")`: causal language modelling (GPT-2), from a checkpoint or from a config of sizes."""

from types import SimpleNamespace

from ..config import Trained
from ..data import causal_lm_data
from ..options import Data
from . import CLM
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        return causal_lm_data(data, tokenizer, text_column=run.text_column or "text", max_length=run.max_length)

    return train_head(CLM, data, run, read)
