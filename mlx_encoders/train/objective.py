"""The one interface between the training loop (`trainer.train`) and a task: `Objective`. The loop asks it for the
batches (`batcher`, `collate`), the step's loss and gradients (`loss_and_grad`), the evaluation and its metric
names, whether a batch can teach the loss anything (`no_signal`), how a batch splits over ranks (`part`, `count`)
and what a checkpoint holds of the model (`write_weights`, `read_weights`). `HeadObjective` is the head tasks'
(masked-LM, causal LM, classification: the loss of the model's own head, `losses.task_loss`); `rtd.RTDObjective`,
`embedding.EmbeddingObjective` and `rerank.RerankObjective` are the others'."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..tokenizer import Tokenizer
from .checkpointing import read_weights, write_weights
from .compiling import compiled_value_and_grad, retraced_value_and_grad, value_and_grad
from .config import TrainingConfig
from .data import Examples, collate
from .evaluation import evaluate, labelled
from .losses import batch_loss, loss_arrays
from .masking import Masker
from .metrics import eval_metric_names
from .tasks import PRETRAINING

LossAndGrad = Callable[[dict], tuple[mx.array, dict]]


class Objective(ABC):
    """What the loop asks of a task. `batch_sampler` names the batches' sampler (in messages); `distributed`: the
    task trains under `mlx.launch`; `compiles`: its whole step compiles in float32 (the loop says so before the
    first); `compilable`: the default `loss_and_grad` may compile its step."""

    batch_sampler: str = "batch_sampler"
    distributed: bool = True
    compiles: bool = False
    compilable: bool = False  # its step compiles traced again per shape (`compiling.retraced_value_and_grad`)

    def batcher(self, examples, batch_size: int) -> Callable[[np.ndarray], list[np.ndarray]] | None:
        """A sampler that builds an epoch's batches from its order, or None for consecutive batches."""
        return None

    @abstractmethod
    def collate(self, examples, indices, rng: np.random.Generator | None = None) -> dict:
        """The batch of `indices`, as numpy arrays; `rng` the loop's masking generator (saved with checkpoints)."""

    def loss_and_grad(
        self, model: nn.Module, dtype: mx.Dtype, random: list[mx.array], compile: bool, one_process: bool
    ) -> LossAndGrad:
        """`batch -> (loss, gradients of the trainable parameters)` in `dtype`; `random` is the dropout key;
        `compile`: float32 without gradient checkpointing, where the step may be compiled. By default the
        objective's own `value_and_grad(model, make, random, trace)` (`make(loss_fn)` casts to the compute dtype,
        `trace(fn)` compiles over the model's state and the key), or its whole step retraced when `compilable`."""
        plain = compile and one_process
        if plain and self.compilable:
            return retraced_value_and_grad(model, random, self)
        make = lambda loss: value_and_grad(model, dtype, loss)  # noqa: E731
        state = [model.state, random]  # what a compiled pass reads, and the dropout key it advances
        trace = (lambda fn: mx.compile(fn, inputs=state, outputs=state)) if plain else None  # noqa: E731
        return self.value_and_grad(model, make, random, trace)

    def value_and_grad(self, model: nn.Module, make: Callable, random: list[mx.array], trace: Callable | None):
        raise NotImplementedError(f"{type(self).__name__} gives its step in `loss_and_grad`")

    @abstractmethod
    def evaluate(self, model: nn.Module, examples, batch_size: int) -> dict[str, float]:
        """The eval metrics of `examples` (`eval_loss` and the task's own)."""

    @abstractmethod
    def metric_names(self, examples) -> list[str]:
        """The metrics `evaluate` reports for `examples`."""

    def no_signal(self, examples, indices) -> str | None:
        """Why the batch of `indices` gives the loss no gradient, or None when it can."""
        return None

    def task(self, examples) -> str:
        return examples.task

    # or a method `part(batch, world)`: this rank's part of a batch whose loss spans every rank's rows
    part = None
    # whether a batch's rows may be computed apart and their parts summed, weighted by `count`: its loss is one mean
    # over the rows' own counted items (`lanes`: a step's rows on every CPU core)
    rows_apart: bool = False

    def count(self, batch: dict) -> int:
        """The items a batch's loss averages over, to weight each rank's rows (`distributed.step_gradients`)."""
        raise NotImplementedError(f"{type(self).__name__} splits batches over ranks with `part`")

    def write_weights(self, model: nn.Module, folder: Path) -> None:
        """What a checkpoint holds of the model (besides LoRA adapters, which the loop saves alone)."""
        write_weights(model, folder)

    def read_weights(self, model: nn.Module, folder: Path) -> dict[str, mx.array] | None:
        """The weights `write_weights` wrote, checked against `model`: the loop restores them once the optimizer
        state is checked too; None when they are restored here."""
        return read_weights(model, folder)


class OwnFormat:
    """For an objective whose model writes and reads its training checkpoints itself (`write_checkpoint`,
    `read_checkpoint`): the pair of ELECTRA's models, or an encoder with its projections."""

    def write_weights(self, model: nn.Module, folder: Path) -> None:
        model.write_checkpoint(folder)

    def read_weights(self, model: nn.Module, folder: Path) -> None:
        model.read_checkpoint(folder)


class HeadObjective(Objective):
    """The head tasks' objective (`task`): dynamic masking for masked-LM (`masker`), the loss of the model's own
    head as transformers computes it, the whole step compiled in float32, and `evaluation.evaluate`'s metrics (masks
    drawn from `config.seed`)."""

    compiles = True

    def __init__(self, tokenizer: Tokenizer, config: TrainingConfig, task: str, masker: Masker | None = None):
        self.tokenizer, self.config, self.task_name, self.masker = tokenizer, config, task, masker

    @property
    def distributed(self) -> bool:
        # BERT pretraining adds a mean over rows (next sentence) to the mean over masked tokens: no one weight of a
        # part gives both their share, so its steps stay whole, on one core and in one process
        return self.task_name != PRETRAINING

    @property
    def rows_apart(self) -> bool:
        return self.distributed

    def collate(self, examples: Examples, indices, rng: np.random.Generator | None = None) -> dict:
        return collate(examples, indices, self.tokenizer, self.masker, rng)

    def loss_arrays(self, model: nn.Module, batch: dict[str, np.ndarray]) -> tuple[dict, dict]:
        return loss_arrays(model, batch)

    def batch_loss(self, model: nn.Module, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> mx.array:
        return batch_loss(model, inputs, labels)

    def loss_and_grad(
        self, model: nn.Module, dtype: mx.Dtype, random: list[mx.array], compile: bool, one_process: bool
    ) -> LossAndGrad:
        if compile:
            return compiled_value_and_grad(model, random, self.loss_arrays, self.batch_loss)
        return value_and_grad(model, dtype, lambda batch: self.batch_loss(model, *self.loss_arrays(model, batch)))

    def evaluate(self, model: nn.Module, examples: Examples, batch_size: int) -> dict[str, float]:
        return evaluate(model, self.tokenizer, examples, self.config, self.masker)

    def metric_names(self, examples: Examples) -> list[str]:
        return eval_metric_names(examples)

    def count(self, batch: dict) -> int:
        return int(labelled(batch["labels"], self.task_name).sum())
