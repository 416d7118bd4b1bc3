"""A training run's files: checkpoints (checkpoint-STEP: the model or its LoRA adapters, `optimizer.safetensors` and
`trainer_state.json`, written atomically, rotated as transformers' `save_total_limit` does), exact resume (every
file checked against this run before anything is restored), the output folder claimed, and metrics.jsonl
(reference: transformers' `Trainer._save_checkpoint`, `_rotate_checkpoints` and `_load_rng_state`).
"""

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import distributed
from ..checkpoint.adapters import CONFIG as PEFT_CONFIG
from ..checkpoint.adapters import read_lora, write_lora
from ..checkpoint.atomic import atomic_folder, disk_full, remove_stale, stale_targets
from ..checkpoint.build import load_model
from ..checkpoint.files import Checkpoint
from ..checkpoint.write import model_config, write_checkpoint
from ..models import task_of_model
from ..tokenizer import Tokenizer
from .config import TrainingConfig
from .lora import ADAPTERS_FILE, LoRAConfig, load_adapter_weights, write_adapters
from .lora import CONFIG_FILE as ADAPTER_CONFIG_FILE
from .plot import CURVES_FILE

STATE_FILE, OPTIMIZER_FILE, METRICS_FILE = "trainer_state.json", "optimizer.safetensors", "metrics.jsonl"
MODEL_FOLDER, ADAPTERS_FOLDER = "model", "adapters"  # where `fine_tune` saves the trained model and LoRA adapters
CHECKPOINT = re.compile(r"checkpoint-(\d+)")


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
    run: dict | None = None  # the settings a resume must share to continue exactly (`RUN_SETTINGS`)


# What decides a run's batches and updates: resuming under other values would continue no run that ever was. Its
# length (epochs, max_steps) may grow: with a constant schedule that is the longer run exactly.
RUN_SETTINGS = ("batch_size", "grad_accum", "seed", "lr", "warmup_ratio", "warmup_steps", "weight_decay", "schedule",
                "max_grad_norm", "group_by_length", "dtype", "cores")  # fmt: skip


def run_settings(config) -> dict:
    """`RUN_SETTINGS`' values as JSON writes them (an option given as a numpy number, as plain Python), and
    `fine_tune`'s task options (`TrainingConfig.task_settings`)."""
    loop = {name: (v.item() if isinstance(v := getattr(config, name), np.generic) else v) for name in RUN_SETTINGS}
    return loop | config.task_settings


def check_run_settings(state: TrainerState, config, folder: Path) -> None:
    """Refuse to resume a checkpoint under other `run_settings` than the run that wrote it (a setting it did not
    record, written before it was, is taken as it is)."""
    if state.run is None:
        return
    now = run_settings(config)
    changed = [
        f"{name} {state.run[name]!r} -> {now[name]!r}" for name in now if state.run.get(name, now[name]) != now[name]
    ]
    if changed:
        raise ValueError(
            f"{folder / STATE_FILE} was written by a run with other settings ({'; '.join(changed)}): resuming "
            "continues that run exactly, so give the same ones (or start a new run without resume)"
        )


def save_checkpoint(
    model: nn.Module,
    tokenizer: Tokenizer,
    optimizer: optim.Optimizer,
    state: TrainerState,
    target: Path,
    write: Callable[[nn.Module, Path], None] | None = None,
) -> None:
    """`target` (checkpoint-STEP) holding what `mlx_encoders.save` writes, `optimizer.safetensors` and
    `trainer_state.json`, atomically: on any error the previous folder (if any) stays, and no partial one. A model
    with LoRA adapters saves them alone (`save_adapters`), as `load_adapters` reads them onto its base; one training
    a task adapter saves that adapter alone, as PEFT does, in the subfolder of its name; `write(model, folder)` writes
    any other (the objective's `write_weights`; default `write_weights`)."""
    trained = adapter_in_training(model)
    with atomic_folder(target, replace=True, whole=True) as tmp:
        if getattr(model, "lora_config", None) is not None:
            write_adapters(model, tmp)
        elif trained is not None:
            encoder, name = trained
            write_lora(tmp / name, encoder.adapter_tensors()[name])
        else:
            (write or write_weights)(model, tmp)
        tokenizer.save(tmp)
        mx.save_safetensors(str(tmp / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)))
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")


def adapter_in_training(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(the encoder, the adapter's name) of a model training one of its task adapters (`train_adapter`), else None."""
    for module in model.modules():
        if (name := getattr(module, "trained_adapter", None)) is not None:
            return module, name
    return None


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


def remove_stale_checkpoints(output_dir: Path) -> None:
    """What interrupted checkpoint writes left in `output_dir` (`atomic.remove_stale`): a checkpoint a killed run
    was writing is otherwise kept for good when the resumed run never saves that step again."""
    for name in stale_targets(output_dir, CHECKPOINT.pattern):
        remove_stale(output_dir / name)


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
    """Record checkpoint `name` as the best when its `metric` beats the best so far. Only a checkpoint of a step that
    was evaluated competes: another step's metrics are not its weights'."""
    if metric is None or state.metrics is None or state.metrics.get("step") != state.step:
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


def label_names(config: dict) -> list[str] | None:
    """A config's label names in id order (id2label's keys are strings in a saved config.json)."""
    id2label = config.get("id2label") or {}
    return [str(name) for _, name in sorted((int(i), name) for i, name in id2label.items())] or None


def check_head(model: nn.Module, folder: Path) -> None:
    """The checkpoint in `folder` has this run's task head, with the same labels (names, in id order) and problem
    type: a head resumed under other names would be saved with them, each class mislabelled."""
    saved, current = Checkpoint.open(folder), model_config(model)
    if saved.task != task_of_model(model):
        raise ValueError(
            f"{folder / 'config.json'}: the checkpoint has a {saved.task} head, but this run trains "
            f"{task_of_model(model)}; resume with the task of the run that wrote it"
        )
    settings = {
        "labels": (label_names(saved.config), label_names(current)),
        "problem_type": (saved.config.get("problem_type"), current.get("problem_type")),
    }
    for name, (found, expected) in settings.items():
        if found and expected and found != expected:  # a checkpoint without labels (an encoder) has none to compare
            raise ValueError(
                f"{folder / 'config.json'}: {name} {found!r:.200} in the checkpoint, {expected!r:.200} in this run; "
                "resume with the data (labels) of the run that wrote it"
            )


def load_checkpoint(
    model: nn.Module,
    optimizer: optim.Optimizer,
    folder: Path,
    read: Callable[[nn.Module, Path], dict | None] | None = None,
) -> TrainerState:
    """Restore `model`'s weights, the optimizer state and the trainer state from a checkpoint folder; `read(model,
    folder)` reads weights other than LoRA or task adapters (the objective's `read_weights`; default
    `read_weights`)."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file() or not (folder / OPTIMIZER_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a training checkpoint (it needs {STATE_FILE} and {OPTIMIZER_FILE}); pass a "
            "checkpoint-STEP folder that train() wrote"
        )
    # the files that can be torn are read first: a damaged one must leave the model and optimizer untouched
    state = read_state(folder / STATE_FILE)
    optimizer_state = read_optimizer_state(folder / OPTIMIZER_FILE)
    lora, saved, trained = getattr(model, "lora_config", None), None, adapter_in_training(model)
    if trained is not None:
        encoder, name = trained
        if not (folder / name / PEFT_CONFIG).is_file():
            raise ValueError(
                f"{folder} holds no {name}/{PEFT_CONFIG}: it is not a checkpoint of a run training the task adapter "
                f"{name!r}; resume with the task_adapter of the run that wrote it"
            )
        low_ranks = read_lora(folder / name)
    elif (folder / ADAPTERS_FILE).is_file() != (lora is not None):
        raise ValueError(
            f"{folder} holds {'LoRA adapters' if (folder / ADAPTERS_FILE).is_file() else 'a whole model'}, but the "
            f"model to resume {'has no' if lora is None else 'has'} adapters; resume "
            "with the same LoRA settings as the run that wrote it"
        )
    if lora is not None:
        check_lora_settings(lora, folder)
        load_adapter_weights(model, folder)  # checks each tensor's name and shape, naming the file
    elif trained is None:
        saved = (read or read_weights)(model, folder)
    check_optimizer_state(optimizer, model, optimizer_state, folder / OPTIMIZER_FILE)
    if trained is not None:
        encoder.restore_adapter(name, low_ranks, folder / name)
    if saved is not None:
        model.update(tree_unflatten(list(saved.items())))
    optimizer.state = tree_unflatten(list(optimizer_state.items()))
    return state


def write_weights(model: nn.Module, folder: Path) -> None:
    """A checkpoint's model files, as `mlx_encoders.save` writes them (config.json and model.safetensors)."""
    write_checkpoint(model, model_config(model), folder)


def read_weights(model: nn.Module, folder: Path) -> dict[str, mx.array]:
    """The weights `write_weights` wrote to `folder`, checked against `model` (its head, each name and shape); the
    caller restores them once the optimizer state is checked too."""
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
    return saved


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
    for name, kinds in (("metrics", dict), ("best_metric", (int, float)), ("best_checkpoint", str), ("run", dict)):
        value = saved.get(name)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise ValueError(f"{path}: field {name!r} has the wrong type ({value!r:.80}); {RESUME_ELSEWHERE}")
    return TrainerState(**saved)


def log_metrics(output_dir: Path, record: dict) -> None:
    path = output_dir / METRICS_FILE
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as error:
        if not disk_full(error, output_dir):
            raise
        saved = checkpoints(output_dir)
        then = f"resume from {saved[-1]} (--resume)" if saved else "run again with overwrite=True (--overwrite)"
        raise OSError(
            error.errno, f"disk full while appending to {path}; free space on that disk, then {then}"
        ) from error


def trim_metrics(output_dir: Path, step: int) -> None:
    """Drop the records after `step` that a run stopped later than its last checkpoint left behind, and a last
    line without its newline: a record cut off as it was appended (a full disk, a killed run). The log is
    replaced whole, never left half-written."""
    path = output_dir / METRICS_FILE
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines.pop()
        kept = "".join(line for number, line in enumerate(lines, 1) if record_step(path, number, line) <= step)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(kept)
        partial.replace(path)


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


def start_state(
    model: nn.Module,
    optimizer: optim.Optimizer,
    config: TrainingConfig,
    resume_from: str | Path | None,
    read: Callable[[nn.Module, Path], dict | None] | None = None,
    total: int | None = None,
) -> TrainerState:
    """A fresh state (the dropout key and masking generator from `seed`) or the one in `resume_from` (its weights
    read by `read`, see `load_checkpoint`), with its saved key; the metrics log keeps only the records up to the
    state's step, and what killed checkpoint writes left is removed. MLX's global key is left alone."""
    if resume_from is None:
        key = np.array(mx.random.key(config.seed)).tolist()
        state = TrainerState(mask_rng=np.random.default_rng(config.seed).bit_generator.state, mlx_key=key)
    else:
        state = load_checkpoint(model, optimizer, resume_from, read)
        check_run_settings(state, config, Path(resume_from))
        if total is not None and state.step > total:  # before the clean-up below: a refusal changes no file
            raise ValueError(
                f"{resume_from} is at step {state.step}, past this run's {total} steps; resume with at least as "
                "many (epochs or max_steps), or use the checkpoint's model as it is"
            )
    state.run = run_settings(config)
    if not distributed.is_main():  # rank 0 alone owns the files
        return state
    remove_stale_checkpoints(config.output_dir)
    trim_metrics(config.output_dir, state.step)
    for later in checkpoints(config.output_dir):  # the stopped run's later states, which this run replaces
        if int(CHECKPOINT.fullmatch(later.name)[1]) > state.step:
            shutil.rmtree(later)
    if resume_from is not None and Path(resume_from).resolve().parent == config.output_dir.resolve():
        # the stopped run may have saved its newest before removing its oldest: keep_last holds from the start
        rotate_checkpoints(config.output_dir, config.keep_last, state.best_checkpoint, Path(resume_from).name)
    return state
