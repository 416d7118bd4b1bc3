"""How a training step's loss and gradients are computed: compiled whole (`compiled_value_and_grad`), compiled and
traced again for each new shape (`retraced_value_and_grad`, an objective's step), or op by op, in float32 or over
weights cast to a half-precision compute dtype (`value_and_grad`).
"""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..models.inputs import checked_inputs, unchecked_inputs
from .losses import batch_loss, loss_arrays


def compiled_value_and_grad(
    model: nn.Module, random: list[mx.array], arrays: Callable = loss_arrays, loss: Callable = batch_loss
) -> Callable[[dict], tuple[mx.array, dict]]:
    """`value_and_grad(model, mx.float32)` under one mx.compile, traced again for each new batch shape (a fraction
    of a step). Within a gradient's trace MLX runs a compiled function op by op, so the fused kernels of engine/ops.py
    (gelu, the softmax's exp) only fuse in training when the whole step is compiled (README, Training speed).
    Gradient checkpointing (which draws from a key of its own per layer) and half-precision passes stay uncompiled.
    The model's input checks read token ids on the host, which a compiled function cannot: they run on each
    batch first, in a forward graph that is built in eval mode (no dropout draws) and never evaluated. `arrays(model,
    batch) -> (inputs, labels)` and `loss(model, inputs, labels)` are the head tasks' (`losses`) unless given."""
    state = [model.state, random]  # the weights it reads, the dropout key it reads and advances
    step = mx.compile(
        nn.value_and_grad(model, lambda inputs, labels: loss(model, inputs, labels)), inputs=state, outputs=state
    )

    def run(batch: dict) -> tuple[mx.array, dict]:
        inputs, labels = arrays(model, batch)
        training = model.training
        model.eval()
        try:
            model(**inputs)  # its checks
        finally:
            model.train(training)
        with unchecked_inputs():
            return step(inputs, labels)

    return run


def retraced_value_and_grad(
    model: nn.Module, random: list[mx.array], objective
) -> Callable[[dict], tuple[mx.array, dict]]:
    """An embedding objective's float32 step (`objective.inputs_loss` of `objective.inputs(batch)`) under mx.compile,
    so that the fused kernels of engine/ops.py fuse (see `compiled_value_and_grad`). Its batches' shapes (length groups)
    seldom repeat, so only the last shape's trace is kept: tracing again costs less than a step's unfused kernels."""
    state, traced = [model.state, random], {}

    def run(batch: dict) -> tuple[mx.array, dict]:
        inputs = objective.inputs(batch)
        shapes = tuple(a.shape for _, a in tree_flatten(inputs))
        if shapes not in traced:
            traced.clear()  # the previous trace, and the graph it holds, go
            loss = nn.value_and_grad(model, lambda x: objective.inputs_loss(model, x))
            traced[shapes] = mx.compile(loss, inputs=state, outputs=state)
        checked_inputs(model, [f for column in inputs["columns"] for f in column["groups"]])
        with unchecked_inputs():
            return traced[shapes](inputs)

    return run


def value_and_grad(
    model: nn.Module, dtype: mx.Dtype, loss_fn: Callable[[dict], mx.array] | None = None
) -> Callable[[dict], tuple[mx.array, dict]]:
    """`batch -> (loss, gradients of the trainable parameters)` with the forward and backward passes in `dtype`:
    the float32 weights are cast for the pass (the casts are part of the graph, so gradients come back in float32)
    and put back after it. Quantization scales and biases keep their dtype. `loss_fn(batch)` replaces the task
    loss (`batch_loss`)."""
    loss_fn = loss_fn or (lambda batch: batch_loss(model, *loss_arrays(model, batch)))
    if dtype == mx.float32:
        return nn.value_and_grad(model, loss_fn)

    def cast(params: dict) -> dict:
        return tree_map_with_path(
            lambda path, p: p if path.endswith((".scales", ".biases")) or p.dtype != mx.float32 else p.astype(dtype),
            params,
        )

    def loss(trainable: dict, batch: dict) -> mx.array:
        model.update(cast(trainable))
        return loss_fn(batch)

    loss_and_grad = mx.value_and_grad(loss)

    def run(batch: dict) -> tuple[mx.array, dict]:
        weights, trainable = model.parameters(), model.trainable_parameters()
        model.update(cast(weights))  # the frozen weights, for this pass only
        try:
            return loss_and_grad(trainable, batch)
        finally:
            model.update(weights)

    return run
