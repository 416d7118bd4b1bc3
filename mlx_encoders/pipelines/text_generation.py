"""Text-generation pipeline, matching transformers' `TextGenerationPipeline` (pipelines/text_generation.py):
`[{"generated_text": prompt + continuation}]` per prompt (`return_full_text=False`: the continuation alone).

Prompts run `batch_size` at a time, left-padded into one batch; options are `GenerationConfig` fields.
"""

from ..generation import GenerationConfig, generate
from ..generation.loop import check_model, generation_config
from ..tokenizer import check_count
from .base import Pipeline, batches


class TextGenerationPipeline(Pipeline):
    task = "text-generation"
    head = "causal-lm"

    def check(self, model) -> None:
        """A causal-LM head without a key/value cache (Qwen3's, Gemma 3's) is refused here, not at the first call."""
        super().check(model)
        check_model(model)

    def predict(
        self,
        text_inputs: str | list[str],
        return_full_text: bool = True,
        num_return_sequences: int = 1,
        generation_config: GenerationConfig | str | None = None,
        *,
        batch_size: int,
        **generate_kwargs,
    ):
        """[{"generated_text": ...}] per prompt (`num_return_sequences` dicts each); a list of prompts gives a
        list of those. `generate_kwargs` (max_new_tokens=, do_sample=, temperature=, top_k=, top_p=,
        repetition_penalty=, stop=, seed=, ...) override `generation_config` (a GenerationConfig or preset)."""
        texts = self.texts(text_inputs)
        check_count("num_return_sequences", num_return_sequences, 1)
        settings = self.config(generation_config, generate_kwargs, 0, self.model)
        if settings.max_length is not None or settings.min_length:  # they count the padded prompt: one at a time,
            batch_size = 1  # as transformers' pipeline runs each prompt, so a prompt's length is its own
        results = []
        for i, chunk in enumerate(batches(texts, batch_size)):
            config = self.config(generation_config, generate_kwargs, i, self.model)
            if num_return_sequences > 1 and not config.do_sample:  # n identical greedy texts: transformers refuses
                raise ValueError(
                    "Greedy methods (do_sample != True) do not support num_return_sequences different than 1 "
                    f"(got {num_return_sequences}); set do_sample=True (or a sampling preset) to get varied texts"
                )
            prompts = [text for text in chunk for _ in range(num_return_sequences)]
            continuations = generate(self.model, self.tokenizer, prompts, config)
            for j, text in enumerate(chunk):
                mine = continuations[j * num_return_sequences : (j + 1) * num_return_sequences]
                results.append([{"generated_text": text + c if return_full_text else c} for c in mine])
        return results[0] if isinstance(text_inputs, str) else results

    @staticmethod
    def config(config: GenerationConfig | str | None, overrides: dict, batch: int, model) -> GenerationConfig:
        """The batch's settings; a seed moves on by one per batch, so batches do not repeat each other's draws."""
        config = generation_config(config, overrides, model)
        return config.replace(seed=config.seed + batch) if config.seed is not None and batch else config
