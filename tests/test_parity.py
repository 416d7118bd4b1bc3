"""Every architecture x head equals transformers on padded batches (fp32, compared on real tokens)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from checkpoints import language_model_task, load_reference
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.models import MODEL_TYPES, architecture_name, model_module

CASES = [(mt, task) for mt in MODEL_TYPES for task in model_module(mt).MODELS]
# Edge lengths: an empty text (specials only), one word, a sentence, and one cut at the model's limit.
TEXTS = [
    "",
    "word",
    "The quick brown fox jumps over the lazy dog.",
    " ".join(["A much longer text, repeated until truncation cuts it at the position limit."] * 30),
]
# Outputs with one row per token; the rest have one row per text.
TOKEN_LEVEL = {"last_hidden_state", "logits", "start_logits", "end_logits", "prediction_logits"}


def as_torch(batch: dict) -> dict:
    return {k: torch.tensor(np.array(v), dtype=torch.long) for k, v in batch.items()}


def reference_outputs(folder, task, batch) -> dict:
    ref = load_reference(folder, task)
    with torch.no_grad():
        out = ref(**as_torch(batch))
    return {k: v.numpy() for k, v in out.items() if isinstance(v, torch.Tensor)}


def our_outputs(out) -> dict:
    fields = {k: getattr(out, k) for k in ("last_hidden_state", "pooler_output", "start_logits", "end_logits")}
    fields["seq_relationship_logits"] = out.seq_relationship_logits
    fields["prediction_logits" if out.seq_relationship_logits is not None else "logits"] = out.logits
    return {k: np.array(v) for k, v in fields.items() if v is not None}


def assert_close(ours: dict, theirs: dict, real: np.ndarray, task: str, atol: float = 1e-4):
    """Max abs error <= atol relative to the output's scale, on real tokens for token-level outputs."""
    shared = set(ours) & set(theirs)
    assert shared, f"no output in common: ours {sorted(ours)}, transformers {sorted(theirs)}"
    for name in shared:
        a, b = ours[name], theirs[name]
        assert a.shape == b.shape, f"{name}: {a.shape} vs {b.shape}"
        if name in TOKEN_LEVEL and not (name == "logits" and task == "sequence-classification"):
            a, b = a[real], b[real]
        scale = max(1.0, float(np.abs(b).max()))
        err = float(np.abs(a - b).max())
        assert err <= atol * scale, f"{name}: max abs error {err:.3g} > {atol} x scale {scale:.3g}"


def check_parity(folder, task):
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(TEXTS, padding=True, truncation=True)
    real = np.array(batch["attention_mask"]).astype(bool)
    assert real.shape[1] == tokenizer.model_max_length, "the longest text should reach the length limit"
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)


@pytest.mark.parametrize("model_type,task", CASES)
def test_matches_transformers(checkpoint, model_type, task):
    check_parity(checkpoint(model_type, task), task)


@pytest.mark.parametrize(
    "model_type,task,overrides",
    [
        ("qwen3", "causal-lm", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=32)),
        ("nomic_bert", "encoder", dict(num_attention_heads=3, head_dim=16)),
        ("gte", "encoder", dict(num_attention_heads=3, head_dim=16)),
        ("jina_embeddings_v3", "encoder", dict(num_attention_heads=3, head_dim=16)),
        ("gte", "encoder", dict(num_attention_heads=3)),  # head_dim left out: hidden_size // heads
        ("jina_embeddings_v3", "encoder", dict(num_attention_heads=3)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_head_dim_that_does_not_divide_the_width_matches_transformers(checkpoint, model_type, task, overrides):
    """These families size their projections from head_dim: a width the heads do not divide is a valid model."""
    check_parity(checkpoint(model_type, task, **overrides), task)


# Masked-LM heads whose own decoder (untied from the word embeddings) carries a bias of its own in transformers.
UNTIED_DECODERS = {"albert": "predictions", "bert": "cls.predictions", "roberta": "lm_head", "xlm-roberta": "lm_head",
                   "mpnet": "lm_head", "nomic_bert": "cls.predictions", "jina_embeddings_v3": "lm_head"}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(UNTIED_DECODERS))
def test_an_untied_masked_lm_head_uses_its_decoders_bias_and_saves_it(checkpoint, tmp_path, model_type):
    """transformers unties the decoder's bias from the head's `bias` with its weight: the logits add the decoder's
    (trained) bias, and `save` writes it for transformers to read back."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "untied"
    shutil.copytree(checkpoint(model_type, "masked-lm", tie_word_embeddings=False), folder)
    head = UNTIED_DECODERS[model_type]
    weights = load_file(folder / "model.safetensors")
    assert f"{head}.decoder.weight" in weights, sorted(weights)
    vocab = weights[f"{head}.decoder.weight"].shape[0]
    weights[f"{head}.decoder.bias"] = np.random.default_rng(0).normal(0, 1, vocab).astype(np.float32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    check_parity(folder, "masked-lm")

    model, tokenizer = mlx_encoders.load(folder)
    saved = mlx_encoders.save(model, tmp_path / "saved", tokenizer)
    reference, info = transformers.AutoModelForMaskedLM.from_pretrained(saved, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    batch = tokenizer(TEXTS[1:3], padding=True)
    with torch.no_grad():
        expected = reference.eval()(**as_torch(batch)).logits.numpy()
    real = np.array(batch["attention_mask"]).astype(bool)
    assert_close({"logits": np.array(model(**batch).logits)}, {"logits": expected}, real, "masked-lm", atol=1e-5)

    # a file of transformers 4, where the two biases were one tensor and one key of the two is stored
    del weights[f"{head}.decoder.bias"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = dict(tree_flatten(mlx_encoders.load_model(folder).parameters()))
    np.testing.assert_array_equal(np.array(loaded[f"{head}.decoder.bias"]), weights[f"{head}.bias"])


def test_every_architecture_has_every_head():
    """Each head transformers has for an architecture (EuroBERT has no question answering), and no other."""
    heads = {"encoder", "masked-lm", "sequence-classification", "token-classification", "question-answering"}
    for model_type in MODEL_TYPES:
        ours = set(model_module(model_type).MODELS)
        theirs = {task for task in heads | ours if hasattr(transformers, architecture_name(model_type, task))}
        assert ours == theirs, model_type
        # and a head that predicts tokens: masked, or causal for a decoder (Qwen3)
        required = {"encoder", "sequence-classification", "token-classification", language_model_task(model_type)}
        assert required <= theirs, model_type
    assert "pretraining" in model_module("bert").MODELS


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_classifier_pooling(checkpoint, pooling):
    check_parity(
        checkpoint("modernbert", "sequence-classification", classifier_pooling=pooling), "sequence-classification"
    )


def rewrite_config(folder, tmp_path, edit) -> str:
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("task", ["encoder", "masked-lm"])
def test_modernbert_legacy_config_keys(checkpoint, tmp_path, task):
    """Hub checkpoints still carry global_attn_every_n_layers / global_rope_theta / local_rope_theta."""

    def legacy(config):
        del config["layer_types"], config["rope_parameters"]
        config.update(global_attn_every_n_layers=2, global_rope_theta=1000.0, local_rope_theta=50.0)

    folder = rewrite_config(checkpoint("modernbert", task), tmp_path, legacy)
    assert "layer_types" not in json.loads((folder / "config.json").read_text())
    check_parity(folder, task)


def test_modernbert_layer_types_spelling(checkpoint, tmp_path):
    """transformers-5 spelling with a pattern no `global_attn_every_n_layers` could express."""

    def spelled(config):
        del config["global_attn_every_n_layers"]
        config["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 2000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        }

    check_parity(rewrite_config(checkpoint("modernbert", "masked-lm"), tmp_path, spelled), "masked-lm")


def test_modernbert_sequences_span_several_windows(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("modernbert"))
    assert model.args.local_attention * 3 <= tokenizer(TEXTS)["input_ids"].shape[1]


def test_text_pairs_use_token_types(checkpoint):
    """BERT pairs: token_type_ids 1 on the second segment change the output, as in transformers."""
    folder = checkpoint("bert", "sequence-classification")
    model, tokenizer = mlx_encoders.load(folder)
    batch = tokenizer(["a question?", "another"], text_pair=["the answer here", "second"], padding=True)
    assert int(mx.sum(batch["token_type_ids"])) > 0
    real = np.array(batch["attention_mask"]).astype(bool)
    task = "sequence-classification"
    assert_close(our_outputs(model(**batch)), reference_outputs(folder, task, batch), real, task)
