"""The training loop: seeded shuffling, gradient accumulation, evaluation, metrics, checkpoints and exact resume
(their files in `checkpointing`, the step's compiled forms in `compiling`, the head tasks' evaluation in
`evaluation`), after transformers' `Trainer` (reference: `Trainer._inner_training_loop` in `trainer.py`;
`TrainingArguments` for the names and defaults).

An epoch's order is drawn from `numpy.random.default_rng([seed, epoch])`, so it needs no saved state; the masking
generator and the trainer's MLX key (dropout) are saved in each checkpoint's `trainer_state.json` and restored on
resume, so a resumed run takes the same steps, with the same masks and dropout, as one never stopped.
"""

import hashlib
import itertools
import math
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm.auto import tqdm

from .. import distributed
from ..checkpoint.lock import FolderLock
from ..engine import runtime
from ..engine.ops import drawing_from
from ..engine.runtime import usable_cores
from ..errors import CommandError
from ..tokenizer import Tokenizer
from .checkpointing import (
    TrainerState,
    checkpoints,
    claim_output,
    log_metrics,
    rotate_checkpoints,
    save_checkpoint,
    start_state,
    update_best,
)
from .config import COMPUTE_DTYPES, OptionError, TrainingConfig
from .data import Examples
from .embedding import batch_tokens
from .evaluation import check_metric_for_best
from .lanes import LEAST_LANE_ROWS, Lanes, lane_count
from .masking import Masker
from .objective import HeadObjective, Objective
from .optim import Schedule, accumulate_gradients, adamw, global_norm, make_schedule, optimizer_step
from .options import check_needs
from .plot import plot_metrics
from .rtd import ReplacedTokenDetection, RTDObjective, rtd_masker
from .tasks import RTD as RTD_TASK

RUN_LOCK = ".training.lock"


class Diverged(ArithmeticError, CommandError):
    """A non-finite loss or gradient norm: training stopped before the step that would have spoiled the weights."""


class NoSignal(OptionError):
    """No batch of the run gives the loss a gradient (one row for in-batch negatives, equal scores for CoSENT, one
    document for a listwise reranking loss): refused before any work, as training would not change the weights."""


class ZeroGradient(CommandError):
    """A step whose batch should teach the loss something gave exactly zero gradients, before any step had moved the
    weights: the loss does not reach the weights being trained. Stopped before saving a model that never trained."""


# ----- batches -----


def epoch_steps(
    n: int,
    config: TrainingConfig,
    epoch: int,
    lengths: np.ndarray | None = None,
    batcher: Callable[[np.ndarray], list[np.ndarray]] | None = None,
) -> list[list[np.ndarray]]:
    """The steps of one epoch, each a list of up to `grad_accum` micro-batches of example indices, in an order
    drawn from `default_rng([seed, epoch])`; the last step of an epoch may hold fewer micro-batches. With
    `config.group_by_length`, the order is grouped by the examples' `lengths`; `batcher` cuts the order into
    batches instead of consecutive runs (e.g. `embedding.no_duplicates`)."""
    order = np.random.default_rng([config.seed, epoch]).permutation(n)
    if config.group_by_length:  # mega-batches of a whole step's examples, as the Trainer's LengthGroupedSampler
        order = length_grouped(order, lengths, config.batch_size * config.grad_accum)
    if batcher is not None:
        batches = batcher(order)
    else:
        batches = [order[i : i + config.batch_size] for i in range(0, n, config.batch_size)]
    return [batches[i : i + config.grad_accum] for i in range(0, len(batches), config.grad_accum)]


def length_grouped(order: np.ndarray, lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """transformers' `get_length_grouped_indices`: a random order cut into mega-batches of up to 50 batches (at
    least 4 mega-batches when there is enough data), each sorted longest first, with the longest example of all
    swapped to the front so that running out of memory happens at once, not late in an epoch."""
    size = max(1, min(len(order) // (batch_size * 4), 50)) * batch_size
    groups = [sorted(order[i : i + size], key=lambda j: -lengths[j]) for i in range(0, len(order), size)]
    longest = int(np.argmax([lengths[g[0]] for g in groups]))
    groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
    return np.array([i for g in groups for i in g], dtype=order.dtype)


# ----- the loop -----


def steps_per_epoch(n: int, config: TrainingConfig) -> int:
    return math.ceil(math.ceil(n / config.batch_size) / config.grad_accum)


def total_steps(
    n: int, config: TrainingConfig, lengths: np.ndarray | None = None, batcher: Callable | None = None
) -> int:
    """`max_steps`, else the steps of every epoch as `epoch_steps` builds them: a `batcher` that defers examples to
    extra batches (`embedding.no_duplicates`) adds steps, so that every example is trained on in every epoch."""
    if config.max_steps:
        return config.max_steps
    if batcher is None:
        return config.epochs * steps_per_epoch(n, config)
    return sum(len(epoch_steps(n, config, epoch, lengths, batcher)) for epoch in range(config.epochs))


def check_signal(
    objective: Objective,
    examples,
    config: TrainingConfig,
    lengths: np.ndarray,
    batcher: Callable | None,
    total: int,
) -> None:
    """Refuse a run none of whose micro-batches gives the objective's loss a gradient (`objective.no_signal`),
    looking at the run's batches in order until one can teach the loss something."""
    reason = None
    for _, (_, _, indices, _, _) in zip(
        range(total), steps_from(lengths, config, TrainerState(), batcher), strict=False
    ):
        for batch in indices:
            found = objective.no_signal(examples, batch)
            if found is None:
                return
            reason = reason or found
    if reason is None:  # no step at all
        return
    rows = f"{len(examples)} row{'s' * (len(examples) != 1)}"
    no_duplicates = objective.batch_sampler == "no_duplicates"  # it may split the batches
    batching = f"batch_size={config.batch_size}" + (", batch_sampler=no_duplicates" if no_duplicates else "")
    raise NoSignal(
        f"Training would leave the weights as they are: no batch of this run ({rows}, {batching}, {total} "
        f"step{'s' * (total != 1)}) gives the loss a gradient: {reason}"
    )


def steps_from(
    lengths: np.ndarray, config: TrainingConfig, state: TrainerState, batcher: Callable | None = None
) -> Iterator[tuple[int, int, list[np.ndarray], bool, float]]:
    """(epoch, position after the step, micro-batches, whether the step ends its epoch, the epochs done after it,
    as transformers counts them: 1.5 halfway through the second) from where `state` stands, epoch after epoch; an
    epoch ends when its list of steps runs out, however many its batcher built."""
    epoch, position = state.epoch, state.position
    while True:
        steps = epoch_steps(len(lengths), config, epoch, lengths, batcher)
        for i in range(position, len(steps)):
            yield epoch, i + 1, steps[i], i + 1 == len(steps), epoch + (i + 1) / len(steps)
        epoch, position = epoch + 1, 0


@dataclass
class Loop:
    """What every step of one `train` call uses."""

    model: nn.Module
    tokenizer: Tokenizer
    examples: Examples
    eval_examples: Examples | None
    config: TrainingConfig
    optimizer: optim.Optimizer
    schedule: Schedule
    state: TrainerState
    total: int
    objective: Objective  # the task's batches, loss and evaluation

    def __post_init__(self):
        self.mask_rng = np.random.default_rng()
        self.mask_rng.bit_generator.state = self.state.mask_rng
        self.random = [mx.array(self.state.mlx_key, dtype=mx.uint32)]  # the key dropout draws from (`drawing_from`)
        self.world = distributed.world()
        trainable = {name for name, _ in tree_flatten(self.model.trainable_parameters())}
        embeddings = (path for path, m in self.model.named_modules() if isinstance(m, nn.Embedding))
        self.tables = {f"{path}.weight" for path in embeddings} & trainable  # rows of their gradients: all_sum
        self.learned = self.state.step > 0  # whether a step has moved the weights (a resumed run's have)
        dtype = COMPUTE_DTYPES[self.config.dtype]
        compile = dtype == mx.float32 and not self.config.gradient_checkpointing
        self.compiled = compile and self.objective.compiles
        one_process = self.world.size == 1
        self.loss_and_grad = self.objective.loss_and_grad(self.model, dtype, self.random, compile, one_process)
        split = one_process and self.objective.rows_apart
        weights = sum(w.size for _, w in tree_flatten(self.model.parameters()))
        lanes = lane_count(self.config.batch_size, self.config.cores, weights) if split else 1
        make = lambda model, key: self.objective.loss_and_grad(model, dtype, key, compile, True)  # noqa: E731
        self.lanes = Lanes(self.model, make, lanes) if lanes > 1 else None
        if (self.config.cores or 1) > 1 and self.world.is_main and lanes != self.config.cores:
            warnings.warn(
                f"cores={self.config.cores}: each step runs on {lanes} lane(s). A step splits over the CPU's usable "
                f"cores ({usable_cores()} here) in one process (not under mlx.launch), on MLX's CPU backend with its "
                f"CPU tuning on, and when batch_size ({self.config.batch_size}) gives each core at least "
                f"{LEAST_LANE_ROWS} rows",
                stacklevel=2,
            )

    def step(self, indices: list[np.ndarray]) -> dict:
        """Collate the micro-batches, take one optimizer step and log it; returns the record with tokens/s."""
        started = time.perf_counter()
        batches = [self.collate(i) for i in indices]
        self.state.mask_rng = self.mask_rng.bit_generator.state
        lr = self.schedule(mx.array(self.state.step)).item()
        with drawing_from(self.random):
            loss, grads = self.gradients(batches)
        norm = global_norm(grads)
        self.check_finite(loss.item(), norm.item())
        self.check_learning(loss.item(), norm.item(), indices, grads)
        norm = optimizer_step(self.model, self.optimizer, grads, self.config.max_grad_norm, norm)
        if self.lanes is not None:  # the copies let go of the weights the optimizer replaced
            self.lanes.follow()
        self.state.step += 1
        record = {
            "step": self.state.step,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": None if norm is None else norm.item(),
        }
        if self.world.is_main:
            log_metrics(self.config.output_dir, record)
        tokens = sum(batch_tokens(b) for b in batches)
        return {**record, "tokens_s": tokens / (time.perf_counter() - started)}

    def collate(self, indices: np.ndarray) -> dict:
        return self.objective.collate(self.examples, indices, self.mask_rng)

    def evaluate(self) -> dict[str, float]:
        return self.objective.evaluate(self.model, self.eval_examples, self.config.batch_size)

    def gradients(self, batches: list[dict]) -> tuple[mx.array, dict]:
        """The step's mean loss and gradients over its micro-batches; under `mlx.launch`, every rank collates the
        same global batches and computes its rows' part (`distributed.step_gradients`), summed over ranks."""
        if self.lanes is not None:  # on every CPU core (`lanes`)
            return self.lanes.gradients(batches, self.objective.count, self.random)
        if self.world.size == 1:
            return accumulate_gradients(self.loss_and_grad, batches)
        shared = self.random[0]
        self.random[0] = mx.random.split(shared, self.world.size)[self.world.rank]  # this rank's own dropout masks
        try:
            return distributed.step_gradients(
                self.loss_and_grad,
                batches,
                count=self.objective.count,
                parameters=self.model.trainable_parameters(),
                world=self.world,
                what=f"step {self.state.step + 1}",
                part=self.objective.part,  # a loss over every rank's rows (in-batch negatives)
                tables=self.tables,
            )
        finally:
            self.random[0] = mx.random.split(shared)[0]  # the next key, the same on every rank (and in checkpoints)

    def check_finite(self, loss: float, norm: float) -> None:
        """Stop before a NaN or infinite loss or gradient reaches the weights: every later step and the saved model
        would be NaN. The checkpoints saved so far are kept; nothing of this step is written."""
        if math.isfinite(loss) and math.isfinite(norm):
            return
        saved = checkpoints(self.config.output_dir)
        last = f"the last good checkpoint is {saved[-1]}" if saved else "no checkpoint was saved before it"
        raise Diverged(
            f"Training diverged at step {self.state.step + 1}: loss {loss}, gradient norm {norm}; the weights were "
            f"not updated and no model was saved ({last}). Lower lr (now {self.config.lr:g}), add warmup or "
            "clipping (max_grad_norm), or check the data, then start again or resume from a checkpoint"
        )

    def check_learning(self, loss: float, norm: float, indices: list[np.ndarray], grads: dict) -> None:
        """Stop at a step whose gradients are all exactly zero, on batches the loss should learn from, before any step
        has moved the weights: the loss does not reach the weights being trained."""
        # Only before the first step that moved the weights: later, an exactly zero step may be a batch the loss has
        # already fitted; a batch the loss cannot learn from (`no_signal`: a one-row tail) is a zero step, as in torch.
        if norm > 0 or self.learned:
            self.learned = True
            return
        if all(self.objective.no_signal(self.examples, b) for b in indices):
            return
        raise ZeroGradient(
            f"Training is not learning: at step {self.state.step + 1} the gradients of all {len(tree_flatten(grads))} "
            f"trainable parameters are exactly zero (loss {loss:g}) and no step before it moved the weights; stopped, "
            "and no model was saved. The loss does not depend on the weights being trained: check that a loss of "
            "your own uses the model's outputs, that LoRA targets or frozen layers leave weights the loss reaches, "
            "and that the data's texts differ (max_length may cut them to the same tokens)"
        )

    def evaluate_and_save(self, end_of_epoch: bool, epochs_done: float) -> None:
        """Evaluate every `eval_every` steps, at each epoch end and at the end; save every `save_every` steps and
        at the end (unless `final_checkpoint` is off), keeping the last `keep_last` checkpoints and the best."""
        config, state, last = self.config, self.state, self.state.step == self.total
        if self.eval_examples is not None and (end_of_epoch or last or due(state.step, config.eval_every)):
            metrics = self.evaluate()
            self.model.train()
            state.metrics = {"step": state.step, "epoch": round(epochs_done, 4), **metrics}
            if self.world.is_main:
                log_metrics(config.output_dir, state.metrics)
        if (last and config.final_checkpoint) or (not last and due(state.step, config.save_every)):
            state.mlx_key = np.array(self.random[0]).tolist()
            name = f"checkpoint-{state.step}"
            update_best(state, config.metric_for_best, name)
            if not self.world.is_main:
                return
            target = config.output_dir / name
            save_checkpoint(self.model, self.tokenizer, self.optimizer, state, target, self.objective.write_weights)
            rotate_checkpoints(config.output_dir, config.keep_last, state.best_checkpoint, name)


def due(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0


def run_facts(model: nn.Module, train_examples: Examples, eval_examples: Examples | None, total: int) -> dict:
    """What every rank of a run shares: its model's parameter names, shapes and dtypes, digests of its data (token
    ids and labels) and its number of steps."""

    def digest(parts: Iterator[bytes]) -> str:
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        return h.hexdigest()[:12]

    def data(examples: Examples | None) -> str | None:
        if examples is None:
            return None
        ids = (np.asarray(e.ids, np.int64).tobytes() for e in examples.encodings)
        return digest(itertools.chain(ids, [pickle.dumps(getattr(examples, "labels", None))]))

    layout = [(k, v.shape, str(v.dtype)) for k, v in tree_flatten(model.parameters())]
    return {
        "the model's parameters": digest(iter([repr(layout).encode()])),
        "the training data": data(train_examples),
        "the eval data": data(eval_examples),
        "the steps": total,
    }


def train(
    model: nn.Module,
    tokenizer: Tokenizer,
    train_examples: Examples,
    eval_examples: Examples | None = None,
    config: TrainingConfig | None = None,
    masker: Masker | None = None,
    resume_from: str | Path | None = None,
    objective: Objective | None = None,
) -> dict:
    """Train `model` on `train_examples` as `config` says (AdamW with transformers' decay groups, warmup then
    `config.schedule`), evaluating on `eval_examples` and writing `output_dir/metrics.jsonl` and checkpoints.
    `masker` masks masked-LM batches (default: `Masker.from_tokenizer`). `resume_from` a checkpoint-STEP folder
    continues that run exactly. `objective` is the task's (`objective.Objective`): by default the head tasks'
    (`HeadObjective`: the model's own head and loss), ELECTRA's for a `ReplacedTokenDetection` pair
    (`rtd.RTDObjective`); else an embedding model's (`embedding.EmbeddingObjective`) or a reranker's
    (`rerank.RerankObjective`). Returns the last evaluation's
    metrics, else the last step's record. Under `mlx.launch`, each rank trains on its rows of every (global) batch
    and rank 0 alone writes (docs/scaling-out.md).
    """
    runtime.claim_mlx()
    config = config or TrainingConfig("output")
    check_needs(asdict(config) | {"eval_data": eval_examples})
    if objective is None and isinstance(model, ReplacedTokenDetection):  # the pair's own loss, never a head's
        objective = RTDObjective(tokenizer, config, RTD_TASK, masker or rtd_masker(tokenizer))
    if objective is None:
        if masker is None and train_examples.task in ("masked-lm", "pretraining"):
            masker = Masker.from_tokenizer(tokenizer)
        objective = HeadObjective(tokenizer, config, train_examples.task, masker)
    check_metric_for_best(config, eval_examples, objective)
    world = distributed.world()
    if problem := distributed.check_batch_size(config.batch_size, world):
        raise OptionError(problem)
    if world.size > 1 and not objective.distributed:
        raise OptionError(f"{objective.task(train_examples)} training runs in one process only: start it without "
                          "mlx.launch")  # fmt: skip
    lengths = np.array([len(e.ids) for e in train_examples.encodings])
    batcher = objective.batcher(train_examples, config.batch_size)
    total = total_steps(len(train_examples), config, lengths, batcher)
    check_signal(objective, train_examples, config, lengths, batcher, total)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total)  # TrainingArguments.get_warmup_steps
    schedule = make_schedule(config.schedule, config.lr, warmup, total)
    optimizer = adamw(model, schedule, config.weight_decay)
    if world.is_main or not config.overwrite:  # every rank refuses another run's files; rank 0 alone clears them
        claim_output(config.output_dir, config.overwrite, resume_from)
    if world.is_main:
        config.output_dir.mkdir(parents=True, exist_ok=True)
    state = start_state(model, optimizer, config, resume_from, objective.read_weights, total)
    if world.size > 1:  # every rank starts from rank 0's weights, whatever seeds built them
        distributed.check_same(world, run_facts(model, train_examples, eval_examples, total), "the start of training")
        model.update(distributed.broadcast(model.trainable_parameters(), world, "the start of training"))
    model.train()
    if config.gradient_checkpointing:  # before the loop copies the module tree for the cores (`lanes`)
        model.gradient_checkpointing_enable()
    loop = Loop(model, tokenizer, train_examples, eval_examples, config, optimizer, schedule, state, total, objective)
    record = {"step": state.step}
    with (
        runtime.keep_freed_memory(),
        tqdm(total=total, initial=state.step, desc="training", disable=not world.is_main) as bar,
    ):
        if world.is_main and loop.compiled and state.step < total:  # compiling takes seconds: say so
            bar.write("Compiling the training step (first step only)...", file=sys.stderr)
        for epoch, position, indices, end_of_epoch, epochs_done in steps_from(lengths, config, state, batcher):
            if state.step >= total:
                break
            record = loop.step(indices)
            runtime.cache_working_set()
            state.epoch, state.position = epoch, position
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tokens_s=f"{record['tokens_s']:.0f}"
            )
            loop.evaluate_and_save(end_of_epoch, epochs_done)
    if world.is_main:
        plot_metrics(config.output_dir)
    return state.metrics or record


@contextmanager
def output_lock(output_dir: Path) -> Iterator[None]:
    """Inside, rank 0 holds the output folder's lock: two runs started into one folder would mix their checkpoints,
    metrics and model (the check for another run's files sees only what is already written). Held from before the
    first file to after the last (the trained model, the adapters); every rank stops when rank 0 cannot take it."""
    world, error, created = distributed.world(), None, not output_dir.exists()
    with ExitStack() as held:
        if world.is_main:
            if created:  # a run refused before its first file leaves no folder behind
                held.callback(remove_if_empty, output_dir)
            try:
                output_dir.mkdir(parents=True, exist_ok=True)
                held.enter_context(
                    FolderLock(
                        output_dir,
                        RUN_LOCK,
                        f"the training output {output_dir}",
                        "Two runs into one folder would mix their checkpoints and metrics: wait for that run to end "
                        "(or stop it), or choose another output folder.",
                        "run",
                        "mlx-encoders train",
                    )
                )
            except OSError as e:
                error = e
        distributed.agree(world, error, "training: taking the output folder")
        yield
        # rank 0 writes the model last: no rank returns a path to load before it is there (a rank that fails
        # raises at once; its process's end tells the others)
        distributed.agree(world, None, "training: saving the model")


def remove_if_empty(folder: Path) -> None:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
