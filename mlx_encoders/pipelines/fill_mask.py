"""Fill-mask pipeline, matching transformers' `FillMaskPipeline` (pipelines/fill_mask.py) output for output.

Inputs are truncated to the model's length (transformers does not truncate and fails on over-long
inputs); a mask token cut off by truncation is reported as missing.
"""

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..tokenizer import text_list
from .base import Pipeline, check_count, to_numpy, tokenizer_options


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


class FillMaskPipeline(Pipeline):
    task = "fill-mask"
    head = "masked-lm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer.mask_token_id is None:
            source = f" in {self.model.path}" if getattr(self.model, "path", None) else ""
            raise ValueError(f"The tokenizer{source} defines no mask_token; fill-mask needs one")

    def mask_logits(
        self, texts: Sequence[str], batch_size: int | None = None, truncation: bool | str = True,
        max_length: int | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
        """Per text: (input ids, mask positions, logits at those positions of shape (n_masks, vocab))."""
        encodings = self.encode(texts, truncation=truncation, max_length=max_length)
        ids = [np.array(e.ids) for e in encodings]
        masks = [np.flatnonzero(i == self.tokenizer.mask_token_id) for i in ids]
        for text, m in zip(texts, masks, strict=True):
            if not len(m):
                raise ValueError(
                    f"No mask_token ({self.tokenizer.mask_token}) found in the input {text!r} "
                    f"(after truncation to {max_length or self.max_length} tokens)"
                )
        logits: list[np.ndarray] = [None] * len(encodings)

        def forward(rows: np.ndarray) -> list[mx.array]:
            out = self.run(self.tokenizer.pad([encodings[i] for i in rows])).logits
            # gather the mask rows before leaving MLX: the full vocabulary is large
            return [out[row, mx.array(masks[i])] for row, i in enumerate(rows)]

        def collect(rows: np.ndarray, arrays: list[mx.array]) -> None:
            for i, array in zip(rows, arrays, strict=True):
                logits[i] = to_numpy(array)

        self.run_batches(encodings, forward, collect, batch_size)
        return list(zip(ids, masks, logits, strict=True))

    def predict(
        self, inputs: str | list[str], top_k: int = 5, targets: str | list[str] | None = None,
        tokenizer_kwargs: dict | None = None, *, batch_size: int,
    ):  # fmt: skip
        """Top-k fillers per mask: [{"score", "token", "token_str", "sequence"}, ...] (one list per mask
        when the text has several); a list of texts gives a list of those. `tokenizer_kwargs` (truncation,
        max_length) as transformers'; texts are truncated to the model's length by default."""
        texts = self.texts(inputs)
        check_count("top_k", top_k, 1)
        target_ids = self.target_ids(targets) if targets is not None else None
        logits = self.mask_logits(texts, batch_size, **tokenizer_options(tokenizer_kwargs))
        results = [self.postprocess(*item, top_k, target_ids) for item in logits]
        return results[0] if isinstance(inputs, str) or len(results) == 1 else results

    def postprocess(self, ids, masks, logits, top_k: int, target_ids: np.ndarray | None):
        probs = softmax(logits)
        candidates = target_ids if target_ids is not None else np.arange(probs.shape[-1])
        probs = probs[:, candidates]
        top_k = min(top_k, len(candidates))
        single = len(masks) == 1
        result = []
        for position, row in zip(masks, probs, strict=True):
            order = np.argsort(-row, kind="stable")[:top_k]
            result.append([self.proposition(ids, position, int(candidates[i]), float(row[i]), single) for i in order])
        return result[0] if single else result

    def proposition(self, ids: np.ndarray, position: int, token: int, score: float, single: bool) -> dict:
        tokens = ids.copy()
        tokens[position] = token
        tokens = tokens[tokens != self.tokenizer.pad_token_id]
        return {
            "score": score,
            "token": token,
            "token_str": self.tokenizer.decode([token], skip_special_tokens=False),
            "sequence": self.tokenizer.decode(tokens, skip_special_tokens=single),
        }

    def target_ids(self, targets: str | list[str]) -> np.ndarray:
        """Vocabulary ids of `targets`; a target outside the vocabulary becomes its first token."""
        ids = []
        for i, target in enumerate(text_list(targets, "fill-mask targets")):
            if not isinstance(target, str):
                raise TypeError(f"fill-mask targets are strings; item {i} is {type(target).__name__}: {target!r:.60}")
            id_ = self.tokenizer.backend.token_to_id(target)
            if id_ is None:
                pieces = self.tokenizer.encode_batch([target], add_special_tokens=False, truncation=False)[0].ids
                if not pieces:
                    continue
                id_ = pieces[0]
            ids.append(id_)
        if not ids:
            raise ValueError(f"None of the targets {targets!r} maps to a token of the vocabulary")
        return np.array(list(set(ids)))
