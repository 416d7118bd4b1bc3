"""Dynamic masking for masked-LM and next-sentence pairs for BERT pretraining.

`Masker` follows transformers' `DataCollatorForLanguageModeling.torch_mask_tokens` (data/data_collator.py): each
real token (never padding nor a special id, even one typed in the text, as the collator's
`get_special_tokens_mask(already_has_special_tokens=True)` marks them) is selected with probability 0.15; of those,
80% become the mask token, 10% a random token, 10% stay; labels are the original ids where selected and -100
elsewhere. One difference:
random replacements are drawn from the vocabulary *without* its special tokens (transformers draws from the whole
vocabulary, so it can put [CLS] or [PAD] mid-text). Another: a batch in which the draw selected no token gets one
token (or word) selected, drawn uniformly, where transformers would return a NaN loss. Whole-word masking selects
a word's first sub-token with probability 0.15 and then every sub-token of that word (a word: tokens with no gap
between their offsets), as transformers' `whole_word_mask=True` does; masked-LM training then replaces all of them by
the mask token, as that collator does (`tasks/masked_lm.py`).
`next_sentence_pairs` follows BERT's `create_pretraining_data.py`: label 0 = the real next sentence, 1 = random.

All randomness comes from a `numpy.random.Generator` the caller passes in, so runs are reproducible and resumable
(`rng.bit_generator.state` can be saved and restored).
"""

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..tokenizer import Tokenizer
from .losses import IGNORE_INDEX

T = TypeVar("T")


@dataclass(frozen=True)
class Masker:
    """Masks a batch of token ids: `masker(input_ids, special_tokens_mask, rng, word_ids=None)`."""

    mask_token_id: int
    replacement_ids: np.ndarray  # the ids a random replacement is drawn from: the vocabulary less special tokens
    probability: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    whole_word: bool = False
    # ids never selected wherever they stand, typed in the text or not: the special tokens (`from_tokenizer`'s)
    special_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self):
        if not 0 <= self.probability <= 1 or self.mask_fraction + self.random_fraction > 1:
            raise ValueError(
                f"Masking needs 0 <= probability <= 1 and mask_fraction + random_fraction <= 1, got probability="
                f"{self.probability}, mask_fraction={self.mask_fraction}, random_fraction={self.random_fraction}"
            )

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, **options) -> "Masker":
        """A masker with the tokenizer's mask token and non-special vocabulary; `options` are the fields above."""
        if tokenizer.mask_token_id is None:
            raise ValueError("The tokenizer has no mask token, so it cannot be used for masked-LM training")
        special = np.array(sorted(special_ids(tokenizer)), dtype=np.int64)
        return cls(tokenizer.mask_token_id, replacement_ids(tokenizer), special_token_ids=special, **options)

    def __call__(
        self,
        input_ids: np.ndarray,
        special_tokens_mask: np.ndarray,
        rng: np.random.Generator,
        word_ids: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(masked input ids, labels) for (B, L) ids; `special_tokens_mask` is True on special tokens and padding,
        `word_ids` (needed for whole-word masking) numbers the words of each row, -1 outside words. A special id is
        never selected, even where the text typed it ("[MASK]") and `special_tokens_mask` says it is text."""
        selectable = ~np.asarray(special_tokens_mask, dtype=bool) & ~np.isin(input_ids, self.special_token_ids)
        if self.whole_word:
            if word_ids is None:
                raise ValueError("Whole-word masking needs word_ids: pass the batch's (B, L) word numbers")
            selected = self.select_words(word_ids, selectable, rng)
        else:
            drawn = (rng.random(selectable.shape) < self.probability) & selectable
            selected = self.at_least_one(drawn, selectable, rng)
        labels = np.where(selected, input_ids, IGNORE_INDEX).astype(input_ids.dtype)
        draw = rng.random(selected.shape)
        masked = selected & (draw < self.mask_fraction)
        randomized = selected & ~masked & (draw < self.mask_fraction + self.random_fraction)
        inputs = input_ids.copy()
        inputs[masked] = self.mask_token_id
        inputs[randomized] = rng.choice(self.replacement_ids, size=int(randomized.sum()))
        return inputs, labels

    def at_least_one(self, selected: np.ndarray, selectable: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """`selected`, or one selectable position drawn uniformly when it is empty: a batch with nothing selected
        (short texts, small batches) would have no labels, a NaN loss, and NaN weights after the step."""
        if selected.any() or not selectable.any() or self.probability == 0:
            return selected
        chosen = np.zeros_like(selectable)
        chosen.flat[rng.choice(np.flatnonzero(selectable))] = True
        return chosen

    def select_words(self, word_ids: np.ndarray, selectable: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Pick each word by its first sub-token, then select all its sub-tokens."""
        in_word = (word_ids >= 0) & selectable
        previous = np.pad(word_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        first = in_word & (word_ids != previous)
        picked = self.at_least_one(first & (rng.random(first.shape) < self.probability), first, rng)
        # one key per (row, word): a word is selected when the key of a picked first sub-token matches
        keys = word_ids + np.arange(len(word_ids))[:, None] * (int(word_ids.max(initial=0)) + 1)
        return in_word & np.isin(keys, keys[picked])


def special_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens ([CLS], [PAD], [MASK], added special tokens...)."""
    special = {i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    for name in ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token", "bos_token", "eos_token"):
        special.add(tokenizer.token_id(getattr(tokenizer, name)))
    return special - {None}


def replacement_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Every id of the tokenizer's vocabulary except its special tokens."""
    ids = set(tokenizer.backend.get_vocab(with_added_tokens=True).values()) - special_ids(tokenizer)
    return np.array(sorted(ids), dtype=np.int64)


def next_sentence_pairs(documents: list[list[T]], rng: np.random.Generator) -> list[tuple[T, T, int]]:
    """(sentence, next, label) for each two consecutive sentences of each document: with probability 1/2 the real
    next sentence (label 0), else a random sentence of another document (label 1), as transformers' BERT labels."""
    if len(documents) < 2:
        raise ValueError(
            f"Next-sentence pairs need at least 2 documents to draw random sentences from, got {len(documents)}"
        )
    pairs = []
    for d, document in enumerate(documents):
        for i in range(len(document) - 1):
            if rng.random() < 0.5:
                pairs.append((document[i], document[i + 1], 0))
            else:
                other = documents[(d + 1 + rng.integers(len(documents) - 1)) % len(documents)]
                pairs.append((document[i], other[rng.integers(len(other))], 1))
    return pairs
