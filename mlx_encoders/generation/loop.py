"""The generate loop: prompts left-padded into one batch, a key/value cache, one token per step per prompt.

Matches transformers' `GenerationMixin._sample` (generation/utils.py) token for token in greedy mode: positions
`cumsum(mask) - 1` (0 on padding), then the last one + 1 per step; the logits processors of `processors`; a
row that produced eos gets `pad_token_id` until every row has (or the token budget is spent). Text comes out
as transformers' text-generation pipeline cuts it, `decode(prompt + new)[len(decode(prompt)):]`, and
streams in whole characters (reference for the streaming loop: mlx-lm's `generate.py`).
"""

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.runtime import claim_mlx, one_row_products
from ..errors import outside_stacklevel
from ..jsonfile import read_json_object
from ..models import task_of_model
from ..tokenizer import Tokenizer, text_list
from . import steps as compiled
from .config import PRESETS, GenerationConfig
from .processors import processors, select

OFF_WHEN_NONE = ("top_k", "min_new_tokens", "min_length")
UNSET_WHEN_NONE = ("do_sample", "temperature", "top_p", "repetition_penalty")  # the file's value, else the default
REPLACEMENT = "\ufffd"  # what decoding shows for a character whose bytes have not all arrived


def generation_config(
    config: GenerationConfig | str | None, overrides: dict, model: nn.Module | None = None
) -> GenerationConfig:
    """`config` (a GenerationConfig, a preset name, or None: the model's generation_config.json, as transformers'
    `generate` reads it, else the defaults) with `overrides` on top; an override of None turns top_k and the
    minimum lengths off and leaves do_sample, temperature, top_p and repetition_penalty unset, as a keyword of
    transformers' `generate` does."""
    overrides = {k: 0 if v is None and k in OFF_WHEN_NONE else v for k, v in overrides.items()}
    overrides = {k: v for k, v in overrides.items() if not (v is None and k in UNSET_WHEN_NONE)}
    if config is not None:  # the caller's strategy; the model's end and pad ids still come from its file
        saved = saved_generation_config(model)
        ids = {k: saved[k] for k in ("eos_token_id", "pad_token_id") if k in saved and k not in overrides}
    if isinstance(config, str):
        return GenerationConfig.preset(config, **{**ids, **overrides})
    if config is None:
        saved = saved_generation_config(model)
        if not saved:
            return GenerationConfig.from_kwargs(overrides)
        with warnings.catch_warnings():  # sampling settings the file holds are the model's, not the caller's
            warnings.simplefilter("ignore", UserWarning)
            merged = GenerationConfig.from_kwargs({**saved, **overrides})
        if not merged.do_sample:  # the caller's own sampling options, ignored by greedy decoding, still warn
            GenerationConfig.from_kwargs({**overrides, "do_sample": False})
        return merged
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig or a preset ({', '.join(PRESETS)}), got {config!r:.60}")
    unset = {k: v for k, v in ids.items() if getattr(config, k) is None}
    return config.replace(**unset, **overrides) if unset or overrides else config


# transformers' decoding settings generate does not apply, with the value that changes nothing
UNSUPPORTED = {"no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "penalty_alpha": None,
               "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
               "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None, "guidance_scale": None,
               "renormalize_logits": False}  # fmt: skip


def saved_generation_config(model: nn.Module | None) -> dict:
    """The GenerationConfig fields set in the generation_config.json beside a loaded model (transformers saves one
    with every causal LM: GPT-2's names only its bos and eos ids); {} for a model built in code."""
    path = getattr(model, "path", None)
    file = Path(path) / "generation_config.json" if path is not None else None
    if file is None or not file.is_file():
        return {}
    saved = read_json_object(file)
    fields = {f.name for f in dataclasses.fields(GenerationConfig)} - {"stop", "seed"}
    unsupported = sorted(k for k, neutral in UNSUPPORTED.items() if saved.get(k, neutral) not in (neutral, None))
    if unsupported:
        warnings.warn(
            f"{file} sets {', '.join(f'{k}={saved[k]!r}' for k in unsupported)}, which generate does not apply; it "
            "decodes with the file's other settings",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    if saved.get("num_beams", 1) not in (1, None):
        warnings.warn(
            f"{file} asks for beam search (num_beams={saved['num_beams']}), which generate does not run; it decodes "
            "one sequence per prompt with the file's other settings",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    try:
        with warnings.catch_warnings():  # checked alone here; `generation_config` warns about the merged settings
            warnings.simplefilter("ignore", UserWarning)
            config = GenerationConfig.from_kwargs({k: v for k, v in saved.items() if k in fields and v is not None})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from e
    return config.changed()


def special_ids(model: nn.Module, config: GenerationConfig) -> tuple[list[int], int]:
    """(eos ids, pad id): the config's, else the model's; pad falls back to the first eos, as in transformers."""
    eos = config.eos_token_id if config.eos_token_id is not None else model.args.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = next((p for p in (config.pad_token_id, model.args.pad_token_id) if p is not None), None)
    pad = pad if pad is not None else eos[0] if eos else 0
    if pad >= model.args.vocab_size:
        raise ValueError(
            f"pad_token_id {pad} (the config's, else the model's, else its first eos_token_id) is outside the "
            f"vocabulary of {model.args.vocab_size} tokens; pass pad_token_id= (any id below it)"
        )
    return eos, pad


def check_model(model: nn.Module) -> None:
    if not hasattr(model, "make_cache") and hasattr(model, "args") and task_of_model(model) == "causal-lm":
        reranker = (
            " (a Qwen3-Reranker folder scores pairs through `CrossEncoder`)" if model.args.model_type == "qwen3" else ""
        )
        raise ValueError(
            f"{type(model).__name__} has a causal-LM head but no key/value cache, so it cannot generate here: "
            f"generation runs GPT-2 models; call the model for its next-token logits{reranker}"
        )
    if not hasattr(model, "make_cache"):
        raise TypeError(
            f"{type(model).__name__} is not a causal language model: generation needs one with an LM head, such as "
            "GPT-2's (load it with task='causal-lm')"
        )


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of the rows, padded on the left to the longest."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def encode_prompts(tokenizer: Tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (special tokens as the tokenizer adds them); an empty prompt fails."""
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"Prompts are strings; prompt {i} is {type(prompt).__name__}: {prompt!r:.60}")
    rows = [e.ids for e in tokenizer.encode_batch(prompts, truncation=False)]
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        if not prompt or not row:
            raise ValueError(f"Prompt {i} ({prompt!r:.40}) is empty: give the model some text to continue")
    return rows


def check_lengths(model: nn.Module, lengths: np.ndarray, new_tokens: int) -> None:
    """Every prompt, and its continuation, must fit the model's position table."""
    n, longest = model.args.max_tokens, int(lengths.max())
    if longest > n:
        raise ValueError(
            f"Prompt {int(lengths.argmax())} has {longest} tokens, more than the model's {n} positions "
            f"(n_positions={n}); shorten it"
        )
    if longest + new_tokens - 1 > n:  # the last new token is not read back: it takes no position
        raise ValueError(
            f"A prompt of {longest} tokens leaves room for {n - longest + 1} new tokens in the model's {n} positions, "
            f"not {new_tokens}: lower max_new_tokens (or max_length), or shorten the prompt"
        )


def forward(model, ids, mask: np.ndarray | None, positions: np.ndarray | None, cache) -> mx.array:
    """The last position's logits, (B, V), of (B, L) `ids` (numpy or MLX)."""
    mask, positions = (None if x is None else mx.array(x) for x in (mask, positions))
    ids = ids if isinstance(ids, mx.array) else mx.array(ids)
    out = model(ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
    return out.logits[:, -1]


def generate_steps(
    model: nn.Module, input_ids, attention_mask=None, config: GenerationConfig | None = None
) -> Iterator[np.ndarray]:
    """Yield each step's (B,) new tokens for a left-padded batch of prompt ids (0 in `attention_mask` on the
    padding), until `config`'s token budget is spent or every row has produced eos."""
    check_model(model)
    config = config or GenerationConfig()
    tokens = np.asarray(input_ids, dtype=np.int32)
    mask = None if attention_mask is None else np.asarray(attention_mask, dtype=np.int32)
    if mask is not None and mask.all():
        mask = None  # no padding: positions are arange, and no mask is needed
    B, L = tokens.shape
    eos, pad = special_ids(model, config)
    new_tokens, lengths = config.new_tokens(L), mask.sum(axis=1) if mask is not None else np.full(B, L)
    if config.max_new_tokens is None and config.max_length is None:  # the default, within the positions left
        new_tokens = max(0, min(new_tokens, model.args.max_tokens - int(lengths.max())))
    check_lengths(model, lengths, new_tokens)
    if new_tokens == 0:
        return iter(())
    return decode(model, tokens, mask, config, eos, pad, new_tokens)


def decode(
    model, tokens: np.ndarray, mask, config: GenerationConfig, eos, pad, new_tokens: int
) -> Iterator[np.ndarray]:
    """generate_steps' loop, a generator of its own so that generate_steps' checks run when it is called."""
    claim_mlx()
    one_row_products()  # each step's products have one row per sequence
    B, L = tokens.shape
    positions = None if mask is None else np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    prompt_start = None if mask is None else mx.array(mask.argmax(axis=1))  # transformers' prompt_ignore_length
    steps = processors(config, L, prompt_start, eos)
    key = mx.random.key(config.seed) if config.seed is not None and config.do_sample else None
    ids, finished = mx.array(tokens), mx.zeros((B,), mx.bool_)
    eos_ids = mx.array(eos, mx.int32) if eos else None

    def choose(logits: mx.array) -> tuple[mx.array, mx.array]:
        """The next (B,) tokens (pad in the finished rows) and which rows have finished, both lazy."""
        nonlocal key, ids, finished
        scores = logits.astype(mx.float32)
        for process in steps:
            scores = process(ids, scores)
        draw = None
        if key is not None:
            key, draw = mx.random.split(key)
        chosen = mx.where(finished, pad, select(scores, config.do_sample, draw).astype(mx.int32))
        ids = mx.concatenate([ids, chosen[:, None]], axis=1)
        if eos_ids is not None:
            finished = finished | (chosen[:, None] == eos_ids).any(axis=1)
        return chosen, finished

    cache = model.make_cache()
    logits = forward(model, tokens, mask, positions, cache)
    decoder = compiled.CompiledSteps(model, cache, L + new_tokens) if compiled.applies(model) else None

    def advance(chosen: mx.array) -> tuple[mx.array, mx.array]:
        """Queue the step after the (lazy) tokens `chosen`; its tokens and finished rows, lazy."""
        nonlocal mask, positions
        if mask is not None:
            mask = np.concatenate([mask, np.ones((B, 1), np.int32)], axis=1)
            positions = positions[:, -1:] + 1
        if decoder is not None:
            logits = decoder.step(chosen, mask, None if positions is None else positions[:, 0])
        else:
            logits = forward(model, chosen[:, None], mask, positions, cache)
        following = choose(logits)
        mx.async_eval(*following)
        return following

    chosen, done = choose(logits)
    for step in range(new_tokens):
        last = step == new_tokens - 1
        if step and not last:  # queued before this step's tokens are read (mlx-lm's loop); not the first step,
            following = advance(chosen)  # whose tracing would hold back the first token
        yield np.array(chosen)
        if last or np.array(done).all():
            return
        chosen, done = following if step else advance(chosen)


def generate_ids(model: nn.Module, input_ids, attention_mask=None, config=None, **overrides) -> np.ndarray:
    """transformers' `generate(input_ids, attention_mask=...)`: (B, L + new) ids, prompts then new tokens."""
    steps = list(generate_steps(model, input_ids, attention_mask, generation_config(config, overrides, model)))
    prompt = np.asarray(input_ids, dtype=np.int32)
    return np.concatenate([prompt, np.stack(steps, axis=1)], axis=1) if steps else prompt


class TextStream:
    """One prompt's continuation as its tokens arrive: whole characters only, ended by eos or cut before the
    first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], eos: list[int], stop: list[str] | None):
        self.tokenizer, self.ids, self.eos, self.stop = tokenizer, list(prompt_ids), set(eos), stop or []
        self.prompt_length = len(prompt_ids)
        self.prefix = len(tokenizer.decode(prompt_ids))
        self.text, self.shown, self.done, self.stopped = "", 0, False, False

    def add(self, token: int, decode: bool = True) -> str:
        """Take the next token; the new text safe to show (nothing without `decode`: `finish` decodes at once)."""
        self.done = token in self.eos
        self.ids.append(token)  # an eos that is a special token decodes to nothing; another keeps its text, as
        return self.decode() if decode else ""  # transformers' pipeline decodes it

    def decode(self) -> str:
        text = self.tokenizer.decode(self.ids)[self.prefix :]
        longest = max((len(s) for s in self.stop), default=0)
        hits = [i for i in (text.find(s, max(self.shown - longest, 0)) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.done, self.stopped = text[: min(hits)], True, True
            return self.flush()
        self.text = text
        end = len(text)
        while end > self.shown and text[end - 1] == REPLACEMENT:
            end -= 1
        end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        piece, self.shown = text[self.shown : end], max(end, self.shown)
        return piece

    def flush(self) -> str:
        piece, self.shown = self.text[self.shown :], len(self.text)
        return piece

    def finish(self) -> str:
        """The whole continuation, once no more tokens come."""
        if not self.stopped:
            self.decode()
        return self.text


def streams(model, tokenizer, prompts: list[str], config: GenerationConfig) -> tuple[list[TextStream], Iterator]:
    """A TextStream per prompt, and the steps that feed them (prompts left-padded into one batch)."""
    check_model(model)
    eos, pad = special_ids(model, config)
    rows = encode_prompts(tokenizer, prompts)
    ids, mask = left_pad(rows, pad)
    return [TextStream(tokenizer, row, eos, config.stop) for row in rows], generate_steps(model, ids, mask, config)


def generate(
    model: nn.Module, tokenizer: Tokenizer, prompt_or_prompts: str | list[str], config=None, **overrides
) -> str | list[str]:
    """The continuation of a prompt (a str), or of each prompt of a list, generated together in one batch.

    `config`: a GenerationConfig, a preset name ("greedy", "sample", "top-k", "nucleus") or None (the model's
    generation_config.json, else greedy, 20 new tokens); `overrides` (max_new_tokens=, do_sample=, temperature=,
    top_k=, top_p=, seed=, stop=, ...) replace its fields.
    """
    config = generation_config(config, overrides, model)
    prompts = text_list(prompt_or_prompts, "generate")
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    texts, steps = streams(model, tokenizer, prompts, config)
    for chosen in steps:
        for stream, token in zip(texts, chosen.tolist(), strict=True):
            if not stream.done:
                stream.add(token, decode=bool(config.stop))
        if all(s.done for s in texts):
            break
    results = [s.finish() for s in texts]
    return results[0] if isinstance(prompt_or_prompts, str) else results


def stream_generate(model: nn.Module, tokenizer: Tokenizer, prompt: str, config=None, **overrides) -> Iterator[str]:
    """Yield the continuation of `prompt` piece by piece as tokens arrive, in whole characters (options as
    `generate`); the pieces join to what `generate` returns."""
    if not isinstance(prompt, str):
        raise TypeError(f"stream_generate takes one prompt (a str), got {type(prompt).__name__}; lists: generate")
    (stream,), steps = streams(model, tokenizer, [prompt], generation_config(config, overrides, model))
    for chosen in steps:
        piece = stream.add(int(chosen[0]))
        if piece:
            yield piece
        if stream.done:
            break
    stream.done = True
    piece = stream.flush()
    if piece:
        yield piece
