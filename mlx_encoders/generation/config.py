"""`GenerationConfig`: how many tokens, how to pick each one, when to stop; presets for the usual strategies.

Names and defaults follow transformers' `GenerationConfig` (top_k 50 when sampling, as transformers applies it;
without `max_new_tokens` or `max_length`, 20 new tokens, or fewer where the positions run out). Values that cannot
work fail here, naming the field; sampling options set for greedy decoding
warn that they are ignored, as transformers' `GenerationConfig.validate` does.
"""

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass

from ..errors import outside_stacklevel
from ..tokenizer import check_count

DEFAULT_NEW_TOKENS = 20
PRESETS = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "temperature": 0.8, "top_k": 0},
    "top-k": {"do_sample": True, "top_k": 40},
    "nucleus": {"do_sample": True, "top_p": 0.9, "top_k": 0},
}


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "seed": None}  # what greedy decoding ignores


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r:.40}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass
class GenerationConfig:
    """Decoding settings. `stop` strings end a text where they first appear (the text stops before them);
    `eos_token_id` None reads the model's config.json, `pad_token_id` None its pad or else its first eos."""

    max_new_tokens: int | None = None
    max_length: int | None = None  # prompt (padded, as transformers counts it) plus new tokens
    min_new_tokens: int | None = 0
    min_length: int | None = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):  # None: unset, the default, as transformers fills a GenerationConfig's
            unset = ("top_k", "min_new_tokens", "min_length", "do_sample", "temperature", "top_p", "repetition_penalty")
            if f.name in unset and getattr(self, f.name) is None:
                setattr(self, f.name, f.default)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.eos_token_id, numbers.Integral) and not isinstance(self.eos_token_id, bool):
            self.eos_token_id = [int(self.eos_token_id)]
        self.check()

    def check(self) -> None:
        for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k", "pad_token_id", "seed"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name), 1 if name == "max_length" else 0)
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True or False, got {self.do_sample!r}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            check_number(name, getattr(self, name))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (the probability mass to keep), got {self.top_p}")
        if self.temperature < 0 or (self.do_sample and self.temperature == 0):
            raise ValueError(
                f"temperature must be > 0 when sampling, got {self.temperature}; for greedy decoding, do_sample=False"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: none), got {self.repetition_penalty}")
        for i, token in enumerate(self.eos_token_id or []):
            check_count(f"eos_token_id[{i}]", token, 0)
        stops = self.stop if isinstance(self.stop, list) else [None]
        if self.stop is not None and not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r:.80}")
        if self.stop is not None and not all(stops):  # "" would stop before the first token
            raise ValueError(f"stop strings must not be empty, got {self.stop!r:.80}")
        if self.seed is not None and self.seed >= 2**64:  # MLX's keys are 64-bit
            raise ValueError(f"seed must be below 2**64, got {self.seed}")
        if not self.do_sample:
            self.warn_unused_sampling()

    def warn_unused_sampling(self) -> None:
        # transformers warns rather than fails here; silence would let a user believe they sampled
        unused = {k: getattr(self, k) for k, default in SAMPLING_DEFAULTS.items() if getattr(self, k) != default}
        if unused:
            given = ", ".join(f"{k}={v}" for k, v in unused.items())
            warnings.warn(
                f"do_sample is not True, so {given} is ignored (greedy decoding); set do_sample=True "
                "(command line: --preset sample, top-k or nucleus) to sample, or leave these unset",
                UserWarning,
                stacklevel=outside_stacklevel(),
            )

    @classmethod
    def preset(cls, name: str, **overrides) -> "GenerationConfig":
        """One of PRESETS ("greedy", "sample", "top-k", "nucleus"), with `overrides` on top."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_kwargs({**PRESETS[name], **overrides})

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "GenerationConfig":
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise TypeError(f"Unknown generation option(s) {', '.join(unknown)}; the options are: {names}")
        return cls(**kwargs)

    def changed(self) -> dict:
        """The fields whose value is not the default."""
        default = GenerationConfig()
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) != getattr(default, f.name)}

    def replace(self, **overrides) -> "GenerationConfig":
        """A copy with `overrides` (checked like the constructor's arguments)."""
        return GenerationConfig.from_kwargs({**dataclasses.asdict(self), **overrides})

    def new_tokens(self, prompt_length: int) -> int:
        """How many tokens to generate after a (padded) prompt of `prompt_length` tokens."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None:
            if self.max_length <= prompt_length:
                raise ValueError(
                    f"max_length={self.max_length} leaves no room after a (padded) prompt of {prompt_length} tokens; "
                    "set max_new_tokens instead, which counts new tokens only"
                )
            return self.max_length - prompt_length
        return DEFAULT_NEW_TOKENS
