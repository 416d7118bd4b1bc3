"""Rotary positions (`layers.rope`) against each family's transformers rotary embedding at long positions: the angles
of position 8191 are where a last-bit difference in the inverse frequencies shows."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

from mlx_encoders.engine import ops
from mlx_encoders.engine.ops import ROTATION_KEYS, ROTATION_ROWS, rotation_tables
from mlx_encoders.engine.runtime import on_cpu
from mlx_encoders.models import model_module
from mlx_encoders.models.layers import rope, rope_wavelengths

LENGTH = 8192
TINY = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64, vocab_size=100)
# model_type -> (transformers module, config class, rotary class, config keys, layer kinds, (base, scale) from our args)
FAMILIES = {
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3RotaryEmbedding", dict(head_dim=32, num_key_value_heads=1), [None],
              lambda a, k: (a.theta, 1.0)),
    "eurobert": ("eurobert", "EuroBertConfig", "EuroBertRotaryEmbedding", dict(rope_theta=250000.0), [None],
                 lambda a, k: (a.theta, 1.0)),
    "jina_embeddings_v3": ("jina_embeddings_v3", "JinaEmbeddingsV3Config", "JinaEmbeddingsV3RotaryEmbedding", {},
                           [None], lambda a, k: (a.rope_theta, 1.0)),
    "nomic_bert": ("nomic_bert", "NomicBertConfig", "NomicBertRotaryEmbedding", {}, [None],
                   lambda a, k: (a.rope.base_for(LENGTH, 32), 1.0)),
    "gte": ("gte", "GteConfig", "GteRotaryEmbedding", {}, [None], lambda a, k: (a.rope.base_for(LENGTH, 32), 1.0)),
    "modernbert": ("modernbert", "ModernBertConfig", "ModernBertRotaryEmbedding", {},
                   ["full_attention", "sliding_attention"], lambda a, k: (a.rope_theta[k], 1.0)),
    "gemma3_text": ("gemma3", "Gemma3TextConfig", "Gemma3RotaryEmbedding",
                    dict(head_dim=32, num_key_value_heads=1, layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                    ["full_attention", "sliding_attention"], lambda a, k: a.rope[k]),
    "embedding_gemma2_text": ("embedding_gemma2", "EmbeddingGemma2TextConfig", "EmbeddingGemma2RotaryEmbedding",
                              dict(head_dim=32, num_key_value_heads=1, global_head_dim=32),
                              ["full_attention", "sliding_attention"], lambda a, k: (a.rope_theta[k], 1.0)),
}  # fmt: skip


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rope_matches_transformers_at_long_positions(model_type):
    package, config_name, rotary_name, keys, kinds, settings = FAMILIES[model_type]
    config = getattr(transformers, config_name)(**TINY, **keys)
    rotary = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), rotary_name)(config)
    args = model_module(model_type).ModelArgs.from_dict({**config.to_dict(), "model_type": model_type})
    q = torch.randn(1, 2, LENGTH, 32, generator=torch.Generator().manual_seed(0))
    apply = importlib.import_module(f"transformers.models.{package}.modeling_{package}").apply_rotary_pos_emb
    for kind in kinds:
        cos, sin = rotary(q, torch.arange(LENGTH)[None], *([kind] if kind else []))
        expected = apply(q, q, cos, sin)[0].numpy()
        got = np.array(rope(mx.array(q.numpy()), *settings(args, kind)))
        np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), err_msg=f"{model_type} {kind}")


def fallback_rope(x: mx.array, base: float, scale: float = 1.0) -> mx.array:
    """MLX's own mx.fast.rope (its composed form on the CPU) over the same wavelengths."""
    dims = x.shape[-1]
    return mx.fast.rope(
        x, dims, traditional=False, base=None, scale=scale, offset=0, freqs=rope_wavelengths(dims, base)
    )


on_the_cpu = pytest.mark.skipif(not on_cpu(), reason="the rotation tables are the CPU's form (elsewhere mx.fast.rope)")


@on_the_cpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_rope_from_tables_equals_mlx_rope_and_its_gradient(dtype):
    """The CPU's rotation tables give mx.fast.rope's products (their sines and cosines correctly rounded, MLX's within
    an ulp), and the same gradient through the rotation; any length after a longer one reads the grown table, and
    the scale is part of a table's key (same base, two scales)."""
    rng = np.random.default_rng(0)
    for length in (700, 5, 1200):
        x = mx.array(rng.standard_normal((2, 3, length, 64)).astype(np.float32)).astype(dtype)
        for base, scale in ((1e6, 1.0), (1e6, 0.125), (1e4, 0.125)):
            got, expected = (np.array(f(x, base, scale).astype(mx.float32)) for f in (rope, fallback_rope))
            tolerance = 1e-6 if dtype == mx.float32 else 2e-3
            np.testing.assert_allclose(got, expected, atol=tolerance * np.abs(expected).max(), rtol=0)
    cotangent = mx.array(rng.standard_normal((2, 3, 40, 64)).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 3, 40, 64)).astype(np.float32))
    grads = [mx.grad(lambda t, f=f: (f(t, 1e4) * cotangent).sum())(x) for f in (rope, fallback_rope)]
    np.testing.assert_allclose(np.array(grads[0]), np.array(grads[1]), atol=1e-6 * np.abs(np.array(grads[1])).max())


@on_the_cpu
def test_rotation_tables_grow_in_blocks_and_keep_a_bounded_number_of_shapes():
    cos, sin = rotation_tables(3, 16, 777.0, 1.0)
    inverse = 1 / np.array(rope_wavelengths(16, 777.0), np.float32)
    angles = (np.arange(3, dtype=np.float32)[:, None] * inverse).astype(np.float64)
    np.testing.assert_array_equal(np.array(cos), np.cos(angles).astype(np.float32))
    np.testing.assert_array_equal(np.array(sin), np.sin(angles).astype(np.float32))
    assert ops._rotations[16, 777.0, 1.0][0].shape == (ROTATION_ROWS, 8)  # whole blocks
    longer = rotation_tables(ROTATION_ROWS + 1, 16, 777.0, 1.0)
    assert longer[0].shape == (ROTATION_ROWS + 1, 8) and ops._rotations[16, 777.0, 1.0][0].shape == (
        2 * ROTATION_ROWS,
        8,
    )
    again = rotation_tables(3, 16, 777.0, 1.0)  # a slice of the grown table: the same values
    np.testing.assert_array_equal(np.array(again[0]), np.array(cos))
    np.testing.assert_array_equal(np.array(again[1]), np.array(sin))
    for base in range(2 * ROTATION_KEYS):  # a dynamic-NTK base: one shape per input length
        rotation_tables(10, 16, 1000.0 + base, 1.0)
    assert len(ops._rotations) == ROTATION_KEYS and (16, 1000.0 + 2 * ROTATION_KEYS - 1, 1.0) in ops._rotations


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters", "legacy type"])
def test_modernbert_linear_scaling_in_either_spelling_matches_transformers(spelling):
    """An older config's `rope_scaling` applies to both layer kinds, as transformers merges it (where its legacy
    "type" key is ignored: each kind already has a rope_type)."""
    from transformers.models.modernbert import modeling_modernbert

    scaling = {"rope_type": "linear", "factor": 4.0}
    if spelling == "legacy type":
        spelling, scaling = "rope_scaling", {"type": "linear", "factor": 4.0}
    given = (
        {"rope_scaling": scaling}
        if spelling == "rope_scaling"
        else {
            "rope_parameters": {
                k: {**scaling, "rope_theta": t}
                for k, t in (("full_attention", 160000.0), ("sliding_attention", 10000.0))
            }
        }
    )
    config = transformers.ModernBertConfig(**TINY, **given)
    rotary = modeling_modernbert.ModernBertRotaryEmbedding(config)
    args = model_module("modernbert").ModelArgs.from_dict({**TINY, "model_type": "modernbert", **given})
    q = torch.randn(1, 2, 512, 32, generator=torch.Generator().manual_seed(0))
    for kind in ("full_attention", "sliding_attention"):
        cos, sin = rotary(q, torch.arange(512)[None], kind)
        expected = modeling_modernbert.apply_rotary_pos_emb(q, q, cos, sin)[0].numpy()
        got = np.array(rope(mx.array(q.numpy()), args.rope_theta[kind], args.rope_scale[kind]))
        np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), err_msg=kind)
