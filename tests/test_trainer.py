"""The training loop: exact resume (weights and loss curve equal to an uninterrupted run, dropout and dynamic masking
on), atomic checkpoints, the metrics log, macro-F1, and a tiny run that overfits."""

import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.train import trainer
from mlx_encoders.train.data import masked_lm_data, sequence_classification_data
from mlx_encoders.train.masking import Masker
from mlx_encoders.train.trainer import TrainingConfig, train

TEXTS = [
    "a fine film", "dull and long", "it was ok", "the best thing this year", "I walked out", "fine, not great",
    "a quiet, lovely story", "the plot makes no sense", "worth a second look", "too loud by half",
]  # fmt: skip
LABELS = ["pos", "neg", "neutral", "pos", "neg", "neutral", "pos", "neg", "pos", "neg"]


def classification(checkpoint, rows: int = len(TEXTS)):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
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

    write = trainer.write_checkpoint
    monkeypatch.setattr(trainer, "write_checkpoint", failing_write)
    with pytest.raises(OSError, match="simulated"):
        train(model, tokenizer, examples, config=TrainingConfig(tmp_path, max_steps=4, batch_size=4, save_every=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl"]  # no partial folder
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2
    assert {"config.json", "optimizer.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "checkpoint-2").iterdir()
    }
    mlx_encoders.load(tmp_path / "checkpoint-2")


def test_tiny_run_overfits_and_logs_metrics(checkpoint, tmp_path):
    model, tokenizer, examples = classification(checkpoint, rows=4)
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
    metrics = trainer.evaluate(model, tokenizer, examples, TrainingConfig(tmp_path, batch_size=3),
                               masker(tokenizer))  # fmt: skip
    assert set(metrics) == {"eval_loss", "eval_accuracy", "eval_perplexity"}
    assert metrics["eval_perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]))
    assert 0 <= metrics["eval_accuracy"] <= 1
