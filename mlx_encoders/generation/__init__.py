"""Text generation with causal language models (GPT-2): greedy, temperature, top-k, top-p, repetition penalty.

- `config`: `GenerationConfig` and its presets; `processors`: the logits processors and token selection,
  equal to transformers' classes; `loop`: the generate loop with a key/value cache, batched (left-padded) and
  streamed; `steps`: its decoding steps, the model's own forward pass compiled once per generation; `cli`: the
  `generate` command of `python -m mlx_encoders`.
"""

from .config import PRESETS, GenerationConfig
from .loop import TextStream, generate, generate_ids, generate_steps, stream_generate

__all__ = [
    "GenerationConfig", "PRESETS", "TextStream", "generate", "generate_ids", "generate_steps", "stream_generate",
]  # fmt: skip
