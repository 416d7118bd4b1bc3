"""`fine_tune("mlm")`: masked language modelling with dynamic masking (`train/masking.py`, whole words optional), and
with `next_sentence` BERT's pretraining heads (masked-LM plus next-sentence prediction on a .txt file's documents),
from a checkpoint or from a config of sizes."""

from types import SimpleNamespace

import numpy as np
from safetensors import safe_open

from ...checkpoint.files import Checkpoint
from ..config import OptionError, Trained
from ..data import masked_lm_data, pretraining_data
from ..masking import Masker
from ..options import Data
from . import MLM, PRETRAINING
from .heads import train_head


def train_task(data: Data, run: SimpleNamespace) -> Trained:
    def read(data, tokenizer, label2id, seed):
        if run.next_sentence:
            rng = np.random.default_rng(seed)
            return pretraining_data(data, tokenizer, rng, text_column=run.text_column or "text",
                                    max_length=run.max_length)  # fmt: skip
        return masked_lm_data(data, tokenizer, text_column=run.text_column or "text", max_length=run.max_length)

    return train_head(
        PRETRAINING if run.next_sentence else MLM, data, run, read, pairs=run.next_sentence,
        masker=lambda tokenizer: Masker.from_tokenizer(tokenizer, **masking(run.whole_word_mask)),
        check_checkpoint=check_next_sentence_head if run.next_sentence else None,
    )  # fmt: skip


def check_next_sentence_head(checkpoint: Checkpoint) -> None:
    """`next_sentence` continues a checkpoint's next-sentence head (and pooler); fine_tune creates neither."""
    names = set()
    for file in checkpoint.weight_files():
        try:
            with safe_open(str(file), framework="numpy") as tensors:  # the header only: no tensor is read
                names.update(tensors.keys())
        except Exception:  # a damaged file: loading it names the file and what is wrong
            return
    missing = [part for part in ("seq_relationship.weight", "pooler.dense.weight") if not any(n.endswith(part)
               for n in names)]  # fmt: skip
    if missing:
        raise OptionError(
            f"next_sentence (--next-sentence) trains BERT's pretraining heads, but {checkpoint.path} has no "
            f"next-sentence head (no {' or '.join(missing)} tensor); start from a BERT pretraining checkpoint "
            "(BertForPreTraining's weights, as bert-base-uncased has), or from scratch with config= (--config) and "
            "tokenizer=, or drop next_sentence to train masked-LM alone"
        )


def masking(whole_word: bool) -> dict:
    """The masker's options: transformers' collator replaces every token of a whole word it selects by the mask
    token (with `whole_word_mask=True` it sets mask_replace_prob to 1)."""
    return dict(whole_word=True, mask_fraction=1.0, random_fraction=0.0) if whole_word else {}
