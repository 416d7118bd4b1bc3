"""Batch invariance, reduced precision, masks that can never produce NaN, and the attention's own exp."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import language_model_task
from mlx.utils import tree_flatten
from tolerance import assert_float32_close, encoder_terms

import mlx_encoders
from mlx_encoders.engine import attention as attention_forms
from mlx_encoders.engine import ops
from mlx_encoders.engine.attention import attention
from mlx_encoders.engine.ops import exp_nonpositive, gelu, gelu_tanh, silu
from mlx_encoders.models import MODEL_TYPES, layers
from mlx_encoders.models.base import padding_mask

TEXTS = ["", "word", "The quick brown fox jumps over the lazy dog.", " ".join(["a long text"] * 60)]
# Documented in docs/numerics.md: max abs difference from float32, relative to the output's scale.
TOLERANCE = {"float16": 1e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_text_alone_equals_itself_in_a_padded_batch(checkpoint, model_type):
    folder = checkpoint(model_type, language_model_task(model_type))
    model, tokenizer = mlx_encoders.load(folder)
    batch, terms = tokenizer(TEXTS, padding=True), encoder_terms(folder, TEXTS)
    together = np.array(model(**batch).logits)
    for i, text in enumerate(TEXTS):
        alone = np.array(model(**tokenizer([text])).logits)[0]
        real = tokenizer.real_tokens(alone.shape[0], together.shape[1])  # either padding side
        assert_float32_close(together[i, real], alone, terms, err_msg=f"text {i}")  # other shapes: other BLAS blocks


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reduced_precision_is_finite_and_close(checkpoint, model_type, dtype):
    folder = checkpoint(model_type, language_model_task(model_type))
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS, padding=True)
    reference = np.array(model(**batch).logits)
    low = mlx_encoders.load_model(folder, dtype=dtype)
    assert {v.dtype for _, v in tree_flatten(low.parameters())} == {getattr(mx, dtype)}
    out = low(**batch).logits
    assert out.dtype == getattr(mx, dtype)
    out = np.array(out.astype(mx.float32))
    assert np.isfinite(out).all()
    real = np.array(batch["attention_mask"]).astype(bool)
    err = np.abs(out - reference)[real].max() / np.abs(reference).max()
    assert err <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sliding_window_wholly_in_padding_stays_finite(checkpoint, dtype):
    """A 1-token-long text beside a long one: padded queries far from any real key see only masked keys."""
    model = mlx_encoders.load_model(checkpoint("modernbert"), dtype=dtype)
    _, tokenizer = mlx_encoders.load(checkpoint("modernbert"))
    batch = tokenizer(["", " ".join(["words"] * 100)], padding=True)
    assert batch["input_ids"].shape[1] > 2 + model.args.local_attention  # a whole window past row 0's end
    out = model(**batch).last_hidden_state.astype(mx.float32)
    assert bool(mx.all(mx.isfinite(out)))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_all_padding_rows_stay_finite_in_float16(checkpoint, model_type):
    model = mlx_encoders.load_model(checkpoint(model_type, language_model_task(model_type)), dtype="float16")
    ids = mx.ones((2, 12), dtype=mx.int32) * 5
    mask = mx.array([[1] + [0] * 11, [0] * 12], dtype=mx.int32)  # one real token; no real token at all
    assert bool(mx.all(mx.isfinite(model(ids, attention_mask=mask).logits)))


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in units of the last place of float32 at `exact` (float64)."""
    return np.abs(got.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)


def test_exp_nonpositive_is_within_one_ulp_of_exp():
    smallest_normal_log = np.log(np.float64(np.finfo(np.float32).tiny))
    x = np.concatenate([
        np.linspace(smallest_normal_log, 0, 2_000_001, dtype=np.float32),
        np.float32(-1) * np.logspace(-30, 1, 10_001, dtype=np.float32),  # tiny magnitudes
        np.float32([0.0, -0.0, np.log(0.5) / 2, np.log(0.5) / 2 - 1e-7]),  # r at the reduction's edge
    ])  # fmt: skip
    x = x[x >= smallest_normal_log]
    got = np.array(exp_nonpositive(mx.array(x)))
    assert ulps(got, np.exp(x.astype(np.float64))).max() <= 1.0


def test_exp_nonpositive_below_the_normal_range_is_tiny_and_finite():
    x = mx.array([-87.5, -100.0, -1e30, float(np.finfo(np.float32).min), -np.inf], dtype=mx.float32)
    got = np.array(exp_nonpositive(x))
    assert np.isfinite(got).all() and (got >= 0).all() and (got <= 1.2e-38).all()


def force_branch(monkeypatch, device: str) -> None:
    """Make attention take the `device` branch (both run here on the CPU); the other must not run."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(getattr(mx, device)))
    if device == "gpu":
        monkeypatch.setattr(attention_forms, "written_out_attention", None)
    else:  # the written-out form applies dropout too
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", None)
        monkeypatch.setattr(attention_forms, "dropped_out_attention", None)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: scores in the hundreds, where an unshifted exp overflows
def test_attention_matches_torch_with_padding_and_a_fully_masked_row(monkeypatch, scale, device):
    force_branch(monkeypatch, device)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 4, 17, 8)).astype(np.float32) * s for s in (scale, scale, 1.0))
    keep = np.ones((3, 17), np.int32)
    keep[1, 5:] = 0
    keep[2, :] = 0  # no real key: every weight equal, as with transformers' finite mask
    mask = padding_mask(mx.array(keep), mx.float32)
    got = np.array(attention(mx.array(q), mx.array(k), mx.array(v), mask))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(t).double() for t in (q, k, v, np.array(mask)))
    ).numpy()
    assert np.isfinite(got).all()
    terms = 8 + 2 * 17  # scores over the head's 8 dimensions, the softmax and the values over 17 keys
    assert_float32_close(got, expected, terms)
    assert_float32_close(got[2], np.broadcast_to(v[2].mean(axis=1, keepdims=True), v[2].shape), terms)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_attention_with_a_scale_and_a_bias_matches_torch_and_differentiates_the_bias(monkeypatch, device):
    """DeBERTa's scale and the relative-position bias of DeBERTa and MPNet: values, and the bias's gradient."""
    force_branch(monkeypatch, device)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    keep = np.ones((2, 9), np.int32)
    keep[1, 6:] = 0
    mask = padding_mask(mx.array(keep), mx.float32)
    scale = 1 / np.sqrt(8 * 3)
    tensors = [torch.from_numpy(t).double() for t in (q, k, v, bias, np.array(mask))]
    tensors[3].requires_grad_(True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *tensors[:3], attn_mask=tensors[4] + tensors[3], scale=scale
    )
    expected.sum().backward()

    def run(b):
        return attention(mx.array(q), mx.array(k), mx.array(v), mask, scale=scale, bias=b)

    terms = 8 + 2 * 9  # scores over the head's 8 dimensions, the softmax and the values over 9 keys
    assert_float32_close(np.array(run(mx.array(bias))), expected.detach().numpy(), terms)
    if device == "cpu":  # MLX's fused kernel has no vjp for its mask on the CPU; the written-out form does
        grad = mx.grad(lambda b: run(b).sum())(mx.array(bias))
        assert_float32_close(np.array(grad), tensors[3].grad.numpy(), 2 * terms)  # the same sums, backwards


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_float16_attention_over_long_inputs_with_large_values_stays_finite(monkeypatch, device):
    """Uniform weights over 1024 keys of value 100: a sum of weights x values far past float16's 65504."""
    force_branch(monkeypatch, device)
    q = mx.zeros((1, 2, 1024, 16), mx.float16)
    v = mx.full((1, 2, 1024, 16), 100.0, mx.float16)
    got = attention(q, q, v, padding_mask(mx.ones((1, 1024), mx.int32), mx.float16))
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), 100.0, rtol=1e-3)


def test_gelu_matches_the_exact_erf_gelu():
    x = np.concatenate([np.linspace(-12, 12, 2_000_001, dtype=np.float32), np.float32([-1e30, -50, 50, 1e30])])
    exact = torch.nn.functional.gelu(torch.from_numpy(x).double()).numpy()
    got = np.array(gelu(mx.array(x)))
    assert np.abs(got - exact).max() <= 1.1e-6
    assert np.abs(got - exact).max() <= 2 * np.abs(torch.nn.functional.gelu(torch.from_numpy(x)).numpy() - exact).max()
    half = gelu(mx.array(x[::1000]).astype(mx.float16))
    assert half.dtype == mx.float16
    np.testing.assert_allclose(np.array(half.astype(mx.float32)), exact[::1000], rtol=2e-3, atol=1e-3)


SIGMOID_GATED = {
    "silu": (silu, torch.nn.functional.silu),
    "gelu_tanh": (gelu_tanh, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
}


@pytest.mark.parametrize("name", SIGMOID_GATED)
def test_sigmoid_gated_activations_match_torch(name):
    """SiLU and the tanh GELU (x times a sigmoid through exp_nonpositive) stay within torch's own float32 error of
    the float64 function; half precision is computed in float32."""
    ours, theirs = SIGMOID_GATED[name]
    x = np.concatenate([np.linspace(-30, 30, 2_000_001, dtype=np.float32), np.float32([-1e30, -50, 50, 1e30])])
    exact = theirs(torch.from_numpy(x).double()).numpy()
    got = np.array(ours(mx.array(x)))
    assert np.abs(got - exact).max() <= 2 * np.abs(theirs(torch.from_numpy(x)).numpy() - exact).max()
    half = ours(mx.array(x[::1000]).astype(mx.float16))
    assert half.dtype == mx.float16
    np.testing.assert_allclose(np.array(half.astype(mx.float32)), exact[::1000], rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
@pytest.mark.parametrize("shape", [(3, 7, 384), (2, 5, 768), (1, 1, 16)])
def test_layer_norm_matches_torch_in_float64_and_its_gradients(shape, affine):
    """ops.layer_norm (the models' LayerNorm: mean and variance as BLAS products on the CPU) against torch's
    layer norm in float64, forward and gradients, on inputs with a large common offset (the centred second pass
    keeps the variance exact there) and at every affine form."""
    rng = np.random.default_rng(0)
    inputs = {"x": (rng.standard_normal(shape) * 3 + 50).astype(np.float32)}
    if affine != "none":
        inputs["weight"] = rng.standard_normal(shape[-1]).astype(np.float32)
    if affine == "weight and bias":
        inputs["bias"] = rng.standard_normal(shape[-1]).astype(np.float32)
    cotangent = rng.standard_normal(shape).astype(np.float32)

    def ours(arrays: dict) -> mx.array:
        return ops.layer_norm(arrays["x"], arrays.get("weight"), arrays.get("bias"), 1e-12)

    arrays = {k: mx.array(v) for k, v in inputs.items()}
    got = ours(arrays)
    grads = mx.grad(lambda a: (ours(a) * mx.array(cotangent)).sum())(arrays)
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in inputs.items()}
    want = torch.nn.functional.layer_norm(tensors["x"], shape[-1:], tensors.get("weight"), tensors.get("bias"), 1e-12)
    (want * torch.tensor(cotangent, dtype=torch.float64)).sum().backward()
    want = want.detach().numpy()
    np.testing.assert_allclose(np.array(got), want, atol=2e-6 * np.abs(want).max())
    for name, tensor in tensors.items():
        expected = tensor.grad.numpy()
        np.testing.assert_allclose(np.array(grads[name]), expected, atol=2e-5 * np.abs(expected).max(), err_msg=name)


def test_layer_norm_keeps_mlx_kernel_off_float32():
    """Half precision (and any device but the CPU) runs mx.fast.layer_norm, which accumulates in float32."""
    x = mx.random.normal((2, 3, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    w, b = mx.ones((64,), mx.bfloat16), mx.zeros((64,), mx.bfloat16)
    assert mx.array_equal(ops.layer_norm(x, w, b, 1e-5), mx.fast.layer_norm(x, w, b, 1e-5)).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 24), (7, 24), (24,)])
def test_linear_in_training_matches_torch_and_lays_its_weight_gradient_out_row_major(shape, bias):
    """layers.Linear in training (its own vjp: d/dW = g^T x in one product) against torch's float64 linear,
    forward and gradients; the weight's gradient comes out C-contiguous (MLX's own is a transposed view); in
    eval mode the layer is nn.Linear's function: the product, then the bias added (on the CPU), within float32
    rounding of nn.Linear's fused addmm."""
    rng = np.random.default_rng(0)
    x, cotangent = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape[:-1] + (10,))
    layer = layers.Linear(24, 10, bias=bias)
    params = {k: np.array(v) for k, v in tree_flatten(layer.parameters())}

    def loss(weights: dict, x: mx.array) -> mx.array:
        layer.update(weights)
        return (layer(x) * mx.array(cotangent.astype(np.float32))).sum()

    layer.train()
    out = np.array(layer(mx.array(x)))
    grads, dx = mx.grad(loss, argnums=(0, 1))(layer.parameters(), mx.array(x))
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    want = torch.nn.functional.linear(tx, tensors["weight"], tensors.get("bias"))
    (want * torch.tensor(cotangent)).sum().backward()
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(dx), tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    for name, tensor in tensors.items():
        np.testing.assert_allclose(np.array(grads[name]), tensor.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.asarray(grads["weight"]).flags["C_CONTIGUOUS"]
    plain = nn.Linear(24, 10, bias=bias)
    plain.update(layer.parameters())
    evaluated = layer.eval()(mx.array(x))
    product = mx.array(x) @ layer.weight.T
    assert mx.array_equal(evaluated, product + layer.bias if bias else product).item()
    np.testing.assert_allclose(np.array(evaluated), np.array(plain(mx.array(x))), rtol=1e-6, atol=1e-6)


def test_gelu_and_exp_inside_a_compiled_gradient_equal_their_eager_values():
    """The stage boundaries (`ops.unfused`) change where kernels split inside a compiled graph, not a bit of
    the result: GELU and exp_nonpositive, forward and gradient, compiled as one graph equal their eager values."""
    x = mx.random.normal((4, 16, 96), key=mx.random.key(1)) * 4
    r = mx.random.normal(x.shape, key=mx.random.key(2))

    def loss(x: mx.array) -> mx.array:
        return (gelu(x) * r).sum() + (exp_nonpositive(-mx.abs(x) * 30) * r).sum()

    compiled = mx.compile(mx.value_and_grad(loss))(x)
    eager = mx.value_and_grad(loss)(x)
    for ours, expected in zip(compiled, eager, strict=True):
        assert mx.array_equal(ours, expected).item()
    assert mx.array_equal(ops.unfused(x), x).item()
    half = x.astype(mx.float16)
    assert ops.unfused(half) is half  # a no-op off float32


# ----- dropout masks: ops.random_words and layers.Dropout -----

WORDS = 1 << 20


def test_random_words_are_uniform_and_independent():
    """Every byte of the words uniform (chi-square over 256 values), every bit set half the time, neighbouring
    words and two calls' words uncorrelated: a hash of the index that mixed poorly fails each of these."""
    mx.random.seed(0)
    words, other = (np.array(ops.random_words((WORDS,))).astype(np.int64) for _ in range(2))
    assert words.dtype == np.int64 and words.max() < 2**32
    expected = WORDS / 256
    for shift in (0, 8, 16, 24):  # 255 degrees of freedom: 360 is beyond their 99.99th percentile
        counts = np.bincount((words >> shift) & 255, minlength=256)
        assert ((counts - expected) ** 2 / expected).sum() < 360, shift
    bits = (words[:, None] >> np.arange(32)) & 1
    assert np.abs(bits.mean(axis=0) - 0.5).max() < 5 * 0.5 / math.sqrt(WORDS)
    bound = 5 / math.sqrt(WORDS)  # five standard errors of a correlation
    assert abs(np.corrcoef(words[:-1], words[1:])[0, 1]) < bound
    assert abs(np.corrcoef(words, other)[0, 1]) < bound
    assert abs((((words ^ other) >> 31) & 1).mean() - 0.5) < 5 * 0.5 / math.sqrt(WORDS)


def test_random_words_follow_mlx_random_key():
    """mx.random.seed sets them, each call draws new ones, and a compiled function that carries the random state
    (as the training step does) draws what eager code draws from the same key."""
    mx.random.seed(7)
    first = np.array(ops.random_words((3, 50)))
    second = np.array(ops.random_words((3, 50)))
    mx.random.seed(7)
    np.testing.assert_array_equal(np.array(ops.random_words((3, 50))), first)
    assert not np.array_equal(first, second)
    state = [mx.random.state]
    compiled = mx.compile(lambda: ops.random_words((3, 50)), inputs=state, outputs=state)
    mx.random.seed(7)
    np.testing.assert_array_equal(np.array(compiled()), first)
    np.testing.assert_array_equal(np.array(compiled()), second)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_drops_p_and_scales_the_rest(p):
    mx.random.seed(1)
    x = mx.random.uniform(1, 2, (WORDS,))
    dropout = layers.Dropout(p)
    y = np.array(dropout(x))
    dropped = y == 0
    assert abs(dropped.mean() - p) < 5 * math.sqrt(p * (1 - p) / WORDS)
    scale = np.float32(1) / np.float32(1 - p)  # nn.Dropout's and torch's factor
    np.testing.assert_array_equal(y[~dropped], np.array(x)[~dropped] * scale)
    np.testing.assert_array_equal(np.array(dropout.eval()(x)), np.array(x))  # eval mode: x itself
    np.testing.assert_array_equal(np.array(layers.Dropout(0.0)(x)), np.array(x))


def test_dropout_keeps_dtype_and_nan():
    """Half-precision inputs stay half precision; a dropped NaN or infinity is NaN (x times 0), as in torch."""
    x = mx.array([float("nan"), float("inf")] * 512, mx.bfloat16)
    y = layers.Dropout(0.5)(x)
    assert y.dtype == mx.bfloat16
    values = np.array(y.astype(mx.float32))
    assert np.isnan(values[0::2]).all()
    assert set(np.unique(values[1::2][~np.isnan(values[1::2])])) == {np.inf}  # kept ones stay infinite
    assert np.isnan(values[1::2]).any()  # dropped ones: inf * 0


def test_dropout_of_more_elements_than_a_uint32_counts_uses_mlx_draws(monkeypatch):
    """Past 2^32 elements the index would repeat, so nn.Dropout's own draws serve (shown here with a lower bound)."""
    monkeypatch.setattr(layers, "MAX_HASHED", 100)
    x = mx.ones((101,))
    mx.random.seed(3)
    ours = np.array(layers.Dropout(0.5)(x))
    mx.random.seed(3)
    np.testing.assert_array_equal(ours, np.array(nn.Dropout(0.5)(x)))
    mx.random.seed(3)
    assert not np.array_equal(np.array(layers.Dropout(0.5)(mx.ones((100,)))), ours[:100])  # hashed below it
