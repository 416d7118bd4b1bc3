"""DeBERTa's configuration space against transformers, forward on a padded batch and gradients: c2p and p2c alone
or together, shared or own position projections, log-bucketed or plainly clamped distances, normalised relative
embeddings or not, a position table, embedding_size != hidden_size, the v2 xlarge convolution, both masked-LM
layouts, and DeBERTa v1. The default test configs (tests/checkpoints.py) run through every generic test."""

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from checkpoints import load_reference
from safetensors.numpy import load_file, save_file
from test_gradients import DROPOUT, check_gradients, scale_instead_of_dropping
from test_parity import TEXTS, as_torch, assert_close, check_parity, our_outputs, reference_outputs
from test_pipelines import assert_same, reference

import mlx_encoders

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {
    "c2p-own-keys-16-buckets": ("deberta-v2", "encoder", dict(
        pos_att_type=["c2p"], share_att_key=False, position_buckets=16, max_relative_positions=32,
    )),
    "p2c-own-queries-no-buckets": ("deberta-v2", "question-answering", dict(
        pos_att_type=["p2c"], share_att_key=False, position_buckets=-1, max_relative_positions=24,
    )),
    "both-own-projections-no-rel-norm": ("deberta-v2", "sequence-classification", dict(
        share_att_key=False, norm_rel_ebd="none", position_buckets=32, max_relative_positions=-1,
    )),
    "embedding-size-position-table-token-types": ("deberta-v2", "masked-lm", dict(
        embedding_size=16, position_biased_input=True, type_vocab_size=2,
    )),
    "conv-layer": ("deberta-v2", "question-answering", dict(conv_kernel_size=3, conv_groups=2, conv_act="gelu")),
    "lm-predictions-head": ("deberta-v2", "masked-lm", dict(legacy=False)),
    "legacy-head-untied": ("deberta-v2", "masked-lm", dict(tie_word_embeddings=False)),
    # the scale still counts pos_att_type's terms, as transformers' does
    "no-relative-attention": ("deberta-v2", "encoder", dict(relative_attention=False, position_biased_input=True)),
    "v1-c2p-no-position-table": ("deberta", "question-answering", dict(
        pos_att_type=["c2p"], position_biased_input=False, max_relative_positions=-1,
    )),
    "v1-embedding-size-lm-predictions": ("deberta", "sequence-classification", dict(
        embedding_size=16, pos_att_type=["p2c"], type_vocab_size=2,
    )),
}  # fmt: skip


def with_token_types(model, batch: dict) -> dict:
    """The batch, with alternating token types when the model reads them (a single text's would all be 0)."""
    if not model.args.type_vocab_size:
        return dict(batch)
    types = mx.broadcast_to(mx.arange(batch["input_ids"].shape[1]) % 2, batch["input_ids"].shape)
    return {**batch, "token_type_ids": types}


def check_forward(folder, task: str, texts=TEXTS):
    model, tokenizer = mlx_encoders.load(folder)
    batch = with_token_types(model, tokenizer(texts, padding=True, truncation=True))
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)


@pytest.mark.parametrize("model_type, task, config", VARIANTS.values(), ids=VARIANTS.keys())
def test_variant_matches_transformers(checkpoint, model_type, task, config):
    folder = checkpoint(model_type, task, **config)
    check_forward(folder, task)
    check_gradients(folder, task)


@pytest.mark.parametrize("model_type", ["deberta", "deberta-v2"])
def test_text_pairs_carry_token_types_where_the_config_has_a_table(checkpoint, model_type):
    """transformers' DeBERTa tokenizers return token types, and a model with a token-type table adds them: a pair's
    second text is type 1 (the released checkpoints have no table, and their tokenizers' types are unused)."""
    folder = checkpoint(model_type, "sequence-classification", type_vocab_size=2)
    first, second = ["A man is eating food.", "hello"], ["Someone eats a meal.", "world and more"]
    expected_batch = transformers.AutoTokenizer.from_pretrained(folder)(first, second, padding=True)
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(first, second, padding=True)
    np.testing.assert_array_equal(np.array(batch["token_type_ids"]), expected_batch["token_type_ids"])
    with torch.no_grad():
        expected = load_reference(folder, "sequence-classification")(**as_torch(batch)).logits.numpy()
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), {"logits": expected}, real, "sequence-classification")


def test_conv_layer_dropout_sits_where_transformers_puts_it(checkpoint, monkeypatch):
    scale_instead_of_dropping(monkeypatch)
    folder = checkpoint("deberta-v2", "masked-lm", conv_kernel_size=3, **DROPOUT["deberta-v2"])
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS[:3], padding=True)
    with torch.no_grad():
        out = load_reference(folder, "masked-lm").train()(**as_torch(batch))
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model.train()(**batch)), {"logits": out.logits.numpy()}, real, "masked-lm")


def test_relative_positions_need_no_position_table(checkpoint):
    """Without a position table, inputs past max_position_embeddings run, their distances clamped as there."""
    folder = checkpoint("deberta-v2")
    model = mlx_encoders.load_model(folder)
    ids = np.random.default_rng(0).integers(5, model.args.vocab_size, (2, model.args.max_position_embeddings + 20))
    batch = {"input_ids": mx.array(ids), "attention_mask": mx.ones(ids.shape, mx.int32)}
    real = np.ones(ids.shape, bool)
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, "encoder", batch), real, "encoder")


def test_pipelines_run_a_long_text_whole_without_a_position_table(checkpoint, tmp_path):
    """DeBERTa-v3's tokenizer sets no model_max_length and its model has no position table: transformers'
    pipelines run the whole text, and so do ours (they cut it at max_position_embeddings, another label)."""
    folder = shutil.copytree(checkpoint("deberta-v2", "sequence-classification", initializer_range=0.5), tmp_path / "m")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("model_max_length", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    ours = mlx_encoders.pipeline("text-classification", model=folder)
    theirs = reference("text-classification", folder, "sequence-classification", ours)
    assert len(theirs.tokenizer(text)["input_ids"]) > ours.model.args.max_position_embeddings
    assert_same(ours(text, top_k=None), theirs(text, top_k=None))


def edited_copy(folder, tmp_path, edit_config=None, add_weights=None):
    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    if add_weights:
        weights = load_file(target / "model.safetensors")
        save_file({**weights, **add_weights}, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_tensors_transformers_ignores_are_ignored(checkpoint, tmp_path):
    """A position table the config does not use, and v3's replaced-token-detection head (`mask_predictions`)."""
    folder = checkpoint("deberta-v2", "masked-lm")
    extra = {
        "deberta.embeddings.position_embeddings.weight": np.ones((128, 32), np.float32),
        "mask_predictions.dense.weight": np.ones((32, 32), np.float32),
        "mask_predictions.classifier.bias": np.ones(1, np.float32),
    }
    check_forward(edited_copy(folder, tmp_path, add_weights=extra), "masked-lm")


def test_pos_att_type_as_a_string(checkpoint, tmp_path):
    def spelled(config):
        config["pos_att_type"] = "p2c|c2p"

    folder = edited_copy(checkpoint("deberta-v2", "token-classification"), tmp_path, spelled)
    check_parity(folder, "token-classification")
    assert mlx_encoders.load_model(folder).config["pos_att_type"] == "p2c|c2p"  # written back as read


def test_saved_conv_layer_reads_back_in_transformers(checkpoint, tmp_path):
    """The convolution's weight is stored (out, in, k) as in torch, MLX's (out, k, in) in the model."""
    model, tokenizer = mlx_encoders.load(checkpoint("deberta-v2", "encoder", conv_kernel_size=3))
    saved = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    check_forward(saved, "encoder", TEXTS[:3])


def test_fill_mask_with_the_lm_predictions_head(checkpoint):
    folder = checkpoint("deberta-v2", "masked-lm", legacy=False, initializer_range=0.8)
    ours = mlx_encoders.pipeline("fill-mask", model=folder)
    ref = reference("fill-mask", folder, "masked-lm", ours)
    texts = [f"The capital of France is {ours.tokenizer.mask_token}.", f"A {ours.tokenizer.mask_token} walks in."]
    assert_same(ours(texts, top_k=3), ref(texts, top_k=3))


@pytest.mark.parametrize("model_type", ["deberta-v2", "deberta"])
def test_masked_lm_head_is_the_one_the_weights_hold_when_config_says_none(checkpoint, tmp_path, model_type):
    """The hub's DeBERTa checkpoints (microsoft/deberta-v3-base) hold `lm_predictions.lm_head` and say no `legacy`,
    whose default is `cls.predictions`: transformers then needs legacy=False to load their head."""
    stored = checkpoint(model_type, "masked-lm", legacy=False)
    folder = edited_copy(stored, tmp_path, lambda config: config.pop("legacy"))
    model, tokenizer = mlx_encoders.load(folder)
    assert "lm_predictions" in model and "cls" not in model
    batch = tokenizer(TEXTS, padding=True, truncation=True)
    oracle = transformers.AutoModelForMaskedLM.from_pretrained(folder, legacy=False, attn_implementation="eager")
    with torch.no_grad():
        expected = oracle.eval()(**as_torch(batch)).logits.numpy()
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close(our_outputs(model(**batch)), {"logits": expected}, real, "masked-lm")
    saved = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    assert json.loads((saved / "config.json").read_text())["legacy"] is False  # transformers reads the same head
    check_forward(saved, "masked-lm", TEXTS[:3])


@pytest.mark.parametrize("stored, said", [("lm_predictions.lm_head", True), ("cls.predictions", False)])
def test_legacy_the_weights_contradict_fails_naming_both_layouts(checkpoint, tmp_path, stored, said):
    folder = checkpoint("deberta-v2", "masked-lm", legacy=not said)
    folder = edited_copy(folder, tmp_path, lambda config: config.update(legacy=said))
    asked = "cls.predictions" if said else "lm_predictions.lm_head"
    message = (
        f"config.json: config key 'legacy' is {json.dumps(said)}, which asks for the `{asked}` masked-LM head, but "
        f'the weights hold `{stored}`; set "legacy": {json.dumps(not said)} in config.json'
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        mlx_encoders.load_model(folder)
    mlx_encoders.load_model(folder, task="encoder")  # loads: the encoder alone does not read the head


@pytest.mark.parametrize(
    "model_type, edit, message",
    [
        ("deberta-v2", dict(pos_att_type=["c2p", "p2p"]), "may list 'c2p' and 'p2c' only"),
        ("deberta-v2", dict(conv_act="nope"), "Unsupported activation 'nope'"),
        ("deberta", dict(talking_head=True), "talking-head attention is not supported"),
    ],
)
def test_configs_that_cannot_work_fail_at_load(checkpoint, tmp_path, model_type, edit, message):
    folder = edited_copy(checkpoint(model_type), tmp_path, lambda config: config.update(edit))
    with pytest.raises(ValueError, match=message):
        mlx_encoders.load_model(folder)
