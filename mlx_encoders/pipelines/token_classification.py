"""Token classification (NER) with entity grouping, matching transformers' `TokenClassificationPipeline`
(pipelines/token_classification.py): the same strategies (none, simple, first, average, max), the same
sub-word rules and the same entity spans. Inputs are truncated to the model's length, as there.
"""

import warnings

import numpy as np
from tokenizers import Encoding

from ..tokenizer import check_count
from .base import Pipeline
from .fill_mask import softmax

STRATEGIES = ("none", "simple", "first", "average", "max")


def get_tag(entity: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'), 'I-PER' -> ('I', 'PER'); a bare label counts as inside: 'PER' -> ('I', 'PER')."""
    if entity.startswith(("B-", "I-")):
        return entity[0], entity[2:]
    return "I", entity


class TokenClassificationPipeline(Pipeline):
    task = "token-classification"
    head = "token-classification"

    def options(self, given: dict) -> dict:
        """transformers' rule, applied to the keywords of one call (or of the construction) on their own."""
        strategy = given.get("aggregation_strategy")
        if given.get("stride") is not None and isinstance(strategy, str) and strategy.lower() == "none":
            raise ValueError('stride needs an aggregation_strategy other than "none", to merge the windows')
        return super().options(given)

    def predict(
        self, inputs: str | list[str] | list[list[str]], aggregation_strategy: str | None = None,
        ignore_labels: list[str] | None = None, stride: int | None = None, is_split_into_words: bool = False,
        delimiter: str | None = None, *, batch_size: int,
    ):  # fmt: skip
        """Entities of a text (a list of dicts), or of each text in a list (a list of lists).

        "none" (the default) gives one dict per token: {"entity", "score", "index", "word", "start", "end"}; the
        other strategies group tokens into {"entity_group", "score", "word", "start", "end"}. Texts longer than
        the model are truncated, unless `stride` is given: then they are split into windows that overlap by
        `stride` tokens, and of overlapping entities the longest (then the higher scored) is kept.
        `is_split_into_words=True` takes a list of words (or a list of such lists) and reports spans in the words
        joined by `delimiter` (default " "); as in transformers, the result is a list of lists either way.
        """
        strategy = (aggregation_strategy or "none").lower()
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown aggregation_strategy {aggregation_strategy!r}; choose one of {STRATEGIES}")
        words = split_words(inputs) if is_split_into_words else None
        delimiter = " " if delimiter is None else delimiter
        texts = [delimiter.join(w) for w in words] if words is not None else self.texts(inputs)
        examples = words if words is not None else texts
        if stride is None:
            windows = [[e] for e in self.encode(examples, is_split_into_words=is_split_into_words)]
        else:
            windows = self.windows(examples, stride, is_split_into_words)
        logits = iter(out[0] for out in self.forward([w for text in windows for w in text], batch_size))
        ignore = ["O"] if ignore_labels is None else ignore_labels
        results = []
        for i, (text, encodings) in enumerate(zip(texts, windows, strict=True)):
            starts = word_starts(words[i], delimiter) if words is not None else None
            entities = []
            for encoding in encodings:
                entities += self.entities(text, encoding, next(logits), strategy, ignore, starts)
            entities = aggregate_overlapping_entities(entities) if len(encodings) > 1 else entities
            results.append([{**e, "score": np.float32(e["score"])} for e in entities])  # transformers' type
        return results[0] if isinstance(inputs, str) else results

    def windows(self, examples: list, stride: int, is_split_into_words: bool = False) -> list[list[Encoding]]:
        """Each text as windows of the model's length overlapping by `stride` tokens."""
        check_count("stride", stride, 0)
        room = self.max_length - self.tokenizer.num_special_tokens_to_add()  # text tokens per window
        if stride >= room:
            raise ValueError(
                f"stride ({stride}) must be less than the {room} text tokens of a window (the model's "
                f"{self.max_length} tokens less {self.max_length - room} special tokens)"
            )
        encodings = self.tokenizer.encode_batch(
            examples, max_length=self.max_length, stride=stride, is_split_into_words=is_split_into_words
        )
        return [[e, *e.overflowing] for e in encodings]

    def entities(
        self, text: str, encoding: Encoding, logits: np.ndarray, strategy: str, ignore: list[str],
        starts: list[int] | None = None,
    ):  # fmt: skip
        pre = self.gather_pre_entities(text, encoding, softmax(logits), strategy, starts)
        grouped = self.aggregate(pre, strategy)
        return [e for e in grouped if e.get("entity") not in ignore and e.get("entity_group") not in ignore]

    def is_word_piece(self) -> bool:
        return bool(getattr(self.tokenizer.backend.model, "continuing_subword_prefix", None))

    def gather_pre_entities(
        self, text: str, encoding: Encoding, scores: np.ndarray, strategy: str, starts: list[int] | None = None
    ) -> list[dict]:
        """Per non-special token: its token string, scores, character span and whether it continues a word.
        With pre-split words (`starts`: where each word begins in `text`), offsets count from their word."""
        unk = self.tokenizer.token_id(self.tokenizer.unk_token)
        pre = []
        for idx, (token_id, special, (start, end), word_id) in enumerate(
            zip(encoding.ids, encoding.special_tokens_mask, encoding.offsets, encoding.word_ids, strict=True)
        ):
            if special:
                continue
            if starts is not None and word_id is not None:
                start, end = start + starts[word_id], end + starts[word_id]
            word = self.tokenizer.backend.id_to_token(token_id)
            word_ref = text[start:end]
            if self.is_word_piece():
                is_subword = len(word) != len(word_ref)
            else:  # no sub-word marker: a token continues a word when no space precedes it
                if strategy in ("first", "average", "max"):
                    warnings.warn("Tokenizer does not support real words, using fallback heuristic", stacklevel=5)
                is_subword = start > 0 and " " not in text[start - 1 : start + 1]
            if token_id == unk:
                word, is_subword = word_ref, False
            pre.append({"word": word, "scores": scores[idx], "start": start, "end": end, "index": idx,
                        "is_subword": is_subword})  # fmt: skip
        return pre

    def aggregate(self, pre: list[dict], strategy: str) -> list[dict]:
        if strategy in ("none", "simple"):
            entities = [self.token_entity(p) for p in pre]
        else:
            entities = self.aggregate_words(pre, strategy)
        return entities if strategy == "none" else self.group_entities(entities)

    def token_entity(self, pre: dict) -> dict:
        best = int(pre["scores"].argmax())
        return {"entity": self.id2label[best], "score": pre["scores"][best], "index": pre["index"],
                "word": pre["word"], "start": pre["start"], "end": pre["end"]}  # fmt: skip

    def tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.tokenizer.backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def aggregate_word(self, entities: list[dict], strategy: str) -> dict:
        if strategy == "first":
            scores = entities[0]["scores"]
        elif strategy == "max":
            scores = max(entities, key=lambda e: e["scores"].max())["scores"]
        else:
            scores = np.nanmean(np.stack([e["scores"] for e in entities]), axis=0)
        best = int(scores.argmax())
        return {"entity": self.id2label[best], "score": scores[best],
                "word": self.tokens_to_string([e["word"] for e in entities]),
                "start": entities[0]["start"], "end": entities[-1]["end"]}  # fmt: skip

    def aggregate_words(self, pre: list[dict], strategy: str) -> list[dict]:
        """Force one label per word: sub-word tokens join the word their first token starts."""
        words, group = [], []
        for entity in pre:
            if group and not entity["is_subword"]:
                words.append(self.aggregate_word(group, strategy))
                group = []
            group.append(entity)
        if group:
            words.append(self.aggregate_word(group, strategy))
        return words

    def group_sub_entities(self, entities: list[dict]) -> dict:
        return {
            "entity_group": entities[0]["entity"].split("-", 1)[-1],
            "score": np.nanmean([e["score"] for e in entities]),
            "word": self.tokens_to_string([e["word"] for e in entities]),
            "start": entities[0]["start"],
            "end": entities[-1]["end"],
        }

    def group_entities(self, entities: list[dict]) -> list[dict]:
        """Merge adjacent entities with the same tag unless the next one begins a new entity (B-)."""
        groups, current = [], []
        for entity in entities:
            if current:
                bi, tag = get_tag(entity["entity"])
                if not (tag == get_tag(current[-1]["entity"])[1] and bi != "B"):
                    groups.append(self.group_sub_entities(current))
                    current = []
            current.append(entity)
        if current:
            groups.append(self.group_sub_entities(current))
        return groups


def split_words(inputs) -> list[list[str]]:
    """`is_split_into_words` inputs: a list of words (one text) or a list of such lists."""
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(w, str) for w in inputs):
        return [list(inputs)]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(w, (list, tuple)) for w in inputs):
        for i, words in enumerate(inputs):
            bad = next((w for w in words if not isinstance(w, str)), None)
            if bad is not None or not words:
                raise TypeError(f"With is_split_into_words=True, item {i} must be a non-empty list of str words")
        return [list(words) for words in inputs]
    raise TypeError(
        "With is_split_into_words=True, the input must be a list of str words, or a list of such lists; "
        f"got {inputs!r:.60}"
    )


def word_starts(words: list[str], delimiter: str) -> list[int]:
    """Where each word begins in `delimiter.join(words)`."""
    starts, position = [], 0
    for word in words:
        starts.append(position)
        position += len(word) + len(delimiter)
    return starts


def aggregate_overlapping_entities(entities: list[dict]) -> list[dict]:
    """Of entities that overlap (from overlapping windows), keep the longest, then the higher scored."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda e: e["start"])
    kept, previous = [], entities[0]
    for entity in entities:
        if previous["start"] <= entity["start"] < previous["end"]:
            length, previous_length = entity["end"] - entity["start"], previous["end"] - previous["start"]
            if length > previous_length or (length == previous_length and entity["score"] > previous["score"]):
                previous = entity
        else:
            kept.append(previous)
            previous = entity
    kept.append(previous)
    return kept
