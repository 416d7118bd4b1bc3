"""Half-precision checkpoints compute in float32 on the CPU by default (MLX's CPU backend runs float16 and
bfloat16 tens of times slower); a GPU keeps the stored dtype, and an explicit `dtype=` always wins."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_encoders.engine.runtime as runtime
from mlx_encoders import load_model, save
from mlx_encoders.quantization import quantize_model


def dtypes(model) -> dict[str, set]:
    """{"weights": dtypes of the float parameters, "scales": those of quantization scales and biases}."""
    out = {"weights": set(), "scales": set()}
    for key, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            out["scales" if key.endswith((".scales", ".biases")) else "weights"].add(value.dtype)
    return out


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half(request, checkpoint, tmp_path_factory):
    """(a copy of the tiny BERT checkpoint stored in that dtype, the dtype)."""
    dtype = getattr(mx, request.param)
    model = load_model(checkpoint("bert"), dtype=dtype)
    return save(model, tmp_path_factory.mktemp(request.param) / "model"), dtype


@pytest.mark.cpu_only("a GPU keeps the stored dtype (test_a_gpu_keeps_the_stored_dtype)")
def test_half_precision_computes_in_float32_on_the_cpu(half, checkpoint):
    folder, _ = half
    model = load_model(folder)
    assert dtypes(model)["weights"] == {mx.float32}
    ids = mx.array([[101, 2023, 2003, 1037, 3231, 102]])
    assert model(ids).last_hidden_state.dtype == mx.float32


def test_explicit_dtype_and_stored_win(half):
    folder, dtype = half
    assert dtypes(load_model(folder, dtype=dtype))["weights"] == {dtype}
    assert dtypes(load_model(folder, as_stored=True))["weights"] == {dtype}


def test_a_gpu_keeps_the_stored_dtype(half, monkeypatch):
    folder, dtype = half
    monkeypatch.setattr(runtime, "on_cpu", lambda: False)
    assert dtypes(load_model(folder))["weights"] == {dtype}


@pytest.mark.cpu_only("the float weights widen to float32 on the CPU alone")
def test_quantized_scales_stay_half_precision(checkpoint, tmp_path):
    model = load_model(checkpoint("bert", hidden_size=64, intermediate_size=128, num_attention_heads=4))
    model.set_dtype(mx.float16)
    quantize_model(model, bits=8, group_size=32)
    loaded = dtypes(load_model(save(model, tmp_path / "q")))
    assert loaded == {"weights": {mx.float32}, "scales": {mx.float16}}
    # an explicit dtype casts everything not quantized: the scales and biases keep their stored dtype
    for dtype in (mx.bfloat16, mx.float32):
        assert dtypes(load_model(tmp_path / "q", dtype=dtype)) == {"weights": {dtype}, "scales": {mx.float16}}


def test_a_float64_checkpoint_loads_as_float32(checkpoint, tmp_path):
    """MLX reads no float64 tensors; transformers reads a double-precision checkpoint into float32 (it was refused
    as an unreadable file)."""
    import numpy as np
    import torch
    from checkpoints import load_reference

    reference = load_reference(checkpoint("bert"), "encoder").double()
    reference.save_pretrained(tmp_path / "f64")
    model = load_model(tmp_path / "f64")
    assert dtypes(model)["weights"] == {mx.float32}
    ids = [[101, 2023, 2003, 1037, 3231, 102]]
    with torch.no_grad():
        expected = reference.float()(torch.tensor(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.array(model(mx.array(ids)).last_hidden_state), expected, rtol=1e-5, atol=1e-5)


def test_save_writes_a_widened_half_precision_checkpoint_back_in_its_stored_dtype(half, tmp_path):
    """As transformers' from_pretrained / save_pretrained keep it; `dtype=` chooses, and transformers reads both."""
    import json

    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import AutoModel

    folder, dtype = half
    name = str(dtype).rsplit(".", 1)[-1]
    model = load_model(folder)
    for given, written in ((None, name), ("float32", "float32")):
        out = save(model, tmp_path / str(given), dtype=given)
        assert json.loads((out / "config.json").read_text())["dtype"] == written
        with safe_open(out / "model.safetensors", "pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {f"torch.{written}"}
        theirs = AutoModel.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
        np.testing.assert_allclose(
            theirs(ids).last_hidden_state.detach().numpy(),
            np.array(model(mx.array(ids.numpy())).last_hidden_state),
            atol=1e-4,
        )
