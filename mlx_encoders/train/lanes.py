"""A training step's rows split over the CPU's cores (`Lanes`), for the losses that average over their rows' own
items (the head tasks: classification, token classification, masked and causal LM).

On the CPU, MLX runs a pass's element-wise work (normalisation, activations, softmax, dropout and their gradients)
on one thread, about half of a step. Each lane computes the loss and gradients of its rows (`rank::size` of every
micro-batch, as the ranks of a distributed run take theirs) on a core of its own (`engine.threads.on_cores`), its
part weighted by its share of the micro-batch's counted items, and the parts are summed: the step's gradients
equal one pass's over the whole batch but for float rounding. Each lane draws its dropout masks from its own key,
split from the step's as ranks split theirs, so a run on n lanes repeats exactly and draws as n ranks would.
"""

import copy
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..distributed import WeightedSum, World, weighted_rows
from ..engine.ops import drawing_from
from ..engine.runtime import on_cpu, one_blas_thread_holds, usable_cores
from ..engine.threads import on_cores

LossAndGrad = Callable[[dict], tuple[mx.array, dict]]
# Rows a lane takes at least: below this a lane's products are too small to gain from a core of their own.
LEAST_LANE_ROWS = 4
# Below this many weights a step is mostly dispatch, where a thread's hand-off and each lane's own trace cost more
# than a core gains (the test suite's tiny models trained 45% slower split); `cores` asks for lanes regardless.
LEAST_LANE_WEIGHTS = 2**22


def module_copy(x):
    """A copy of a module tree (its modules, lists and dicts) over the same arrays: `nn.value_and_grad` puts the
    traced weights into the module it differentiates for the length of a pass, so two passes at once need two trees."""
    if isinstance(x, nn.Module):
        copied = copy.copy(x)
        for name, value in x.items():
            copied[name] = module_copy(value)
        return copied
    if isinstance(x, list | tuple):
        return type(x)(module_copy(v) for v in x)
    if isinstance(x, dict):
        return {name: module_copy(v) for name, v in x.items()}
    return x


def lane_count(batch_size: int, cores: int | None = None, weights: int = LEAST_LANE_WEIGHTS) -> int:
    """The lanes a step of `batch_size` rows of a model of `weights` weights runs on, each with one BLAS thread:
    one per usable core, or `cores` of them; 1 (the step whole, its products on every core) where the batch has
    fewer than LEAST_LANE_ROWS rows for each, for a model under LEAST_LANE_WEIGHTS unless `cores` is given, off the
    CPU (a GPU runs each kernel on all of its cores) or where MLX's BLAS cannot be held to one thread a call (CPU
    tuning off)."""
    lanes = min(cores or usable_cores(), usable_cores())
    small = cores is None and weights < LEAST_LANE_WEIGHTS
    if lanes < 2 or small or batch_size < lanes * LEAST_LANE_ROWS or not on_cpu() or not one_blas_thread_holds():
        return 1
    return lanes


class Lanes:
    """`gradients(batches, count, random)`: the step's mean loss and gradients over its micro-batches, each split
    over `size` lanes. `make(model, random)` gives a lane's `batch -> (loss, gradients)` over its module tree and
    dropout key list; lane 0 is `model` itself and runs on the calling thread."""

    def __init__(self, model: nn.Module, make: Callable[[nn.Module, list[mx.array]], LossAndGrad], size: int):
        self.models = [model, *(module_copy(model) for _ in range(size - 1))]
        self.keys = [[mx.random.key(0)] for _ in range(size)]
        self.steps = [make(m, key) for m, key in zip(self.models, self.keys, strict=True)]
        self.size = size

    def gradients(self, batches: list[dict], count: Callable[[dict], int], random: list[mx.array]):
        """`random[0]` is the step's key: lane i draws from its i-th split and the key moves on as a rank's does."""
        model = self.models[0]
        self.follow()
        keys = list(mx.random.split(random[0], self.size))
        mx.eval(keys, model.parameters())  # a worker can evaluate nothing made on this thread's stream
        parts = on_cores([self.lane(i, keys[i], batches, count) for i in range(self.size)])
        random[0] = mx.random.split(random[0])[0]
        total = WeightedSum()
        while parts:  # ((loss, gradients), their weight); let go of each as it is added: MLX reuses its buffers
            part = parts.pop(0)
            if part is not None:
                total.add(*part)
            del part
        if total.tree is None:  # no lane had a counted item: a step that changes nothing, as one pass would give
            return mx.array(0.0), tree_map(mx.zeros_like, model.trainable_parameters())
        loss, grads = total.result()
        mx.eval(loss, grads)
        return loss, grads

    def follow(self) -> None:
        """Point the copies at the model's weights and mode: the optimizer replaces the weights in the model alone."""
        model = self.models[0]
        for other in self.models[1:]:
            other.update(model.parameters())
            other.train(model.training)

    def lane(self, i: int, key: mx.array, batches: list[dict], count: Callable[[dict], int]):
        """Lane i's task: its rows' loss and gradients, each micro-batch's part weighted by its share of that
        micro-batch's counted items over the number of micro-batches, as ((loss, gradients), the weight still to
        apply to them: `WeightedSum`); None when it has no counted item."""
        world = World(None, self.size, i)

        def run() -> tuple[tuple[mx.array, dict], float] | None:
            self.keys[i][0] = key
            total = WeightedSum()
            with drawing_from(self.keys[i]):
                for batch in batches:
                    mine, share = weighted_rows(batch, count, world, len(batches))
                    if share:
                        total.add(self.steps[i](mine), share)
                        mx.eval(total.tree)  # one micro-batch's graph at a time, as `accumulate_gradients`
            return None if total.tree is None else (total.tree, total.weight)

        return run
