"""The optimizer's CPU fast paths: AdamW's update fused into one kernel per parameter, spread over one stream per
core, and the gradient norm read in place by numpy's BLAS. Values equal mlx's AdamW and a plain norm
(tests/test_train_optim.py).
"""

import contextlib
from collections.abc import Sequence

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from .runtime import on_cpu, spread_over_streams


@mx.compile
def adamw_update(parameter, gradient, m, v, scale, lr, c1, c2, decay: float, b1: float, b2: float, eps: float):
    """mlx's AdamW.apply_single (with bias correction) for one parameter, of the gradient times `scale` (the
    clipping factor, 1 when not clipping): the same ops in the same order. Compiled for each shape it meets:
    a shapeless kernel indexes every element through its strides and runs half as fast."""
    gradient = gradient * scale
    parameter = parameter * (1 - lr * decay)
    m = b1 * m + (1 - b1) * gradient
    v = b2 * v + (1 - b2) * mx.square(gradient)
    return parameter - (c1 * m) / (mx.sqrt(v) * c2 + eps), m, v


class FusedAdamW(optim.AdamW):
    """mlx's AdamW with bias correction, its per-parameter update compiled (`adamw_update`): MLX's CPU backend
    runs each element-wise op as a pass of its own over the weights, about ten per parameter, and the fused
    kernel makes one. The step's scalars (learning rate, bias corrections, clipping factor) are computed once
    per step and shared, so a parameter's update is one kernel. On the CPU the parameters' updates are spread
    over one stream per core (`spread_over_streams`) and `dispatch` starts each stream's share, the
    largest first. `gradient_scale`, when set (by `optimizer_step`), multiplies every gradient inside that
    kernel: clipping costs no pass of its own over the gradients."""

    gradient_scale: mx.array | None = None
    _streams: dict[int, mx.Stream] | None = None
    _scalars: dict | None = None
    _pending: dict | None = None
    _made_scalars: tuple = ()

    def apply_gradients(self, gradients: dict, parameters: dict) -> dict:
        self._streams = spread_over_streams([g for _, g in tree_flatten(gradients)])
        self._scalars, self._pending = {}, {}
        try:
            return super().apply_gradients(gradients, parameters)
        finally:
            self._made_scalars = tuple(self._scalars.values())
            self._streams = self._scalars = None

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        stream = self._streams.get(id(gradient)) if self._streams else None
        self.step_scalars(gradient.dtype)  # on the default stream, before any parameter's (see `dispatch`)
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            parameter = self.fused_single(gradient, parameter, state)
        if stream is not None and self._pending is not None:
            share = self._pending.setdefault(stream, [0, []])
            share[0] += parameter.size
            share[1] += [parameter, state["m"], state["v"]]
        return parameter

    def dispatch(self) -> None:
        """Start the updates `update` built, one stream at a time, the most loaded first (`optimizer_step` calls
        it). Evaluated together, MLX dispatches them in graph order and stops dispatching while more than ten
        groups of ops are in flight, so the one large update (the word embeddings') started only once the other
        stream had worked through most of its hundred small ones. Does nothing without streams."""
        pending, self._pending = self._pending or {}, None
        if not pending:
            return
        # The step's scalars first: inside the first share's async_eval, the other streams could wait for them
        # behind work that eval dispatches before them.
        mx.eval(self._made_scalars)
        for _, arrays in sorted(pending.values(), key=lambda entry: -entry[0]):
            mx.async_eval(arrays)

    def step_scalars(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(clipping factor, learning rate, lr / (1 - b1^t), 1 / sqrt(1 - b2^t)) in `dtype`, as mlx's AdamW
        computes them, made once per step (`apply_gradients`) for all parameters of that dtype."""
        cached = self._scalars.get(dtype) if self._scalars is not None else None
        if cached is not None:
            return cached
        scale = mx.array(1.0, dtype) if self.gradient_scale is None else self.gradient_scale.astype(dtype)
        lr = self.learning_rate.astype(dtype)
        b1, b2 = self.betas
        c1 = (lr / (1 - b1**self.step)).astype(dtype)
        c2 = mx.rsqrt(1 - b2**self.step).astype(dtype)
        if self._scalars is not None:
            self._scalars[dtype] = (scale, lr, c1, c2)
        return scale, lr, c1, c2

    def fused_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        scale, lr, c1, c2 = self.step_scalars(gradient.dtype)
        if not self.bias_correction:
            return super().apply_single(gradient * scale, parameter, state)
        b1, b2 = self.betas
        parameter, state["m"], state["v"] = adamw_update(
            parameter, gradient, state["m"], state["v"], scale, lr, c1, c2, self.weight_decay, b1, b2, self.eps
        )
        return parameter


def sum_of_squares(arrays: Sequence[mx.array]) -> mx.array:
    """The float32 sum of the squares of every element of `arrays` (a global gradient norm's square). On the CPU,
    float32 arrays are evaluated and read in place by numpy's BLAS dot product: one vectorised pass over each,
    on every core, where MLX would square each into a new array and reduce that on one thread."""
    if not on_cpu() or any(x.dtype != mx.float32 for x in arrays):
        return sum((mx.square(x.astype(mx.float32)).sum() for x in arrays), mx.array(0.0))
    mx.eval(*arrays)
    # ravel in memory order ("K"): a view of MLX's buffer for any dense layout, transposed ones included (a linear
    # weight's gradient is the transpose of x^T g), where reshape(-1) would copy it.
    flat = (np.asarray(x).ravel(order="K") for x in arrays)
    return mx.array(sum(float(np.dot(a, a)) for a in flat), mx.float32)
