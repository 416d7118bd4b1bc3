"""Feature extraction (hidden states per token), matching transformers' `FeatureExtractionPipeline`
(pipelines/feature_extraction.py): a nested list of shape (1, tokens, hidden) per text.

Any checkpoint works: its bare encoder is used. Inputs are truncated to the model's length unless
`truncation=False` (transformers' default is not to truncate, and an over-long input fails there).
"""

import mlx.core as mx
import mlx.nn as nn

from ..models.base import HeadModel
from .base import Pipeline, tokenizer_options


class FeatureExtractionPipeline(Pipeline):
    task = "feature-extraction"
    head = "encoder"

    def check(self, model: nn.Module) -> None:
        """Any model will do: a head model (passed in loaded) runs its encoder alone."""

    def run(self, batch: dict[str, mx.array]):
        encoder = self.model.encode if isinstance(self.model, HeadModel) else self.model
        types = batch.get("token_type_ids")
        return encoder(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=types)

    def predict(
        self, inputs: str | list[str], return_tensors: bool = False, truncation: bool | str | None = None,
        tokenize_kwargs: dict | None = None, *, batch_size: int,
    ):  # fmt: skip
        """Last hidden states of a text (or of each text in a list); `return_tensors=True` gives mx.arrays.
        Texts are truncated to the model's length unless `truncation=False`; `tokenize_kwargs` (truncation,
        max_length) as transformers'."""
        if (tokenize_kwargs or {}).get("padding") == "max_length":  # transformers returns the padding's states too
            raise ValueError(
                "feature-extraction: tokenize_kwargs padding='max_length' is not supported here: each text's hidden "
                "states are those of its own tokens; pad the arrays afterwards if a fixed width is needed"
            )
        options = tokenizer_options(tokenize_kwargs, "tokenize_kwargs")
        if truncation is not None:
            if "truncation" in options:  # transformers' rule and message
                raise ValueError(
                    "truncation parameter defined twice (given as keyword argument as well as in tokenize_kwargs)"
                )
            options["truncation"] = truncation
        texts = self.texts(inputs)
        outputs = self.forward(self.encode(texts, **options), batch_size, ("last_hidden_state",))
        states = [out[0][None] for out in outputs]  # (1, tokens, hidden) per text, as transformers
        results = [mx.array(s) if return_tensors else s.tolist() for s in states]
        return results[0] if isinstance(inputs, str) else results
