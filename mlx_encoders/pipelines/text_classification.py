"""Text classification (single texts and text pairs) and reranking, matching transformers'
`TextClassificationPipeline` (pipelines/text_classification.py): same labels, scores and nesting.

Inputs longer than the model's positions are truncated (longest-first for pairs) unless `truncation=False`.
"""

from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from ..tokenizer import text_list
from .base import Pipeline, check_count, tokenizer_options
from .fill_mask import softmax

FUNCTIONS = ("softmax", "sigmoid", "none")
LEGACY = ""  # `top_k` left out: transformers' legacy output (best label only, a list around a single text)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class TextClassificationPipeline(Pipeline):
    task = "text-classification"
    head = "sequence-classification"
    none_is_a_value = ("top_k",)  # top_k=None: every label's score, as transformers'

    def default_function(self) -> str:
        problem, n = self.model.args.problem_type, self.model.args.num_labels
        if problem == "regression":
            return "none"
        if problem == "multi_label_classification" or n == 1:
            return "sigmoid"
        return "softmax"

    def scores(
        self, texts: list[str], pairs: list[str] | None = None, function_to_apply: str | None = None,
        batch_size: int | None = None, **encode_options,
    ):  # fmt: skip
        """(n, num_labels) scores after softmax / sigmoid / none (default from problem_type and num_labels)."""
        self.check_function(function_to_apply)
        if pairs is None or all(pairs):
            encodings = self.encode(texts, pairs, **encode_options)
        else:  # single texts among pairs (an empty text_pair is none, as transformers' tokenizer takes it)
            encodings = [None] * len(texts)
            for paired in (False, True):
                rows = [i for i, second in enumerate(pairs) if bool(second) == paired]
                seconds = [pairs[i] for i in rows] if paired else None
                if rows:
                    done = self.encode([texts[i] for i in rows], seconds, **encode_options)
                    for i, encoding in zip(rows, done, strict=True):
                        encodings[i] = encoding
        logits = np.stack([out[0] for out in self.forward(encodings, batch_size, per_token=False)])
        return self.activate(logits, function_to_apply)

    def check_function(self, function_to_apply: str | None) -> str:
        """`function_to_apply` in lower case (the default one for None); ValueError naming the choices if unknown."""
        function = (function_to_apply or self.default_function()).lower()
        if function not in FUNCTIONS:
            raise ValueError(f"Unrecognized function_to_apply {function_to_apply!r}; choose one of {FUNCTIONS}")
        return function

    def activate(self, logits: np.ndarray, function_to_apply: str | None = None) -> np.ndarray:
        """(n, num_labels) scores of `logits`, as `scores` gives them: softmax, sigmoid or none (`function_to_apply`,
        default from problem_type and num_labels)."""
        function = self.check_function(function_to_apply)
        return {"softmax": softmax, "sigmoid": sigmoid, "none": lambda x: x}[function](logits)

    def __call__(self, inputs, **options):
        # transformers puts a single string's result in a list unless this call passes top_k
        result = super().__call__(inputs, **options)
        return [result] if isinstance(inputs, str) and "top_k" not in options else result

    def predict(
        self, inputs, top_k: int | None | str = LEGACY, function_to_apply: str | None = None,
        return_all_scores: bool | None = None, truncation: bool | str = True, max_length: int | None = None,
        padding: bool | str = False, tokenizer_kwargs: dict | None = None, *, batch_size: int,
    ):  # fmt: skip
        """Labels and scores for a text, a {"text", "text_pair"} dict, or a list of either.

        Without `top_k`: the best {"label", "score"} per input (in a list for a single string); with `top_k`
        (None = all labels): a list of the best `top_k` per input, highest first. `return_all_scores` is
        transformers 4's legacy form (5 ignores it), taken when `top_k` is not given: True gives every label in
        the model's order, False the best. `truncation`, `max_length` and `tokenizer_kwargs` as transformers'
        tokenizer keywords; inputs are truncated to the model's length by default. `padding` is taken and, as
        in transformers' results, changes nothing.
        """
        single = isinstance(inputs, (str, Mapping))  # a text or one {"text", "text_pair"} dict
        items = [inputs] if single else text_list(inputs, "text-classification")  # a list, tuple or generator
        if not items:
            raise ValueError("text-classification needs at least one input")
        legacy = top_k == LEGACY
        if legacy:
            top_k = None if return_all_scores else 1
        if top_k is not None:
            check_count("top_k", top_k, 1)
        texts, pairs = split_pairs(items)
        options = {"truncation": truncation, "max_length": max_length, **tokenizer_options(tokenizer_kwargs)}
        scores = self.scores(texts, pairs, function_to_apply, batch_size, **options)
        results = [self.labels(row, top_k, legacy) for row in scores]
        return results[0] if single else results

    def labels(self, scores: np.ndarray, top_k: int | None, legacy: bool):
        """transformers' postprocess: the best label alone (legacy top 1), else labels in the model's order
        (legacy, all of them) or sorted best first and cut to `top_k`."""
        if legacy and top_k == 1:
            best = int(scores.argmax())
            return {"label": self.id2label[best], "score": float(scores[best])}
        ranked = [{"label": self.id2label[i], "score": float(s)} for i, s in enumerate(scores)]
        if legacy:
            return ranked
        ranked.sort(key=lambda x: x["score"], reverse=True)
        return ranked if top_k is None else ranked[:top_k]

    def rerank(
        self, query: str, documents: list[str], top_k: int | None = None, function_to_apply: str | None = None
    ) -> list[dict]:
        """Documents ordered by relevance to `query`, as [{"corpus_id", "score", "text"}, ...], best first.

        The score is the last label's (the "relevant" class of a cross-encoder; its only label for the
        usual one-logit rerankers, where the default function is a sigmoid).
        """
        if top_k is not None:
            check_count("top_k", top_k, 1)
        if not documents:
            return []
        with mx.stream(self.device):
            scores = self.scores([query] * len(documents), list(documents), function_to_apply)[:, -1]
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [{"corpus_id": int(i), "score": float(scores[i]), "text": documents[i]} for i in order]


def split_pairs(items: list) -> tuple[list[str], list[str | None] | None]:
    """Texts and (when any input is a pair) their second texts, None or "" for a single text: transformers'
    pipeline tokenizes each input alone, and its tokenizer takes an empty text_pair for none."""
    pairs = [as_pair(i, item) for i, item in enumerate(items)]
    seconds = [p.get("text_pair") for p in pairs]
    return [p["text"] for p in pairs], None if all(s is None for s in seconds) else seconds


def as_pair(index: int, item) -> dict:
    if isinstance(item, str):
        return {"text": item}
    if isinstance(item, dict) and "text" in item:
        return item
    error = ValueError if isinstance(item, dict) else TypeError
    expected = 'text-classification inputs are strings or {"text": ..., "text_pair": ...} dicts'
    raise error(f"{expected}; item {index} is {item!r:.60}")
