"""The optimizer building blocks equal transformers' Trainer step for step: AdamW over its decay / no-decay groups,
its learning-rate schedules, torch's gradient clipping and the Trainer's gradient accumulation."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from checkpoints import load_reference
from mlx.utils import tree_flatten, tree_map

import mlx_encoders
from mlx_encoders.train import task_loss
from mlx_encoders.train.optim import (
    FusedAdamW,
    accumulate_gradients,
    adamw,
    clip_grad_norm,
    decay_parameter_names,
    linear_schedule,
    make_schedule,
    optimizer_step,
)

TEXTS = [
    ["A short one.", "The quick brown fox jumps over the lazy dog."],
    ["Hello world", "Training a tiny encoder, step by step, in two frameworks."],
    ["Gradient accumulation sums micro-batches.", "x"],
    ["Weight decay skips biases and norms.", "Warmup, then linear decay to zero."],
]
STEPS, ACCUMULATION, WARMUP, LR, DECAY, MAX_NORM = 10, 2, 3, 2e-3, 0.01, 1.0
TORCH_SCHEDULES = {
    "linear": transformers.get_linear_schedule_with_warmup,
    "cosine": transformers.get_cosine_schedule_with_warmup,
    "constant": lambda opt, warmup, total: transformers.get_constant_schedule_with_warmup(opt, warmup),
}


def micro_batches(tokenizer) -> list[dict[str, np.ndarray]]:
    """Fixed micro-batches with seeded labels, tokenized once, reused in order by both loops."""
    rng = np.random.default_rng(0)
    batches = [{k: np.array(v) for k, v in dict(tokenizer(texts, padding=True)).items()} for texts in TEXTS]
    return [{**b, "labels": rng.integers(0, 3, len(b["input_ids"]))} for b in batches]


def torch_training(folder, batches: list[dict]) -> tuple[list[float], dict[str, np.ndarray]]:
    """transformers' Trainer inner loop, written out: losses / accumulation steps, clip, AdamW step, schedule step."""
    ref = load_reference(folder, "sequence-classification")
    decay = set(transformers.Trainer.get_decay_parameter_names(None, ref))
    groups = [
        {"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": DECAY},
        {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    schedule = transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for i in range(ACCUMULATION):
            batch = batches[(step * ACCUMULATION + i) % len(batches)]
            loss = ref(**{k: torch.from_numpy(v) for k, v in batch.items()}).loss / ACCUMULATION
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().numpy() for n, p in ref.named_parameters()}


def mlx_training(model: nn.Module, batches: list[dict]) -> list[float]:
    """The same loop on the building blocks of mlx_encoders.train.optim."""
    optimizer = adamw(model, make_schedule("linear", LR, WARMUP, STEPS), weight_decay=DECAY)

    def loss_fn(batch):
        inputs = {k: mx.array(v) for k, v in batch.items() if k != "labels"}
        return task_loss(model, model(**inputs), mx.array(batch["labels"]))

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    losses = []
    for step in range(STEPS):
        micro = [batches[(step * ACCUMULATION + i) % len(batches)] for i in range(ACCUMULATION)]
        loss, grads = accumulate_gradients(loss_and_grad, micro)
        optimizer_step(model, optimizer, grads, MAX_NORM)
        losses.append(loss.item())
    return losses


def test_training_matches_transformers_trainer(checkpoint):
    folder = checkpoint("bert", "sequence-classification")
    model, tokenizer = mlx_encoders.load(folder)
    batches = micro_batches(tokenizer)
    expected_losses, expected_weights = torch_training(folder, batches)
    losses = mlx_training(model, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    weights = dict(tree_flatten(model.parameters()))
    assert set(weights) == set(expected_weights)
    for name, w in weights.items():
        if name.endswith("attention.self.key.bias"):
            continue  # its gradient is 0 (softmax ignores a shift shared by all keys): Adam amplifies rounding noise
        np.testing.assert_allclose(np.array(w), expected_weights[name], atol=1e-4, rtol=0, err_msg=name)


def test_training_moves_weights(checkpoint):
    """A guard on the parity test above: ten steps at this rate move the weights far more than its tolerance."""
    folder = checkpoint("bert", "sequence-classification")
    model, tokenizer = mlx_encoders.load(folder)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    mlx_training(model, micro_batches(tokenizer))
    moved = max(float(np.abs(np.array(v) - before[k]).max()) for k, v in tree_flatten(model.parameters()))
    assert moved > 1e-2


@pytest.mark.parametrize("model_type", mlx_encoders.MODEL_TYPES)
def test_decay_parameters_match_transformers(checkpoint, model_type):
    task = "masked-lm" if model_type in ("distilbert", "modernbert") else "sequence-classification"
    folder = checkpoint(model_type, task)
    model, _ = mlx_encoders.load(folder)
    ours = set(dict(tree_flatten(model.parameters())))
    expected = set(transformers.Trainer.get_decay_parameter_names(None, load_reference(folder, task)))
    # tied copies (a masked-LM decoder's weight) live only in transformers' model
    assert set(decay_parameter_names(model)) == expected & ours
    assert expected & ours != ours, "every parameter decays: the no-decay group is empty"


@pytest.mark.parametrize("name", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 7)])
def test_schedules_match_transformers(name, warmup, total):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    reference = TORCH_SCHEDULES[name](opt, warmup, total)
    schedule = make_schedule(name, LR, warmup, total)
    for step in range(total + 3):  # past the end too: transformers' formulas hold there as well
        # float32 rounding of the factor: 1e-7 of the peak rate
        np.testing.assert_allclose(
            schedule(mx.array(step)).item(), opt.param_groups[0]["lr"], rtol=1e-6, atol=1e-7 * LR
        )
        opt.step()
        reference.step()


def test_schedule_drives_the_optimizer_as_lambda_lr():
    """The rate of the k-th update is schedule(k - 1), starting at 0 under warmup, as torch's LambdaLR gives."""
    model = nn.Linear(2, 2)
    optimizer = adamw(model, make_schedule("linear", LR, 2, 4))
    rates = []
    for _ in range(4):
        optimizer_step(model, optimizer, tree_map(mx.ones_like, model.trainable_parameters()))
        rates.append(optimizer.learning_rate.item())
    np.testing.assert_allclose(rates, [0.0, LR / 2, LR, LR / 2], rtol=1e-6)


@pytest.mark.parametrize("scale", [0.1, 10.0])
def test_clipping_matches_torch(scale):
    rng = np.random.default_rng(1)
    grads = {
        "a": rng.standard_normal((3, 4)).astype(np.float32) * scale,
        "b": rng.standard_normal(5).astype(np.float32),
    }
    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads.values()]
    for p, g in zip(params, grads.values(), strict=True):
        p.grad = torch.from_numpy(g.copy())
    expected_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item()
    clipped, norm = clip_grad_norm({k: mx.array(v) for k, v in grads.items()}, MAX_NORM)
    assert norm.item() == pytest.approx(expected_norm, rel=1e-6)
    for p, g in zip(params, clipped.values(), strict=True):
        np.testing.assert_allclose(np.array(g), p.grad.numpy(), rtol=1e-6)


def test_accumulation_averages_micro_batches():
    """Two micro-batches of one example each give the gradient of the mean loss over both."""
    model = nn.Linear(3, 1)
    x = mx.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])
    loss_and_grad = nn.value_and_grad(model, lambda batch: (model(batch) ** 2).mean())
    loss, grads = accumulate_gradients(loss_and_grad, [x[:1], x[1:]])
    expected_loss, expected = loss_and_grad(x)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for (_, g), (_, e) in zip(tree_flatten(grads), tree_flatten(expected), strict=True):
        # an element is a sum of terms that may cancel (the weights are unseeded): its rounding follows the
        # largest of the gradient's terms, not its own size
        e = np.array(e)
        np.testing.assert_allclose(np.array(g), e, rtol=1e-6, atol=1e-6 * np.abs(e).max())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_adamw_is_mlx_adamw_bit_for_bit(dtype):
    """The compiled update runs the same ops in the same order as mlx's AdamW: equal, not merely close, for
    parameters of several shapes (one compiled kernel serves them all), a schedule and weight decay."""
    import mlx.optimizers as optim

    keys = iter(mx.random.split(mx.random.key(0), 32))
    params = {"w": mx.random.normal((37, 5), key=next(keys)), "b": mx.random.normal((3,), key=next(keys))}
    params = tree_map(lambda p: p.astype(dtype), params)
    schedule = linear_schedule(1e-2, 2, 6)
    options = dict(betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01, bias_correction=True)
    reference, fused = optim.AdamW(schedule, **options), FusedAdamW(schedule, **options)
    ours, theirs = params, params
    for _ in range(6):
        grads = tree_map(lambda p: mx.random.normal(p.shape, key=next(keys)).astype(dtype), params)
        ours, theirs = fused.apply_gradients(grads, ours), reference.apply_gradients(grads, theirs)
    for key in params:
        assert ours[key].dtype == dtype and fused.state[key]["m"].dtype == dtype
        np.testing.assert_array_equal(np.array(ours[key].astype(mx.float32)), np.array(theirs[key].astype(mx.float32)))
        np.testing.assert_array_equal(np.array(fused.state[key]["v"].astype(mx.float32)),
                                      np.array(reference.state[key]["v"].astype(mx.float32)))  # fmt: skip
    assert not np.array_equal(np.array(ours["w"].astype(mx.float32)), np.array(params["w"].astype(mx.float32)))


def test_clipping_inside_the_fused_update_equals_clipping_first():
    """optimizer_step hands the clipping factor to FusedAdamW's kernel (no pass of its own over the gradients):
    the parameters and moments equal clipping the gradients first and applying mlx's AdamW, bit for bit, over a
    MultiOptimizer's two groups and parameters spread over several CPU streams."""
    import mlx.optimizers as optim

    keys = iter(mx.random.split(mx.random.key(1), 32))
    model = nn.Sequential(nn.Linear(33, 17), nn.LayerNorm(17), nn.Linear(17, 5))
    reference = nn.Sequential(nn.Linear(33, 17), nn.LayerNorm(17), nn.Linear(17, 5))
    reference.update(tree_map(lambda p: p, model.parameters()))
    fused = adamw(model, linear_schedule(1e-2, 1, 4), DECAY)
    decayed = set(decay_parameter_names(reference))
    plain = optim.MultiOptimizer(
        [optim.AdamW(linear_schedule(1e-2, 1, 4), [0.9, 0.999], 1e-8, d, bias_correction=True) for d in (DECAY, 0.0)],
        [lambda path, _: path in decayed],
    )
    for scale in (10.0, 0.01, 10.0):  # clipped, not clipped, clipped
        grads = tree_map(lambda p, s=scale: mx.random.normal(p.shape, key=next(keys)) * s, model.trainable_parameters())
        norm = optimizer_step(model, fused, grads, MAX_NORM)
        clipped, expected_norm = clip_grad_norm(grads, MAX_NORM)
        plain.update(reference, clipped)
        assert norm.item() == pytest.approx(expected_norm.item(), rel=1e-6)
    pairs = zip(tree_flatten(model.parameters()), tree_flatten(reference.parameters()), strict=True)
    for (name, ours), (_, theirs) in pairs:
        np.testing.assert_array_equal(np.array(ours), np.array(theirs), err_msg=name)
    assert all(o.gradient_scale is None for o in fused.optimizers)  # the factor is not left behind


def test_global_norm_reads_every_layout():
    """The norm's CPU path (numpy's dot over MLX's buffers) equals a float64 reference for contiguous, transposed,
    sliced and half-precision gradients (the last take MLX's own reduction)."""
    from mlx_encoders.train.optim import global_norm

    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 30)).astype(np.float32)
    grads = {"plain": mx.array(a), "transposed": mx.array(a).T, "sliced": mx.array(a)[::3, 1:], "half": mx.array(a)}
    grads["half"] = grads["half"].astype(mx.float16)
    parts = [a, a.T, a[::3, 1:], a.astype(np.float16).astype(np.float32)]
    expected = np.sqrt(sum(np.sum(p.astype(np.float64) ** 2) for p in parts))
    assert global_norm(grads).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.cpu_only("the updates spread over CPU streams")
def test_updates_are_spread_evenly_over_cpu_streams():
    from mlx_encoders.engine import runtime

    arrays = [mx.zeros((n,)) for n in (1000, 10, 600, 400, 10, 5)]
    chosen = runtime.spread_over_streams(arrays)
    if len(runtime.cpu_streams()) < 2:
        assert chosen is None
        return
    loads = {}
    for x in arrays:
        loads[chosen[id(x)]] = loads.get(chosen[id(x)], 0) + x.size
    assert sum(loads.values()) == 2025 and max(loads.values()) <= 1015  # largest first onto the least loaded
    assert runtime.spread_over_streams(arrays) == chosen  # the same every step


def test_training_keeps_freed_buffers_and_leaves_mlx_as_it_was():
    """Inside keep_freed_memory a freed 64 MB buffer stays in MLX's cache for the next step (above the caller's
    limit, so outside the block it goes back to the system), but the cache never holds more than the largest
    working set seen (steps of changing shapes cannot grow it without bound); after the block MLX's cache limit is
    the one the caller had, and the cache is empty. Nested blocks keep it until the outermost leaves."""
    from mlx_encoders.engine import runtime

    def cached_after_free(elements: int = 16 << 20) -> int:
        x = mx.ones((elements,))
        mx.eval(x)
        del x
        return mx.get_cache_memory()

    caller_limit = 40 << 20
    previous = mx.set_cache_limit(caller_limit)
    try:
        mx.clear_cache()
        assert cached_after_free() < 64 << 20
        with runtime.keep_freed_memory():
            with runtime.keep_freed_memory():
                runtime.cache_working_set()
                assert cached_after_free() >= 64 << 20
            assert mx.get_cache_memory() >= 64 << 20
            for k in range(1, 40):  # buffers of ever new sizes: the cache stays within the peak working set
                cached_after_free((16 << 20) + (k << 16))
                runtime.cache_working_set()
            assert mx.get_cache_memory() <= mx.get_peak_memory()
        assert mx.get_cache_memory() == 0
        assert mx.set_cache_limit(caller_limit) == caller_limit
    finally:
        mx.set_cache_limit(previous)


def test_fine_tune_leaves_mlx_global_key_alone(tmp_path, checkpoint):
    """New weights (a fresh head, LoRA adapters) come from `seed` through a key of fine_tune's own: the same seed
    gives the same weights, and MLX's global random stream after the call does not depend on the seed (it is not
    reseeded; building modules advances it as any MLX model construction does)."""
    rows = [{"text": f"text number {i}", "label": i % 2} for i in range(8)]
    runs, draws = [], []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        mx.random.seed(123)
        options = dict(model=checkpoint("bert"), max_steps=1, lora_rank=2, seed=seed)
        runs.append(mlx_encoders.train.fine_tune("classify", rows, tmp_path / name, **options))
        draws.append(np.array(mx.random.uniform(shape=(4,))))
    assert np.array_equal(draws[0], draws[2])
    weights = [dict(tree_flatten(run.model.parameters())) for run in runs]
    for name, value in weights[0].items():
        assert np.array_equal(np.array(value), np.array(weights[1][name])), name
    assert not np.array_equal(np.array(weights[0]["classifier.weight"]), np.array(weights[2]["classifier.weight"]))
