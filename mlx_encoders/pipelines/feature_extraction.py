"""Feature extraction (hidden states per token), matching transformers' `FeatureExtractionPipeline`
(pipelines/feature_extraction.py): a nested list of shape (1, tokens, hidden) per text.

Any checkpoint works: its bare encoder is used. Inputs are truncated to the model's length.
"""

import mlx.core as mx
import mlx.nn as nn

from ..models.base import HeadModel
from .base import Pipeline


class FeatureExtractionPipeline(Pipeline):
    task = "feature-extraction"
    head = "encoder"

    def check(self, model: nn.Module) -> None:
        """Any model will do: a head model (passed in loaded) runs its encoder alone."""

    def run(self, batch: dict[str, mx.array]):
        encoder = self.model.encode if isinstance(self.model, HeadModel) else self.model
        types = batch.get("token_type_ids")
        return encoder(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=types)

    def __call__(self, inputs: str | list[str], return_tensors: bool = False, truncation: bool = True):
        """Last hidden states of a text (or of each text in a list); `return_tensors=True` gives mx.arrays."""
        texts = self.texts(inputs)
        outputs = self.forward(self.encode(texts, truncation=truncation), ("last_hidden_state",))
        states = [out[0][None] for out in outputs]  # (1, tokens, hidden) per text, as transformers
        results = [mx.array(s) if return_tensors else s.tolist() for s in states]
        return results[0] if isinstance(inputs, str) else results
