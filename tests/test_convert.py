"""`convert` / `python -m convert`: quantize, cast and dequantize checkpoints into the mlx-community layout.

Expected values come from transformers: the quantized model's outputs are compared with the float
transformers model, and every stored weight/scales/biases triplet must dequantize to the transformers
weight within one quantization step when rounded to nearest (`calibration=False`), and on average within
half a step with the default GPTQ (which moves single weights further to keep the layer's outputs).
"""

import errno
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import load_reference, make_checkpoint
from safetensors.numpy import load_file, save_file

import mlx_encoders
from convert.__main__ import main, parser
from mlx_encoders import conversion
from mlx_encoders.errors import CommandError, OptionError
from mlx_encoders.quantization import calibration, rounding

EUROBERT_WIDTHS = dict(hidden_size=64, intermediate_size=128, initializer_range=0.05)
# Widths chosen so some modules divide the group size and some do not (those must stay float).
ROUND_TRIPS = [
    ("bert", "masked-lm", 8, 32, {}),
    ("bert", "encoder", 6, 128, dict(hidden_size=128, intermediate_size=128, num_attention_heads=4)),
    ("roberta", "sequence-classification", 4, 32, {}),
    ("xlm-roberta", "token-classification", 8, 32, dict(hidden_size=32, num_attention_heads=4)),
    ("distilbert", "question-answering", 4, 32, {}),
    ("albert", "masked-lm", 8, 32, {}),
    ("modernbert", "sequence-classification", 4, 64, dict(hidden_size=64, intermediate_size=64)),
    ("mpnet", "masked-lm", 8, 32, {}),
    ("electra", "pretraining", 6, 32, {}),
    ("deberta-v2", "masked-lm", 4, 32, dict(conv_kernel_size=3)),  # the convolution stays float, in torch's layout
    ("deberta", "question-answering", 8, 32, {}),
    # EuroBERT's SwiGLU multiplies two rounded projections: with random weights of deviation 0.2, 4-bit rounding
    # moves its outputs past MIN_COSINE; at 0.05 (its own initializer_range is 0.02) it does not.
    ("eurobert", "masked-lm", 8, 32, EUROBERT_WIDTHS),
    ("eurobert", "sequence-classification", 4, 32, EUROBERT_WIDTHS),
]
MIN_COSINE = {8: 0.995, 6: 0.99, 4: 0.95}  # per-text output cosine vs the float transformers model
# Below 8 bits, a BERT's position and token-type tables get per-module 8-bit entries (recipes.SHARED_TABLES).
TABLES_AT_8 = {
    f"embeddings.{name}": {"group_size": 32, "bits": 8, "mode": "affine"}
    for name in ("position_embeddings", "token_type_embeddings")
}


def inputs(vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ids (avoiding special ids 0-4) with padding in the second row."""
    ids = np.random.default_rng(seed).integers(5, vocab_size, (3, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def oracle(folder: Path, task: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The transformers model's main output: logits (start/end for QA), else last_hidden_state."""
    with torch.no_grad():
        out = load_reference(folder, task)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if task == "question-answering":
        return torch.stack([out.start_logits, out.end_logits], dim=-1).numpy()
    return (out.logits if task != "encoder" else out.last_hidden_state).numpy()


def ours(folder: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    model = mlx_encoders.load_model(folder)
    out = model(mx.array(ids), attention_mask=mx.array(mask))
    return np.array((out.logits if out.logits is not None else out.last_hidden_state).astype(mx.float32))


def text_cosines(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if a.ndim == 3:
        a, b = a * mask[..., None], b * mask[..., None]
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def stored(folder: Path) -> dict[str, np.ndarray]:
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update({k: np.array(v) for k, v in mx.load(str(file)).items()})
    return weights


def assert_triplets_match(
    out: Path, source: Path, default_group: int, default_bits: int, rounded: bool = False
) -> None:
    """Every 2-D transformers weight is quantized iff its width divides the group size, with float16 scales
    and biases; within one step of it if `rounded` (to nearest), else within half a step on average."""
    reference = {k: v for k, v in load_file(source / "model.safetensors").items() if v.ndim == 2}
    weights = stored(out)
    config = json.loads((out / "config.json").read_text())
    for key, w in reference.items():
        path = key.removesuffix(".weight")
        own = config["quantization"].get(path)  # a per-module entry (position/token-type tables at 8 bits)
        bits, group_size = (own["bits"], own["group_size"]) if isinstance(own, dict) else (default_bits, default_group)
        if w.shape[-1] % group_size:
            assert f"{path}.scales" not in weights and config["quantization"][path] is False, path
            np.testing.assert_array_equal(weights[key], w)
            continue
        packed, scales, biases = weights[key], weights[f"{path}.scales"], weights[f"{path}.biases"]
        assert packed.dtype == np.uint32 and packed.shape == (w.shape[0], w.shape[1] * bits // 32), path
        assert scales.dtype == biases.dtype == np.float16, path
        scales, biases = mx.array(scales, mx.float32), mx.array(biases, mx.float32)
        restored = np.array(mx.dequantize(mx.array(packed), scales, biases, group_size, bits))
        step = np.abs(np.repeat(np.array(scales), group_size, axis=-1))
        if rounded:  # MLX shifts the grid so 0 is exact (up to a step); float16 storage adds its rounding
            fp16 = step * (2**bits - 1) * 2**-11 + np.abs(np.repeat(np.array(biases), group_size, axis=-1)) * 2**-11
            assert np.all(np.abs(restored - w) <= step + fp16 + 1e-6), path
        else:
            assert np.abs(restored - w).mean() <= 0.5 * step.mean(), path


@pytest.fixture(autouse=True)
def short_calibration(monkeypatch):
    """The default GPTQ calibration, on the first 24 built-in texts (the full 256 take too long for tests).

    Patched in `calibration`, the module whose `calibration_texts` looks it up."""
    texts = calibration.builtin_calibration()[:24]
    monkeypatch.setattr(calibration, "builtin_calibration", lambda: texts)


def test_builtin_calibration_is_disjoint_from_evaluated_docstrings(monkeypatch):
    from mlx_encoders.corpus import stdlib_docstrings

    monkeypatch.undo()  # the real set, not `short_calibration`'s
    texts = calibration.builtin_calibration()
    assert len(texts) == calibration.CALIBRATION_TEXTS == 128
    assert not set(texts) & set(stdlib_docstrings(calibration.CALIBRATION_START, calibration.CALIBRATION_CHARS))


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "bert", "encoder", hidden_size=64, intermediate_size=64)


@pytest.fixture(scope="module")
def bert_q8(bert, tmp_path_factory) -> Path:
    return mlx_encoders.convert(bert, tmp_path_factory.mktemp("q") / "bert-8bit", bits=8, group_size=32)


def hub_modernbert(root: Path) -> Path:
    """A tiny ModernBERT laid out as the real answerdotai/ModernBERT-base in a huggingface_hub cache."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "hub" / "models--answerdotai--ModernBERT-base"
    snapshot = make_checkpoint(
        repo / "snapshots" / sha, "modernbert", "masked-lm", hidden_size=64, intermediate_size=64
    )
    config = json.loads((snapshot / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "dtype"):  # back to the legacy spelling of the real file
        config.pop(key)
    config.update(global_rope_theta=1000.0, local_rope_theta=50.0, torch_dtype="float32")
    assert config["architectures"] == ["ModernBertForMaskedLM"] and config["global_attn_every_n_layers"] == 2
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return snapshot


def test_design_card_command_on_offline_hub_cache(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    snapshot = hub_modernbert(tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import time, which happened long before this test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)

    assert main(["--quantize", "--bits", "8", "answerdotai/ModernBERT-base"]) == 0

    out = tmp_path / "ModernBERT-base-8bit"
    report = capsys.readouterr().out
    for words in ("parameters", "size on disk", "bits/weight", "cosine mean", "max abs diff", "time"):
        assert words in report
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    assert config["global_rope_theta"] == 1000.0 and "layer_types" not in config
    assert_triplets_match(out, snapshot, 64, 8)
    model, tokenizer = mlx_encoders.load(out)
    assert type(model).__name__ == "ModernBertForMaskedLM"
    assert tokenizer.mask_token == "[MASK]"
    ids, mask = inputs(config["vocab_size"])
    assert text_cosines(ours(out, ids, mask), oracle(snapshot, "masked-lm", ids, mask), mask).min() > MIN_COSINE[8]
    card = (out / "README.md").read_text()
    assert "base_model: answerdotai/ModernBERT-base" in card
    assert "8-bit affine, group size 64 (GPTQ on 24 calibration texts)" in card


@pytest.mark.parametrize("model_type, task, bits, group_size, overrides", ROUND_TRIPS)
def test_round_trip(tmp_path, model_type, task, bits, group_size, overrides):
    source = make_checkpoint(tmp_path / "hf", model_type, task, **overrides)
    # rounded to nearest: GPTQ calibrated on text does not suit these random ids through random weights
    out = mlx_encoders.convert(source, tmp_path / "mlx", bits=bits, group_size=group_size, calibration=False)
    assert_triplets_match(out, source, group_size, bits, rounded=True)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    ids, mask = inputs(vocab_size)
    cosines = text_cosines(ours(out, ids, mask), oracle(source, task, ids, mask), mask)
    assert cosines.min() > MIN_COSINE[bits], cosines


def test_float_widths_are_reported(tmp_path, capsys):
    source = make_checkpoint(tmp_path / "hf", "bert", "encoder")  # intermediate_size 37
    out = mlx_encoders.convert(source, tmp_path / "mlx", bits=4, group_size=32, calibration=False)
    left = [k for k, v in json.loads((out / "config.json").read_text())["quantization"].items() if v is False]
    assert sorted(left) == [f"encoder.layer.{i}.output.dense" for i in range(3)]
    assert "3 modules left float" in capsys.readouterr().out
    assert "(round to nearest)" in (out / "README.md").read_text()
    assert_triplets_match(out, source, 32, 4, rounded=True)


def test_gptq_calibration_beats_rounding(tmp_path, bert):
    docs = (conversion.__doc__, mlx_encoders.quantization.__doc__, mlx_encoders.convert.__doc__)
    texts = [line for doc in docs for line in doc.splitlines() if line]
    file = tmp_path / "calibration.txt"
    file.write_text("\n".join(texts))
    gptq = tmp_path / "gptq"
    argv = ["--mlx-path", str(gptq), "--bits", "4", "--group-size", "32", "--calibration", str(file), str(bert)]
    assert main(argv) == 0
    rtn = mlx_encoders.convert(bert, tmp_path / "rtn", bits=4, group_size=32, calibration=False)
    config = json.loads((gptq / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine", **TABLES_AT_8}
    assert "GPTQ on" in (gptq / "README.md").read_text()
    batch = mlx_encoders.load(gptq)[1](texts, padding=True)
    ids, mask = np.array(batch["input_ids"]), np.array(batch["attention_mask"])
    expected = oracle(bert, "encoder", ids, mask)
    gaps = {f: 1 - text_cosines(ours(f, ids, mask), expected, mask).mean() for f in (gptq, rtn)}
    assert gaps[gptq] < 0.7 * gaps[rtn], gaps


@pytest.mark.parametrize("model_type", ["deberta", "deberta-v2"])
def test_gptq_calibrates_deberta_whose_position_table_runs_through_query_and_key(checkpoint, tmp_path, model_type):
    """DeBERTa's query and key projections also read its relative-position table, a (1, 2k, H) input beside the
    (B, L, H) tokens: the default conversion (GPTQ on the built-in texts) calibrates on both."""
    source = checkpoint(model_type)
    out = mlx_encoders.convert(source, tmp_path / "q8", bits=8, group_size=32)
    assert "GPTQ on" in (out / "README.md").read_text()
    batch = mlx_encoders.load(out)[1](calibration.builtin_calibration()[:6], padding=True, max_length=64)
    ids, mask = np.array(batch["input_ids"]), np.array(batch["attention_mask"])
    assert text_cosines(ours(out, ids, mask), oracle(source, "encoder", ids, mask), mask).min() > 0.9999


def test_gptq_act_order_moves_outputs_less_than_left_to_right():
    """Correlated inputs whose last columns carry most of the energy: rounded left to right, the strong
    columns come last with nothing left to absorb their error; act-order rounds them first."""
    rng = np.random.default_rng(0)
    inputs_ = rng.standard_normal((2048, 128)) + rng.standard_normal((2048, 8)) @ rng.standard_normal((8, 128))
    inputs_[:, 100:] *= 10
    hessian, weight = inputs_.T @ inputs_, np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)
    errors = {}
    for act_order in (True, False):
        packed, scales, biases = rounding.gptq(weight, hessian, 4, 32, act_order=act_order)
        codes = np.array(mx.dequantize(mx.array(packed), mx.ones(scales.shape), mx.zeros(biases.shape), 32, 4))
        errors[act_order] = rounding.output_error(weight, hessian, codes, scales.astype(np.float64), biases).sum()
    assert errors[True] < 0.7 * errors[False], errors  # measured ratio 0.43
    default, ordered = rounding.gptq(weight, hessian, 4, 32), rounding.gptq(weight, hessian, 4, 32, act_order=True)
    assert all(np.array_equal(a, b) for a, b in zip(default, ordered, strict=True))  # act-order is the default


def test_gptq_rounds_stacked_rows_as_alone():
    """Every row's codes, scales and biases depend on that row and the Hessian only, so Linears that share an input
    (query, key, value) are rounded as one stacked weight (`rounding.shared_fits`)."""
    rng = np.random.default_rng(0)
    inputs_ = rng.standard_normal((512, 96)) + rng.standard_normal((512, 4)) @ rng.standard_normal((4, 96))
    hessian, parts = inputs_.T @ inputs_, [rng.standard_normal((n, 96)).astype(np.float32) for n in (8, 24)]
    stacked = rounding.gptq(np.concatenate(parts), hessian, 4, 32)
    for got, *alone in zip(stacked, *(rounding.gptq(p, hessian, 4, 32) for p in parts), strict=True):
        np.testing.assert_array_equal(got, np.concatenate(alone))


def test_inverse_cholesky_is_the_cholesky_factor_of_the_inverse():
    rng = np.random.default_rng(0)
    inputs_ = rng.standard_normal((256, 48))
    hessian, order = inputs_.T @ inputs_, rng.permutation(48)
    expected = np.linalg.cholesky(np.linalg.inv(hessian[np.ix_(order, order)])).T  # upper: U^T U = H^-1
    got = rounding.checked(rounding.inverse_cholesky(hessian, order))
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        rounding.checked(rounding.inverse_cholesky(np.array([[1.0, 2.0], [2.0, 1.0]]), np.arange(2)))


@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
def test_pack_is_mlx_packing(bits):
    packed, scales, biases = mx.quantize(mx.random.normal((4, 128), key=mx.random.key(bits)), 32, bits)
    codes = np.array(mx.dequantize(packed, mx.ones(scales.shape), mx.zeros(biases.shape), 32, bits), np.int64)
    np.testing.assert_array_equal(rounding.pack(codes, bits), np.array(packed))


def test_calibration_batches_pad_to_a_token_budget():
    """Shortest texts first, at most `batch_size` texts and `batch_tokens` tokens once padded per batch."""
    batches = calibration.token_batches([5, 300, 40, 41, 7, 256], batch_size=3, batch_tokens=100)
    assert batches == [[0, 4], [2, 3], [5], [1]]  # a text longer than the budget goes alone


def test_calibration_weighs_texts_alike_and_skips_padding(bert):
    """The batched Hessian is the sum over texts of X^T X / length, X a text's own (unpadded) inputs."""
    model, tokenizer = mlx_encoders.load(bert)
    texts = ["short", "a much longer text, with many more tokens than the first one has"]
    got = calibration.input_hessians(model, tokenizer, texts, batch_size=2)["encoder.layer.0.attention.self.query"]
    expected = 0
    for text in texts:
        batch = tokenizer([text])
        x = np.array(model.embeddings(batch["input_ids"], batch["token_type_ids"]), np.float64)[0]
        expected = expected + x.T @ x / len(x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_dequantize_restores_floats(tmp_path, bert, bert_q8):
    out = mlx_encoders.convert(bert_q8, tmp_path / "deq", dequantize=True, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    weights = stored(out)
    reference = load_file(bert / "model.safetensors")
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    for key, w in reference.items():
        if w.ndim == 2:  # within 8-bit rounding of the original float weight
            assert weights[key].dtype == np.float32 and np.abs(weights[key] - w).max() < 0.02, key
    ids, mask = inputs(config["vocab_size"])
    # the same weights; MLX's QuantizedEmbedding returns float16 rows (float16 scales), the float copy float32
    restored, quantized = ours(out, ids, mask), ours(bert_q8, ids, mask)
    np.testing.assert_allclose(restored, quantized, atol=1e-2)
    assert text_cosines(restored, quantized, mask).min() > 0.99999


def test_sharding_writes_an_index(tmp_path, bert):
    out = mlx_encoders.convert(bert, tmp_path / "mlx", bits=8, group_size=32, shard_size=200_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(stored(out))
    ids, mask = inputs(30522)
    assert text_cosines(ours(out, ids, mask), oracle(bert, "encoder", ids, mask), mask).min() > MIN_COSINE[8]


def test_a_model_no_group_size_fits_is_refused_before_calibrating(tmp_path, checkpoint, capsys, monkeypatch):
    """TinyBERT's widths (312, 1200) take no affine group size: convert says to keep it float, before the
    calibration pass (which would run for nothing), and quantize_model says the same."""
    source = checkpoint("bert", hidden_size=40, intermediate_size=50)

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated a model that cannot be quantized")

    monkeypatch.setattr(conversion, "input_hessians", no_calibration)
    assert main([str(source), "--mlx-path", str(tmp_path / "mlx"), "-q", "--bits", "8"]) == 2
    err = capsys.readouterr().err
    assert "divides none of this model's input widths (40, 50)" in err and "keep this model float" in err
    assert not (tmp_path / "mlx").exists()
    with pytest.raises(OptionError, match="no affine group size .* divides them; keep this model float"):
        mlx_encoders.quantization.quantize_model(mlx_encoders.load_model(source), bits=8)


def test_a_quantized_model_is_not_quantized_again(checkpoint):
    """A second quantize_model changed nothing and returned the new settings as though it had; over a model
    quantized in part, its entry records the modules quantized before at their own settings."""
    from mlx_encoders.quantization import dequantize_model, quantize_model

    model = mlx_encoders.load_model(checkpoint("bert", hidden_size=32, intermediate_size=96))
    quantize_model(model, bits=8, group_size=32)
    with pytest.raises(ValueError, match=r"quantized already \(\d+ modules, .*dequantize_model\(model\) first"):
        quantize_model(model, bits=4, group_size=32)
    dequantize_model(model)
    quantize_model(model.encoder.layer[0], bits=4, group_size=32)
    entry = quantize_model(model, bits=8, group_size=32)
    assert entry["bits"] == 8 and entry["encoder.layer.0.intermediate.dense"] == {
        "group_size": 32, "bits": 4, "mode": "affine"
    }  # fmt: skip
    assert "encoder.layer.1.intermediate.dense" not in entry


def test_a_group_size_that_fits_no_width_is_refused_naming_one_that_does(tmp_path, checkpoint, capsys):
    source = checkpoint("bert", hidden_size=32, intermediate_size=96)  # widths 32 and 96: 64 divides neither
    args = [str(source), "--mlx-path", str(tmp_path / "mlx"), "-q", "--bits", "8", "--group-size", "64"]
    assert main([*args, "--no-calibration"]) == 2  # an option refused, as argparse exits
    err = capsys.readouterr().err
    assert "group size 64 (group_size, --group-size) divides none of this model's input widths (32, 96)" in err
    assert "use group_size=32 (--group-size 32" in err and not (tmp_path / "mlx").exists()
    recipe = ["--recipe", '{"*": {"bits": 4, "group_size": 128}}']  # the recipe's size: --group-size cannot help
    assert main([*args[:-1], "32", *recipe, "--no-calibration"]) == 2
    err = capsys.readouterr().err
    assert "group size 128 (the recipe's group_size)" in err and '"group_size": 32 in the recipe' in err


def test_report_describes_the_settings_applied_not_the_default(tmp_path, bert, capsys):
    # every module overridden to mxfp4: config.json's default (8-bit affine) describes none of them
    out = mlx_encoders.convert(bert, tmp_path / "fp4", recipe={"*": {"bits": 4, "mode": "mxfp4"}}, calibration=False)
    printed = capsys.readouterr().out
    for text in (printed, (out / "README.md").read_text()):
        assert "4-bit mxfp4, group size 32 (round to nearest)" in text and "8-bit affine" not in text
    out = mlx_encoders.convert(bert, tmp_path / "mixed", recipe="mixed_4_8", calibration=False)
    # 6 Linears in each of 3 layers at 4 bits; word, position, token-type tables and pooler at 8
    assert "mixed: 4-bit affine (g32) for 18 modules, 8-bit affine (g64) for 4 modules" in capsys.readouterr().out


def test_recipe_keeps_embeddings_and_heads_at_higher_precision(tmp_path):
    source = make_checkpoint(tmp_path / "hf", "bert", "sequence-classification", hidden_size=64, intermediate_size=64)
    out = mlx_encoders.convert(source, tmp_path / "mlx", recipe="mixed_4_8", group_size=32)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    high = {k for k, v in quantization.items() if isinstance(v, dict)}
    assert quantization["bits"] == 4
    assert {"bert.embeddings.word_embeddings", "bert.pooler.dense", "classifier"} <= high
    assert not any(".layer." in k for k in high)
    weights = stored(out)
    assert weights["bert.embeddings.word_embeddings.weight"].shape[1] == 64 * 8 // 32
    assert weights["bert.encoder.layer.0.attention.self.query.weight"].shape[1] == 64 * 4 // 32
    ids, mask = inputs(30522)
    cos = text_cosines(ours(out, ids, mask), oracle(source, "sequence-classification", ids, mask), mask)
    assert cos.min() > MIN_COSINE[4]


def test_a_recipe_pattern_matching_no_module_warns_naming_it(tmp_path, bert):
    with pytest.warns(UserWarning, match=r"Recipe pattern 'encoder\.layers\.\*' matches no Linear or Embedding"):
        mlx_encoders.convert(bert, tmp_path / "mlx", recipe={"encoder.layers.*": 4, "*": 8}, calibration=False)


def test_mixed_recipe_layers_take_the_group_size_of_plain_4_bits(tmp_path, bert):
    plain = mlx_encoders.convert(bert, tmp_path / "q4", bits=4, calibration=False)
    mixed = mlx_encoders.convert(bert, tmp_path / "mixed", recipe="mixed_4_8", calibration=False)
    plain_config = json.loads((plain / "config.json").read_text())["quantization"]
    mixed_config = json.loads((mixed / "config.json").read_text())["quantization"]
    assert mixed_config["bits"] == 4 and mixed_config["group_size"] == plain_config["group_size"]
    layer = "encoder.layer.0.attention.self.query.weight"
    assert stored(mixed)[layer].shape == stored(plain)[layer].shape


def test_shared_tables_stay_at_8_bits_unless_a_recipe_names_them(tmp_path, bert):
    out = mlx_encoders.convert(bert, tmp_path / "q4", bits=4, calibration=False)
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": 32, "bits": 4, "mode": "affine", **TABLES_AT_8
    }  # fmt: skip
    weights = stored(out)
    assert weights["embeddings.position_embeddings.weight"].shape[1] == 64 * 8 // 32
    assert weights["embeddings.word_embeddings.weight"].shape[1] == 64 * 4 // 32
    out = mlx_encoders.convert(bert, tmp_path / "all4", bits=4, recipe={"*": 4}, calibration=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert stored(out)["embeddings.token_type_embeddings.weight"].shape[1] == 64 * 4 // 32
    out = mlx_encoders.convert(bert, tmp_path / "q6", bits=6, group_size=64, calibration=False)
    config = json.loads((out / "config.json").read_text())["quantization"]
    assert config["embeddings.position_embeddings"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    # a params dict's missing keys follow the run's bits and group size, as a bits entry's do
    recipe = {"*": {"group_size": 64}}
    out = mlx_encoders.convert(bert, tmp_path / "dict", bits=4, group_size=32, recipe=recipe, calibration=False)
    modules = {k: v for k, v in json.loads((out / "config.json").read_text())["quantization"].items() if "." in k}
    assert modules and all(v == {"group_size": 64, "bits": 4, "mode": "affine"} for v in modules.values()), modules


def test_other_modes_and_dtype(tmp_path, bert):
    out = mlx_encoders.convert(bert, tmp_path / "fp8", mode="mxfp8", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["embeddings.LayerNorm.weight"].dtype == mx.bfloat16
    assert weights["encoder.layer.0.attention.self.query.scales"].dtype == mx.uint8
    assert "encoder.layer.0.attention.self.query.biases" not in weights
    ids, mask = inputs(30522)
    assert text_cosines(ours(out, ids, mask), oracle(bert, "encoder", ids, mask), mask).min() > 0.99


def sentence_checkpoint(folder: Path, dense_weights: str = "safetensors") -> Path:
    """A tiny BERT with sentence-transformers modules: Transformer, Pooling, Dense, Normalize; `dense_weights`
    "safetensors", "pickle", "none" (no 2_Dense folder) or "config only" (its config.json alone)."""
    make_checkpoint(folder, "bert", "encoder", hidden_size=64, intermediate_size=64)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 64, "do_lower_case": false}')
    (folder / "config_sentence_transformers.json").write_text('{"prompts": {"query": "query: "}}')
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        '{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}'
    )
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text('{"in_features": 64, "out_features": 16, "bias": true}')
    dense = {"linear.weight": np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)}
    if dense_weights == "safetensors":
        save_file(dense, str(folder / "2_Dense" / "model.safetensors"))
    elif dense_weights == "pickle":
        torch.save({k: torch.tensor(v) for k, v in dense.items()}, folder / "2_Dense" / "pytorch_model.bin")
    elif dense_weights != "config only":  # the module's folder left out, as some converters leave it
        shutil.rmtree(folder / "2_Dense")
    (folder / "3_Normalize").mkdir()
    return folder


def test_sentence_transformers_files_are_kept(tmp_path):
    source = sentence_checkpoint(tmp_path / "st")
    out = mlx_encoders.convert(source, tmp_path / "mlx", bits=8, dtype="float16")
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                 "1_Pooling/config.json", "2_Dense/config.json", "tokenizer.json", "vocab.txt",
                 "tokenizer_config.json", "special_tokens_map.json"):  # fmt: skip
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert (out / "3_Normalize").is_dir()
    dense = load_file(out / "2_Dense" / "model.safetensors")
    expected = load_file(source / "2_Dense" / "model.safetensors")["linear.weight"].astype(np.float16)
    np.testing.assert_array_equal(dense["linear.weight"], expected)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_failure_leaves_nothing_behind(tmp_path, bert, monkeypatch):
    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(conversion, "copy_sentence_files", fail)  # after the weights are written
    (tmp_path / "out").mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        mlx_encoders.convert(bert, tmp_path / "out" / "mlx", bits=8, group_size=32)
    assert listing(tmp_path / "out") == []


def test_outputs_that_are_not_finite_are_refused_before_anything_is_written(tmp_path, bert):
    """A weight past float16's range makes every output NaN at --dtype float16: refused, saying what to use."""
    source = tmp_path / "big"
    shutil.copytree(bert, source)
    weights = load_file(source / "model.safetensors")
    weights["encoder.layer.0.output.LayerNorm.weight"][0] = 1e6
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"non-finite outputs .* overflow float16 .* --dtype bfloat16\. Nothing was "
                       r"written"):  # fmt: skip
        mlx_encoders.convert(source, tmp_path / "fp16", dtype="float16")
    assert not (tmp_path / "fp16").exists()
    mlx_encoders.convert(source, tmp_path / "bf16", dtype="bfloat16")  # its range holds the weight


def test_the_default_output_of_a_folder_given_as_dot_is_named_after_it_and_beside_it(tmp_path, bert, monkeypatch):
    source = tmp_path / "mymodel"
    shutil.copytree(bert, source)
    before = listing(source)
    monkeypatch.chdir(source)
    assert main([".", "--bits", "8", "--group-size", "32", "--no-calibration"]) == 0
    assert listing(source) == before  # nothing written into the model's folder
    assert (tmp_path / "mymodel-8bit" / "model.safetensors").exists()


def test_existing_target_needs_force(tmp_path, bert):
    target = tmp_path / "mlx"
    target.mkdir()  # an empty folder holds nothing to lose: written without force, as save_pretrained writes it
    mlx_encoders.convert(bert, target, dtype="float16")
    assert (target / "model.safetensors").exists()
    shutil.rmtree(target)
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for force in (False, True):  # force never deletes other data, and is not suggested where it would not help
        with pytest.raises(FileExistsError, match=r"not a checkpoint folder \(no config.json\); refusing to replace"):
            mlx_encoders.convert(bert, target, bits=8, group_size=32, force=force)
    assert listing(target) == ["keep.txt"]
    (target / "config.json").write_text("{}")  # an earlier output: force replaces it whole
    with pytest.raises(FileExistsError, match="already exists; pass force=True"):
        mlx_encoders.convert(bert, target, bits=8, group_size=32)
    mlx_encoders.convert(bert, target, bits=8, group_size=32, force=True)
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["mlx"]
    (tmp_path / "notes.txt").write_text("mine")
    for force in (False, True):  # a file: no option replaces it, and the first error says so
        with pytest.raises(FileExistsError, match=r"notes.txt is a file, not a folder"):
            mlx_encoders.convert(bert, tmp_path / "notes.txt", dtype="float16", force=force)


def test_a_second_identical_convert_reuses_the_folder(tmp_path, bert, capsys):
    target = tmp_path / "mlx"
    command = [str(bert), "--mlx-path", str(target), "-q", "--bits", "8", "--no-calibration", "--force"]
    assert main(command) == 0
    written = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert main(command) == 0 and main(command[:-1]) == 0  # with --force or without
    assert capsys.readouterr().out.count(f"{target} is already a conversion of {bert} with these options") == 2
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == written

    def converts_again(command) -> bool:
        assert main(command) == 0
        return f"Converted {command[0]} -> {target}" in capsys.readouterr().out

    assert converts_again([*command, "--dtype", "float16"])  # other options
    with (target / "README.md").open("a") as card:  # an edited output
        card.write("edited")
    assert converts_again([*command, "--dtype", "float16"])
    source = Path(shutil.copytree(bert, tmp_path / "source"))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-5}))  # another source
    assert converts_again([str(source), *command[1:], "--dtype", "float16"])
    assert not converts_again([str(source), *command[1:], "--dtype", "float16"])


# A convert that stops where `step` says and prints the step: "write" inside the atomic write (after the
# weights), "swap" between moving the old target aside and renaming the new folder into place.
HOLD = """
import signal, sys, time
from pathlib import Path
from mlx_encoders import conversion

signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as under a terminal: a suite run under nohup passes it ignored
source, target, step = sys.argv[1:]
rename = Path.rename

def hold(*args):
    print(step, flush=True)
    time.sleep(600)  # until the test signals it: a busy machine can take minutes to get there

def held_rename(self, to):
    if self.suffix == ".partial":
        hold()
    return rename(self, to)

if step == "write":
    conversion.copy_sentence_files = hold
else:
    Path.rename = held_rename
conversion.convert(source, target, force=True)
"""


def start_convert(source: Path, target: Path, step: str) -> subprocess.Popen:
    """A convert in another process, returned once it holds at `step`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(source), str(target), step],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if proc.stdout.readline().strip() != step:
        proc.kill()
        raise AssertionError(proc.communicate()[1])
    return proc


def hidden(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("."))


def test_killed_convert_is_cleaned_by_the_next_but_a_live_one_never(tmp_path, bert):
    target = tmp_path / "mlx"
    killed = start_convert(bert, target, "write")
    killed.kill()  # SIGKILL: no cleanup can run
    killed.wait()
    (stale,) = hidden(tmp_path)
    assert stale.name.startswith(".mlx.") and stale.name.endswith(".partial")
    assert (stale / "model.safetensors").is_file()

    live = start_convert(bert, target, "write")  # the next run removes what the killed one left...
    (writing,) = hidden(tmp_path)
    assert not stale.exists() and writing != stale
    mlx_encoders.convert(bert, target)  # ...and never a folder a live run is writing
    assert writing.is_dir() and (target / "model.safetensors").is_file()

    live.send_signal(signal.SIGHUP)  # SIGHUP and SIGTERM clean up as Ctrl-C does
    assert live.wait(timeout=30) == 128 + signal.SIGHUP
    assert [p.name for p in tmp_path.iterdir()] == ["mlx"]


def test_terminated_convert_leaves_nothing_behind(tmp_path, bert):
    proc = start_convert(bert, tmp_path / "mlx", "write")
    proc.terminate()  # SIGTERM
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert listing(tmp_path) == []


def test_force_keeps_the_old_target_recoverable_until_the_new_one_is_in_place(tmp_path, bert):
    target = tmp_path / "mlx"
    mlx_encoders.convert(bert, target, dtype="float16")
    before = (target / "model.safetensors").read_bytes()
    other = tmp_path / ".mlx.v2.abcd1234.partial"  # another target's (`mlx.v2`): not this run's business
    other.mkdir()
    proc = start_convert(bert, target, "swap")
    proc.kill()  # between the two renames: the old target sits in `.mlx.xxxxxxxx.old/mlx`
    proc.wait()
    assert not target.exists()
    (old,) = [p for p in hidden(tmp_path) if p.suffix == ".old"]
    assert (old / "mlx" / "model.safetensors").read_bytes() == before

    assert main([str(bert), "--mlx-path", str(target)]) == 1  # the next run puts it back
    assert (target / "model.safetensors").read_bytes() == before
    assert hidden(tmp_path) == [other]


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("[write] Unable to write 8 bytes to file.")],
    ids=["OSError", "MLX RuntimeError"],
)
def test_full_disk_is_one_line(tmp_path, bert, monkeypatch, capsys, error):
    def fail(*args):
        raise error

    monkeypatch.setattr(conversion, "copy_sentence_files", fail)  # after the weights are written
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=0))  # MLX's error has no errno
    assert main([str(bert), "--mlx-path", str(tmp_path / "mlx")]) == 1
    err = capsys.readouterr().err
    message = err.split("\r")[-1]  # after the progress bar
    expected = f"python -m convert: error: disk full while writing {tmp_path / 'mlx'}; nothing was written. Free space"
    assert message.startswith(expected)
    assert message.count("\n") == 1 and "Traceback" not in err
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "args, message, status",
    [
        (["--calibration", "{tmp}/missing.txt"], "argument --calibration: {tmp}/missing.txt: no such file", 2),
        (["--calibration", "{tmp}"], "argument --calibration: {tmp}: a folder, not a file", 2),
        (["--group-size", "16"], "affine quantization supports group sizes [32, 64, 128], not 16", 2),
        (["--mode", "mxfp4", "--bits", "8"], "mxfp4 quantization supports bits [4], not 8", 2),
        (["--mode", "int3"], "Unknown quantization mode 'int3'; choose one of: affine, mxfp4", 2),
        (["--dtype", "float64"], "dtype (--dtype): Unsupported dtype 'float64'; choose one of: float32, float16", 2),
        (["--mlx-path", "{bert}"], "mlx_path (--mlx-path) {bert} is the source folder", 2),
        (["--recipe", '{{"*": 4,}}'], "argument --recipe: not valid JSON (Expecting property name", 2),  # .format
    ],
    ids=[
        "missing calibration",
        "calibration folder",
        "group size",
        "bits",
        "mode",
        "dtype",
        "source as target",
        "recipe JSON",
    ],  # fmt: skip
)
def test_cli_refuses_bad_options_before_converting(tmp_path, bert, capsys, args, message, status):
    # argparse reads the files, the library checks the options: status 2 (a usage error) and one line either way
    args = [a.format(tmp=tmp_path, bert=bert) for a in args]
    try:
        code = main(["-q", str(bert), "--mlx-path", str(tmp_path / "mlx"), *args])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == status and f"python -m convert: error: {message.format(tmp=tmp_path, bert=bert)}" in err
    assert "Traceback" not in err and not (tmp_path / "mlx").exists()


def test_usage_names_the_command_it_was_run_by(monkeypatch):
    root = Path(__file__).parents[1]
    module = subprocess.run([sys.executable, "-m", "convert", "--help"], cwd=root, capture_output=True, text=True)
    assert module.stdout.startswith("usage: python -m convert ")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mlx-encoders-convert", "--help"])
    assert parser().format_usage().startswith("usage: mlx-encoders-convert ")


def unsupported(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "funnel", "architectures": ["FunnelForMaskedLM"]}')
    save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(folder / "model.safetensors"))
    return folder


def pickle_only(folder: Path) -> Path:
    make_checkpoint(folder, "bert", "encoder")
    state = {k: torch.tensor(v) for k, v in load_file(folder / "model.safetensors").items()}
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


BAD_INPUTS = [
    ("missing source", lambda d, bert: d / "nowhere", {}, FileNotFoundError, "nowhere"),
    ("unsupported architecture", lambda d, bert: unsupported(d / "funnel"), {}, ValueError, "supported: bert, roberta"),
    ("pickle only", lambda d, bert: pickle_only(d / "pkl"), {}, ValueError, "only pickle weights"),
    ("pickle-only Dense", lambda d, bert: sentence_checkpoint(d / "st", "pickle"), {}, ValueError, "2_Dense"),
    ("missing Dense", lambda d, bert: sentence_checkpoint(d / "st", "none"), {}, ValueError, "2_Dense, which has no"),
    (
        "Dense without weights",
        lambda d, bert: sentence_checkpoint(d / "st", "config only"),
        {},
        ValueError,
        "2_Dense, which has no weights",
    ),
    ("bits", lambda d, bert: bert, {"bits": 7}, ValueError, "bits \\[2, 3, 4, 5, 6, 8\\], not 7"),
    ("group size", lambda d, bert: bert, {"group_size": 48}, ValueError, "group sizes \\[32, 64, 128\\], not 48"),
    ("mode", lambda d, bert: bert, {"mode": "int3"}, ValueError, "choose one of: affine, mxfp4"),
    ("recipe", lambda d, bert: bert, {"recipe": "fancy"}, ValueError, "mixed_4_8"),
    (
        "recipe key",
        lambda d, bert: bert,
        {"recipe": {"*.query": {"bit": 4}}},
        ValueError,
        "Recipe entry '\\*.query': unknown key\\(s\\) 'bit'; a params dict may set only bits, group_size, mode",
    ),
]


@pytest.mark.parametrize("name, make, kwargs, error, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_write_nothing(tmp_path, bert, name, make, kwargs, error, message):
    source = make(tmp_path / "src", bert)
    (tmp_path / "out").mkdir()
    with pytest.raises(error, match=message):
        mlx_encoders.convert(source, tmp_path / "out" / "mlx", quantize=True, **kwargs)
    assert listing(tmp_path / "out") == []


def test_cli_accepts_mlx_lm_spellings_and_reports_errors(tmp_path, bert, capsys):
    out = tmp_path / "mlx"
    assert main(["--hf-path", str(bert), "--mlx-path", str(out), "-q", "--q-bits", "4", "--q-group-size", "32"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        **TABLES_AT_8,
    }
    assert main(["--hf-path", str(bert), "--mlx-path", str(out), "-q"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_upload_calls_huggingface_hub(tmp_path, bert, monkeypatch):
    """One commit of the folder, its card's code loading the repo it goes to: on a fresh conversion, and on a
    reused one converted under another name (the card in the folder names the folder)."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def create_commit(self, repo_id, repo_type, operations, commit_message):
            files = {op.path_in_repo: op.path_or_fileobj for op in operations}
            calls.append(("create_commit", repo_id, repo_type, sorted(files)))
            card = files["README.md"]
            uploaded_cards.append(card.decode() if isinstance(card, bytes) else Path(card).read_text())
            assert Path(files["model.safetensors"]).exists()

    uploaded_cards = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = mlx_encoders.convert(bert, tmp_path / "mlx", bits=8, group_size=32, upload_repo="someone/tiny-bert-8bit")
    expected = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert calls == [
        ("create_repo", {"repo_id": "someone/tiny-bert-8bit", "repo_type": "model", "exist_ok": True}),
        ("create_commit", "someone/tiny-bert-8bit", "model", expected),
    ]
    assert 'mlx_encoders.load("someone/tiny-bert-8bit")' in (out / "README.md").read_text() == uploaded_cards[0]

    local = mlx_encoders.convert(bert, tmp_path / "local", bits=8, group_size=32)
    assert 'mlx_encoders.load("local")' in (local / "README.md").read_text()
    assert mlx_encoders.convert(bert, local, bits=8, group_size=32, upload_repo="someone/other") == local  # reused
    assert 'mlx_encoders.load("someone/other")' in uploaded_cards[1] and '"local"' not in uploaded_cards[1]
    assert uploaded_cards[1].replace("someone/other", "local") == (local / "README.md").read_text()


def test_quantized_source_is_not_quantized_twice(tmp_path, bert_q8):
    with pytest.raises(ValueError, match="already quantized"):
        mlx_encoders.convert(bert_q8, tmp_path / "again", bits=4)
    with pytest.raises(ValueError, match=r"already quantized: convert it with dequantize=True \(--dequantize\)"):
        mlx_encoders.convert(bert_q8, tmp_path / "again", dtype="float16")  # a cast would misreport it
    assert not (tmp_path / "again").exists()


def test_conflicting_options_are_refused_naming_both(tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("one text\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "model"), "--calibration", str(texts), "--no-calibration"])
    assert "--calibration and --no-calibration conflict" in capsys.readouterr().err
    assert main([str(tmp_path / "model"), "--recipe", "mixed_4_8", "--bits", "8"]) == 2
    assert "recipe 'mixed_4_8' and bits=8 (--bits) conflict" in capsys.readouterr().err


def test_no_calibration_without_quantizing_is_refused(tmp_path, bert, bert_q8, capsys):
    """--no-calibration chooses how weights are rounded: alone it would make a float copy, silently."""
    for source, extra in ((bert, []), (bert_q8, ["--dequantize"])):
        assert main([str(source), "--mlx-path", str(tmp_path / "copy"), "--no-calibration", *extra]) == 2
        assert "quantizes nothing: add quantize=True (-q, or --bits)" in capsys.readouterr().err
        assert not (tmp_path / "copy").exists()


def test_requests_that_would_be_misread_are_refused_or_honoured(tmp_path, bert, monkeypatch, capsys):
    """--group-size alone quantizes (as --bits does); an output inside the source, calibration texts for a source
    without a tokenizer, are refused before anything is written; a source without a tokenizer gets a card whose
    code runs; "." is named by its folder."""
    out = mlx_encoders.convert(bert, tmp_path / "grouped", group_size=32, calibration=False)
    assert json.loads((out / "config.json").read_text())["quantization"]["group_size"] == 32
    out = mlx_encoders.convert(bert, tmp_path / "affine", mode="affine", calibration=False)  # a mode quantizes
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == "affine"
    for given in ("texts.txt", Path("texts.txt"), ["a text", 3]):  # a path would calibrate on its characters
        with pytest.raises(OptionError, match="calibration takes a list of texts"):
            mlx_encoders.convert(bert, tmp_path / "calibrated", bits=8, calibration=given)
    assert not (tmp_path / "calibrated").exists()
    texts = ["Calibration text one.", "Another calibration text."]
    kinds = {"tuple": tuple(texts), "generator": (t for t in texts), "numpy": np.array(texts)}  # read as a list's
    outputs = {k: mlx_encoders.convert(bert, tmp_path / k, bits=8, calibration=v) for k, v in kinds.items()}
    listed = mlx_encoders.convert(bert, tmp_path / "list", bits=8, calibration=texts)
    for out in outputs.values():  # the same request recorded (so the same command reuses its folder)
        request = json.loads((out / "conversion.json").read_text())["request"]
        assert request == json.loads((listed / "conversion.json").read_text())["request"]

    inside = tmp_path / "source"
    shutil.copytree(bert, inside)
    with pytest.raises(OptionError, match="is inside the source folder"):
        mlx_encoders.convert(inside, inside / "q8", bits=8)
    assert not (inside / "q8").exists()
    with pytest.raises(OptionError, match="holds the source folder"):  # --force would replace it, source and all
        mlx_encoders.convert(inside, tmp_path, bits=8, force=True)
    assert (inside / "config.json").exists()

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(bert / name, bare / name)
    with pytest.raises(OptionError, match=r"has no tokenizer.json: add .* or quantize without calibration"):
        mlx_encoders.convert(bare, tmp_path / "bare-gptq", bits=8, calibration=["a text to calibrate on"])
    assert not (tmp_path / "bare-gptq").exists()
    plain = mlx_encoders.convert(bare, tmp_path / "bare-8bit", bits=8)
    card = (plain / "README.md").read_text()
    code = card.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    exec(code, {})  # the card's code runs (the model alone: no tokenizer)
    assert 'load_model("bare-8bit")' in code

    monkeypatch.chdir(bert)
    assert main(["-q", "--no-calibration", ".", "--mlx-path", str(tmp_path / "dot")]) == 0
    assert f"MLX weights of `{bert.name}`" in (tmp_path / "dot" / "README.md").read_text()
    assert f"Converted {bert.name} ->" in capsys.readouterr().out


@pytest.mark.parametrize(
    "entry, message",
    [
        (True, r"'quantization' entry must be an object \(bits, group_size, mode\), got True"),
        ({"bits": 8, "group_size": 0}, r"'quantization' entry: affine quantization supports group sizes .*, not 0"),
        ({"bits": "8", "group_size": 32}, r"'quantization' entry: bits and group_size must be integers"),
        ({"bits": 7, "group_size": 32}, r"'quantization' entry: affine quantization supports bits .*, not 7"),
        ({"bits": 8, "group_size": 64}, r"its stored weights \(.*\) and scales \(.*\) do not fit config.json's"),
    ],
    ids=["not-an-object", "group-size-0", "string-bits", "bits-7", "other-group-size"],
)
def test_a_quantization_entry_that_does_not_fit_the_weights_is_named(tmp_path, bert_q8, entry, message):
    """Each would otherwise fail deep in MLX, or crash the process (a group size of 0: a division by zero)."""
    folder = shutil.copytree(bert_q8, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = entry
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        mlx_encoders.load_model(folder)


def test_a_float_checkpoint_with_another_librarys_quantization_config_loads(tmp_path, bert):
    folder = shutil.copytree(bert, tmp_path / "float")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": -1}
    (folder / "config.json").write_text(json.dumps(config))
    assert mlx_encoders.load_model(folder) is not None
    from safetensors.numpy import save_file  # the same library's quantized weights: refused, naming the method

    weights = load_file(folder / "model.safetensors")
    key = next(k for k in weights if k.endswith("intermediate.dense.weight"))
    weights[key.replace(".weight", ".qweight")] = weights.pop(key).view(np.int32)
    weights[key.replace(".weight", ".scales")] = np.ones(4, np.float16)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="quantized by 'gptq' \\(transformers' layout"):
        mlx_encoders.load_model(folder)


def test_a_failed_upload_says_the_folder_was_written_and_how_to_upload_it(tmp_path, bert, monkeypatch):
    import huggingface_hub

    class Unreachable:
        def create_repo(self, **kwargs):
            raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    with pytest.raises(CommandError, match=r"was written, but uploading it to me/x failed: .*hf upload me/x"):
        mlx_encoders.convert(bert, tmp_path / "up", bits=8, group_size=32, upload_repo="me/x")
    assert (tmp_path / "up" / "model.safetensors").exists()


def test_quantized_weights_without_their_config_entry_are_refused(tmp_path, bert_q8):
    """The bits and group size live in config.json alone: a folder that lost them is named, not unpacked with
    guessed settings."""
    folder = shutil.copytree(bert_q8, tmp_path / "stripped")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized tensors \(.*\.scales, \.\.\.\) but config.json has no"):
        mlx_encoders.load_model(folder)


def test_the_report_says_which_modules_gptq_fitted(bert, tmp_path, capsys):
    """GPTQ fits affine modules; a recipe's floating-point modes are rounded to nearest, and the card says so."""
    recipe = {"*attention*": {"bits": 4, "mode": "mxfp4", "group_size": 32}}
    out = mlx_encoders.convert(bert, tmp_path / "mixed", bits=8, group_size=32, recipe=recipe,
                               calibration=["a text to calibrate on"] * 4)  # fmt: skip
    assert "calibration texts for affine; mxfp4 rounded to nearest)" in (out / "README.md").read_text()


def test_calibration_texts_are_read_as_every_text_file(tmp_path):
    """A byte-order mark is no text to calibrate on, and a line ends at a line end only (not at U+2028 or a form
    feed inside it), as `records.text_lines` reads every other text file."""
    from convert.__main__ import calibration_arg

    file = tmp_path / "texts.txt"
    file.write_bytes("\ufefffirst text\r\nsecond\x0cpart\u2028still second\n\n".encode())
    assert calibration_arg(str(file)) == ["first text", "second\x0cpart\u2028still second"]
