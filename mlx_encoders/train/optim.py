"""Optimizer, learning-rate schedules, gradient clipping and accumulation, as transformers' `Trainer` sets them up
(reference: `Trainer.create_optimizer` and `get_decay_parameter_names` in `trainer.py`, `optimization.py`'s
`get_{linear,cosine,constant}_schedule_with_warmup`, `torch.optim.AdamW`, `torch.nn.utils.clip_grad_norm_`).

mlx's `AdamW` with `bias_correction=True` is torch's update exactly (decoupled decay `p * (1 - lr * wd)`, then
`lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`) and its schedules read the number of steps taken
before, as torch's `LambdaLR` does. Clipping scales by `min(1, max_norm / (norm + 1e-6))`, as torch's. The
schedules are written here because mlx's clamp where transformers' keep their formula. `FusedAdamW` is that
update (and the clipping factor) with its element-wise ops compiled into one kernel per parameter.
"""

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from ..engine.optim import FusedAdamW, sum_of_squares

Schedule = Callable[[mx.array], mx.array]

# transformers' `get_decay_parameter_names`: searched in lower-cased parameter names; nn.LayerNorm's are excluded too
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The trainable parameters that weight decay applies to: transformers' rule (no biases, no norm weights,
    nothing inside an nn.LayerNorm) on this model's parameter names, which are the checkpoint's."""
    norms = [path + "." for path, module in model.named_modules() if isinstance(module, nn.LayerNorm)]
    return [
        name
        for name, _ in tree_flatten(model.trainable_parameters())
        if not name.startswith(tuple(norms)) and not any(re.search(p, name.lower()) for p in NO_DECAY_PATTERNS)
    ]


def adamw(
    model: nn.Module,
    learning_rate: float | Schedule = 5e-5,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> optim.Optimizer:
    """torch's AdamW with `TrainingArguments`' defaults, over two groups as `Trainer.create_optimizer` makes them:
    `weight_decay` on `decay_parameter_names(model)`, none on the other trainable parameters."""

    def make(decay: float) -> optim.AdamW:
        return FusedAdamW(learning_rate, list(betas), eps, decay, bias_correction=True)

    if weight_decay == 0:
        return make(0.0)
    decayed = set(decay_parameter_names(model))
    return optim.MultiOptimizer([make(weight_decay), make(0.0)], [lambda path, _: path in decayed])


def warmup_factor(step: mx.array, num_warmup_steps: int) -> mx.array:
    return step / max(1, num_warmup_steps)


def linear_schedule(learning_rate: float, num_warmup_steps: int, num_training_steps: int) -> Schedule:
    """transformers' `get_linear_schedule_with_warmup`: 0 -> lr over the warmup, then linearly down to 0."""

    def schedule(step: mx.array) -> mx.array:
        step = mx.array(step, mx.float32)
        decay = mx.maximum(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
        return learning_rate * mx.where(step < num_warmup_steps, warmup_factor(step, num_warmup_steps), decay)

    return schedule


def cosine_schedule(
    learning_rate: float, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5
) -> Schedule:
    """transformers' `get_cosine_schedule_with_warmup`: linear warmup, then a cosine from lr to 0 over
    `num_cycles` periods (half a period by default)."""

    def schedule(step: mx.array) -> mx.array:
        step = mx.array(step, mx.float32)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        decay = mx.maximum(0.0, 0.5 * (1.0 + mx.cos(math.pi * num_cycles * 2.0 * progress)))
        return learning_rate * mx.where(step < num_warmup_steps, warmup_factor(step, num_warmup_steps), decay)

    return schedule


def constant_schedule(learning_rate: float, num_warmup_steps: int, num_training_steps: int | None = None) -> Schedule:
    """transformers' `get_constant_schedule_with_warmup`: linear warmup, then lr."""

    def schedule(step: mx.array) -> mx.array:
        step = mx.array(step, mx.float32)
        return learning_rate * mx.where(step < num_warmup_steps, warmup_factor(step, num_warmup_steps), 1.0)

    return schedule


SCHEDULES = {"linear": linear_schedule, "cosine": cosine_schedule, "constant": constant_schedule}


def make_schedule(name: str, learning_rate: float, num_warmup_steps: int, num_training_steps: int) -> Schedule:
    """The schedule `TrainingArguments.lr_scheduler_type` names: "linear" (its default), "cosine" or "constant"
    (transformers' "constant_with_warmup"; with 0 warmup steps, its "constant")."""
    if name not in SCHEDULES:
        raise ValueError(f"Unknown learning-rate schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](learning_rate, num_warmup_steps, num_training_steps)


def global_norm(grads: dict) -> mx.array:
    """The norm of all gradients together, as one vector (torch's `clip_grad_norm_` with its default 2-norm)."""
    return mx.sqrt(sum_of_squares([g for _, g in tree_flatten(grads)]))


def clip_scale(norm: mx.array, max_norm: float) -> mx.array:
    """torch's `clip_grad_norm_` factor: `max_norm / (norm + 1e-6)`, at most 1."""
    return mx.minimum(max_norm / (norm + 1e-6), 1.0)


def clip_grad_norm(grads: dict, max_norm: float) -> tuple[dict, mx.array]:
    """torch's `clip_grad_norm_`: scale every gradient by `max_norm / (norm + 1e-6)` when the global norm exceeds
    `max_norm`; returns the gradients and the norm before clipping."""
    norm = global_norm(grads)
    return scaled(grads, clip_scale(norm, max_norm)), norm


def scaled(grads: dict, scale: mx.array) -> dict:
    return tree_map(lambda g: g * scale.astype(g.dtype), grads)


def accumulate_gradients(
    loss_and_grad: Callable[[Any], tuple[mx.array, dict]], batches: Iterable[Any]
) -> tuple[mx.array, dict]:
    """Gradient accumulation: each micro-batch's loss (and so its gradient) is divided by the number of
    micro-batches, and the parts are summed, so k micro-batches of b examples step as one batch of k x b would
    (transformers' `Trainer` did this before 4.46; since then it divides by the labelled tokens of the whole step
    for the heads whose loss takes `num_items_in_batch`, and for the others sums micro-batch means undivided).
    `loss_and_grad(batch)` is e.g. `nn.value_and_grad(model, loss_fn)`; returns the mean loss and the summed
    gradients."""
    batches = list(batches)
    if len(batches) == 1:  # dividing by 1 would be a pass over every gradient for nothing
        loss, grads = loss_and_grad(batches[0])
        mx.eval(loss, grads)
        return loss, grads
    total_loss, total_grads = mx.array(0.0), None
    for batch in batches:
        loss, grads = loss_and_grad(batch)
        grads = tree_map(lambda g: g / len(batches), grads)
        total_loss = total_loss + loss / len(batches)
        total_grads = grads if total_grads is None else tree_map(mx.add, total_grads, grads)
        mx.eval(total_loss, total_grads)  # one micro-batch's graph at a time: that is the point of accumulating
    return total_loss, total_grads


def optimizer_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    grads: dict,
    max_grad_norm: float | None = 1.0,
    norm: mx.array | None = None,
) -> mx.array | None:
    """Clip (unless `max_grad_norm` is None or <= 0, as `TrainingArguments.max_grad_norm`) and apply `grads` to
    `model`; returns the gradient norm before clipping (`norm`, when the caller has computed it already), None when
    not clipping. `FusedAdamW` optimizers (alone or in a `MultiOptimizer`) apply the clipping factor inside their
    update kernel."""
    parts = getattr(optimizer, "optimizers", [optimizer])
    fused = all(isinstance(o, FusedAdamW) for o in parts)
    clipping = max_grad_norm is not None and max_grad_norm > 0  # a negative factor would flip every gradient
    if clipping:
        norm = global_norm(grads) if norm is None else norm
        scale = clip_scale(norm, max_grad_norm)
        if fused:
            for o in parts:
                o.gradient_scale = scale
        else:
            grads = scaled(grads, scale)
    try:
        optimizer.update(model, grads)
        for o in parts if fused else ():
            o.dispatch()
        mx.eval(model.parameters(), optimizer.state)
    finally:
        if fused:
            for o in parts:
                o.gradient_scale = None
    return norm if clipping else None
