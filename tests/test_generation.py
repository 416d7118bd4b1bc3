"""Generation equals transformers: greedy tokens of `generate` for single prompts and left-padded batches (eos,
minimum lengths, repetition penalty), each logits processor on random logits, sampling that follows the
processed distribution; then text, streaming, stop strings, the pipeline, the command and bad input."""

import io
import json
import shutil
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from checkpoints import load_reference
from scipy.stats import chisquare
from transformers.generation import logits_process as hf

import mlx_encoders
from mlx_encoders import GenerationConfig, generate, stream_generate
from mlx_encoders.__main__ import main
from mlx_encoders.generation import PRESETS, TextStream, generate_ids, steps
from mlx_encoders.generation import processors as ours
from mlx_encoders.generation.loop import forward, left_pad

PROMPTS = ["The quick brown fox", "Return the value of", "a", "Parse the command line arguments and"]
PAD = 0  # the tokenizer's <|endoftext|>, GPT-2's usual pad


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(checkpoint):
    """(folder, model, tokenizer, transformers' model) of a seeded GPT-2 whose greedy text varies (init 0.05)."""
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.05)
    model, tokenizer = mlx_encoders.load(folder)
    return folder, model, tokenizer, load_reference(folder, "causal-lm")


def prompt_ids(tokenizer, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return left_pad([e.ids for e in tokenizer.encode_batch(prompts)], PAD)


def transformers_generate(ref, ids: np.ndarray, mask: np.ndarray, **kwargs) -> np.ndarray:
    kwargs = {"do_sample": False, "pad_token_id": PAD, **kwargs}
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(), **kwargs)
    return out.numpy()


def an_eos(ref, ids, mask, step: int) -> int:
    """A token greedy decoding of the first prompt first produces at `step` or after (else its first token):
    made eos, it stops that row mid-way while the others go on."""
    tokens = list(transformers_generate(ref, ids, mask, max_new_tokens=12, eos_token_id=None)[0, ids.shape[1] :])
    return int(next((t for i, t in enumerate(tokens) if i >= step and t not in tokens[:i]), tokens[0]))


@pytest.mark.parametrize(
    "batch",
    [[p] for p in PROMPTS[:2]] + [PROMPTS[1:3], PROMPTS],
    ids=["single", "single2", "left-padded-pair", "left-padded"],
)
@pytest.mark.parametrize(
    "options",
    [
        dict(max_new_tokens=12),
        dict(max_new_tokens=12, eos_at=3),
        dict(max_new_tokens=10, eos_at=2, min_new_tokens=6),
        dict(max_length=28, eos_at=2, min_length=26),
        dict(max_new_tokens=12, repetition_penalty=1.5),
        dict(max_new_tokens=12, repetition_penalty=0.7, eos_at=4),
    ],
    ids=["plain", "eos", "min_new_tokens", "max_length,min_length", "repetition_penalty", "penalty<1,eos"],
)
def test_greedy_tokens_equal_transformers(lm, batch, options):
    _, model, tokenizer, ref = lm
    ids, mask = prompt_ids(tokenizer, batch)
    options = dict(options)
    if "eos_at" in options:
        eos = an_eos(ref, ids, mask, options.pop("eos_at"))
        options["eos_token_id"] = eos
    else:
        options["eos_token_id"] = None
    expected = transformers_generate(ref, ids, mask, **options)
    options["eos_token_id"] = options["eos_token_id"] if options["eos_token_id"] is not None else []
    np.testing.assert_array_equal(generate_ids(model, ids, mask, pad_token_id=PAD, **options), expected)


def test_the_models_generation_config_is_the_default_as_in_transformers(lm, tmp_path):
    """generation_config.json's settings apply when a call leaves them unset (transformers' `generate` reads the
    file saved with the model); a call's own options win, and a GenerationConfig given whole replaces the file."""
    folder, _, tokenizer, _ = lm
    copied = shutil.copytree(folder, tmp_path / "lm")
    saved = (
        json.loads((copied / "generation_config.json").read_text())
        if (copied / "generation_config.json").exists()
        else {}
    )
    (copied / "generation_config.json").write_text(json.dumps({**saved, "max_new_tokens": 6, "repetition_penalty": 2.0,
                                                                "pad_token_id": PAD}))  # fmt: skip
    model, ref = mlx_encoders.load_model(copied), load_reference(copied, "causal-lm")
    ids, mask = prompt_ids(tokenizer, PROMPTS[1:3])
    with torch.no_grad():
        expected = ref.generate(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long()).numpy()
    assert expected.shape[1] == ids.shape[1] + 6
    np.testing.assert_array_equal(generate_ids(model, ids, mask), expected)
    assert generate_ids(model, ids, mask, max_new_tokens=3).shape[1] == ids.shape[1] + 3
    assert generate_ids(model, ids, mask, GenerationConfig()).shape[1] == ids.shape[1] + 20
    # save and convert keep the file, as transformers' save_pretrained writes it
    saved = mlx_encoders.save(model, tmp_path / "saved", mlx_encoders.load_tokenizer(model))
    converted = mlx_encoders.convert(copied, tmp_path / "q8", bits=8, group_size=32, calibration=False)
    np.testing.assert_array_equal(generate_ids(mlx_encoders.load_model(saved), ids, mask), expected)
    assert generate_ids(mlx_encoders.load_model(converted), ids, mask).shape == expected.shape  # 8 bits: 6 new
    # the file's sampling settings are the model's: no warning that the caller's options are ignored
    (copied / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_ids(model, ids, mask, do_sample=True, seed=0, max_new_tokens=2)
        generate_ids(model, ids, mask, max_new_tokens=2)
    with pytest.warns(UserWarning, match=r"do_sample is not True, so top_k=3 is ignored"):
        generate_ids(model, ids, mask, top_k=3, max_new_tokens=2)
    (copied / "generation_config.json").write_text(json.dumps({"top_k": -1}))
    with pytest.raises(ValueError, match="generation_config.json: top_k must be an int >= 0"):
        generate_ids(model, ids, mask)
    # settings generate does not apply warn, naming them
    (copied / "generation_config.json").write_text(json.dumps({"no_repeat_ngram_size": 2, "typical_p": 1.0}))
    with pytest.warns(UserWarning, match=r"sets no_repeat_ngram_size=2, which generate does not apply"):
        generate_ids(model, ids, mask, max_new_tokens=2)
    # a preset or a GenerationConfig keeps the file's end ids, as transformers fills a given config's unset ones
    first = int(generate_ids(model, ids[:1], mask[:1], max_new_tokens=1)[0, -1])
    (copied / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    for config in ("greedy", GenerationConfig(max_new_tokens=5)):
        assert generate_ids(model, ids[:1], mask[:1], config).shape[1] == ids.shape[1] + 1  # stops at that id
    # without a length, 20 new tokens or fewer where the positions run out, as transformers caps them
    (copied / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))  # no end: all the room
    long = np.ones((1, model.args.max_tokens - 5), np.int32) * ids[0, -1]
    assert generate_ids(model, long, np.ones_like(long)).shape[1] == model.args.max_tokens


def test_the_last_new_token_needs_no_position(lm):
    """It is not read back: a prompt n - 4 tokens long takes 5 new tokens as transformers' generate gives them, and
    6 are refused (transformers fails on a position past its table)."""
    _, model, _, ref = lm
    n = model.args.max_tokens
    ids = (np.arange(n - 4, dtype=np.int32) % 200 + 5)[None]
    mask = np.ones_like(ids)
    expected = transformers_generate(ref, ids, mask, max_new_tokens=5, eos_token_id=None)
    np.testing.assert_array_equal(generate_ids(model, ids, mask, max_new_tokens=5, eos_token_id=[]), expected)
    with pytest.raises(ValueError, match=f"A prompt of {n - 4} tokens leaves room for 5 new tokens"):
        generate_ids(model, ids, mask, max_new_tokens=6)


def test_eos_ends_every_row_and_pads_the_finished(lm):
    _, model, tokenizer, ref = lm
    ids, mask = prompt_ids(tokenizer, PROMPTS)
    eos = an_eos(ref, ids, mask, 1)
    tokens = generate_ids(model, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=PAD)
    np.testing.assert_array_equal(tokens, transformers_generate(ref, ids, mask, max_new_tokens=30, eos_token_id=eos))
    first = list(tokens[0, ids.shape[1] :])
    assert set(first[first.index(eos) + 1 :]) <= {PAD}


STEP_CONFIGS = {
    "default": {},
    "erf-gelu": dict(activation_function="gelu"),
    "relu": dict(activation_function="relu"),
    "layer-scaled": dict(scale_attn_by_inverse_layer_idx=True),
    "unscaled": dict(scale_attn_weights=False),
    "untied": dict(tie_word_embeddings=False),
}
STEP_PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 120]]  # left-padded as a pair: the second row starts with 4 pads
FED = [11, 3, 250, 64, 9]  # the tokens fed after the prompt, one a step


def transformers_logits(ref, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits of every position of the whole sequence, positions as its `generate` makes them."""
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                  position_ids=torch.tensor(positions).long())  # fmt: skip
    return out.logits.numpy()


@pytest.mark.parametrize("block", [steps.BLOCK, 4], ids=["one-length", "growing-lengths"])
@pytest.mark.parametrize("padded", [False, True], ids=["one-unmasked", "left-padded-pair"])
@pytest.mark.parametrize("name", list(STEP_CONFIGS))
def test_compiled_steps_equal_transformers(checkpoint, monkeypatch, name, padded, block):
    """The logits of each compiled decoding step, across the config options the forward pass reads; without a
    mask (an unpadded prompt) positions follow the cache's length. With a small block, the attention length
    grows across the steps (one compiled function per length) and ends at the buffers' capacity."""
    monkeypatch.setattr(steps, "BLOCK", block)
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.2, **STEP_CONFIGS[name])
    model, ref = mlx_encoders.load_model(folder), load_reference(folder, "causal-lm")
    prompt, mask = left_pad(STEP_PROMPTS if padded else STEP_PROMPTS[:1], 0)
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0) if padded else None
    cache = model.make_cache()
    forward(model, prompt, mask if padded else None, positions, cache)
    decoder = steps.CompiledSteps(model, cache, prompt.shape[1] + len(FED))
    ids, full_mask, got = prompt, mask, []
    for token in FED:
        new = np.full(len(prompt), token, np.int32)
        ids = np.concatenate([ids, new[:, None]], axis=1)
        full_mask = np.concatenate([full_mask, np.ones((len(prompt), 1), np.int32)], axis=1)
        if padded:
            positions = positions[:, -1:] + 1
            got.append(np.array(decoder.step(mx.array(new), full_mask, positions[:, 0])))
        else:
            got.append(np.array(decoder.step(mx.array(new), None, None)))
    expected = transformers_logits(ref, ids, full_mask)[:, prompt.shape[1] :]
    np.testing.assert_allclose(np.stack(got, axis=1), expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize("variant", ["float32", "8-bit"])
def test_generation_takes_the_compiled_steps_and_equals_the_forward_pass(checkpoint, monkeypatch, variant):
    """Greedy tokens through the compiled steps equal those of the plain forward pass with the growing cache
    (the path of models in training mode), quantized models too."""
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.05)
    model = mlx_encoders.load_model(folder)
    if variant == "8-bit":
        nn.quantize(model, 32, 8, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[1] % 32 == 0)
    prompt, mask = left_pad(STEP_PROMPTS, 0)
    taken = []
    monkeypatch.setattr(
        steps.CompiledSteps, "step", lambda self, *a, f=steps.CompiledSteps.step: taken.append(1) or f(self, *a)
    )
    fast = generate_ids(model, prompt, mask, max_new_tokens=12, eos_token_id=[])
    assert len(taken) == 11  # every token after the first came from a compiled step
    monkeypatch.setattr(steps, "applies", lambda model: False)
    np.testing.assert_array_equal(fast, generate_ids(model, prompt, mask, max_new_tokens=12, eos_token_id=[]))


def test_compiled_steps_only_in_eval_mode(checkpoint):
    model = mlx_encoders.load_model(checkpoint("gpt2", "causal-lm", initializer_range=0.2))
    assert steps.applies(model)
    model.train()
    assert not steps.applies(model)  # dropout draws a new mask each call


def random_case(seed: int, vocab: int = 50):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((4, vocab)).astype(np.float32) * 3
    input_ids = rng.integers(0, vocab, (4, 9))
    return input_ids, scores


PROCESSORS = {
    "temperature": (ours.Temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
    "top_k": (ours.TopK(5), hf.TopKLogitsWarper(5)),
    "top_k>vocab": (ours.TopK(80), hf.TopKLogitsWarper(80)),
    "top_p=0.8": (ours.TopP(0.8), hf.TopPLogitsWarper(0.8)),
    "top_p=0.05": (ours.TopP(0.05), hf.TopPLogitsWarper(0.05)),
    "top_p=1": (ours.TopP(1.0), hf.TopPLogitsWarper(1.0)),
    "repetition_penalty": (ours.RepetitionPenalty(1.3), hf.RepetitionPenaltyLogitsProcessor(1.3)),
    "repetition_penalty,padding": (
        ours.RepetitionPenalty(0.8, mx.array([0, 3, 8, 1])),
        hf.RepetitionPenaltyLogitsProcessor(0.8, prompt_ignore_length=torch.tensor([0, 3, 8, 1])),
    ),
    "min_new_tokens": (ours.MinNewTokens(5, 6, [3, 7]), hf.MinNewTokensLengthLogitsProcessor(5, 6, [3, 7])),
    "min_new_tokens,reached": (ours.MinNewTokens(5, 4, [3]), hf.MinNewTokensLengthLogitsProcessor(5, 4, [3])),
    "min_length": (ours.MinLength(10, [3, 7]), hf.MinLengthLogitsProcessor(10, [3, 7])),
}


@pytest.mark.parametrize("name", PROCESSORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_processor_equals_transformers(name, seed):
    mine, theirs = PROCESSORS[name]
    input_ids, scores = random_case(seed)
    expected = theirs(torch.tensor(input_ids), torch.tensor(scores)).numpy()
    got = np.array(mine(mx.array(input_ids), mx.array(scores)))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_processors_follow_transformers_order():
    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=10, top_p=0.9, repetition_penalty=1.2,
                              min_new_tokens=2, min_length=3)  # fmt: skip
    names = [type(p).__name__ for p in ours.processors(config, 4, None, [0])]
    assert names == ["RepetitionPenalty", "MinLength", "MinNewTokens", "Temperature", "TopK", "TopP"]
    with pytest.warns(UserWarning, match="is ignored"):  # greedy keeps the sampling values but does not use them
        greedy = config.replace(do_sample=False)
    assert [type(p).__name__ for p in ours.processors(greedy, 4, None, [0])][-1] == "MinNewTokens"


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7, top_k=0),
        dict(top_k=4),
        dict(top_p=0.8, top_k=0),
        dict(temperature=1.5, top_k=6, top_p=0.9),
    ],
)
def test_sampled_tokens_follow_the_processed_distribution(options):
    """Chi-square test of 40,000 draws on a vocabulary of 10: frequencies match softmax(processed scores), and
    tokens top-k / top-p removed are never drawn."""
    config = GenerationConfig(do_sample=True, **options)
    scores = mx.array(np.random.default_rng(3).standard_normal((1, 10)).astype(np.float32))
    for process in ours.processors(config, 1, None, []):
        scores = process(mx.zeros((1, 1), mx.int32), scores)
    probabilities = np.array(mx.softmax(scores, axis=-1))[0]
    draws = 40_000
    tokens = np.array(ours.select(mx.broadcast_to(scores, (draws, 10)), True, mx.random.key(7)))
    counts = np.bincount(tokens, minlength=10)
    kept = probabilities > 0
    assert counts[~kept].sum() == 0
    assert kept.sum() < 10 or not (options.get("top_k") or options.get("top_p", 1) < 1)
    expected = probabilities[kept].astype(np.float64)
    assert chisquare(counts[kept], draws * expected / expected.sum()).pvalue > 1e-3


def test_sampling_is_reproducible_with_a_seed(lm):
    _, model, tokenizer, _ = lm
    a = generate(model, tokenizer, PROMPTS, "sample", max_new_tokens=12, seed=3, temperature=1.5)
    assert a == generate(model, tokenizer, PROMPTS, "sample", max_new_tokens=12, seed=3, temperature=1.5)
    assert a != generate(model, tokenizer, PROMPTS, "sample", max_new_tokens=12, seed=4, temperature=1.5)


def test_none_turns_top_k_and_the_minimum_lengths_off_as_in_transformers(lm):
    """A keyword of None is off (top_k 0); a GenerationConfig's None field is unset, its default, as transformers
    fills a generation config's None fields from the defaults."""
    _, model, tokenizer, _ = lm
    config = GenerationConfig(do_sample=True, top_k=None, min_new_tokens=None, min_length=None, seed=0)
    assert (config.top_k, config.min_new_tokens, config.min_length) == (50, 0, 0)
    assert generate(model, tokenizer, "hi", do_sample=True, top_k=None, seed=0) == generate(
        model, tokenizer, "hi", do_sample=True, top_k=0, seed=0
    )


@pytest.mark.parametrize("option", ["do_sample", "temperature", "top_p", "repetition_penalty"])
def test_none_leaves_the_sampling_settings_unset_as_in_transformers(lm, option):
    """generate(temperature=None) (a caller passing its own optional argument on) is transformers' default."""
    _, model, tokenizer, ref = lm
    ids, mask = prompt_ids(tokenizer, PROMPTS)
    expected = transformers_generate(ref, ids, mask, max_new_tokens=6, **{option: None})
    np.testing.assert_array_equal(generate_ids(model, ids, mask, max_new_tokens=6, **{option: None}), expected)
    assert getattr(GenerationConfig(**{option: None}), option) == getattr(GenerationConfig(), option)


def test_presets():
    assert set(PRESETS) == {"greedy", "sample", "top-k", "nucleus"}
    nucleus = GenerationConfig.preset("nucleus", max_new_tokens=5)
    assert nucleus.do_sample and nucleus.top_p == 0.9 and nucleus.top_k == 0 and nucleus.max_new_tokens == 5
    with pytest.raises(ValueError, match="Unknown preset 'beam'"):
        GenerationConfig.preset("beam")


@pytest.mark.parametrize(
    "options", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9), dict(temperature=0.5, top_k=3)]
)
def test_sampling_options_without_sampling_warn_as_in_transformers(options):
    """transformers flags these in greedy mode (strict validate raises, else it logs); ours warns, naming them."""
    with pytest.raises(ValueError, match="only used in sample-based generation"):
        transformers.GenerationConfig(**options).validate(strict=True)
    with pytest.warns(UserWarning, match=f"do_sample is not True, so {next(iter(options))}=.* is ignored"):
        GenerationConfig(**options)
    with pytest.warns(UserWarning, match="seed=3 is ignored"):
        GenerationConfig(seed=3)  # transformers has no seed option; ours is equally unused without sampling


def test_defaults_and_sampling_do_not_warn(recwarn):
    transformers.GenerationConfig(top_k=50, temperature=1.0).validate(strict=True)
    GenerationConfig(top_k=50, temperature=1.0)
    GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=1)
    GenerationConfig.preset("nucleus", seed=2)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_several_greedy_sequences_are_refused_as_in_transformers(lm):
    folder, _, _, _ = lm
    with pytest.raises(ValueError, match="num_return_sequences.* different than 1 .got 3"):
        transformers.GenerationConfig(num_return_sequences=3).validate()
    ours_ = mlx_encoders.pipeline("text-generation", model=folder)
    with pytest.raises(ValueError, match=r"num_return_sequences different than 1 \(got 3\); set do_sample=True"):
        ours_(PROMPTS[0], num_return_sequences=3, max_new_tokens=2)


def test_an_ignored_sampling_option_is_reported_at_the_callers_line(lm):
    """The warning points at the user's call, however many of the package's frames lie between."""
    _, model, tokenizer, _ = lm
    with pytest.warns(UserWarning, match="do_sample is not True, so seed=0 is ignored") as caught:
        generate(model, tokenizer, PROMPTS[0], "greedy", seed=0, max_new_tokens=2)
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    with pytest.warns(UserWarning, match="temperature=0.5 is ignored") as caught:
        GenerationConfig(temperature=0.5)
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
        (dict(do_sample=True, temperature=float("inf")), "temperature must be a finite number, got inf"),
        (dict(temperature=-1.0), "temperature must be > 0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
        (dict(do_sample=True, top_p=float("nan")), "top_p must be a finite number"),
    ],
)
def test_non_finite_or_out_of_range_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**options)


def test_text_is_the_pipelines_continuation(lm):
    """generate's text equals the continuation transformers' text-generation pipeline returns, batched too."""
    folder, model, tokenizer, ref = lm
    theirs = transformers.pipeline("text-generation", model=ref, tokenizer=str(folder))
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    expected = [theirs(p, return_full_text=False, **options)[0]["generated_text"] for p in PROMPTS[:2]]
    assert generate(model, tokenizer, PROMPTS[:2], max_new_tokens=10, eos_token_id=[]) == expected
    assert generate(model, tokenizer, PROMPTS[0], max_new_tokens=10, eos_token_id=[]) == expected[0]
    # an eos that is not a special token ends the text with its own, as the pipeline decodes it
    first = tokenizer.encode_batch([expected[0]], add_special_tokens=False)[0].ids[2]
    options = {**options, "eos_token_id": first}
    cut = theirs(PROMPTS[0], return_full_text=False, **options)[0]["generated_text"]
    assert generate(model, tokenizer, PROMPTS[0], max_new_tokens=10, eos_token_id=first) == cut
    assert cut and cut.endswith(tokenizer.decode([first])) and cut != expected[0]


def test_pipeline(lm):
    folder, _, _, ref = lm
    ours_ = mlx_encoders.pipeline("text-generation", model=folder, batch_size=2)
    theirs = transformers.pipeline("text-generation", model=ref, tokenizer=str(folder))
    options = dict(max_new_tokens=8, eos_token_id=None)
    got = ours_(PROMPTS[:3], **{**options, "eos_token_id": []})
    expected = [theirs(p, do_sample=False, pad_token_id=PAD, **options) for p in PROMPTS[:3]]
    assert got == expected
    assert ours_(PROMPTS[0], max_new_tokens=8, eos_token_id=[]) == expected[0]
    short = ours_(PROMPTS[0], return_full_text=False, max_new_tokens=8, eos_token_id=[])
    assert short == [{"generated_text": expected[0][0]["generated_text"][len(PROMPTS[0]) :]}]
    # max_length counts each prompt's own tokens, as transformers' pipeline runs one prompt at a time
    lengths = {len(ours_.tokenizer.encode_batch([p])[0].ids) for p in PROMPTS[:3]}
    assert len(lengths) > 1  # prompts of other lengths share a batch
    by_length = ours_(PROMPTS[:3], max_length=max(lengths) + 4, eos_token_id=[])
    alone = [theirs(p, do_sample=False, pad_token_id=PAD, max_length=max(lengths) + 4) for p in PROMPTS[:3]]
    assert by_length == alone
    three = ours_(PROMPTS[0], num_return_sequences=3, do_sample=True, seed=0, max_new_tokens=8)
    assert len(three) == 3 and all(r["generated_text"].startswith(PROMPTS[0]) for r in three)
    with pytest.raises(ValueError, match="needs a causal-lm head"):
        mlx_encoders.pipeline("text-generation", model=(mlx_encoders.load_model(folder, task="encoder"), None))


def test_stream_pieces_join_to_the_text(lm):
    _, model, tokenizer, _ = lm
    text = generate(model, tokenizer, PROMPTS[1], max_new_tokens=20, eos_token_id=[])
    pieces = list(stream_generate(model, tokenizer, PROMPTS[1], max_new_tokens=20, eos_token_id=[]))
    assert "".join(pieces) == text and len(pieces) > 1


def test_stream_shows_whole_characters_only(lm):
    """Byte-level tokens of multi-byte characters, one byte at a time: no piece holds half a character."""
    _, _, tokenizer, _ = lm
    text = "naïve café, 12 µs 🙂 done"
    byte_tokens = [tokenizer.backend.token_to_id(t) for t in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)
                   for t in t[0]]  # fmt: skip
    stream = TextStream(tokenizer, tokenizer.encode_batch(["Say:"])[0].ids, [], None)
    pieces = [stream.add(t) for t in byte_tokens]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and "" in pieces  # some bytes had to wait for the rest of their character


def test_stop_strings_end_the_text_before_them(lm):
    _, model, tokenizer, _ = lm
    options = dict(max_new_tokens=20, eos_token_id=[], seed=0, temperature=3.0)  # sampled: varied text
    full = generate(model, tokenizer, PROMPTS, "sample", **options)
    start = next(i for i in range(4, 15) if full[0].find(full[0][i : i + 3]) == i)
    stop = full[0][start : start + 3]
    cut = generate(model, tokenizer, PROMPTS, "sample", **options, stop=[stop, "never there"])
    for whole, part in zip(full, cut, strict=True):
        assert part == (whole[: whole.index(stop)] if stop in whole else whole)
    one = generate(model, tokenizer, PROMPTS[0], "sample", **options)
    stop = one[start : start + 3]
    pieces = list(stream_generate(model, tokenizer, PROMPTS[0], "sample", **options, stop=stop))
    assert "".join(pieces) == one[: one.index(stop)]


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda m, t: generate(m, t, ""), ValueError, r"Prompt 0 \(''\) is empty"),
        (lambda m, t: generate(m, t, ["fine", ""]), ValueError, "Prompt 1 .* is empty"),
        (lambda m, t: generate(m, t, []), ValueError, "at least one prompt"),
        (lambda m, t: generate(m, t, "word " * 30), ValueError, r"Prompt 0 has \d+ tokens, more than the model's 64"),
        (lambda m, t: generate(m, t, "word " * 15, max_new_tokens=60), ValueError, r"leaves room for \d+ new tokens"),
        (lambda m, t: generate(m, t, "word " * 15, max_length=10), ValueError, "max_length=10 leaves no room"),
        (lambda m, t: generate(m, t, "hi", top_p=0), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda m, t: generate(m, t, "hi", top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda m, t: generate(m, t, "hi", do_sample=True, temperature=0), ValueError, "temperature must be > 0"),
        (lambda m, t: generate(m, t, "hi", max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0"),
        (lambda m, t: generate(m, t, "hi", max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
        (lambda m, t: generate(m, t, "hi", top_k=-1), ValueError, "top_k must be an int >= 0"),
        (lambda m, t: generate(m, t, "hi", beams=2), TypeError, "Unknown generation option.*beams"),
        (lambda m, t: generate(m, t, "hi", stop=""), ValueError, "stop strings must not be empty"),
        (lambda m, t: generate(m, t, "hi", stop=["x", 3]), TypeError, "stop must be a non-empty string"),
        (lambda m, t: generate(m, t, "hi", do_sample=True, seed=2**64), ValueError, r"seed must be below 2\*\*64"),
        (lambda m, t: generate(m, t, "hi", config=3), TypeError, "config must be a GenerationConfig"),
        (lambda m, t: generate(m, t, "hi", pad_token_id=512), ValueError, "pad_token_id 512 .* outside the vocab"),
        (lambda m, t: stream_generate(m, t, ["a", "b"]).__next__(), TypeError, "takes one prompt"),
    ],
)
def test_bad_input_fails_clearly(lm, call, error, message):
    _, model, tokenizer, _ = lm
    with pytest.raises(error, match=message):
        call(model, tokenizer)


def test_only_language_models_generate(checkpoint, lm):
    _, _, tokenizer, _ = lm
    encoder = mlx_encoders.load_model(checkpoint("gpt2", "causal-lm", initializer_range=0.05), task="encoder")
    with pytest.raises(TypeError, match="GPT2Model is not a causal language model"):
        generate(encoder, tokenizer, "hi")


def test_generate_command_streams_the_text(lm, capsys, monkeypatch):
    folder, model, tokenizer, _ = lm
    expected = generate(model, tokenizer, PROMPTS[0], max_new_tokens=9, eos_token_id=[])
    assert main(["generate", "--model", str(folder), "--max-new-tokens", "9", PROMPTS[0]]) == 0
    out = capsys.readouterr()
    assert out.out == PROMPTS[0] + expected + "\n"
    assert "prompt tokens" in out.err and "9 generated" in out.err
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPTS[0]))
    assert main(["generate", "-m", str(folder), "--preset", "nucleus", "--seed", "1", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith(PROMPTS[0])
    # stdin's byte-order mark and Windows line ends are no part of the prompt, as for the other commands
    monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeff" + PROMPTS[0].replace(" ", "\r\n", 1)))
    assert main(["generate", "-m", str(folder), "--max-new-tokens", "9"]) == 0
    out = capsys.readouterr()
    prompt = PROMPTS[0].replace(" ", "\n", 1)
    assert out.out == prompt + generate(model, tokenizer, prompt, max_new_tokens=9, eos_token_id=[]) + "\n"
    assert main(["generate", "-m", str(folder), "--top-p", "2", "hi"]) == 2  # a refused option
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--repetition-penalty", "inf"], "repetition_penalty must be a finite number"),
        (["--max-new-tokens", "60"], "leaves room for"),  # found by the model's length, after loading
    ],
)
def test_generate_command_validates_before_printing(lm, capsys, flags, message):
    folder, _, _, _ = lm
    refused_option = "--max-new-tokens" not in flags  # the options alone: 2; the model's length: 1
    assert main(["generate", "-m", str(folder), *flags, "word " * 15]) == (2 if refused_option else 1)
    out = capsys.readouterr()
    assert out.out == "" and message in out.err


def test_generate_command_warns_of_ignored_sampling_options(lm, capsys):
    folder, _, _, _ = lm
    with pytest.warns(UserWarning, match="temperature=0.7 is ignored .greedy decoding.*--preset sample"):
        assert main(["generate", "-m", str(folder), "--temperature", "0.7", "--max-new-tokens", "2", "hi"]) == 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
def test_sampling_at_a_temperature_near_zero_is_greedy(lm, temperature):
    """A temperature so small that scores / temperature overflows float32 (or that float32 holds as 0): the best
    token, as temperatures approaching 0 tend to, never the first token with a positive score."""
    _, model, tokenizer, _ = lm
    ids, mask = prompt_ids(tokenizer, ["The quick brown fox", "A"])
    greedy = generate_ids(model, ids, mask, max_new_tokens=8, pad_token_id=PAD)
    sampled = generate_ids(model, ids, mask, max_new_tokens=8, pad_token_id=PAD, do_sample=True, top_k=0,
                           temperature=temperature, seed=0)  # fmt: skip
    np.testing.assert_array_equal(sampled, greedy)
