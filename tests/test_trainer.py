"""The training loop: exact resume (weights and loss curve equal to an uninterrupted run, dropout and dynamic masking
on), atomic checkpoints, the metrics log, macro-F1, and a tiny run that overfits."""

import errno
import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.train import checkpointing, compiling, evaluation, optim, trainer
from mlx_encoders.train.data import collate, masked_lm_data, sequence_classification_data
from mlx_encoders.train.masking import Masker
from mlx_encoders.train.trainer import TrainingConfig, train

TEXTS = [
    "a fine film", "dull and long", "it was ok", "the best thing this year", "I walked out", "fine, not great",
    "a quiet, lovely story", "the plot makes no sense", "worth a second look", "too loud by half",
]  # fmt: skip
LABELS = ["pos", "neg", "neutral", "pos", "neg", "neutral", "pos", "neg", "pos", "neg"]


def classification(checkpoint, rows: int = len(TEXTS), **config):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification", **config))
    data = [{"text": t, "label": label} for t, label in zip(TEXTS[:rows], LABELS[:rows], strict=True)]
    return model, tokenizer, sequence_classification_data(data, tokenizer)


def masked_lm(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "masked-lm"))
    return model, tokenizer, masked_lm_data([{"text": t} for t in TEXTS[:8]], tokenizer)


def masker(tokenizer) -> Masker:
    """Half the tokens masked, so no micro-batch of these short texts is left without a masked token (its loss, as
    torch's, would be NaN)."""
    return Masker.from_tokenizer(tokenizer, probability=0.5)


def records(folder, kind: str = "loss") -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if kind in r]


@pytest.mark.parametrize(
    "task, batch_size, grad_accum",
    [("classification", 2, 1), ("masked-lm", 2, 2)],  # 5 steps an epoch; 2 steps of 2 micro-batches an epoch
)
def test_resumed_run_equals_uninterrupted_run(checkpoint, tmp_path, task, batch_size, grad_accum):
    make = classification if task == "classification" else masked_lm

    def config(folder, max_steps: int) -> TrainingConfig:
        # a constant schedule, so the stopped run's shorter max_steps does not change its learning rates
        return TrainingConfig(folder, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, lr=1e-3,
                              schedule="constant", weight_decay=0.01, seed=7)  # fmt: skip

    whole, tokenizer, examples = make(checkpoint)
    mask = masker(tokenizer) if task == "masked-lm" else None
    train(whole, tokenizer, examples, config=config(tmp_path / "whole", 6), masker=mask)

    stopped, _, _ = make(checkpoint)
    train(stopped, tokenizer, examples, config=config(tmp_path / "resumed", 3), masker=mask)
    resumed, _, _ = make(checkpoint)
    resume = tmp_path / "resumed" / "checkpoint-3"
    train(resumed, tokenizer, examples, config=config(tmp_path / "resumed", 6), masker=mask, resume_from=resume)

    expected, found = records(tmp_path / "whole"), records(tmp_path / "resumed")
    assert [r["step"] for r in found] == [1, 2, 3, 4, 5, 6] and np.isfinite([r["loss"] for r in found]).all()
    np.testing.assert_allclose([r["loss"] for r in found], [r["loss"] for r in expected], rtol=1e-6)
    for (name, a), (_, b) in zip(tree_flatten(resumed.parameters()), tree_flatten(whole.parameters()), strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6, err_msg=name)
    state = json.loads((tmp_path / "resumed" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and (state["epoch"], state["position"]) == (
        (1, 1) if task == "classification" else (2, 2)
    )


def test_failed_save_keeps_the_previous_checkpoint(checkpoint, tmp_path, monkeypatch):
    model, tokenizer, examples = classification(checkpoint)
    saves = []

    def failing_write(*args, **kwargs):
        saves.append(write(*args, **kwargs))  # the model files are written, then the save fails
        if len(saves) == 2:
            raise OSError("simulated failure while writing checkpoint-4")
        return saves[-1]

    write = checkpointing.write_checkpoint
    monkeypatch.setattr(checkpointing, "write_checkpoint", failing_write)
    with pytest.raises(OSError, match="simulated"):
        train(model, tokenizer, examples, config=TrainingConfig(tmp_path, max_steps=4, batch_size=4, save_every=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl"]  # no partial folder
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2
    assert {"config.json", "optimizer.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "checkpoint-2").iterdir()
    }
    mlx_encoders.load(tmp_path / "checkpoint-2")


@pytest.fixture(scope="module")
def stopped_run(checkpoint, tmp_path_factory):
    """An output folder whose run stopped at checkpoint-2; copy it before damaging a file."""
    folder = tmp_path_factory.mktemp("stopped") / "run"
    model, tokenizer, examples = classification(checkpoint)
    train(model, tokenizer, examples, config=TrainingConfig(folder, max_steps=2, batch_size=4, seed=3))
    return folder


def set_field(name, value):
    def edit(path):
        state = json.loads(path.read_text())
        state[name] = value
        path.write_text(json.dumps(state))

    return edit


def drop_field(name):
    def edit(path):
        state = json.loads(path.read_text())
        del state[name]
        path.write_text(json.dumps(state))

    return edit


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble_second_line(path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([lines[0], '{"step": 2, "lo\n', *lines[2:]]))


@pytest.mark.parametrize(
    "file, damage, message",
    [
        ("checkpoint-2/optimizer.safetensors", truncate, r"optimizer\.safetensors: not a readable optimizer state"),
        ("checkpoint-2/trainer_state.json", truncate, r"trainer_state\.json, line \d+: not valid JSON"),
        ("checkpoint-2/trainer_state.json", drop_field("step"), r"trainer_state\.json: field 'step' is missing"),
        ("checkpoint-2/trainer_state.json", set_field("epoch", "0"), r"field 'epoch' must be an integer >= 0"),
        ("checkpoint-2/trainer_state.json", set_field("step", -1), r"field 'step' must be an integer >= 0"),
        ("checkpoint-2/trainer_state.json", set_field("mlx_key", [1]), r"field 'mlx_key' must be two uint32"),
        ("checkpoint-2/trainer_state.json", set_field("mask_rng", {"state": 1}), r"field 'mask_rng' is not"),
        ("checkpoint-2/trainer_state.json", set_field("stepp", 2), r"unknown field\(s\) stepp"),
        ("metrics.jsonl", garble_second_line, r"metrics\.jsonl, line 2: not a JSON record"),
    ],
)
def test_resuming_from_a_damaged_file_names_it_and_what_to_do(checkpoint, stopped_run, tmp_path, file, damage, message):
    folder = tmp_path / "run"
    shutil.copytree(stopped_run, folder)
    damage(folder / file)
    model, tokenizer, examples = classification(checkpoint)
    config = TrainingConfig(folder, max_steps=4, batch_size=4, seed=3)
    with pytest.raises(ValueError, match=message) as raised:
        train(model, tokenizer, examples, config=config, resume_from=folder / "checkpoint-2")
    assert str(folder / file) in str(raised.value) and (
        "another checkpoint" in str(raised.value) or "delete" in str(raised.value)
    )


def test_resume_drops_what_a_run_cut_off_mid_write_left_behind(checkpoint, stopped_run, tmp_path):
    """A record cut off as it was appended (no newline: a full disk, a killed run) and a checkpoint folder a killed
    run was writing: the resumed run drops the one and removes the other, even when it never saves that step."""
    folder = tmp_path / "run"
    shutil.copytree(stopped_run, folder)
    with open(folder / "metrics.jsonl", "a") as log:
        log.write('{"step": 3, "lo')
    (folder / ".checkpoint-3.abcd_123.partial").mkdir()
    (folder / ".checkpoint-3.abcd_123.partial" / "model.safetensors").write_bytes(b"\0" * 64)
    model, tokenizer, examples = classification(checkpoint)
    config = TrainingConfig(folder, max_steps=4, batch_size=4, seed=3, save_every=4)
    train(model, tokenizer, examples, config=config, resume_from=folder / "checkpoint-2")
    assert [r["step"] for r in records(folder)] == [1, 2, 3, 4]
    assert sorted(p.name for p in folder.iterdir() if p.name != "curves.png") == [
        "checkpoint-2", "checkpoint-4", "metrics.jsonl"
    ]  # fmt: skip


def test_a_full_disk_while_logging_names_the_log_and_the_way_on(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing, "open", full, raising=False)  # the module's open, not the test's
    with pytest.raises(OSError, match=r"disk full while appending to .*metrics\.jsonl; .* run again with") as raised:
        checkpointing.log_metrics(tmp_path, {"step": 1})
    assert raised.value.errno == errno.ENOSPC
    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(OSError, match=r"free space on that disk, then resume from .*checkpoint-2 \(--resume\)"):
        checkpointing.log_metrics(tmp_path, {"step": 3})


def test_tiny_run_overfits_and_logs_metrics(checkpoint, tmp_path):
    # dropout off: with it, whether 12 steps halve the loss of this tiny model depends on the masks drawn
    model, tokenizer, examples = classification(checkpoint, rows=4, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0)  # fmt: skip
    config = TrainingConfig(tmp_path, epochs=12, batch_size=4, lr=1e-2, save_every=4, keep_last=1,
                            metric_for_best="eval_loss", seed=0)  # fmt: skip
    final = train(model, tokenizer, examples, examples, config)

    losses = [r["loss"] for r in records(tmp_path)]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3])
    evals = records(tmp_path, "eval_loss")
    assert [r["step"] for r in evals] == list(range(1, 13))  # one step an epoch, evaluated at each epoch end
    assert set(evals[-1]) == {"step", "epoch", "eval_loss", "eval_accuracy", "eval_f1"}
    assert final == evals[-1] and final["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm"} for r in records(tmp_path))
    best = json.loads((tmp_path / "checkpoint-12" / "trainer_state.json").read_text())["best_checkpoint"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == sorted({best, "checkpoint-12"})


def test_masked_lm_evaluation_reports_accuracy_and_perplexity(checkpoint, tmp_path):
    model, tokenizer, examples = masked_lm(checkpoint)
    metrics = evaluation.evaluate(model, tokenizer, examples, TrainingConfig(tmp_path, batch_size=3),
                               masker(tokenizer))  # fmt: skip
    assert set(metrics) == {"eval_loss", "eval_accuracy", "eval_perplexity"}
    assert metrics["eval_perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]))
    assert 0 <= metrics["eval_accuracy"] <= 1


def test_classification_evaluation_in_length_order_equals_transformers(checkpoint, tmp_path):
    """Evaluation batches examples shortest first (less padding); the loss and accuracy are transformers' own of
    the texts in their given order, batch by batch."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = checkpoint("bert", "sequence-classification")
    model, tokenizer, examples = classification(checkpoint)
    order = evaluation.eval_order(examples, tokenizer)
    assert list(order) != list(range(len(TEXTS)))  # the lengths differ, so the order does: the test tests sorting
    metrics = evaluation.evaluate(model, tokenizer, examples, TrainingConfig(tmp_path, batch_size=3))
    reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    labels = torch.tensor([examples.label2id[label] for label in LABELS])
    with torch.no_grad():
        batches = [AutoTokenizer.from_pretrained(folder)(TEXTS[i : i + 3], padding=True, return_tensors="pt")
                   for i in range(0, len(TEXTS), 3)]  # fmt: skip
        logits = torch.cat([reference(**b).logits for b in batches])
    assert metrics["eval_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())


@pytest.mark.parametrize("task", ["classification", "masked-lm"])
def test_compiled_step_equals_value_and_grad(checkpoint, task):
    """The loop's float32 step runs under mx.compile (compiled_value_and_grad): from the same random key, dropout
    on, it gives value_and_grad's loss and gradients, over two steps of two batch shapes (each traced anew) and a
    repeat of the first shape (its cached trace), and leaves the key where value_and_grad leaves it."""
    import mlx.core as mx

    from mlx_encoders.engine.ops import drawing_from

    model, tokenizer, data = classification(checkpoint) if task == "classification" else masked_lm(checkpoint)
    model.train()
    rng = np.random.default_rng(0)
    mask = masker(tokenizer) if task == "masked-lm" else None
    batches = [collate(data, rows, tokenizer, mask, rng) for rows in ([0, 1, 2], [3, 4], [5, 6, 7])]
    assert batches[0]["input_ids"].shape != batches[1]["input_ids"].shape

    def run(loss_and_grad, random: list) -> tuple[list, list, list]:
        random[0] = mx.random.key(7)
        with drawing_from(random):
            results = [loss_and_grad(batch) for batch in batches]
        return [r[0].item() for r in results], [tree_flatten(r[1]) for r in results], np.array(random[0])

    global_key = np.array(mx.random.state[0])
    random = [mx.random.key(7)]
    plain = run(compiling.value_and_grad(model, mx.float32), [None])
    compiled = run(compiling.compiled_value_and_grad(model, random), random)
    np.testing.assert_array_equal(np.array(mx.random.state[0]), global_key)  # drawn from the trainer's own key
    np.testing.assert_allclose(compiled[0], plain[0], rtol=1e-5)
    for got, want in zip(compiled[1], plain[1], strict=True):
        assert [k for k, _ in got] == [k for k, _ in want]
        for (name, g), (_, w) in zip(got, want, strict=True):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(compiled[2], plain[2])
    assert len(set(plain[0])) == 3  # the steps differ: the key advanced between them


def test_compiled_step_still_checks_token_ids(checkpoint):
    """A compiled function cannot read its inputs on the host; the model's own checks still reject an id outside
    the vocabulary (MLX would read stray memory), and the compiled step runs again afterwards."""
    model, tokenizer, data = classification(checkpoint)
    model.train()
    import mlx.core as mx

    loss_and_grad = compiling.compiled_value_and_grad(model, [mx.random.key(0)])
    batch = collate(data, [0, 1], tokenizer)
    assert np.isfinite(loss_and_grad(batch)[0].item())
    bad = dict(batch, input_ids=batch["input_ids"].copy())
    bad["input_ids"][1, 1] = model.args.vocab_size
    with pytest.raises(ValueError, match=f"token id {model.args.vocab_size},"):
        loss_and_grad(bad)
    assert model.training
    assert np.isfinite(loss_and_grad(batch)[0].item())


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("lr", 0.0, r"lr must be a finite number in \(0, inf\), got 0.0"),
        ("lr", -1e-3, r"lr must be a finite number in \(0, inf\)"),
        ("lr", float("nan"), r"lr must be a finite number in \(0, inf\), got nan"),
        ("lr", float("inf"), r"lr must be a finite number in \(0, inf\), got inf"),
        ("weight_decay", -0.01, r"weight_decay must be a finite number in \[0, inf\)"),
        ("weight_decay", float("nan"), r"weight_decay must be a finite number in \[0, inf\)"),
        ("warmup_ratio", 1.5, r"warmup_ratio must be a finite number in \[0, 1\], got 1.5"),
        ("warmup_ratio", float("nan"), r"warmup_ratio must be a finite number in \[0, 1\]"),
        ("warmup_steps", -1, "warmup_steps must be an integer >= 0, got -1"),
        ("max_grad_norm", float("nan"), r"max_grad_norm must be a finite number \(<= 0 turns clipping off\) or None"),
        ("max_grad_norm", float("inf"), r"max_grad_norm must be a finite number"),
        ("keep_last", 0, "keep_last must be an integer >= 1 or None, got 0"),
        ("eval_every", 0, "eval_every must be an integer >= 1 or None, got 0"),
        ("save_every", -2, "save_every must be an integer >= 1 or None, got -2"),
        ("max_steps", 0, "max_steps must be an integer >= 1 or None, got 0"),
        ("epochs", 0, "epochs must be an integer >= 1, got 0"),
        ("epochs", 1.5, "epochs must be an integer >= 1, got 1.5"),
        ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
        ("grad_accum", 0, "grad_accum must be an integer >= 1, got 0"),
        ("seed", -1, "seed must be an integer >= 0, got -1"),
        ("schedule", "warm", "schedule must be one of linear, cosine, constant, got 'warm'"),
    ],
)
def test_options_outside_their_range_are_refused_naming_the_range(tmp_path, option, value, message):
    with pytest.raises(trainer.OptionError, match=message):
        TrainingConfig(tmp_path / "run", **{option: value})


def test_a_negative_max_grad_norm_turns_clipping_off_and_never_flips_gradients():
    # transformers clips only when max_grad_norm > 0; a negative clip factor would step uphill
    def stepped(max_grad_norm):
        mx.random.seed(0)
        model = nn.Linear(4, 2)
        grads = {"weight": mx.full((2, 4), 3.0), "bias": mx.full((2,), -3.0)}
        optim.optimizer_step(model, optim.adamw(model, 1e-1), grads, max_grad_norm)
        return model

    off, negative = stepped(None), stepped(-1.0)
    np.testing.assert_array_equal(np.array(negative.weight), np.array(off.weight))
    np.testing.assert_array_equal(np.array(negative.bias), np.array(off.bias))
