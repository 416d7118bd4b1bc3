"""Quantized models on the CPU run through dequantize-then-BLAS (mlx_encoders/engine/quantized.py): the same outputs
as MLX's own quantized kernels for every architecture and every bit width and group size (see SETTINGS), and
gradients through it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from checkpoints import CONFIGS
from mlx.utils import tree_flatten

import mlx_encoders.engine.quantized as quantized
from mlx_encoders import load_model
from mlx_encoders.models import DECODER_TYPES, MODEL_TYPES, model_class, model_module
from mlx_encoders.quantization import quantize_model

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
# Widths that every group size divides, so that each Linear and Embedding is quantized.
WIDE = {
    "bert": dict(hidden_size=128, intermediate_size=256),
    "roberta": dict(hidden_size=128, intermediate_size=256),
    "xlm-roberta": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4),
    "distilbert": dict(dim=128, hidden_dim=256),
    "albert": dict(embedding_size=128, hidden_size=128, intermediate_size=256),
    "modernbert": dict(hidden_size=128, intermediate_size=128),
    "mpnet": dict(hidden_size=128, intermediate_size=256),  # relative_attention_bias (buckets, heads) stays float
    "electra": dict(embedding_size=128, hidden_size=256, intermediate_size=256),
    "deberta-v2": dict(hidden_size=128, intermediate_size=256),
    "deberta": dict(hidden_size=128, intermediate_size=256),
    "nomic_bert": dict(hidden_size=128, intermediate_size=256),
    "gte": dict(hidden_size=128, intermediate_size=256),
    "eurobert": dict(hidden_size=128, intermediate_size=256),
    "jina_embeddings_v3": dict(hidden_size=128, intermediate_size=256),
    "gpt2": dict(n_embd=128, n_inner=256),
    "qwen3": dict(hidden_size=128, intermediate_size=256, head_dim=32),
}
TASKS = {"gpt2": "causal-lm"}
# The unpacking per (bits, group size) is architecture-independent (test_dequantize_is_mlx_dequantize): the full grid
# runs on bert and gpt2, each other architecture takes two settings in turn, so every setting meets one of them too.
GRID = [(bits, group_size) for bits in BITS for group_size in GROUP_SIZES]
FULL_GRID = ("bert", "gpt2")
_OTHERS = [t for t in [*MODEL_TYPES, *DECODER_TYPES] if t not in FULL_GRID]
SETTINGS = {t: GRID for t in FULL_GRID} | {
    t: [GRID[2 * j % len(GRID)], GRID[(2 * j + 1) % len(GRID)]] for j, t in enumerate(_OTHERS)
}


def outputs(model: nn.Module, ids: mx.array) -> mx.array:
    out = model(ids)
    return out.last_hidden_state if out.last_hidden_state is not None else out.logits


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_dequantize_is_mlx_dequantize(bits, group_size):
    w = mx.random.normal((48, 256), key=mx.random.key(bits))
    packed, scales, biases = mx.quantize(w, group_size, bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    expected = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    assert mx.array_equal(quantized.dequantize(packed, scales, biases, group_size, bits, "affine"), expected)


def random_model(model_type: str) -> nn.Module:
    """A seeded random float32 model of the architecture (its test config, widened), built in code."""
    config = {**CONFIGS[model_type], **WIDE[model_type], "model_type": model_type, "vocab_size": 256}
    mx.random.seed(0)
    model = model_class(model_type, TASKS.get(model_type, "encoder"))(
        model_module(model_type).ModelArgs.from_dict(config)
    )
    model.eval()
    return model


def float32_scales(model: nn.Module) -> None:
    """Widen the stored float16 scales and biases, so that MLX's kernels, like the fast path, compute in float32
    (MLX's quantized embedding returns its scales' dtype)."""
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales, module.biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, *DECODER_TYPES])
def test_fast_path_equals_mlx_kernels(model_type, monkeypatch):
    """Bit widths and group sizes (SETTINGS), on each architecture: the fast path is within float32 rounding of MLX's
    kernels, far inside the quantization's own error (the distance to the float model)."""
    assert model_type in WIDE, f"add {model_type}'s widths (multiples of 128) to WIDE"
    ids = mx.array([[3, 17, 42, 5, 9, 11, 60, 7], [3, 8, 25, 33, 2, 19, 50, 6]])
    reference = outputs(random_model(model_type), ids)
    for bits, group_size in SETTINGS[model_type]:
        model = random_model(model_type)
        quantize_model(model, bits=bits, group_size=group_size, recipe={"*": bits})
        assert all(type(m) is not nn.Linear for _, m in model.named_modules()), (bits, group_size)
        float32_scales(model)
        fast = outputs(model, ids)
        with monkeypatch.context() as m:
            m.setattr(quantized, "on_cpu", lambda: False)
            mlx = outputs(model, ids)
        difference = mx.abs(fast - mlx).max().item()
        quantization_error = mx.abs(mlx - reference).max().item()
        assert difference <= 1e-5 * mx.abs(mlx).max().item() + 1e-3 * quantization_error, (
            bits, group_size, difference, quantization_error,
        )  # fmt: skip


@pytest.mark.parametrize("mode", ["affine", "mxfp4", "mxfp8", "nvfp4"])
def test_every_mode_and_a_5_bit_grid_equal_mlx_kernels(mode):
    """The modes (and widths) that `mx.dequantize` unpacks on the fast path, linear and embedding alike."""
    settings = dict(bits=5, group_size=32) if mode == "affine" else {}
    linear = nn.QuantizedLinear.from_linear(nn.Linear(128, 96), mode=mode, **settings)
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 128), mode=mode, **settings)
    x, ids = mx.random.normal((5, 128)), mx.array([[1, 7, 49]])
    for module, fast, inputs in [
        (linear, quantized.QuantizedLinear, x),
        (embedding, quantized.QuantizedEmbedding, ids),
    ]:
        expected = type(module).__call__(module, inputs).astype(mx.float32)
        assert mx.allclose(fast.__call__(module, inputs), expected, rtol=1e-5, atol=1e-5), (mode, fast)


def test_loaded_quantized_checkpoint_uses_fast_path(checkpoint, tmp_path):
    from mlx_encoders import save

    model = load_model(checkpoint("bert"))
    quantize_model(model, bits=4, group_size=32)
    model = load_model(save(model, tmp_path / "q"))
    kinds = {type(m) for _, m in model.named_modules()}
    assert {quantized.QuantizedLinear, quantized.QuantizedEmbedding} <= kinds
    assert nn.QuantizedLinear not in kinds and nn.QuantizedEmbedding not in kinds


def test_gradients_flow_to_inputs_and_adapters_not_weights():
    """QLoRA: a frozen quantized linear plus trainable low-rank adapters; the fast path's gradients equal those
    through MLX's kernel (nn.QuantizedLinear's own __call__)."""
    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 96), group_size=32, bits=4)
    assert [k for k, _ in tree_flatten(layer.trainable_parameters())] == ["bias"]  # weight, scales, biases frozen
    adapters = {"a": 0.1 * mx.random.normal((4, 128)), "b": 0.1 * mx.random.normal((96, 4))}
    x = mx.random.normal((5, 128))

    def loss(x, adapters, kind):
        y = kind.__call__(layer, x) + (x @ adapters["a"].T) @ adapters["b"].T
        return (y * y).sum()

    grad = mx.grad(loss, argnums=(0, 1))
    expected = tree_flatten(grad(x, adapters, nn.QuantizedLinear))
    found = tree_flatten(grad(x, adapters, quantized.QuantizedLinear))
    for (name, e), (_, f) in zip(expected, found, strict=True):
        assert mx.allclose(e, f, rtol=1e-4, atol=1e-4), name


@pytest.mark.cpu_only("the CPU path's own vjp")
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_path_gradients_of_scales_and_biases_equal_the_float_reconstructions(bits):
    """The CPU path's vjp recomputes the dequantized weight; its scale and bias gradients must equal those of
    W = scale * code + bias written out with MLX's own dequantize of unit scales (codes) as a plain graph."""
    layer = nn.QuantizedLinear.from_linear(nn.Linear(64, 24), group_size=32, bits=bits)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    scales, biases = layer.scales.astype(mx.float32), layer.biases.astype(mx.float32)
    ones, zeros = mx.ones_like(layer.scales), mx.zeros_like(layer.biases)
    codes = mx.dequantize(layer.weight, ones, zeros, 32, bits).astype(mx.float32).reshape(24, 2, 32)

    def reference(s, b):
        w = (codes * s[..., None] + b[..., None]).reshape(24, 64)
        return ((x @ w.T) ** 2).sum()

    def fast(s, b):
        return (quantized.quantized_matmul(x, layer.weight, s, b, 32, bits, "affine") ** 2).sum()

    expected = mx.grad(reference, argnums=(0, 1))(scales, biases)
    found = mx.grad(fast, argnums=(0, 1))(scales, biases)
    for e, f in zip(expected, found, strict=True):
        assert mx.allclose(e, f, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.array(fast(scales, biases)), np.array(reference(scales, biases)), rtol=1e-5)


@pytest.mark.cpu_only("a GPU takes MLX's kernel for every row count")
@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 32)])
def test_few_rows_take_mlx_kernel_and_agree_with_the_blas_path(bits, group_size, monkeypatch):
    """Decoding one token per sequence: up to KERNEL_ROWS rows go through MLX's kernel (float32 scales), more
    through dequantize-then-BLAS; both equal the float32 matmul of the dequantized weight."""
    layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 96), group_size=group_size, bits=bits)
    weight = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size, bits)
    calls = []
    kernel = mx.quantized_matmul
    monkeypatch.setattr(quantized.mx, "quantized_matmul", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    for rows in (1, quantized.KERNEL_ROWS, quantized.KERNEL_ROWS + 1):
        x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
        got = quantized.QuantizedLinear.__call__(layer, x)
        np.testing.assert_allclose(np.array(got), np.array(x @ weight.T + layer.bias), atol=2e-5, rtol=1e-5)
    assert calls == [(1, 1, 256), (quantized.KERNEL_ROWS, 1, 256)]


@pytest.mark.cpu_only("the shared float copies serve the CPU's lanes")
@pytest.mark.parametrize("model_type", ["bert", "gpt2"])
def test_shared_dequantized_passes_equal_their_own_and_dequantize_each_weight_once_a_group(model_type, monkeypatch):
    """Inside shared_dequantized, the passes of a group (SentenceEncoder's lanes) share each weight's float copy:
    the same outputs as passes that dequantize for themselves; each weight dequantized once a group, by its first
    pass; the copies forgotten once the group is built."""
    model = random_model(model_type)
    quantize_model(model, bits=4, group_size=32, recipe={"*": 4})
    batches = [mx.array([[3, 17, 42, 5, 9, 11]]), mx.array([[8, 25, 33, 2, 19, 50], [1, 2, 3, 4, 5, 6]])]
    own = [outputs(model, ids) for ids in batches]
    made, ready, used = [], [], set()  # ids of the packed weights dequantized; per product, whether its copy existed
    dequantize = quantized.dequantize
    monkeypatch.setattr(quantized, "dequantize", lambda w, *args: made.append(id(w)) or dequantize(w, *args))
    with quantized.shared_dequantized() as shared:
        matmul = shared.matmul

        def recording(x, arguments):
            ready.append(id(arguments[0]) in shared.weights)
            used.add(id(arguments[0]))
            return matmul(x, arguments)

        shared.matmul = recording
        for _ in range(2):  # a second group dequantizes again
            made.clear()
            built = []
            for ids in batches:
                ready.clear()
                built.append(outputs(model, ids))
                if ids is batches[0]:  # the first pass makes the copies
                    assert len(ready) == len(used) > 5 and not any(ready)
                else:
                    assert all(ready) and len(ready) == len(used)
            assert sorted(w for w in made if w in used) == sorted(used)  # each once a group
            shared.next_group()
            assert not shared.weights  # the copies now live only as long as the passes that use them
            for got, expected in zip(built, own, strict=True):
                assert mx.array_equal(got, expected)
    assert getattr(quantized._SHARING, "weights", None) is None  # outside the block: each pass its own copies again


def test_grids_of_a_bfloat16_model_are_fitted_to_the_scales_as_stored():
    """numpy has no bfloat16: `stored` rounds as MLX stores (to nearest, ties to even), and a fit for bfloat16
    scales chooses its codes for them, beating a float32 fit whose scales are then rounded."""
    from mlx_encoders.quantization.rounding import BFLOAT16, fit_grid, stored

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(10_000) * 10.0 ** rng.integers(-6, 3, 10_000),
                             [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]]).astype(np.float32)  # fmt: skip
    expected = np.array(mx.array(values).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(stored(values, BFLOAT16), expected.astype(np.float64))

    weight = (rng.standard_normal((64, 128)) * 0.05).astype(np.float32)

    def error(dtype) -> float:
        packed, scales, biases = fit_grid(weight, 8, 32, dtype)
        as_stored = [mx.array(x).astype(mx.bfloat16) for x in (scales, biases)]
        rebuilt = mx.dequantize(mx.array(packed), *as_stored, group_size=32, bits=8).astype(mx.float32)
        return float(np.square(np.array(rebuilt) - weight).sum())

    assert error(BFLOAT16) < error(np.float32)


def test_an_untied_output_head_quantizes_and_loads_as_mlx_lm_writes_it(checkpoint, tmp_path):
    """A causal LM's own lm_head (Qwen3-4B/8B and their rerankers untie it) is quantized with the rest and loads back
    from its .scales and .biases (it was left float by convert, and a folder holding it quantized failed to load)."""
    import mlx_encoders
    from mlx_encoders.models.base import QuantizedDecoder

    source = checkpoint("qwen3", "causal-lm", tie_word_embeddings=False, hidden_size=64, intermediate_size=128)
    out = mlx_encoders.convert(source, tmp_path / "q4", bits=4, group_size=32, calibration=False)
    model, tokenizer = mlx_encoders.load(out)
    assert isinstance(model.lm_head, QuantizedDecoder)
    float_model, _ = mlx_encoders.load(mlx_encoders.convert(out, tmp_path / "float", dequantize=True))
    assert type(float_model.lm_head).__name__ == "TiedDecoder"
    batch = tokenizer(["a short text", "and a somewhat longer one here"], padding=True)
    np.testing.assert_allclose(
        np.array(model(**batch).logits), np.array(float_model(**batch).logits), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_dequantizing_into_half_precision_rounds_the_exact_weights_once(checkpoint, dtype):
    from mlx_encoders.quantization import dequantize_model

    model = load_model(checkpoint("bert", hidden_size=64, intermediate_size=128, num_attention_heads=4))
    quantize_model(model, bits=4, group_size=32)
    layer = model.encoder.layer[0].intermediate.dense
    exact = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32), 32, 4)
    dequantize_model(model, dtype)
    np.testing.assert_array_equal(
        np.array(model.encoder.layer[0].intermediate.dense.weight.astype(mx.float32)),
        np.array(exact.astype(dtype).astype(mx.float32)),
    )
