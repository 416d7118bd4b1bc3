"""Loading: hub ids, task overrides, key fixes, shards, dtypes, quantized checkpoints and every refusal."""

import json
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

import mlx_encoders

TEXTS = ["hello there", "a second, longer text for the batch"]


def copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "ckpt")


def edit_weights(folder, edit):
    file = folder / "model.safetensors"
    weights = load_file(file)
    edit(weights)
    save_file(weights, file, metadata={"format": "pt"})


def edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def hidden(folder, **kwargs) -> np.ndarray:
    model, tokenizer = mlx_encoders.load(folder, **kwargs)
    out = model(**tokenizer(TEXTS))
    return np.array(out.logits if out.logits is not None else out.last_hidden_state)


def test_hub_id_loads_from_offline_cache(checkpoint, hub_cache):
    folder = checkpoint("bert", "masked-lm")
    hub_cache("some-org/tiny-bert", folder)
    np.testing.assert_array_equal(hidden("some-org/tiny-bert"), hidden(folder))


def test_hub_id_missing_from_offline_cache(hub_cache):
    with pytest.raises(FileNotFoundError, match="some-org/absent.*HF_HUB_OFFLINE"):
        mlx_encoders.load("some-org/absent")


def test_missing_local_folder():
    with pytest.raises(FileNotFoundError, match="No checkpoint folder at ./nowhere"):
        mlx_encoders.load("./nowhere")


def test_task_override_gives_the_encoder_of_an_mlm_checkpoint(checkpoint):
    folder = checkpoint("roberta", "masked-lm")
    model, tokenizer = mlx_encoders.load(folder, task="encoder")
    assert type(model).__name__ == "RobertaModel" and model.args.max_tokens
    batch = tokenizer(TEXTS)
    with torch.no_grad():
        ref = load_reference(folder, "encoder")(**{k: torch.tensor(np.array(v)) for k, v in batch.items()})
    real = np.array(batch["attention_mask"]).astype(bool)
    ours = np.array(model(**batch).last_hidden_state)
    np.testing.assert_allclose(ours[real], ref.last_hidden_state.numpy()[real], atol=1e-4)


def test_task_override_keeps_the_mlm_head_of_a_pretraining_checkpoint(checkpoint):
    folder = checkpoint("bert", "pretraining")
    model, tokenizer = mlx_encoders.load(folder, task="masked-lm")
    assert type(model).__name__ == "BertForMaskedLM"
    full, _ = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS)
    np.testing.assert_array_equal(np.array(model(**batch).logits), np.array(full(**batch).logits))


def test_task_override_refuses_a_head_the_checkpoint_lacks(checkpoint):
    with pytest.raises(ValueError, match="missing from the checkpoint: classifier.bias, classifier.weight"):
        mlx_encoders.load(checkpoint("distilbert", "masked-lm"), task="token-classification")


def test_unknown_task(checkpoint):
    with pytest.raises(ValueError, match="Unknown task 'summarize'; choose one of: encoder, masked-lm"):
        mlx_encoders.load_model(checkpoint("bert"), task="summarize")


def test_encoder_checkpoint_without_prefix_loads_into_a_head_model(checkpoint, tmp_path):
    """sentence-transformers checkpoints store the bare encoder; `bert.` is added for head classes."""
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)

    def strip(weights):
        for key in [k for k in weights if k.startswith("bert.")]:
            weights[key[len("bert.") :]] = weights.pop(key)

    edit_weights(folder, strip)
    np.testing.assert_array_equal(hidden(folder), hidden(checkpoint("bert", "masked-lm")))


def test_legacy_gamma_beta_position_ids_and_stored_tied_decoder(checkpoint, tmp_path):
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)

    def legacy(weights):
        for key in [k for k in weights if "LayerNorm" in k]:
            weights[key.replace(".weight", ".gamma").replace(".bias", ".beta")] = weights.pop(key)
        weights["bert.embeddings.position_ids"] = np.arange(128)[None]
        weights["cls.predictions.decoder.weight"] = weights["bert.embeddings.word_embeddings.weight"]
        weights["cls.predictions.decoder.bias"] = weights["cls.predictions.bias"]

    edit_weights(folder, legacy)
    assert any(k.endswith("gamma") for k in load_file(folder / "model.safetensors"))
    np.testing.assert_array_equal(hidden(folder), hidden(checkpoint("bert", "masked-lm")))


def test_sharded_checkpoint(checkpoint, tmp_path):
    source = checkpoint("albert", "sequence-classification")
    model = load_reference(source, "sequence-classification")
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    np.testing.assert_array_equal(hidden(folder), hidden(source))


def test_missing_shard_is_named(checkpoint, tmp_path):
    folder = tmp_path / "sharded"
    load_reference(checkpoint("bert"), "encoder").save_pretrained(folder, max_shard_size="50KB")
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        mlx_encoders.load_model(folder)


def test_missing_key_is_named(checkpoint, tmp_path):
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)
    edit_weights(folder, lambda w: w.pop("bert.encoder.layer.1.output.dense.weight"))
    with pytest.raises(ValueError, match="missing from the checkpoint: bert.encoder.layer.1.output.dense.weight"):
        mlx_encoders.load_model(folder)


def test_unexpected_key_is_named(checkpoint, tmp_path):
    folder = copy(checkpoint("bert", "masked-lm"), tmp_path)
    edit_weights(folder, lambda w: w.update({"bert.encoder.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match="not used by BertForMaskedLM: bert.encoder.extra.weight"):
        mlx_encoders.load_model(folder)


def test_shape_mismatch_is_named(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    edit_config(folder, lambda c: c.update(intermediate_size=38))
    with pytest.raises(
        ValueError, match=r"encoder.layer.0.intermediate.dense.bias is \(37,\) in the file but \(38,\) in the model"
    ):
        mlx_encoders.load_model(folder)


def test_alibaba_s_model_type_names_the_one_that_loads(checkpoint, tmp_path):
    """gte-multilingual / gte-*-v1.5 say "new" (their remote code's name); the error says what to write."""
    folder = copy(checkpoint("gte"), tmp_path)
    edit_config(folder, lambda c: c.update(model_type="new"))
    with pytest.raises(ValueError, match="""Unsupported model_type 'new' .*set "model_type": "gte" in its config"""):
        mlx_encoders.load_model(folder)
    edit_config(folder, lambda c: c.update(model_type="gte"))
    mlx_encoders.load_model(folder)


def test_unknown_model_type_lists_supported(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    edit_config(folder, lambda c: c.update(model_type="funnel"))
    with pytest.raises(ValueError, match="Unsupported model_type 'funnel'.*bert, roberta, xlm-roberta, distilbert"):
        mlx_encoders.load_model(folder)


def test_unsupported_head_is_refused(checkpoint, tmp_path):
    folder = copy(checkpoint("roberta"), tmp_path)
    edit_config(folder, lambda c: c.update(architectures=["RobertaForCausalLM"]))
    with pytest.raises(ValueError, match="Unsupported architecture 'RobertaForCausalLM'"):
        mlx_encoders.load_model(folder)


def test_pickle_only_checkpoint_is_refused_without_unpickling(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(ValueError, match="only pickle weights \\(pytorch_model.bin\\).*safetensors"):
        mlx_encoders.load_model(folder)
    # the advice names the checkpoint's own class: AutoModel would save it without its head
    with pytest.raises(
        ValueError, match=r"`transformers.BertModel.from_pretrained\(path\).save_pretrained\(new_path\)`"
    ):
        mlx_encoders.load_model(folder)


def test_no_weights_at_all(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="No model.safetensors"):
        mlx_encoders.load_model(folder)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="No config.json in"):
        mlx_encoders.load_model(tmp_path)


def test_a_training_runs_output_folder_points_to_its_model_folder(checkpoint, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(checkpoint("bert", "sequence-classification"), run / "model")
    hint = f"No config.json in {run}; it looks like a training run's output: pass {run / 'model'}"
    with pytest.raises(FileNotFoundError, match=re.escape(hint)):
        mlx_encoders.load(run)
    with pytest.raises(FileNotFoundError, match=re.escape(hint)):
        mlx_encoders.pipeline("text-classification", model=run)


def test_missing_tokenizer_json_says_what_to_do(checkpoint, tmp_path):
    folder = copy(checkpoint("bert"), tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="No tokenizer.json in .*load_model"):
        mlx_encoders.load(folder)
    assert mlx_encoders.load_model(folder) is not None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stored_dtype_is_kept_and_dtype_argument_casts(checkpoint, tmp_path, dtype):
    source = checkpoint("modernbert", "masked-lm")
    folder = tmp_path / dtype
    load_reference(source, "masked-lm").to(getattr(torch, dtype)).save_pretrained(folder)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    stored = mlx_encoders.load_model(folder, as_stored=True)  # the default computes in float32 on the CPU
    assert {v.dtype for _, v in tree_flatten(stored.parameters())} == {getattr(mx, dtype)}
    cast = mlx_encoders.load_model(folder, dtype="float32")
    assert {v.dtype for _, v in tree_flatten(cast.parameters())} == {mx.float32}


def save_mlx_community(model: nn.Module, folder, config: dict):
    """What mlx-lm-style converters publish: model keys, uint32 weight + scales + biases, and `quantization`."""
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 32)])
def test_quantized_checkpoint_loads_exactly_the_stored_quantized_modules(checkpoint, tmp_path, bits, group_size):
    source = checkpoint("bert", "masked-lm", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model, tokenizer = mlx_encoders.load(source)
    batch = tokenizer(TEXTS)
    float_logits = np.array(model(**batch).logits)
    keep_float = "bert.encoder.layer.0.attention.self.query"  # a module left in float, as recipes do
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and p != keep_float,
    )
    expected = np.array(model(**batch).logits)
    config = {**model.config, "quantization": {"group_size": group_size, "bits": bits, "mode": "affine"}}
    folder = tmp_path / "quantized"
    save_mlx_community(model, folder, config)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")

    loaded, tokenizer = mlx_encoders.load(folder)
    modules = dict(loaded.named_modules())
    assert isinstance(modules[keep_float], nn.Linear) and not isinstance(modules[keep_float], nn.QuantizedLinear)
    assert isinstance(modules["bert.encoder.layer.0.attention.self.key"], nn.QuantizedLinear)
    assert isinstance(modules["bert.embeddings.word_embeddings"], nn.QuantizedEmbedding)
    assert modules["bert.embeddings.word_embeddings"].bits == bits
    logits = np.array(loaded(**batch).logits)
    np.testing.assert_array_equal(logits, expected)
    assert np.abs(logits - float_logits).max() < (0.05 if bits == 8 else 0.5) * np.abs(float_logits).max()


def test_quantized_checkpoint_honours_per_module_overrides(checkpoint, tmp_path):
    source = checkpoint("bert", "masked-lm", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model = mlx_encoders.load_model(source)
    special = "cls.predictions.transform.dense"
    override = {"group_size": 32, "bits": 8}
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: override if p == special else hasattr(m, "to_quantized"))
    quantization = {"group_size": 64, "bits": 4, special: {"group_size": 32, "bits": 8}}
    save_mlx_community(model, tmp_path / "q", {**model.config, "quantization": quantization})
    modules = dict(mlx_encoders.load_model(tmp_path / "q").named_modules())
    assert (modules[special].bits, modules[special].group_size) == (8, 32)
    assert modules["bert.encoder.layer.0.output.dense"].bits == 4


@pytest.mark.parametrize(
    "model_type, key",
    [
        ("bert", "cls.predictions.decoder.weight"),
        ("roberta", "lm_head.decoder.weight"),
        ("deberta-v2", "cls.predictions.decoder.weight"),  # its untied decoder's bias is the head's, as tied
    ],
)
def test_a_tied_head_stored_with_other_values_is_kept_as_transformers_keeps_it(checkpoint, tmp_path, model_type, key):
    """config.json ties the output layer, but the file's copy differs: transformers 5 unties and keeps it."""
    folder = copy(checkpoint(model_type, "masked-lm"), tmp_path)
    rng = np.random.default_rng(0)

    def store_apart(weights):
        embeddings = next(v for k, v in weights.items() if k.endswith("word_embeddings.weight"))
        weights[key] = (embeddings + rng.normal(0, 0.05, embeddings.shape)).astype(embeddings.dtype)

    edit_weights(folder, store_apart)
    edit_config(folder, lambda c: c.update(tie_word_embeddings=True))
    reference = load_reference(folder, "masked-lm")
    with pytest.warns(UserWarning, match=f"stores {re.escape(key)} with other values; it is loaded as the model's own"):
        model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS)
    with torch.no_grad():
        expected = reference(**{k: torch.tensor(np.array(v)) for k, v in batch.items()}).logits.numpy()
    got = np.array(model(**batch).logits)
    mask = np.array(batch["attention_mask"], bool)
    np.testing.assert_allclose(got[mask], expected[mask], rtol=1e-4, atol=1e-4 * np.abs(expected).max())
