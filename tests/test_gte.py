"""GTE beyond the registry's tests (which hold every architecture to transformers: outputs and gradients of every
head, dropout, save -> transformers, quantized kernels, LoRA targets): Alibaba's own key layout and config
spelling, gte-base-en-v1.5's layout without token types, mixed-length batches against one-by-one runs, the
sentence-transformers folder as snowflake-arctic-embed-m-v2.0 lays it out (CLS pooling, Normalize, a `query: `
prompt, Matryoshka `truncate_dim`), 8- and 4-bit conversion, the server, the index, embedding training with
LoRA (the checks are test_nomic_bert.py's), and gte-multilingual-reranker-base's layout as a CrossEncoder.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from checkpoints import make_checkpoint
from safetensors.numpy import load_file, save_file
from test_nomic_bert import (
    DYNAMIC,
    check_batch_equals_one_by_one,
    check_conversion,
    check_dynamic_rope,
    check_lora_embedding_training,
    check_sentence_transformers,
    check_serve_and_index,
    st_folder,
)
from test_parity import assert_close, check_parity, our_outputs, reference_outputs

import mlx_encoders

# snowflake-arctic-embed-m-v2.0's config_sentence_transformers.json prompts
ARCTIC_PROMPTS = {"query": "query: "}


def copy_with(folder: Path, target: Path, config_edit=None, key_edit=None) -> Path:
    shutil.copytree(folder, target)
    if config_edit is not None:
        config = json.loads((target / "config.json").read_text())
        config_edit(config)
        (target / "config.json").write_text(json.dumps(config))
    if key_edit is not None:
        weights = load_file(target / "model.safetensors")
        save_file({key_edit(k): v for k, v in weights.items()}, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("task", ["masked-lm", "sequence-classification"])
def test_alibaba_layout_and_config_spelling_match_transformers(checkpoint, tmp_path, task):
    """transformers writes Alibaba's keys (`encoder.layer.{i}.attention.qkv_proj`, `mlp.up_gate_proj`, `lm_head.norm`,
    ...); their files put them under `new.` and spell the rotary base `rope_theta` beside `rope_scaling: null`."""
    folder = checkpoint("gte", task)
    keys = load_file(folder / "model.safetensors")
    assert any(k.endswith("attention.qkv_proj.weight") for k in keys) and any("up_gate_proj" in k for k in keys)

    def legacy(config):
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config.update(rope_scaling=None, logn_attention_scale=False, pack_qkv=True)

    renamed = copy_with(folder, tmp_path / "new", legacy, lambda k: "new." + k[4:] if k.startswith("gte.") else k)
    model, tokenizer = mlx_encoders.load(renamed)
    batch = tokenizer(["a text", "another, longer text"], padding=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_without_token_types_as_gte_base_en_v1_5(checkpoint, task):
    folder = checkpoint("gte", task, type_vocab_size=0)
    assert not any("token_type" in k for k in load_file(folder / "model.safetensors"))
    check_parity(folder, task)


def test_text_pairs_carry_token_types_where_the_config_has_two(checkpoint):
    """A GTE with two token types (its config allows any): the tokenizer gives the model its token types (with a
    WordPiece tokenizer, as gte-base-en-v1.5's, the second text's are 1; this test's XLM-R one gives 0s)."""
    folder = checkpoint("gte", "encoder", type_vocab_size=2)
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(["a query", "who wrote it"], ["a passage of text", "someone"], padding=True)
    assert "token_type_ids" in batch
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, "encoder", batch), real, "encoder")


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(rope_parameters=None, rope_scaling={"type": "ntk", "factor": 2.0}), "'rope_scaling': rope type 'ntk' is"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), "'rope_scaling': rope type 'linear' is not"),
        (dict(logn_attention_scale=True), "'logn_attention_scale' is true"),
    ],
)
def test_what_transformers_cannot_compute_fails_naming_the_key(checkpoint, tmp_path, edit, message):
    folder = copy_with(checkpoint("gte"), tmp_path / "ckpt", lambda config: config.update(edit))
    with pytest.raises(ValueError, match=message):
        mlx_encoders.load_model(folder)


def test_dynamic_rope_matches_transformers_within_and_past_the_trained_length(checkpoint):
    check_dynamic_rope(checkpoint("gte", "encoder", **DYNAMIC), "encoder")


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_head_dim_other_than_hidden_size_over_heads_matches_transformers(checkpoint, task):
    check_parity(checkpoint("gte", task, head_dim=16), task)  # hidden 32 over 4 heads would be 8


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_mixed_length_batch_equals_one_by_one(checkpoint, task):
    check_batch_equals_one_by_one(checkpoint("gte", task))


@pytest.fixture(scope="module")
def arctic_folder(tmp_path_factory) -> Path:
    """snowflake-arctic-embed-m-v2.0's modules (gte-multilingual-base's too, less the prompt): CLS, Normalize."""
    root = tmp_path_factory.mktemp("gte")
    ckpt = make_checkpoint(root / "ckpt", "gte", hidden_size=64, intermediate_size=64)
    return st_folder(root / "st", ckpt, "cls", normalize=True, prompts=ARCTIC_PROMPTS)


def test_sentence_transformers_folder_with_prompts_and_truncate_dim(arctic_folder):
    check_sentence_transformers(arctic_folder, truncate_dim=16)


@pytest.mark.parametrize("bits, min_cosine, mean_cosine", [(8, 0.999, 0.9995), (4, 0.85, 0.95)])
def test_converted_folder_embeds_close_to_float(arctic_folder, bits, min_cosine, mean_cosine):
    check_conversion(arctic_folder, bits, min_cosine, mean_cosine)


def test_serve_and_index(arctic_folder, tmp_path):
    check_serve_and_index(arctic_folder, tmp_path)


def test_lora_embedding_training(arctic_folder, tmp_path):
    check_lora_embedding_training(arctic_folder, tmp_path, {"q_proj", "k_proj", "v_proj"})


def test_reranker_equals_sentence_transformers_cross_encoder(checkpoint, one_torch_thread):
    """gte-multilingual-reranker-base's layout: the classification head with one label, read as a CrossEncoder."""
    from sentence_transformers import CrossEncoder as TorchCrossEncoder

    from mlx_encoders import CrossEncoder

    folder = checkpoint("gte", "sequence-classification", num_labels=1)
    pairs = [("where do cats sleep", "Cats sleep on warm windowsills."), ("capital of France", "Berlin, Germany.")]
    pairs += [("a query", ""), ("tea", "Pour hot water over the leaves and wait a few minutes before drinking.")]
    expected = TorchCrossEncoder(str(folder), device="cpu").predict(pairs, convert_to_numpy=True)
    np.testing.assert_allclose(CrossEncoder(folder).predict(pairs), expected, atol=1e-5)
