"""LoRA and QLoRA: adapters start as no-ops, only they and the head train, they save alone and load back, and
`fuse` folds them into a float or re-quantized checkpoint that `mlx_encoders.save` writes."""

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.models import MODEL_TYPES
from mlx_encoders.quantization import quantize_model
from mlx_encoders.train import task_loss
from mlx_encoders.train.lora import (
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    fuse,
    load_adapters,
    save_adapters,
)
from mlx_encoders.train.optim import adamw, optimizer_step

TASK = "sequence-classification"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A second, shorter text.", "x"]
RANK, ALPHA = 4, 8.0


def load(checkpoint, model_type: str = "bert", bits: int | None = None, **settings):
    """(model, batch with labels) for a sequence classifier, quantized to `bits` when given (`settings`: group_size,
    mode)."""
    model, tokenizer = mlx_encoders.load(checkpoint(model_type, TASK))
    if bits:
        quantize_model(model, bits=bits, **{"group_size": 32, **settings})
    batch = {k: mx.array(v) for k, v in dict(tokenizer(TEXTS, padding=True)).items()}
    return model, batch, mx.array([0, 2, 1])


def logits(model: nn.Module, batch: dict) -> np.ndarray:
    return np.array(model(**batch).logits)


def flat(tree: dict) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def train(model: nn.Module, batch: dict, labels: mx.array, steps: int = 3) -> None:
    """A few AdamW steps at a high rate, so the adapters move well away from their start."""
    optimizer = adamw(model, 1e-2, weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(model, lambda: task_loss(model, model(**batch), labels))
    for _ in range(steps):
        _, grads = loss_and_grad()
        optimizer_step(model, optimizer, grads)


def adapter_size(model: nn.Module) -> int:
    return sum(m.lora_a.size + m.lora_b.size for m in model.modules() if isinstance(m, LoRALinear))


def head_size(model: nn.Module) -> int:
    """The head's float parameters: everything outside the encoder's prefix."""
    return sum(v.size for k, v in tree_flatten(model.parameters()) if not k.startswith(model.prefix + "."))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_default_targets_start_equal_and_train_alone(checkpoint, model_type):
    model, batch, _ = load(checkpoint, model_type)
    before = logits(model, batch)
    adapted = apply_lora(model, RANK, ALPHA)
    names = {path.rsplit(".", 1)[-1] for path in adapted}
    assert names == set(DEFAULT_TARGETS[model_type])
    np.testing.assert_array_equal(logits(model, batch), before)  # B = 0: exactly the base model
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert trainable == adapter_size(model) + head_size(model)
    assert all(k.endswith(("lora_a", "lora_b")) or not k.startswith(model.prefix + ".")
               for k, _ in tree_flatten(model.trainable_parameters()))  # fmt: skip


def test_targets_are_names_or_patterns(checkpoint):
    model, _, _ = load(checkpoint)
    adapted = apply_lora(model, RANK, ALPHA, targets=["value", r".*\.intermediate\.dense"])
    assert len(adapted) == 2 * model.args.num_hidden_layers
    with pytest.raises(ValueError, match="No linear.*its linears: .*bert.encoder.layer.N.attention.self.query"):
        apply_lora(load(checkpoint)[0], targets=["no_such_module"])


@pytest.mark.parametrize("targets", [["attention.self.query"], ["intermediate.dense"], ["self.query", "self.value"]])
def test_targets_as_peft_names_them(checkpoint, targets):
    """PEFT's target_modules list: a name equals the path or ends it after a dot; ours adapts what PEFT adapts."""
    import peft

    reference = load_reference(checkpoint("bert", TASK), TASK)
    adapted = peft.get_peft_model(reference, peft.LoraConfig(r=RANK, target_modules=targets))
    expected = {n.removeprefix("base_model.model.") for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert expected and set(apply_lora(load(checkpoint)[0], RANK, ALPHA, targets=targets)) == expected


def test_training_changes_only_adapters_and_head(checkpoint):
    model, batch, labels = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    trainable = set(flat(model.trainable_parameters()))
    before = flat(model.parameters())
    train(model, batch, labels)
    after = flat(model.parameters())
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == trainable  # every adapter and head tensor moved; nothing else did


def test_qlora_keeps_quantized_weights_frozen(checkpoint):
    model, batch, labels = load(checkpoint, bits=4)
    before_logits = logits(model, batch)
    adapted = apply_lora(model, RANK, ALPHA)
    wrapped = [m.linear for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == len(adapted) and all(isinstance(m, nn.QuantizedLinear) for m in wrapped)
    np.testing.assert_array_equal(logits(model, batch), before_logits)
    trainable = flat(model.trainable_parameters())
    assert all(np.issubdtype(v.dtype, np.floating) for v in trainable.values())
    assert sum(v.size for v in trainable.values()) == adapter_size(model) + sum(
        v.size for k, v in trainable.items() if not k.startswith(model.prefix + ".")
    )
    frozen = {k: v for k, v in flat(model.parameters()).items() if k not in trainable}
    train(model, batch, labels)
    after = flat(model.parameters())
    assert all(np.array_equal(v, after[k]) for k, v in frozen.items())
    assert all(w.weight.dtype == mx.uint32 for w in wrapped)  # still packed: trained through quantized_matmul


def test_adapters_save_alone_and_load_back(checkpoint, tmp_path):
    model, batch, labels = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    train(model, batch, labels)
    folder = save_adapters(model, tmp_path / "adapters")
    saved = mx.load(str(folder / "adapters.safetensors"))
    assert set(saved) == set(flat(model.trainable_parameters()))
    assert sum(v.size for v in saved.values()) < sum(v.size for _, v in tree_flatten(model.parameters())) / 50
    restored, _, _ = load(checkpoint)
    load_adapters(restored, folder)
    np.testing.assert_array_equal(logits(restored, batch), logits(model, batch))
    assert restored.lora_config == model.lora_config


def test_load_adapters_fails_on_another_architecture(checkpoint, tmp_path):
    model, _, _ = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    folder = save_adapters(model, tmp_path / "adapters")
    with pytest.raises(ValueError, match="are for bert"):
        load_adapters(load(checkpoint, "roberta")[0], folder)


def test_adapters_that_do_not_fit_the_base_are_named(checkpoint, tmp_path):
    model, _, _ = load(checkpoint)
    with pytest.raises(ValueError, match="save_adapters: the model has no LoRA adapters"):
        save_adapters(model, tmp_path / "none")
    with pytest.raises(ValueError, match="fuse: the model has no LoRA adapters"):
        fuse(model)
    apply_lora(model, RANK, ALPHA)
    folder = save_adapters(model, tmp_path / "adapters")
    with pytest.raises(ValueError, match="The model already has LoRA adapters"):
        load_adapters(model, folder)
    saved = mx.load(str(folder / "adapters.safetensors"))
    lost = next(k for k in saved if k.endswith("lora_b"))
    mx.save_safetensors(str(folder / "adapters.safetensors"), {k: v for k, v in saved.items() if k != lost})
    with pytest.raises(ValueError, match=f"lacks adapters the model's targets need: {re.escape(lost)}"):
        load_adapters(load(checkpoint)[0], folder)  # adapters of a model with fewer layers, say
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    with pytest.raises(ValueError, match="is not a save_adapters folder's config \\(a PEFT adapter"):
        load_adapters(load(checkpoint)[0], folder)


def test_fused_float_model_equals_adapted_and_saves(checkpoint, tmp_path):
    model, batch, labels = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    train(model, batch, labels)
    adapted = logits(model, batch)
    fuse(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    np.testing.assert_allclose(logits(model, batch), adapted, atol=1e-5, rtol=0)
    folder = mlx_encoders.save(model, tmp_path / "fused")
    reloaded = mlx_encoders.load_model(folder)
    np.testing.assert_array_equal(logits(reloaded, batch), logits(model, batch))
    with torch.no_grad():  # and transformers reads it back as the same model
        expected = load_reference(folder, TASK)(**{k: torch.from_numpy(np.array(v)) for k, v in batch.items()}).logits
    np.testing.assert_allclose(expected.numpy(), adapted, atol=1e-4, rtol=0)


def test_requantized_fuse_is_close_and_saves(checkpoint, tmp_path):
    model, batch, labels = load(checkpoint, bits=8)
    mx.random.seed(0)  # the adapters' start: drawn from MLX's global key, which earlier tests of a worker move
    apply_lora(model, RANK, ALPHA)
    train(model, batch, labels)
    adapted = logits(model, batch)
    settings = {
        p: (m.linear.bits, m.linear.group_size, m.linear.mode)
        for p, m in model.named_modules()
        if isinstance(m, LoRALinear)
    }
    fuse(model, requantize=True)
    for path, module in model.named_modules():
        if path in settings:
            assert isinstance(module, nn.QuantizedLinear)
            assert (module.bits, module.group_size, module.mode) == settings[path]
    fused = logits(model, batch)
    # one more rounding to 8 bits: far below the change training made (0.4-1.2% over seeds 0-9; 0.7% at seed 0)
    assert np.abs(fused - adapted).max() <= 0.02 * np.abs(adapted).max()
    folder = mlx_encoders.save(model, tmp_path / "fused")
    reloaded = mlx_encoders.load_model(folder)
    np.testing.assert_array_equal(logits(reloaded, batch), fused)


@pytest.mark.parametrize(
    "settings", [dict(bits=4), dict(bits=8), dict(bits=4, group_size=32, mode="mxfp4"),
                 dict(bits=4, group_size=16, mode="nvfp4"), dict(bits=8, group_size=32, mode="mxfp8")]
)  # fmt: skip
def test_fusing_onto_a_quantized_base_gives_the_adapted_model_and_saves(checkpoint, tmp_path, settings):
    """The adapted linears become float W + (alpha / r) B A, the others stay quantized: the fused model is the one
    trained (rounding the merged weights again to 4 bits changed the logits by 60-120% of their range here)."""
    model, batch, labels = load(checkpoint, **settings)
    mx.random.seed(0)
    apply_lora(model, RANK, ALPHA)
    train(model, batch, labels)
    adapted = logits(model, batch)
    wrapped = {p for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    fuse(model)
    fused_modules = [m for p, m in model.named_modules() if p in wrapped]
    assert len(fused_modules) == len(wrapped) and all(type(m).__name__ == "Linear" for m in fused_modules)
    assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())  # the rest stays quantized
    fused = logits(model, batch)
    np.testing.assert_allclose(fused, adapted, rtol=0, atol=1e-5 * np.abs(adapted).max())
    folder = mlx_encoders.save(model, tmp_path / "fused")
    np.testing.assert_array_equal(logits(mlx_encoders.load_model(folder), batch), fused)


def test_requantized_fuse_of_a_floating_point_quantized_base(checkpoint):
    model, batch, labels = load(checkpoint, bits=4, group_size=32, mode="mxfp4")
    apply_lora(model, RANK, ALPHA)
    settings = {p: (m.linear.bits, m.linear.group_size, m.linear.mode) for p, m in model.named_modules()
                if isinstance(m, LoRALinear)}  # fmt: skip
    fuse(model, requantize=True)
    for path, module in model.named_modules():
        if path in settings:
            assert (module.bits, module.group_size, module.mode) == settings[path]


def test_adapters_are_saved_whole_or_not_at_all(checkpoint, tmp_path, monkeypatch):
    """A write cut short (a full disk) leaves the adapters saved before, whole, and says which folder it was."""
    model, batch, labels = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    folder = save_adapters(model, tmp_path / "adapters")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    train(model, batch, labels)

    def cut_short(file, arrays):  # MLX's error for a file it could not write
        with open(file, "wb") as f:
            f.write(b"\0" * 100)
        raise RuntimeError("[write] Unable to write 480 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", cut_short)
    with pytest.raises(OSError, match=f"could not write {folder} .*: a file size limit .* nothing was written"):
        save_adapters(model, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapters"]  # no temporary folder left


def test_a_damaged_adapters_file_is_named(checkpoint, tmp_path):
    model, _, _ = load(checkpoint)
    apply_lora(model, RANK, ALPHA)
    folder = save_adapters(model, tmp_path / "adapters")
    data = (folder / "adapters.safetensors").read_bytes()
    (folder / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"adapters.safetensors is not a readable safetensors file"):
        load_adapters(load(checkpoint)[0], folder)


def test_qlora_trains_a_quantized_head_in_full_as_float(checkpoint):
    """`convert` quantizes every linear, the classifier too: apply_lora makes the head float (its dequantized weight,
    the same logits) so that it trains, as the task head of a LoRA run does."""
    wide = checkpoint("bert", TASK, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model, tokenizer = mlx_encoders.load(wide)
    quantize_model(model, bits=8, group_size=32)
    assert isinstance(model.classifier, nn.QuantizedLinear)  # as convert leaves it
    batch, labels = {k: mx.array(v) for k, v in dict(tokenizer(TEXTS, padding=True)).items()}, mx.array([0, 2, 1])
    before = logits(model, batch)
    apply_lora(model, RANK, ALPHA)
    assert type(model.classifier) is not nn.QuantizedLinear and model.classifier.weight.dtype == mx.float32
    np.testing.assert_allclose(logits(model, batch), before, rtol=1e-5, atol=1e-6)
    assert {"classifier.weight", "classifier.bias"} <= set(flat(model.trainable_parameters()))
    start = np.array(model.classifier.weight)
    train(model, batch, labels)
    assert not np.array_equal(np.array(model.classifier.weight), start)


def test_qlora_trains_an_untied_quantized_output_head_as_a_float_decoder(checkpoint):
    source = checkpoint("qwen3", "causal-lm", tie_word_embeddings=False, hidden_size=64, intermediate_size=128)
    model, tokenizer = mlx_encoders.load(source)
    quantize_model(model, bits=8, group_size=32)
    batch = {k: mx.array(v) for k, v in dict(tokenizer(TEXTS, padding=True)).items()}
    before = np.array(model(**batch).logits)
    apply_lora(model, RANK, ALPHA)
    assert type(model.lm_head).__name__ == "TiedDecoder" and "lm_head.weight" in flat(model.trainable_parameters())
    np.testing.assert_allclose(np.array(model(**batch).logits), before, rtol=1e-4, atol=1e-5)
