"""The training loop: seeded shuffling, gradient accumulation, evaluation, metrics, checkpoints and exact resume,
after transformers' `Trainer` (reference: `Trainer._inner_training_loop`, `_save_checkpoint`, `_rotate_checkpoints`
and `_load_rng_state` in `trainer.py`; `TrainingArguments` for the names and defaults).

An epoch's order is drawn from `numpy.random.default_rng([seed, epoch])`, so it needs no saved state; the masking
generator and MLX's global key (dropout) are saved in each checkpoint's `trainer_state.json` and restored on resume,
so a resumed run takes the same steps, with the same masks and dropout, as one never stopped.
"""

import json
import math
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm.auto import tqdm

from ..checkpoint.atomic import atomic_folder
from ..checkpoint.build import load_model
from ..checkpoint.write import model_config, write_checkpoint
from ..models import task_of_model
from ..tokenizer import Tokenizer
from .data import Examples, collate
from .losses import IGNORE_INDEX, task_loss
from .masking import Masker
from .optim import Schedule, accumulate_gradients, adamw, make_schedule, optimizer_step

LABEL_KEYS = ("labels", "next_sentence_label", "start_positions", "end_positions")
STATE_FILE, OPTIMIZER_FILE, METRICS_FILE = "trainer_state.json", "optimizer.safetensors", "metrics.jsonl"
CHECKPOINT = re.compile(r"checkpoint-(\d+)")


@dataclass
class TrainingConfig:
    """What `train` does; the names and defaults follow `TrainingArguments` (`lr` is its `learning_rate`,
    `grad_accum` its `gradient_accumulation_steps`). `max_steps`, when set, replaces `epochs` and is also the
    length of the learning-rate schedule; `eval_every`/`save_every` count optimizer steps (None: never, besides
    each epoch end for evaluation and the end of training for both). `metric_for_best` names an eval metric (e.g.
    "eval_loss", "eval_accuracy"); lower is better for losses and perplexity, higher for the rest."""

    output_dir: str | Path
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 8
    lr: float = 5e-5
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    schedule: str = "linear"
    seed: int = 42
    eval_every: int | None = None
    save_every: int | None = None
    keep_last: int | None = 2
    metric_for_best: str | None = None

    def __post_init__(self):
        for name in ("epochs", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainingConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainingConfig.max_steps must be at least 1 (or None for epochs), got {self.max_steps}")
        self.output_dir = Path(self.output_dir)


@dataclass
class TrainerState:
    """Where training stands: saved as `trainer_state.json` in each checkpoint and read back on resume."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # optimizer steps already taken in `epoch`
    mask_rng: dict | None = None  # the masking generator's `bit_generator.state`
    mlx_key: list[int] | None = None  # `mx.random.state[0]`, the key dropout draws from
    metrics: dict | None = None  # the last evaluation
    best_metric: float | None = None
    best_checkpoint: str | None = None


# ----- batches -----


def epoch_steps(n: int, config: TrainingConfig, epoch: int) -> list[list[np.ndarray]]:
    """The steps of one epoch, each a list of up to `grad_accum` micro-batches of example indices, in an order
    drawn from `default_rng([seed, epoch])`; the last step of an epoch may hold fewer micro-batches."""
    order = np.random.default_rng([config.seed, epoch]).permutation(n)
    batches = [order[i : i + config.batch_size] for i in range(0, n, config.batch_size)]
    return [batches[i : i + config.grad_accum] for i in range(0, len(batches), config.grad_accum)]


def split_batch(batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(model inputs, loss labels) of a collated batch, as MLX arrays."""
    inputs = {k: mx.array(v) for k, v in batch.items() if k not in LABEL_KEYS}
    return inputs, {k: mx.array(v) for k, v in batch.items() if k in LABEL_KEYS}


def batch_loss(model: nn.Module, batch: dict[str, np.ndarray]) -> mx.array:
    inputs, labels = split_batch(batch)
    return task_loss(model, model(**inputs), **labels)


# ----- evaluation -----


def macro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """sklearn's `f1_score(labels, predictions, average="macro")`: the mean F1 over the classes that occur in
    either array, F1 = 2TP / (2TP + FP + FN)."""
    scores = []
    for c in np.union1d(predictions, labels):
        tp = np.sum((predictions == c) & (labels == c))
        wrong = np.sum((predictions == c) != (labels == c))
        scores.append(2 * tp / (2 * tp + wrong))
    return float(np.mean(scores))


def labelled(target: np.ndarray) -> np.ndarray:
    """What a loss averages over: the labelled positions of (B, L) token ids, else every example."""
    if target.ndim == 2 and np.issubdtype(target.dtype, np.integer):
        return target != IGNORE_INDEX
    return np.ones(len(target), dtype=bool)


def evaluate(
    model: nn.Module,
    tokenizer: Tokenizer,
    examples: Examples,
    config: TrainingConfig,
    masker: Masker | None = None,
) -> dict[str, float]:
    """Mean eval loss (per labelled token for token-level tasks, per example otherwise) with the model in eval
    mode; accuracy over masked (labelled) positions or examples wherever labels are class ids, perplexity =
    exp(loss) for masked-LM, macro-F1 for sequence classification. Masks come from `default_rng(seed)`, the same
    at every evaluation, and leave the training generators alone."""
    model.eval()
    rng = np.random.default_rng(config.seed)
    total, weight, predicted, expected = 0.0, 0, [], []
    for start in range(0, len(examples), config.batch_size):
        batch = collate(examples, range(start, min(start + config.batch_size, len(examples))), tokenizer, masker, rng)
        inputs, labels = split_batch(batch)
        output = model(**inputs)
        kept = labelled(batch["labels"])
        total += task_loss(model, output, **labels).item() * int(kept.sum())
        weight += int(kept.sum())
        if np.issubdtype(batch["labels"].dtype, np.integer):
            predicted.append(np.array(output.logits.astype(mx.float32)).argmax(-1)[kept])
            expected.append(batch["labels"][kept])
    metrics = {"eval_loss": total / weight}
    if predicted:
        predicted, expected = np.concatenate(predicted), np.concatenate(expected)
        metrics["eval_accuracy"] = float(np.mean(predicted == expected))
        if examples.task == "sequence-classification":
            metrics["eval_f1"] = macro_f1(predicted, expected)
    if examples.task == "masked-lm":
        metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
    return metrics


# ----- checkpoints -----


def save_checkpoint(
    model: nn.Module, tokenizer: Tokenizer, optimizer: optim.Optimizer, state: TrainerState, target: Path
) -> None:
    """`target` (checkpoint-STEP) holding what `mlx_encoders.save` writes, `optimizer.safetensors` and
    `trainer_state.json`, atomically: on any error the previous folder (if any) stays, and no partial one."""
    with atomic_folder(target, replace=True, whole=True) as tmp:
        write_checkpoint(model, model_config(model), tmp)
        tokenizer.save(tmp)
        mx.save_safetensors(str(tmp / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)))
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")


def checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint-STEP folders of `output_dir`, by step."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT.fullmatch(p.name)[1]))


def rotate_checkpoints(output_dir: Path, keep_last: int | None, best: str | None) -> None:
    """Delete all but the last `keep_last` checkpoints and the `best` one (transformers' `save_total_limit`)."""
    if keep_last is None:
        return
    found = checkpoints(output_dir)
    for folder in found[: max(0, len(found) - keep_last)]:
        if folder.name != best:
            shutil.rmtree(folder)


def update_best(state: TrainerState, metric: str | None, name: str) -> None:
    """Record checkpoint `name` as the best when its `metric` beats the best so far."""
    if metric is None or state.metrics is None:
        return
    if metric not in state.metrics:
        raise KeyError(f"metric_for_best={metric!r} is not an eval metric; choose one of {', '.join(state.metrics)}")
    value = state.metrics[metric]
    lower = metric.endswith(("loss", "perplexity"))
    if state.best_metric is None or (value < state.best_metric if lower else value > state.best_metric):
        state.best_metric, state.best_checkpoint = value, name


def load_checkpoint(model: nn.Module, optimizer: optim.Optimizer, folder: Path) -> TrainerState:
    """Restore `model`'s weights, the optimizer state and the trainer state from a checkpoint folder."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file() or not (folder / OPTIMIZER_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a training checkpoint (it needs {STATE_FILE} and {OPTIMIZER_FILE}); pass a "
            "checkpoint-STEP folder that train() wrote"
        )
    saved = dict(tree_flatten(load_model(folder, task=task_of_model(model)).parameters()))
    current = dict(tree_flatten(model.parameters()))
    if saved.keys() != current.keys():
        missing = sorted(current.keys() ^ saved.keys())[:5]
        raise ValueError(f"{folder} does not hold this model's weights (differing keys: {', '.join(missing)})")
    model.update(tree_unflatten(list(saved.items())))
    optimizer.state = tree_unflatten(list(mx.load(str(folder / OPTIMIZER_FILE)).items()))
    return TrainerState(**json.loads((folder / STATE_FILE).read_text()))


# ----- metrics -----


def log_metrics(output_dir: Path, record: dict) -> None:
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(output_dir: Path, step: int) -> None:
    """Drop the records after `step` that a run stopped later than its last checkpoint left behind."""
    path = output_dir / METRICS_FILE
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step))


# ----- the loop -----


def total_steps(n: int, config: TrainingConfig) -> int:
    return config.max_steps or config.epochs * len(epoch_steps(n, config, 0))


def steps_from(n: int, config: TrainingConfig, state: TrainerState) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """(epoch, position after the step, micro-batches) from where `state` stands, epoch after epoch."""
    epoch, position = state.epoch, state.position
    while True:
        steps = epoch_steps(n, config, epoch)
        for i in range(position, len(steps)):
            yield epoch, i + 1, steps[i]
        epoch, position = epoch + 1, 0


def start_state(
    model: nn.Module, optimizer: optim.Optimizer, config: TrainingConfig, resume_from: str | Path | None
) -> TrainerState:
    """A fresh state (MLX seeded with `seed`) or the one in `resume_from`, with MLX's key put back; the metrics
    log keeps only the records up to the state's step."""
    if resume_from is None:
        mx.random.seed(config.seed)
        state = TrainerState(mask_rng=np.random.default_rng(config.seed).bit_generator.state)
    else:
        state = load_checkpoint(model, optimizer, resume_from)
        mx.random.state[0][...] = mx.array(state.mlx_key, dtype=mx.uint32)  # in place: the state list cannot be set
    trim_metrics(config.output_dir, state.step)
    return state


@dataclass
class Loop:
    """What every step of one `train` call uses."""

    model: nn.Module
    tokenizer: Tokenizer
    examples: Examples
    eval_examples: Examples | None
    config: TrainingConfig
    masker: Masker | None
    optimizer: optim.Optimizer
    schedule: Schedule
    state: TrainerState
    total: int

    def __post_init__(self):
        self.mask_rng = np.random.default_rng()
        self.mask_rng.bit_generator.state = self.state.mask_rng
        self.loss_and_grad = nn.value_and_grad(self.model, lambda batch: batch_loss(self.model, batch))

    def step(self, indices: list[np.ndarray]) -> dict:
        """Collate the micro-batches, take one optimizer step and log it; returns the record with tokens/s."""
        started = time.perf_counter()
        batches = [collate(self.examples, i, self.tokenizer, self.masker, self.mask_rng) for i in indices]
        self.state.mask_rng = self.mask_rng.bit_generator.state
        lr = self.schedule(mx.array(self.state.step)).item()
        loss, grads = accumulate_gradients(self.loss_and_grad, batches)
        norm = optimizer_step(self.model, self.optimizer, grads, self.config.max_grad_norm)
        self.state.step += 1
        record = {
            "step": self.state.step,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": None if norm is None else norm.item(),
        }
        log_metrics(self.config.output_dir, record)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        return {**record, "tokens_s": tokens / (time.perf_counter() - started)}

    def evaluate_and_save(self, end_of_epoch: bool) -> None:
        """Evaluate every `eval_every` steps, at each epoch end and at the end; save every `save_every` steps and
        at the end, keeping the last `keep_last` checkpoints and the best."""
        config, state, last = self.config, self.state, self.state.step == self.total
        if self.eval_examples is not None and (end_of_epoch or last or due(state.step, config.eval_every)):
            metrics = evaluate(self.model, self.tokenizer, self.eval_examples, config, self.masker)
            self.model.train()
            state.metrics = {"step": state.step, "epoch": state.epoch, **metrics}
            log_metrics(config.output_dir, state.metrics)
        if last or due(state.step, config.save_every):
            state.mlx_key = np.array(mx.random.state[0]).tolist()
            name = f"checkpoint-{state.step}"
            update_best(state, config.metric_for_best, name)
            save_checkpoint(self.model, self.tokenizer, self.optimizer, state, config.output_dir / name)
            rotate_checkpoints(config.output_dir, config.keep_last, state.best_checkpoint)


def due(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0


def train(
    model: nn.Module,
    tokenizer: Tokenizer,
    train_examples: Examples,
    eval_examples: Examples | None = None,
    config: TrainingConfig | None = None,
    masker: Masker | None = None,
    resume_from: str | Path | None = None,
) -> dict:
    """Train `model` on `train_examples` as `config` says (AdamW with transformers' decay groups, warmup then
    `config.schedule`), evaluating on `eval_examples` and writing `output_dir/metrics.jsonl` and checkpoints.
    `masker` masks masked-LM batches (default: `Masker.from_tokenizer`). `resume_from` a checkpoint-STEP folder
    continues that run exactly. Returns the last evaluation's metrics, else the last step's record."""
    config = config or TrainingConfig("output")
    if masker is None and train_examples.task in ("masked-lm", "pretraining"):
        masker = Masker.from_tokenizer(tokenizer)
    n, total = len(train_examples), total_steps(len(train_examples), config)
    schedule = make_schedule(config.schedule, config.lr, math.ceil(config.warmup_ratio * total), total)
    optimizer = adamw(model, schedule, config.weight_decay)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    state = start_state(model, optimizer, config, resume_from)
    loop = Loop(model, tokenizer, train_examples, eval_examples, config, masker, optimizer, schedule, state, total)
    record = {"step": state.step}
    model.train()
    with tqdm(total=total, initial=state.step, desc="training") as bar:
        for epoch, position, indices in steps_from(n, config, state):
            if state.step >= total:
                break
            record = loop.step(indices)
            state.epoch, state.position = epoch, position
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tokens_s=f"{record['tokens_s']:.0f}"
            )
            loop.evaluate_and_save(end_of_epoch=position == len(epoch_steps(n, config, epoch)))
    return state.metrics or record
