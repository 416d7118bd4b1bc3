"""Text classification (single texts and text pairs) and reranking, matching transformers'
`TextClassificationPipeline` (pipelines/text_classification.py): same labels, scores and nesting.

Inputs longer than the model's positions are truncated (longest-first for pairs).
"""

import numpy as np

from .base import Pipeline, check_count
from .fill_mask import softmax

FUNCTIONS = ("softmax", "sigmoid", "none")
LEGACY = ""  # `top_k` left out: transformers' legacy output (best label only, a list around a single text)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class TextClassificationPipeline(Pipeline):
    task = "text-classification"
    head = "sequence-classification"

    def default_function(self) -> str:
        problem, n = self.model.args.problem_type, self.model.args.num_labels
        if problem == "regression":
            return "none"
        if problem == "multi_label_classification" or n == 1:
            return "sigmoid"
        return "softmax"

    def scores(self, texts: list[str], pairs: list[str] | None = None, function_to_apply: str | None = None):
        """(n, num_labels) scores after softmax / sigmoid / none (default from problem_type and num_labels)."""
        function = (function_to_apply or self.default_function()).lower()
        if function not in FUNCTIONS:
            raise ValueError(f"Unrecognized function_to_apply {function_to_apply!r}; choose one of {FUNCTIONS}")
        logits = np.stack([out[0] for out in self.forward(self.encode(texts, pairs), per_token=False)])
        return {"softmax": softmax, "sigmoid": sigmoid, "none": lambda x: x}[function](logits)

    def __call__(self, inputs, top_k: int | None | str = LEGACY, function_to_apply: str | None = None):
        """Labels and scores for a text, a {"text", "text_pair"} dict, or a list of either.

        Without `top_k`: the best {"label", "score"} per input (a list of one for a single string);
        with `top_k` (None = all labels): a list of the best `top_k` per input, highest first.
        """
        items = inputs if isinstance(inputs, list) else [inputs]
        if not items:
            raise ValueError("text-classification needs at least one input")
        if top_k not in (LEGACY, None):
            check_count("top_k", top_k, 1)
        texts, pairs = split_pairs(items)
        scores = self.scores(texts, pairs, function_to_apply)
        results = [self.labels(row, top_k) for row in scores]
        if isinstance(inputs, list):
            return results
        return [results[0]] if isinstance(inputs, str) and top_k == LEGACY else results[0]

    def labels(self, scores: np.ndarray, top_k: int | None | str):
        if top_k == LEGACY:
            best = int(scores.argmax())
            return {"label": self.id2label[best], "score": float(scores[best])}
        ranked = [{"label": self.id2label[i], "score": float(s)} for i, s in enumerate(scores)]
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
        scores = self.scores([query] * len(documents), list(documents), function_to_apply)[:, -1]
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [{"corpus_id": int(i), "score": float(scores[i]), "text": documents[i]} for i in order]


def split_pairs(items: list) -> tuple[list[str], list[str] | None]:
    """Texts and (when every input is a pair) their second texts."""
    pairs = [as_pair(i, item) for i, item in enumerate(items)]
    seconds = [p.get("text_pair") for p in pairs]
    if all(s is None for s in seconds):
        return [p["text"] for p in pairs], None
    if any(s is None for s in seconds):
        raise ValueError("Got both single texts and text pairs in one call; classify them in separate calls")
    return [p["text"] for p in pairs], seconds


def as_pair(index: int, item) -> dict:
    if isinstance(item, str):
        return {"text": item}
    if isinstance(item, dict) and "text" in item:
        return item
    error = ValueError if isinstance(item, dict) else TypeError
    expected = 'text-classification inputs are strings or {"text": ..., "text_pair": ...} dicts'
    raise error(f"{expected}; item {index} is {item!r:.60}")
