"""GPT-2 equals transformers: logits of every head on padded batches with and without the key/value cache,
gradients, every config key it honours, checkpoints in both directions, and convert's 8- and 4-bit models."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from checkpoints import AUTO_CLASSES, load_reference
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file
from test_parity import as_torch, assert_close
from tolerance import assert_float32_close

import mlx_encoders
from mlx_encoders.checkpoint import save
from mlx_encoders.generation.loop import left_pad
from mlx_encoders.models import DECODER_TYPES, model_module

CASES = [(mt, task) for mt in DECODER_TYPES for task in model_module(mt).MODELS]
TEXTS = ["word", "The quick brown fox jumps over the lazy dog.", "Return the value, or None."]
# Every config key transformers' GPT-2 reads that changes the forward pass, each away from its default.
CONFIG_KEYS = [
    dict(scale_attn_weights=False),
    dict(scale_attn_by_inverse_layer_idx=True),
    dict(reorder_and_upcast_attn=True),
    dict(n_inner=None, activation_function="relu", layer_norm_epsilon=1e-3),
    dict(tie_word_embeddings=False),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def folder_for(checkpoint, model_type: str, task: str, **overrides):
    pad = {"pad_token_id": 0} if task == "sequence-classification" else {}  # GPT-2 classifies batches with one
    return checkpoint(model_type, task, **pad, **overrides)


def output(out) -> np.ndarray:
    return np.array(out.logits if out.logits is not None else out.last_hidden_state)


def reference(folder, task: str, **inputs) -> np.ndarray:
    with torch.no_grad():
        out = load_reference(folder, task)(**{k: torch.tensor(np.array(v)) for k, v in inputs.items()})
    return (out.logits if "logits" in out else out.last_hidden_state).numpy()


def left_padded(tokenizer) -> dict[str, mx.array]:
    """TEXTS left-padded, with the positions transformers' generate gives them."""
    ids, mask = left_pad([e.ids for e in tokenizer.encode_batch(TEXTS)], pad=0)
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)
    return {"input_ids": mx.array(ids), "attention_mask": mx.array(mask), "position_ids": mx.array(positions)}


@pytest.mark.parametrize("model_type,task", CASES)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_matches_transformers(checkpoint, model_type, task, padding):
    folder = folder_for(checkpoint, model_type, task)
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True)) if padding == "right" else left_padded(tokenizer)
    real = np.array(batch["attention_mask"]).astype(bool)
    theirs = reference(folder, task, **batch)
    ours = output(model(**batch))
    assert_close({"logits": ours}, {"logits": theirs}, real, task)


@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_cache_changes_nothing(checkpoint, model_type):
    """The prompt in two chunks, then one token at a time through the cache: the logits of one full pass (1e-5)
    and of transformers (1e-4), on a left-padded batch."""
    folder = folder_for(checkpoint, model_type, "causal-lm")
    model, tokenizer = mlx_encoders.load(folder)
    batch = left_padded(tokenizer)
    full = np.array(model(**batch).logits)
    cache, pieces, L = model.make_cache(), [], full.shape[1]
    for start, end in [(0, 5), *((i, i + 1) for i in range(5, L))]:
        out = model(
            batch["input_ids"][:, start:end],
            attention_mask=batch["attention_mask"][:, :end],
            position_ids=batch["position_ids"][:, start:end],
            cache=cache,
        )
        pieces.append(np.array(out.logits))
    cached = np.concatenate(pieces, axis=1)
    real = np.array(batch["attention_mask"]).astype(bool)
    scale = np.abs(full[real]).max()
    assert np.abs(cached[real] - full[real]).max() <= 1e-5 * max(1.0, scale)
    assert_close({"logits": cached}, {"logits": reference(folder, "causal-lm", **batch)}, real, "causal-lm")


@pytest.mark.parametrize("overrides", CONFIG_KEYS, ids=lambda o: ",".join(o))
def test_config_keys_are_honoured(checkpoint, overrides):
    folder = checkpoint("gpt2", "causal-lm", **overrides)
    model, tokenizer = mlx_encoders.load(folder)
    batch = left_padded(tokenizer)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close({"logits": output(model(**batch))}, {"logits": reference(folder, "causal-lm", **batch)}, real, "")


def test_config_keys_that_cannot_work_are_refused(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("gpt2", "causal-lm"), tmp_path / "ckpt")
    for edit, message in [
        ({"add_cross_attention": True}, "config key 'add_cross_attention' is true: .* not supported"),
        ({"activation_function": "swoosh"}, "config key 'activation_function': unsupported activation 'swoosh'"),
        ({"n_embd": 30}, "the hidden size 30 is not divisible by the number of attention heads 4"),
        ({"n_head": 0}, "config key 'n_head' must be a positive integer"),
        ({"attn_pdrop": 1.0}, "config key 'attn_pdrop' is a probability below 1"),
    ]:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=f"config.json: {message}"):
            mlx_encoders.load_model(folder)
        (folder / "config.json").write_text(json.dumps(config))


def test_gradients_match_transformers(checkpoint):
    """The causal-LM loss (next-token cross-entropy on real tokens) and every parameter's gradient."""
    folder = checkpoint("gpt2", "causal-lm")
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    ids, mask = np.array(batch["input_ids"]), np.array(batch["attention_mask"])
    labels = np.where(mask == 1, ids, -100)

    def loss_fn():
        logits = model(**batch).logits[:, :-1]
        targets, keep = mx.array(labels[:, 1:]), mx.array(labels[:, 1:] != -100)
        losses = nn.losses.cross_entropy(logits, mx.maximum(targets, 0), reduction="none")
        return (losses * keep).sum() / keep.sum()

    loss, grads = nn.value_and_grad(model, loss_fn)()
    ref = load_reference(folder, "causal-lm")
    expected = ref(**as_torch(batch), labels=torch.tensor(labels, dtype=torch.long))
    expected.loss.backward()
    assert abs(loss.item() - expected.loss.item()) <= 1e-5 * expected.loss.item()
    theirs = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    ours = {k: np.array(v) for k, v in tree_flatten(grads)}
    assert set(ours) == set(theirs)
    scale = max(float(np.abs(g).max()) for g in theirs.values())
    for name, g in ours.items():
        g = g.T if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else g  # Conv1D: [in, out]
        assert np.abs(g - theirs[name]).max() <= 1e-4 * scale, name
    model.gradient_checkpointing_enable()  # recomputes each block's activations: the same gradients
    checkpointed = dict(tree_flatten(nn.value_and_grad(model, loss_fn)()[1]))
    for name, g in ours.items():
        np.testing.assert_allclose(np.array(checkpointed[name]), g, rtol=1e-5, atol=1e-7 * scale, err_msg=name)


@pytest.mark.parametrize("model_type,task", CASES)
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(checkpoint, tmp_path, model_type, task):
    model, tokenizer = mlx_encoders.load(folder_for(checkpoint, model_type, task))
    folder = save(model, tmp_path / "saved", tokenizer)
    loaded, info = AUTO_CLASSES[task].from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    assert type(loaded).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    batch = dict(tokenizer(TEXTS, padding=True))
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close({"logits": output(model(**batch))}, {"logits": reference(folder, task, **batch)}, real, task, 1e-5)
    again = mlx_encoders.load_model(folder)
    for key, value in tree_flatten(model.parameters()):
        np.testing.assert_array_equal(np.array(dict(tree_flatten(again.parameters()))[key]), np.array(value))


def test_original_openai_layout_loads(checkpoint, tmp_path):
    """The hub's gpt2 files: no `transformer.` prefix, causal-mask buffers, and a stored copy of the tied head."""
    folder = shutil.copytree(checkpoint("gpt2", "causal-lm"), tmp_path / "old")
    weights = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    for i in range(3):
        weights[f"h.{i}.attn.bias"] = np.tril(np.ones((64, 64), np.float32))[None, None]
        weights[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    weights["lm_head.weight"] = weights["wte.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    expected = output(mlx_encoders.load_model(checkpoint("gpt2", "causal-lm"))(**batch))
    np.testing.assert_array_equal(output(model(**batch)), expected)


def test_mlx_lm_layout_loads(checkpoint, tmp_path):
    """mlx-lm's GPT-2 folders (mlx_lm/models/gpt2.py): blocks under `model.`, every weight [out, in] already."""
    source = checkpoint("gpt2", "causal-lm")
    folder = shutil.copytree(source, tmp_path / "mlx-lm")
    conv = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    weights = {
        "model." + key.removeprefix("transformer."): value.T.copy() if key.endswith(conv) else value
        for key, value in load_file(folder / "model.safetensors").items()
    }
    assert weights["model.h.0.attn.c_proj.weight"].shape[0] == weights["model.h.0.attn.c_proj.weight"].shape[1]
    save_file(weights, folder / "model.safetensors", metadata={"format": "mlx"})
    model, tokenizer = mlx_encoders.load(folder)
    batch = dict(tokenizer(TEXTS, padding=True))
    with torch.no_grad():
        expected = load_reference(source, "causal-lm")(**as_torch(batch)).logits.numpy()
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close({"logits": output(model(**batch))}, {"logits": expected}, real, "causal-lm")


def test_bad_inputs_fail_naming_the_limit(checkpoint):
    model = mlx_encoders.load_model(checkpoint("gpt2", "causal-lm"))
    with pytest.raises(ValueError, match="input of 65 tokens is longer than the 64 positions.*n_positions=64"):
        model(mx.zeros((1, 65), mx.int32))
    cache = model.make_cache()
    model(mx.zeros((1, 60), mx.int32), cache=cache)
    with pytest.raises(ValueError, match="input of 65 tokens is longer than the 64 positions"):
        model(mx.zeros((1, 5), mx.int32), cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 1\), but 60 cached and 1 new tokens need"):
        model(mx.zeros((1, 1), mx.int32), attention_mask=mx.ones((1, 1)), cache=cache)
    with pytest.raises(ValueError, match="input_ids holds token id 512, outside the vocabulary of 512"):
        model(mx.array([[512]]))
    with pytest.raises(ValueError, match="position_ids holds 64, outside the model's 64 positions"):
        model(mx.array([[1]]), position_ids=mx.array([[64]]))


@pytest.mark.parametrize("bits", [8, 4])
def test_convert_quantizes_and_reports_perplexity(checkpoint, tmp_path, capsys, bits):
    source = checkpoint("gpt2", "causal-lm", n_embd=64, n_inner=128, initializer_range=0.05)
    target = mlx_encoders.convert(source, tmp_path / f"q{bits}", bits=bits, group_size=32, calibration=False)
    report = capsys.readouterr().out
    assert "perplexity" in report and f"{bits}-bit affine" in report
    before, after = (float(x) for x in report.split("perplexity")[1].split()[:3:2])
    assert before > 1 and abs(after / before - 1) < (0.01 if bits == 8 else 0.1)
    assert "Perplexity on the probe texts" in (target / "README.md").read_text()
    model, tokenizer = mlx_encoders.load(target)
    assert isinstance(model.transformer.h[0].attn.c_attn, nn.QuantizedLinear)
    assert isinstance(model.transformer.wte, nn.QuantizedEmbedding)
    assert model.transformer.wpe.bits == 8  # a position table: 8 bits below 8, as the encoders' are
    text = mlx_encoders.generate(model, tokenizer, "Return the", max_new_tokens=5)
    assert isinstance(text, str)
    float_model = mlx_encoders.load_model(source)
    batch = dict(tokenizer(TEXTS, padding=True))
    real = np.array(batch["attention_mask"]).astype(bool)
    a, b = output(model(**batch))[real], output(float_model(**batch))[real]
    assert np.abs(a - b).max() < (0.05 if bits == 8 else 0.5) * np.abs(b).max()


def test_new_classification_head_on_a_language_model(checkpoint):
    source = checkpoint("gpt2", "causal-lm")
    with pytest.warns(UserWarning, match="newly initialized: score.weight"):
        model = mlx_encoders.load_model(source, task="sequence-classification", num_labels=3)
    assert model(mx.array([[5, 6, 7]])).logits.shape == (1, 3)
    with pytest.raises(ValueError, match="no pad_token_id and no attention_mask was given"):
        model(mx.array([[5, 6], [7, 8]]))
    # Without a pad token the mask says where each text ends: a padded row scores as that text alone.
    padded = model(mx.array([[5, 6, 7], [8, 9, 0]]), attention_mask=mx.array([[1, 1, 1], [1, 1, 0]])).logits
    alone = model(mx.array([[8, 9]])).logits[0]
    config = transformers.GPT2Config.from_pretrained(source)
    terms = config.n_layer * (config.n_embd + (config.n_inner or 4 * config.n_embd) + 3)
    assert_float32_close(np.array(padded[1]), np.array(alone), terms)
    assert config.pad_token_id is None
