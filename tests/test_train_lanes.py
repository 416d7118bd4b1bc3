"""A training step's rows split over CPU cores (mlx_encoders.train.lanes): the step's loss and gradients equal
transformers' over the whole batch, the lanes run on threads of their own, and a lane's failure reaches the caller."""

import json
import threading

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import load_reference
from mlx.utils import tree_flatten
from tolerance import assert_float32_close, encoder_terms

import mlx_encoders
from mlx_encoders.engine.runtime import usable_cores
from mlx_encoders.engine.threads import on_cores
from mlx_encoders.train import fine_tune
from mlx_encoders.train.compiling import compiled_value_and_grad
from mlx_encoders.train.lanes import Lanes, lane_count, module_copy

TEXTS = [
    "A short one.", "The quick brown fox jumps over the lazy dog.", "Hello world",
    "Training a tiny encoder, step by step, in two frameworks.", "Gradient accumulation sums micro-batches.", "x",
    "Weight decay skips biases and norms.", "Warmup, then linear decay to zero.", "Two cores, two threads.",
    "Each lane takes every other row of the batch.",
]  # fmt: skip


def counted(batch: dict) -> int:
    return int((batch["labels"] != -100).sum())


def torch_gradients(folder, task: str, batches: list[dict]) -> tuple[float, dict[str, np.ndarray]]:
    """The mean loss and gradients of one step over `batches` in transformers: each micro-batch's mean loss over the
    number of micro-batches, backpropagated into the same gradients."""
    ref = load_reference(folder, task)
    total = 0.0
    for batch in batches:
        loss = ref(**{k: torch.from_numpy(v) for k, v in batch.items()}).loss / len(batches)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}


def assert_gradients_equal(folder, grads: dict, expected: dict, texts: list[str], rows: int) -> None:
    grads = dict(tree_flatten(grads))
    for name, g in expected.items():
        if name.endswith("attention.self.key.bias"):
            continue  # its gradient is 0 up to rounding (softmax ignores a shift shared by all keys)
        assert_float32_close(np.array(grads[name]), g, encoder_terms(folder, texts) * rows, err_msg=name)


def tokenized(tokenizer, texts: list[str]) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in dict(tokenizer(texts, padding=True)).items()}


@pytest.mark.parametrize("size", [2, 3])
def test_lanes_give_transformers_gradients_of_the_whole_batch(checkpoint, size):
    folder = checkpoint("bert", "sequence-classification")
    model, tokenizer = mlx_encoders.load(folder)
    model.eval()  # no dropout: the lanes' masks differ from torch's
    rng = np.random.default_rng(0)
    batches = [{**tokenized(tokenizer, TEXTS[i : i + 5]), "labels": rng.integers(0, 3, 5)} for i in (0, 5)]
    expected_loss, expected = torch_gradients(folder, "sequence-classification", batches)
    lanes = Lanes(model, compiled_value_and_grad, size)
    loss, grads = lanes.gradients(batches, counted, [mx.random.key(0)])
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert_gradients_equal(folder, grads, expected, TEXTS, rows=10)


def test_a_lane_without_counted_items_adds_nothing(checkpoint):
    """Masked-LM: each lane's part is weighted by its share of the micro-batch's masked tokens; a lane whose rows
    have none in one micro-batch skips it."""
    folder = checkpoint("bert", "masked-lm")
    model, tokenizer = mlx_encoders.load(folder)
    model.eval()
    rng = np.random.default_rng(1)
    batches = []
    for i in (0, 5):
        batch = tokenized(tokenizer, TEXTS[i : i + 5])
        labels = np.where(rng.random(batch["input_ids"].shape) < 0.4, batch["input_ids"], -100)
        labels[:, 1] = batch["input_ids"][:, 1]  # every row has a masked token...
        if i == 0:
            labels[1::2] = -100  # ...but lane 1's rows of the first micro-batch
        batches.append({**batch, "labels": labels.astype(np.int64)})
    expected_loss, expected = torch_gradients(folder, "masked-lm", batches)
    loss, grads = Lanes(model, compiled_value_and_grad, 2).gradients(batches, counted, [mx.random.key(0)])
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert_gradients_equal(folder, grads, expected, TEXTS, rows=10)


def test_each_lane_runs_on_a_thread_of_its_own_over_the_same_weights(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    threads = []

    def make(lane_model, key):
        step = compiled_value_and_grad(lane_model, key)

        def run(batch):
            threads.append(threading.get_ident())
            return step(batch)

        return run

    lanes = Lanes(model, make, 3)
    weights = [dict(tree_flatten(m.parameters())) for m in lanes.models]
    assert all(w[name] is weights[0][name] for w in weights[1:] for name in weights[0])
    assert len({id(m) for m in lanes.models}) == 3 and model.bert is not lanes.models[1].bert
    batch = {**tokenized(tokenizer, TEXTS[:6]), "labels": np.arange(6) % 3}
    lanes.gradients([batch], counted, [mx.random.key(0)])
    assert len(threads) == 3 and len(set(threads)) == 3 and threads.count(threading.get_ident()) == 1


def test_the_copies_follow_the_weights_the_optimizer_wrote(checkpoint):
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    lanes = Lanes(model, compiled_value_and_grad, 2)
    model.update({"classifier": {"bias": model.classifier.bias + 1.0}})
    model.eval()
    batch = {**tokenized(tokenizer, TEXTS[:4]), "labels": np.arange(4) % 3}
    lanes.gradients([batch], counted, [mx.random.key(0)])
    np.testing.assert_array_equal(np.array(lanes.models[1].classifier.bias), np.array(model.classifier.bias))
    assert not lanes.models[1].training


def test_module_copy_shares_arrays_and_copies_modules(checkpoint):
    model, _ = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    copied = module_copy(model)
    layer, copied_layer = model.bert.encoder.layer[0], copied.bert.encoder.layer[0]
    assert copied_layer is not layer and copied_layer.attention.self.query.weight is layer.attention.self.query.weight
    copied.update({"classifier": {"bias": mx.zeros_like(model.classifier.bias)}})
    assert copied.classifier.bias is not model.classifier.bias


def test_a_failing_lane_raises_once_every_lane_has_ended_and_the_workers_live_on():
    ended = []

    def lane(i):
        def run():
            if i == 1:
                raise ValueError("lane 1 failed")
            x = mx.ones((256, 256))
            mx.eval(x @ x)
            ended.append(i)
            return i

        return run

    with pytest.raises(ValueError, match="lane 1 failed"):
        on_cores([lane(i) for i in range(3)])
    assert sorted(ended) == [0, 2]
    assert on_cores([lambda i=i: i * 10 for i in range(3)]) == [0, 10, 20]


@pytest.mark.cpu_only("lanes are the CPU's cores; elsewhere one pass runs on the whole device")
def test_lane_count_follows_the_cores_the_rows_and_the_model(monkeypatch):
    cores = usable_cores()
    assert lane_count(64) == (cores if cores > 1 else 1)
    assert lane_count(64, weights=1000) == 1  # a tiny model's step is mostly dispatch: whole
    assert lane_count(64, cores=2, weights=1000) == min(2, cores) if cores > 1 else 1  # unless asked
    assert lane_count(64, cores=1) == 1  # fine_tune(cores=1): the step whole
    assert lane_count(4) == 1 and lane_count(1) == 1  # fewer than 4 rows a core
    monkeypatch.setenv("MLX_ENCODERS_CPU_TUNING", "0")  # MLX's BLAS left as it is: its threads cannot be held to one
    assert lane_count(64) == 1


def test_each_lane_draws_its_own_dropout_masks(checkpoint):
    """Two identical rows in two lanes, dropout on: each lane's gradients differ (its own key), and the step
    repeats exactly from the same key."""
    model, tokenizer = mlx_encoders.load(checkpoint("bert", "sequence-classification"))
    model.train()
    lane_grads = []

    def make(lane_model, key):
        step = compiled_value_and_grad(lane_model, key)

        def run(batch):
            loss, grads = step(batch)
            lane_grads.append(grads)
            return loss, grads

        return run

    lanes = Lanes(model, make, 2)
    batch = {**tokenized(tokenizer, [TEXTS[1]] * 8), "labels": np.zeros(8, np.int64)}
    first = lanes.gradients([batch], counted, [mx.random.key(3)])[1]
    name, a = tree_flatten(lane_grads[0])[0]
    assert not np.allclose(np.array(a), np.array(dict(tree_flatten(lane_grads[1]))[name]))
    again = lanes.gradients([batch], counted, [mx.random.key(3)])[1]
    for (_, x), (_, y) in zip(tree_flatten(first), tree_flatten(again), strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))


@pytest.mark.cpu_only("lanes are the CPU's cores")
def test_fine_tune_on_two_cores_repeats_and_keeps_gradient_checkpointing(checkpoint, tmp_path, monkeypatch):
    if usable_cores() < 2:
        pytest.skip("one usable core: a step cannot split")
    made = []
    init = Lanes.__init__

    def spy(self, *args):
        init(self, *args)
        made.append([layer.gradient_checkpointing for layer in (m.bert.encoder for m in self.models)])

    monkeypatch.setattr(Lanes, "__init__", spy)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(TEXTS)))
    options = dict(model=checkpoint("bert", "sequence-classification"), max_steps=3, batch_size=8, cores=2)
    runs = [fine_tune("classify", data, tmp_path / f"run{i}", gradient_checkpointing=True, **options) for i in (0, 1)]
    assert made == [[True, True], [True, True]]
    for (_, x), (_, y) in zip(*(tree_flatten(r.model.parameters()) for r in runs), strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_only_losses_that_average_over_their_rows_split():
    """A head task's loss is one mean over its counted items; BERT pretraining adds a mean over rows (next
    sentence) and ELECTRA a discriminator loss over other tokens: their steps stay whole."""
    from mlx_encoders.train.objective import HeadObjective
    from mlx_encoders.train.rtd import RTDObjective
    from mlx_encoders.train.tasks import CLASSIFY, CLM, MLM, PRETRAINING, RTD, TOKENS

    assert all(HeadObjective(None, None, task).rows_apart for task in (CLASSIFY, TOKENS, MLM, CLM))
    assert not HeadObjective(None, None, PRETRAINING).rows_apart
    assert not RTDObjective(None, None, RTD).rows_apart


def test_cores_that_cannot_be_used_are_said(checkpoint, tmp_path):
    """cores=2 with 4 rows a step (fewer than 4 a core): the step runs whole, and a warning says why."""
    if usable_cores() < 2:
        pytest.skip("one usable core: cores=2 gets the one there is, as asked")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(TEXTS)))
    model = checkpoint("bert", "sequence-classification")
    with pytest.warns(UserWarning, match=r"cores=2: each step runs on 1 lane\(s\).*batch_size \(4\)"):
        fine_tune("classify", data, tmp_path / "run", model=model, max_steps=1, batch_size=4, cores=2)


def test_more_cores_than_the_machine_has_are_said(checkpoint, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(TEXTS)))
    usable, model = usable_cores(), checkpoint("bert", "sequence-classification")
    message = rf"cores={usable + 1}: each step runs on {usable} lane\(s\)\. .* usable cores \({usable} here\)"
    with pytest.warns(UserWarning, match=message):
        fine_tune("classify", data, tmp_path / "run", model=model, max_steps=1, batch_size=4 * usable, cores=usable + 1)
