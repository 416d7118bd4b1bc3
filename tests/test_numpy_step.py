"""GPT-2's numpy decoding steps (generation's CPU path) equal transformers: the logits of each new token, for one
prompt and a left-padded pair, across the config options the step reads; and they are taken only where they
apply (float32 GPT-2 LMs in eval mode on the CPU, at most two rows)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import load_reference

import mlx_encoders
from mlx_encoders.generation import generate_ids, numpy_step
from mlx_encoders.generation.loop import forward, left_pad
from mlx_encoders.generation.numpy_step import NumpyDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = {
    "default": {},
    "erf-gelu": dict(activation_function="gelu"),  # through MLX's own function
    "relu": dict(activation_function="relu"),
    "layer-scaled": dict(scale_attn_by_inverse_layer_idx=True),
    "unscaled": dict(scale_attn_weights=False),
    "untied": dict(tie_word_embeddings=False),
}
PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 120]]  # left-padded as a pair: the second row starts with 4 pads
NEW = [11, 3, 250, 64, 9]  # the tokens fed after the prompt, one a step


def transformers_logits(ref, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits of every position of the whole sequence, positions as its `generate` makes them."""
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                  position_ids=torch.tensor(positions).long())  # fmt: skip
    return out.logits.numpy()


@pytest.mark.parametrize("rows", [[0], [0, 1]], ids=["one", "left-padded-pair"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_equal_transformers(checkpoint, name, rows):
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.2, **CONFIGS[name])
    model, ref = mlx_encoders.load_model(folder), load_reference(folder, "causal-lm")
    assert numpy_step.supported(model, len(rows))
    prompt, mask = left_pad([PROMPTS[r] for r in rows], 0)
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    cache = model.make_cache()
    forward(model, prompt, mask, positions, cache)
    decoder = NumpyDecoder(model, cache, prompt.shape[1] + len(NEW))
    ids, full_mask, got = prompt, mask, []
    for token in NEW:
        new = np.full(len(rows), token, np.int32)
        ids = np.concatenate([ids, new[:, None]], axis=1)
        full_mask = np.concatenate([full_mask, np.ones((len(rows), 1), np.int32)], axis=1)
        positions = positions[:, -1:] + 1
        got.append(decoder.step(new, full_mask, positions[:, 0]))
    expected = transformers_logits(ref, ids, full_mask)[:, prompt.shape[1] :]
    got = np.stack(got, axis=1)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=1e-5 * scale, rtol=0)


def test_without_a_mask_positions_follow_the_cache(checkpoint):
    """generate_steps passes no mask for unpadded prompts: positions are the cache's length, as GPT2Model's."""
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.2)
    model, ref = mlx_encoders.load_model(folder), load_reference(folder, "causal-lm")
    prompt = np.array([PROMPTS[0]], np.int32)
    cache = model.make_cache()
    forward(model, prompt, None, None, cache)
    decoder = NumpyDecoder(model, cache, prompt.shape[1] + 2)
    got = [decoder.step(np.array([t], np.int32), None, None) for t in NEW[:2]]
    ids = np.concatenate([prompt, np.array([NEW[:2]], np.int32)], axis=1)
    expected = transformers_logits(ref, ids, np.ones_like(ids))[:, prompt.shape[1] :]
    np.testing.assert_allclose(np.stack(got, axis=1), expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_generation_takes_the_numpy_steps_and_equals_mlx_steps(checkpoint, monkeypatch):
    """Greedy tokens through the numpy steps equal those through MLX's steps (the path GPUs take)."""
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.05)
    model = mlx_encoders.load_model(folder)
    prompt, mask = left_pad(PROMPTS, 0)
    steps = []
    monkeypatch.setattr(NumpyDecoder, "step", lambda self, *a, f=NumpyDecoder.step: steps.append(1) or f(self, *a))
    fast = generate_ids(model, prompt, mask, max_new_tokens=12, eos_token_id=[])
    assert len(steps) == 11  # every token after the first came from a numpy step
    monkeypatch.setattr(numpy_step, "supported", lambda model, batch: False)
    np.testing.assert_array_equal(fast, generate_ids(model, prompt, mask, max_new_tokens=12, eos_token_id=[]))


def test_taken_only_where_it_applies(checkpoint, monkeypatch):
    folder = checkpoint("gpt2", "causal-lm", initializer_range=0.2)
    model = mlx_encoders.load_model(folder)
    assert numpy_step.supported(model, 1) and numpy_step.supported(model, 2)
    assert not numpy_step.supported(model, 3)  # MLX's matrix products share each weight's reading over the rows
    model.train()
    assert not numpy_step.supported(model, 1)  # dropout
    model.eval()
    assert not numpy_step.supported(mlx_encoders.load_model(folder, task="encoder"), 1)
    assert not numpy_step.supported(mlx_encoders.load_model(folder, dtype="bfloat16"), 1)
    quantized = mlx_encoders.load_model(folder)
    nn.quantize(quantized, 32, 8, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[1] % 32 == 0)
    assert not numpy_step.supported(quantized, 1)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # a GPU runs MLX's steps
    assert not numpy_step.supported(model, 1)
