"""The training loop: seeded shuffling, gradient accumulation, evaluation, metrics, checkpoints and exact resume,
after transformers' `Trainer` (reference: `Trainer._inner_training_loop`, `_save_checkpoint`, `_rotate_checkpoints`
and `_load_rng_state` in `trainer.py`; `TrainingArguments` for the names and defaults).

An epoch's order is drawn from `numpy.random.default_rng([seed, epoch])`, so it needs no saved state; the masking
generator and the trainer's MLX key (dropout) are saved in each checkpoint's `trainer_state.json` and restored on
resume, so a resumed run takes the same steps, with the same masks and dropout, as one never stopped.
"""

import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten
from tqdm.auto import tqdm

from .. import distributed
from ..checkpoint.atomic import atomic_folder
from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint
from ..checkpoint.write import model_config, write_checkpoint
from ..engine import runtime
from ..engine.ops import drawing_from
from ..errors import CommandError
from ..models import task_of_model
from ..models.inputs import checked_inputs, unchecked_inputs
from ..tokenizer import Tokenizer
from .config import COMPUTE_DTYPES, OptionError, TrainingConfig
from .data import Examples, collate
from .embedding import EmbeddingObjective, batch_tokens
from .lora import ADAPTERS_FILE, LoRAConfig, load_adapter_weights, save_adapters
from .lora import CONFIG_FILE as ADAPTER_CONFIG_FILE
from .losses import IGNORE_INDEX, cross_entropy, task_loss
from .masking import Masker
from .metrics import entity_scores, eval_metric_names, is_chunk_scheme, macro_f1
from .optim import Schedule, accumulate_gradients, adamw, global_norm, make_schedule, optimizer_step
from .options import check_needs
from .plot import CURVES_FILE, plot_metrics
from .rerank import RerankObjective

LABEL_KEYS = ("labels", "next_sentence_label", "start_positions", "end_positions")
STATE_FILE, OPTIMIZER_FILE, METRICS_FILE = "trainer_state.json", "optimizer.safetensors", "metrics.jsonl"
MODEL_FOLDER, ADAPTERS_FOLDER = "model", "adapters"  # where `fine_tune` saves the trained model and LoRA adapters
CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class Diverged(ArithmeticError, CommandError):
    """A non-finite loss or gradient norm: training stopped before the step that would have spoiled the weights."""


class NoSignal(OptionError):
    """No batch of the run gives the loss a gradient (one row for in-batch negatives, equal scores for CoSENT, one
    document for a listwise reranking loss): refused before any work, as training would not change the weights."""


class ZeroGradient(CommandError):
    """A step whose batch should teach the loss something gave exactly zero gradients, before any step had moved the
    weights: the loss does not reach the weights being trained. Stopped before saving a model that never trained."""


@dataclass
class TrainerState:
    """Where training stands: saved as `trainer_state.json` in each checkpoint and read back on resume."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # optimizer steps already taken in `epoch`
    mask_rng: dict | None = None  # the masking generator's `bit_generator.state`
    mlx_key: list[int] | None = None  # the MLX key dropout draws from (`drawing_from`)
    metrics: dict | None = None  # the last evaluation
    best_metric: float | None = None
    best_checkpoint: str | None = None


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
    if config.group_by_length:
        order = length_grouped(order, lengths, config.batch_size)
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


def split_batch(batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(model inputs, loss labels) of a collated batch, as MLX arrays."""
    inputs = {k: mx.array(v) for k, v in batch.items() if k not in LABEL_KEYS}
    return inputs, {k: mx.array(v) for k, v in batch.items() if k in LABEL_KEYS}


def loss_arrays(model: nn.Module, batch: dict[str, np.ndarray]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """`split_batch`, the labels of a masked-LM batch also giving `masked`: the flat positions of its masked
    tokens (a loss under mx.compile reads nothing on the host). A model that trains two parts at once (train/rtd.py)
    brings its own `loss_arrays`, `batch_loss`, `evaluate`, `metric_names` and checkpoint methods."""
    if hasattr(model, "loss_arrays"):
        return model.loss_arrays(batch)
    inputs, labels = split_batch(batch)
    if task_of_model(model) == "masked-lm":
        labels["masked"] = mx.array(np.flatnonzero(batch["labels"].reshape(-1) != IGNORE_INDEX))
    return inputs, labels


def batch_loss(model: nn.Module, inputs: dict[str, mx.array], labels: dict[str, mx.array]) -> mx.array:
    """The loss of a batch given as `loss_arrays`, in MLX operations only."""
    if hasattr(model, "batch_loss"):
        return model.batch_loss(inputs, labels)
    if task_of_model(model) == "masked-lm":
        return masked_lm_loss(model, inputs, labels["labels"], labels["masked"])
    return task_loss(model, model(**inputs), **labels)


def masked_lm_loss(model: nn.Module, inputs: dict[str, mx.array], labels: mx.array, masked: mx.array) -> mx.array:
    """The masked-LM loss with vocabulary logits computed at the `masked` (flat) positions only (about 15% of the
    tokens): the same loss and gradients as scoring every position, as the others add nothing (ModernBERT's
    `sparse_prediction`), at a fraction of the decoder's cost, which dominates small models' steps."""
    hidden = model.encode(**inputs).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[masked]
    return cross_entropy(model.predict_tokens(hidden), labels.reshape(-1)[masked])


# ----- evaluation -----


def labelled(target: np.ndarray, task: str) -> np.ndarray:
    """What a loss averages over: the labelled positions of (B, L) token ids (for causal LM, those a token before
    them predicts), else every example."""
    if target.ndim == 2 and np.issubdtype(target.dtype, np.integer):
        return (target[:, 1:] if task == "causal-lm" else target) != IGNORE_INDEX
    return np.ones(len(target), dtype=bool)


def predictions(logits: mx.array, task: str) -> np.ndarray:
    """Argmax class ids, aligned with `labelled`'s positions."""
    ids = np.array(logits.argmax(-1))
    return ids[:, :-1] if task == "causal-lm" else ids


def targets(labels: np.ndarray, task: str) -> np.ndarray:
    return labels[:, 1:] if task == "causal-lm" else labels


def tag_scores(sentences: list[tuple[np.ndarray, np.ndarray]], label2id: dict[str, int]) -> dict[str, float]:
    """Entity precision, recall and F1 over (true ids, predicted ids) of each sentence's labelled tokens (a word's
    first sub-token, as transformers' token-classification example evaluates), when the labels are BIO tags."""
    names = {i: name for name, i in label2id.items()}
    if not is_chunk_scheme(list(names.values())):
        return {}
    true = [[names[int(i)] for i in t] for t, _ in sentences]
    predicted = [[names.get(int(i), "O") for i in p] for _, p in sentences]
    return {f"eval_{name}": value for name, value in entity_scores(true, predicted).items()}


def evaluate(
    model: nn.Module,
    tokenizer: Tokenizer,
    examples: Examples,
    config: TrainingConfig,
    masker: Masker | None = None,
) -> dict[str, float]:
    """Mean eval loss (per labelled token for token-level tasks, per example otherwise) with the model in eval
    mode; accuracy over masked (labelled) positions or examples wherever labels are class ids, perplexity =
    exp(loss) for masked-LM and causal LM, macro-F1 for sequence classification, entity-level precision, recall
    and F1 (as seqeval counts them) for BIO tags. Masks come from `default_rng(seed)`, the same at every
    evaluation, and leave the training generators alone."""
    if hasattr(model, "evaluate"):
        return model.evaluate(tokenizer, examples, config.batch_size, config.seed, masker)
    model.eval()
    rng = np.random.default_rng(config.seed)
    task = examples.task
    total, weight, predicted, expected, sentences = 0.0, 0, [], [], []

    def scored(batch: dict) -> tuple:  # (labelled positions, loss, predicted ids, label ids) of one batch
        kept = labelled(batch["labels"], task)
        if not kept.any():  # a masked-LM batch where no token was drawn for masking: nothing to score
            return kept, 0.0, None, None
        inputs, labels = split_batch(batch)
        output = model(**inputs)
        found = predictions(output.logits, task) if np.issubdtype(batch["labels"].dtype, np.integer) else None
        return kept, task_loss(model, output, **labels).item(), found, targets(batch["labels"], task)

    batches = (collate(examples, range(start, min(start + config.batch_size, len(examples))), tokenizer, masker, rng)
               for start in range(0, len(examples), config.batch_size))  # fmt: skip
    for kept, loss, found, wanted in distributed.shared_map(scored, batches):  # each rank scores its share of batches
        if not kept.any():
            continue
        total += loss * int(kept.sum())
        weight += int(kept.sum())
        if found is not None:
            predicted.append(found[kept])
            expected.append(wanted[kept])
            if task == "token-classification":
                sentences += [(t[k], p[k]) for t, p, k in zip(wanted, found, kept, strict=True)]
    metrics = {"eval_loss": total / weight if weight else math.nan}
    if predicted:
        predicted, expected = np.concatenate(predicted), np.concatenate(expected)
        metrics["eval_accuracy"] = float(np.mean(predicted == expected))
        if task == "sequence-classification":
            metrics["eval_f1"] = macro_f1(predicted, expected)
        if task == "token-classification":
            metrics |= tag_scores(sentences, examples.label2id)
    if task in ("masked-lm", "causal-lm"):
        metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
    return metrics


def check_metric_for_best(
    config: TrainingConfig, eval_examples: Examples | None, model: nn.Module | None = None, objective=None
) -> None:
    if config.metric_for_best is None:
        return
    if eval_examples is None:
        raise OptionError(f"metric_for_best={config.metric_for_best!r} needs evaluation data (eval_data / --eval-data)")
    if objective is not None:  # a task's own metrics (`objective.evaluate`)
        names = objective.metric_names(eval_examples)
    else:
        names = model.metric_names() if hasattr(model, "metric_names") else eval_metric_names(eval_examples)
    if config.metric_for_best not in names:
        raise OptionError(
            f"metric_for_best={config.metric_for_best!r} is not a metric {eval_examples.task} reports; choose one "
            f"of {', '.join(names)}"
        )


# ----- checkpoints -----


def save_checkpoint(
    model: nn.Module, tokenizer: Tokenizer, optimizer: optim.Optimizer, state: TrainerState, target: Path
) -> None:
    """`target` (checkpoint-STEP) holding what `mlx_encoders.save` writes, `optimizer.safetensors` and
    `trainer_state.json`, atomically: on any error the previous folder (if any) stays, and no partial one. A model
    with LoRA adapters saves them alone (`save_adapters`), as `load_adapters` reads them onto its base."""
    with atomic_folder(target, replace=True, whole=True) as tmp:
        if getattr(model, "lora_config", None) is not None:
            save_adapters(model, tmp)
        elif hasattr(model, "write_checkpoint"):
            model.write_checkpoint(tmp)
        else:
            write_checkpoint(model, model_config(model), tmp)
        tokenizer.save(tmp)
        mx.save_safetensors(str(tmp / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)))
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")


def checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint-STEP folders of `output_dir`, by step."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT.fullmatch(p.name)[1]))


def rotate_checkpoints(output_dir: Path, keep_last: int | None, best: str | None, newest: str | None = None) -> None:
    """Delete all but the last `keep_last` checkpoints, the `best` one and the `newest` (the one just saved)
    (transformers' `save_total_limit`)."""
    if keep_last is None:
        return
    found = checkpoints(output_dir)
    for folder in found[: max(0, len(found) - keep_last)]:
        if folder.name not in (best, newest):
            shutil.rmtree(folder)


def run_files(output_dir: Path) -> list[Path]:
    """What a run writes to `output_dir`: checkpoints, the metrics log and plot, the model and adapters."""
    names = (METRICS_FILE, CURVES_FILE, MODEL_FOLDER, ADAPTERS_FOLDER)
    return checkpoints(output_dir) + [output_dir / n for n in names if (output_dir / n).exists()]


def claim_output(output_dir: Path, overwrite: bool, resume_from: str | Path | None) -> None:
    """Refuse to mix this run's files with another's in `output_dir`, unless it resumes from a checkpoint there or
    `overwrite` clears them first. Only a run's files are cleared: other files in the folder are the user's."""
    found = run_files(output_dir)
    if not found or (resume_from is not None and Path(resume_from).resolve().parent == output_dir.resolve()):
        return
    if not overwrite:
        raise FileExistsError(
            f"{output_dir} already holds another run's files ({', '.join(p.name for p in found[:4])}); pass "
            "overwrite=True (--overwrite) to clear them, resume from one of its checkpoints, or choose another output"
        )
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


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


def check_lora_settings(lora: LoRAConfig, folder: Path) -> None:
    """The adapters in `folder` were trained with this run's rank, alpha, dropout and targets."""
    saved = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    for name, value in asdict(lora).items():
        if saved.get(name) != value:
            raise ValueError(
                f"{folder / ADAPTER_CONFIG_FILE}: LoRA {name} is {saved.get(name)!r}, but this run's is {value!r}; "
                "resume with the same LoRA settings as the run that wrote it"
            )


def check_head(model: nn.Module, folder: Path) -> None:
    """The checkpoint in `folder` has this run's task head, with as many labels and the same problem type."""
    saved, current = Checkpoint.open(folder), model_config(model)
    if saved.task != task_of_model(model):
        raise ValueError(
            f"{folder / 'config.json'}: the checkpoint has a {saved.task} head, but this run trains "
            f"{task_of_model(model)}; resume with the task of the run that wrote it"
        )
    settings = {
        "labels": (len(saved.config.get("id2label") or {}), len(current.get("id2label") or {})),
        "problem_type": (saved.config.get("problem_type"), current.get("problem_type")),
    }
    for name, (found, expected) in settings.items():
        if found and expected and found != expected:  # a checkpoint without labels (an encoder) has none to compare
            raise ValueError(
                f"{folder / 'config.json'}: {name} {found!r} in the checkpoint, {expected!r} in this run; resume with "
                "the data (labels) of the run that wrote it"
            )


def load_checkpoint(model: nn.Module, optimizer: optim.Optimizer, folder: Path) -> TrainerState:
    """Restore `model`'s weights, the optimizer state and the trainer state from a checkpoint folder."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file() or not (folder / OPTIMIZER_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a training checkpoint (it needs {STATE_FILE} and {OPTIMIZER_FILE}); pass a "
            "checkpoint-STEP folder that train() wrote"
        )
    # the files that can be torn are read first: a damaged one must leave the model and optimizer untouched
    state = read_state(folder / STATE_FILE)
    optimizer_state = read_optimizer_state(folder / OPTIMIZER_FILE)
    lora, saved = getattr(model, "lora_config", None), None
    if (folder / ADAPTERS_FILE).is_file() != (lora is not None):
        raise ValueError(
            f"{folder} holds {'LoRA adapters' if (folder / ADAPTERS_FILE).is_file() else 'a whole model'}, but the "
            f"model to resume {'has no' if lora is None else 'has'} adapters; resume "
            "with the same LoRA settings as the run that wrote it"
        )
    if lora is not None:
        check_lora_settings(lora, folder)
        load_adapter_weights(model, folder)  # checks each tensor's name and shape, naming the file
    elif hasattr(model, "read_checkpoint"):
        model.read_checkpoint(folder)
    else:
        check_head(model, folder)
        saved = dict(tree_flatten(load_model(folder, task=task_of_model(model)).parameters()))
        current = dict(tree_flatten(model.parameters()))
        if saved.keys() != current.keys():
            missing = sorted(current.keys() ^ saved.keys())[:5]
            raise ValueError(f"{folder} does not hold this model's weights (differing keys: {', '.join(missing)})")
        for name, value in current.items():
            if saved[name].shape != value.shape:
                raise ValueError(
                    f"{folder / 'model.safetensors'}: {name} has shape {tuple(saved[name].shape)}, but this run's "
                    f"model has {tuple(value.shape)}; resume with the model (and sizes) of the run that wrote it"
                )
    check_optimizer_state(optimizer, model, optimizer_state, folder / OPTIMIZER_FILE)
    if saved is not None:
        model.update(tree_unflatten(list(saved.items())))
    optimizer.state = tree_unflatten(list(optimizer_state.items()))
    return state


RESUME_ELSEWHERE = "resume from another checkpoint-STEP folder (an earlier one), or start the run afresh"


def read_optimizer_state(path: Path) -> dict[str, mx.array]:
    """The tensors of `optimizer.safetensors`; a ValueError naming it when it is truncated or not safetensors."""
    try:
        return mx.load(str(path), format="safetensors")
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable optimizer state ({e}); {RESUME_ELSEWHERE}") from None


def check_optimizer_state(optimizer: optim.Optimizer, model: nn.Module, saved: dict[str, mx.array], path: Path) -> None:
    """The saved state holds the moments of exactly this run's trainable parameters, each of its shape: another
    run's (other sizes, LoRA targets or weight decay groups) would resume from moments that belong elsewhere."""
    optimizer.init(model.trainable_parameters())  # what the first step would build: the state this run expects
    expected = dict(tree_flatten(optimizer.state))
    other_run = "it belongs to another run (other sizes, LoRA settings or weight_decay)"
    if missing := sorted(expected.keys() - saved.keys()):
        raise ValueError(
            f"{path}: no tensor {missing[0]!r} ({len(missing)} of this run's optimizer tensors missing); "
            f"{other_run}; {RESUME_ELSEWHERE}"
        )
    if extra := sorted(saved.keys() - expected.keys()):
        raise ValueError(
            f"{path}: tensor {extra[0]!r} is no trainable parameter's state in this run ({len(extra)} such); "
            f"{other_run}; {RESUME_ELSEWHERE}"
        )
    for name, value in expected.items():
        if saved[name].shape != value.shape:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(saved[name].shape)}, but this run's parameter has "
                f"{tuple(value.shape)}; {RESUME_ELSEWHERE}"
            )


def read_state(path: Path) -> TrainerState:
    """`trainer_state.json`, each field checked: a hand-edited or torn file must not resume inexactly."""
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}); {RESUME_ELSEWHERE}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: holds a {type(saved).__name__}, not the trainer state object; {RESUME_ELSEWHERE}")
    fields = set(TrainerState.__dataclass_fields__)
    if unknown := sorted(saved.keys() - fields):
        raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; {RESUME_ELSEWHERE}")
    for name in ("step", "epoch", "position", "mask_rng", "mlx_key"):
        if name not in saved:
            raise ValueError(f"{path}: field {name!r} is missing; {RESUME_ELSEWHERE}")
    for name in ("step", "epoch", "position"):
        if type(saved[name]) is not int or saved[name] < 0:
            raise ValueError(
                f"{path}: field {name!r} must be an integer >= 0, found {saved[name]!r}; {RESUME_ELSEWHERE}"
            )
    key = saved["mlx_key"]
    if not (isinstance(key, list) and len(key) == 2 and all(type(k) is int and 0 <= k < 2**32 for k in key)):
        raise ValueError(f"{path}: field 'mlx_key' must be two uint32 integers, found {key!r:.80}; {RESUME_ELSEWHERE}")
    try:  # numpy checks the generator's name and state words itself
        np.random.default_rng().bit_generator.state = saved["mask_rng"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: field 'mask_rng' is not a PCG64 generator state ({e}); {RESUME_ELSEWHERE}") from None
    for name, kinds in (("metrics", dict), ("best_metric", (int, float)), ("best_checkpoint", str)):
        value = saved.get(name)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise ValueError(f"{path}: field {name!r} has the wrong type ({value!r:.80}); {RESUME_ELSEWHERE}")
    return TrainerState(**saved)


# ----- metrics -----


def log_metrics(output_dir: Path, record: dict) -> None:
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(output_dir: Path, step: int) -> None:
    """Drop the records after `step` that a run stopped later than its last checkpoint left behind."""
    path = output_dir / METRICS_FILE
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text(
            "".join(line for number, line in enumerate(lines, 1) if record_step(path, number, line) <= step)
        )


def record_step(path: Path, number: int, line: str) -> int:
    """The step of one metrics record; a ValueError naming the line when it is torn (a run killed mid-write)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}, line {number}: not a JSON record ({e.msg}); delete that line (or the file), or "
            f"{RESUME_ELSEWHERE} with a fresh output_dir"
        ) from None
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        raise ValueError(f"{path}, line {number}: a record with no integer 'step'; delete that line, then resume")
    return record["step"]


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
    objective: EmbeddingObjective | RerankObjective,
    examples,
    config: TrainingConfig,
    lengths: np.ndarray,
    batcher: Callable | None,
    total: int,
) -> None:
    """Refuse a run none of whose micro-batches gives the objective's loss a gradient (`objective.no_signal`),
    looking at the run's batches in order until one can teach the loss something."""
    reason = None
    for _, (_, _, indices, _) in zip(range(total), steps_from(lengths, config, TrainerState(), batcher), strict=False):
        for batch in indices:
            found = objective.no_signal(examples, batch)
            if found is None:
                return
            reason = reason or found
    if reason is None:  # no step at all
        return
    rows = f"{len(examples)} row{'s' * (len(examples) != 1)}"
    no_duplicates = getattr(objective, "batch_sampler", None) == "no_duplicates"  # it may split the batches
    batching = f"batch_size={config.batch_size}" + (", batch_sampler=no_duplicates" if no_duplicates else "")
    raise NoSignal(
        f"Training would leave the weights as they are: no batch of this run ({rows}, {batching}, {total} "
        f"step{'s' * (total != 1)}) gives the loss a gradient: {reason}"
    )


def steps_from(
    lengths: np.ndarray, config: TrainingConfig, state: TrainerState, batcher: Callable | None = None
) -> Iterator[tuple[int, int, list[np.ndarray], bool]]:
    """(epoch, position after the step, micro-batches, whether the step ends its epoch) from where `state` stands,
    epoch after epoch; an epoch ends when its list of steps runs out, however many its batcher built."""
    epoch, position = state.epoch, state.position
    while True:
        steps = epoch_steps(len(lengths), config, epoch, lengths, batcher)
        for i in range(position, len(steps)):
            yield epoch, i + 1, steps[i], i + 1 == len(steps)
        epoch, position = epoch + 1, 0


def start_state(
    model: nn.Module, optimizer: optim.Optimizer, config: TrainingConfig, resume_from: str | Path | None
) -> TrainerState:
    """A fresh state (the dropout key and masking generator from `seed`) or the one in `resume_from`, with its saved
    key; the metrics log keeps only the records up to the state's step. MLX's global key is left alone."""
    if resume_from is None:
        key = np.array(mx.random.key(config.seed)).tolist()
        state = TrainerState(mask_rng=np.random.default_rng(config.seed).bit_generator.state, mlx_key=key)
    else:
        state = load_checkpoint(model, optimizer, resume_from)
    if not distributed.is_main():  # rank 0 alone owns the files
        return state
    trim_metrics(config.output_dir, state.step)
    for later in checkpoints(config.output_dir):  # the stopped run's later states, which this run replaces
        if int(CHECKPOINT.fullmatch(later.name)[1]) > state.step:
            shutil.rmtree(later)
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
    objective: EmbeddingObjective | RerankObjective | None = None  # a task's own batches, loss and evaluation

    def __post_init__(self):
        self.mask_rng = np.random.default_rng()
        self.mask_rng.bit_generator.state = self.state.mask_rng
        self.random = [mx.array(self.state.mlx_key, dtype=mx.uint32)]  # the key dropout draws from (`drawing_from`)
        self.world = distributed.world()
        self.learned = self.state.step > 0  # whether a step has moved the weights (a resumed run's have)
        dtype = COMPUTE_DTYPES[self.config.dtype]
        self.compiled = dtype == mx.float32 and not self.config.gradient_checkpointing and self.objective is None
        plain = dtype == mx.float32 and not self.config.gradient_checkpointing and self.world.size == 1
        if self.objective is not None and plain and getattr(self.objective, "compilable", False):
            self.loss_and_grad = retraced_value_and_grad(self.model, self.random, self.objective)
        elif self.objective is not None:
            make = lambda loss: value_and_grad(self.model, dtype, loss)  # noqa: E731
            state = [self.model.state, self.random]  # what a compiled pass reads, and the dropout key it advances
            trace = (lambda fn: mx.compile(fn, inputs=state, outputs=state)) if plain else None  # noqa: E731
            self.loss_and_grad = self.objective.value_and_grad(self.model, make, self.random, trace)
        elif self.compiled:
            self.loss_and_grad = compiled_value_and_grad(self.model, self.random)
        else:
            self.loss_and_grad = value_and_grad(self.model, dtype)

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
        if self.objective is not None:
            return self.objective.collate(self.examples, indices)
        return collate(self.examples, indices, self.tokenizer, self.masker, self.mask_rng)

    def evaluate(self) -> dict[str, float]:
        if self.objective is not None:
            return self.objective.evaluate(self.model, self.eval_examples, self.config.batch_size)
        return evaluate(self.model, self.tokenizer, self.eval_examples, self.config, self.masker)

    def gradients(self, batches: list[dict]) -> tuple[mx.array, dict]:
        """The step's mean loss and gradients over its micro-batches; under `mlx.launch`, every rank collates the
        same global batches and computes its rows' part (`distributed.step_gradients`), summed over ranks."""
        if self.world.size == 1:
            return accumulate_gradients(self.loss_and_grad, batches)
        task, shared = self.examples.task, self.random[0]
        self.random[0] = mx.random.split(shared, self.world.size)[self.world.rank]  # this rank's own dropout masks
        try:
            return distributed.step_gradients(
                self.loss_and_grad,
                batches,
                count=lambda batch: int(labelled(batch["labels"], task).sum()),
                parameters=self.model.trainable_parameters(),
                world=self.world,
                what=f"step {self.state.step + 1}",
                part=getattr(self.objective, "part", None),  # a loss over every rank's rows (in-batch negatives)
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
        if self.objective is not None and all(self.objective.no_signal(self.examples, b) for b in indices):
            return
        raise ZeroGradient(
            f"Training is not learning: at step {self.state.step + 1} the gradients of all {len(tree_flatten(grads))} "
            f"trainable parameters are exactly zero (loss {loss:g}) and no step before it moved the weights; stopped, "
            "and no model was saved. The loss does not depend on the weights being trained: check that a loss of "
            "your own uses the model's outputs, that LoRA targets or frozen layers leave weights the loss reaches, "
            "and that the data's texts differ (max_length may cut them to the same tokens)"
        )

    def evaluate_and_save(self, end_of_epoch: bool) -> None:
        """Evaluate every `eval_every` steps, at each epoch end and at the end; save every `save_every` steps and
        at the end (unless `final_checkpoint` is off), keeping the last `keep_last` checkpoints and the best."""
        config, state, last = self.config, self.state, self.state.step == self.total
        if self.eval_examples is not None and (end_of_epoch or last or due(state.step, config.eval_every)):
            metrics = self.evaluate()
            self.model.train()
            state.metrics = {"step": state.step, "epoch": state.epoch, **metrics}
            if self.world.is_main:
                log_metrics(config.output_dir, state.metrics)
        if (last and config.final_checkpoint) or (not last and due(state.step, config.save_every)):
            state.mlx_key = np.array(self.random[0]).tolist()
            name = f"checkpoint-{state.step}"
            update_best(state, config.metric_for_best, name)
            if not self.world.is_main:
                return
            save_checkpoint(self.model, self.tokenizer, self.optimizer, state, config.output_dir / name)
            rotate_checkpoints(config.output_dir, config.keep_last, state.best_checkpoint, name)


def compiled_value_and_grad(model: nn.Module, random: list[mx.array]) -> Callable[[dict], tuple[mx.array, dict]]:
    """`value_and_grad(model, mx.float32)` under one mx.compile, traced again for each new batch shape (a fraction
    of a step). Within a gradient's trace MLX runs a compiled function op by op, so the fused kernels of engine/ops.py
    (gelu, the softmax's exp) only fuse in training when the whole step is compiled (README, Training speed).
    Gradient checkpointing (which draws from a key of its own per layer) and half-precision passes stay uncompiled.
    The model's input checks read token ids on the host, which a compiled function cannot: they run on each
    batch first, in a forward graph that is built in eval mode (no dropout draws) and never evaluated."""
    state = [model.state, random]  # the weights it reads, the dropout key it reads and advances
    step = mx.compile(
        nn.value_and_grad(model, lambda inputs, labels: batch_loss(model, inputs, labels)), inputs=state, outputs=state
    )

    def run(batch: dict) -> tuple[mx.array, dict]:
        inputs, labels = loss_arrays(model, batch)
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
    model: nn.Module, random: list[mx.array], objective: EmbeddingObjective
) -> Callable[[dict], tuple[mx.array, dict]]:
    """An objective's float32 step (`objective.inputs_loss` of `objective.inputs(batch)`) under mx.compile, so that
    the fused kernels of engine/ops.py fuse (see `compiled_value_and_grad`). Its batches' shapes (length groups)
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
    objective: EmbeddingObjective | RerankObjective | None = None,
) -> dict:
    """Train `model` on `train_examples` as `config` says (AdamW with transformers' decay groups, warmup then
    `config.schedule`), evaluating on `eval_examples` and writing `output_dir/metrics.jsonl` and checkpoints.
    `masker` masks masked-LM batches (default: `Masker.from_tokenizer`). `resume_from` a checkpoint-STEP folder
    continues that run exactly. `objective` trains a sentence-embedding model (`embedding.EmbeddingObjective`) or a
    reranker (`rerank.RerankObjective`). Returns the last evaluation's metrics, else the last step's record. Under
    `mlx.launch`, each rank trains on its rows of every (global) batch and rank 0 alone writes (docs/scaling-out.md).
    """
    runtime.claim_mlx()
    config = config or TrainingConfig("output")
    check_needs(asdict(config) | {"eval_data": eval_examples})
    check_metric_for_best(config, eval_examples, model, objective)
    world = distributed.world()
    if problem := distributed.check_batch_size(config.batch_size, world):
        raise OptionError(problem)
    if world.size > 1 and (hasattr(model, "batch_loss") if objective is None else not hasattr(objective, "part")):
        kind = getattr(objective if objective is not None else model, "task", train_examples.task)
        raise OptionError(f"{kind} training runs in one process only: start it without mlx.launch")
    if masker is None and train_examples.task in ("masked-lm", "pretraining"):
        masker = Masker.from_tokenizer(tokenizer)
    lengths = np.array([len(e.ids) for e in train_examples.encodings])
    batcher = objective.batcher(train_examples, config.batch_size) if objective is not None else None
    total = total_steps(len(train_examples), config, lengths, batcher)
    if objective is not None:
        check_signal(objective, train_examples, config, lengths, batcher, total)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total)  # TrainingArguments.get_warmup_steps
    schedule = make_schedule(config.schedule, config.lr, warmup, total)
    optimizer = adamw(model, schedule, config.weight_decay)
    if world.is_main or not config.overwrite:  # every rank refuses another run's files; rank 0 alone clears them
        claim_output(config.output_dir, config.overwrite, resume_from)
    if world.is_main:
        config.output_dir.mkdir(parents=True, exist_ok=True)
    state = start_state(model, optimizer, config, resume_from)
    if world.size > 1:  # every rank starts from rank 0's weights, whatever seeds built them
        model.update(distributed.broadcast(model.trainable_parameters(), world, "the start of training"))
    loop = Loop(
        model, tokenizer, train_examples, eval_examples, config, masker, optimizer, schedule, state, total, objective
    )
    record = {"step": state.step}
    model.train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    with (
        runtime.keep_freed_memory(),
        tqdm(total=total, initial=state.step, desc="training", disable=not world.is_main) as bar,
    ):
        if world.is_main and loop.compiled and state.step < total:  # compiling takes seconds: say so
            bar.write("Compiling the training step (first step only)...", file=sys.stderr)
        for epoch, position, indices, end_of_epoch in steps_from(lengths, config, state, batcher):
            if state.step >= total:
                break
            record = loop.step(indices)
            runtime.cache_working_set()
            state.epoch, state.position = epoch, position
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tokens_s=f"{record['tokens_s']:.0f}"
            )
            loop.evaluate_and_save(end_of_epoch)
    if world.is_main:
        plot_metrics(config.output_dir)
    return state.metrics or record
