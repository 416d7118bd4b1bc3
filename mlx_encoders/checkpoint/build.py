"""Fitting a checkpoint's tensors to a model built from its config, and initialising heads it lacks.

Loading is strict: every parameter must come from the checkpoint and every checkpoint tensor must land
somewhere, except head tensors dropped on purpose when `task=` asks for less, and heads created on request
(`num_labels=`, ...), which are initialised as transformers initialises them (`_init_weights`: normal(0,
initializer_range) weights, zero biases, LayerNorm 1 and 0, or the architecture's own `init_std`).
"""

import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..engine.quantized import QUANTIZED
from ..engine.runtime import claim_mlx, compute_dtype, on_cpu
from ..engine.threads import on_own_thread
from ..models import TASKS, model_class, task_of_model
from ..models.base import HeadModel, label_ids, takes_pooler
from ..models.layers import next_key
from .adapters import attach_adapters
from .files import Checkpoint

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
LABELLED_TASKS = ("sequence-classification", "token-classification")  # heads whose outputs are labels


def normalize_keys(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop position_ids buffers; read TF-era `gamma`/`beta` as `weight`/`bias`."""
    out = {}
    for key, value in weights.items():
        if key.endswith("position_ids"):
            continue
        for old, new in LEGACY_SUFFIXES.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        out[key] = value
    return out


def slots(model: nn.Module) -> set[str]:
    """Every key the model could take: its parameters, plus scales/biases of quantizable modules."""
    names = {k for k, _ in tree_flatten(model.parameters())}
    for path, module in model.named_modules():
        if hasattr(module, "to_quantized"):
            names |= {f"{path}.scales", f"{path}.biases"}
    return names


def fit_prefix(weights: dict[str, mx.array], model: nn.Module) -> dict[str, mx.array]:
    """Add or strip the base-model prefix (`bert.`, `model.`, ...) so keys name the model's parameters."""
    prefix = model.prefix + "." if isinstance(model, HeadModel) else None
    taken = slots(model)
    out = {}
    for key, value in weights.items():
        candidates = [key, prefix + key] if prefix else [key, key.split(".", 1)[-1]]  # `bert.x` for a bare encoder
        out[next((c for c in candidates if c in taken), key)] = value
    return out


def quantize_like(model: nn.Module, weights: dict[str, mx.array], config: dict) -> None:
    """Turn exactly the modules whose `<path>.scales` is stored into quantized ones (models/layers.py: the engine's)."""
    spec = config.get("quantization") or config.get("quantization_config") or {}
    method = spec.get("quant_method") if isinstance(spec, dict) and "quantization" not in config else None
    if method is not None and any(k.endswith((".scales", ".qweight")) for k in weights):
        raise ValueError(
            f"config.json's quantization_config says the weights were quantized by {method!r} (transformers' "
            "layout: qweight, qzeros, ...), which mlx_encoders does not read; convert the float source instead "
            "(python -m convert --quantize SOURCE)"
        )
    if not spec and (stored := next((k for k in weights if k.endswith(".scales")), None)):
        # the bits and group size are in the config alone: guessed, the weights would unpack wrongly
        raise ValueError(
            f"The weights hold quantized tensors ({stored}, ...) but config.json has no 'quantization' entry "
            "(bits, group_size, mode): restore it from the folder the checkpoint was converted into, or convert "
            "the float source again"
        )
    if not any(k.endswith(".scales") for k in weights):  # a float checkpoint: another library's entry is not ours
        return
    if not isinstance(spec, dict):
        raise ValueError(
            f"config.json's 'quantization' entry must be an object (bits, group_size, mode), got {spec!r:.60}"
        )
    default = stored_settings(spec, "")

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        override = module_override(spec, path)
        settings = stored_settings({**default, **override}, path) if isinstance(override, dict) else dict(default)
        check_stored_groups(weights, path, settings)
        return settings

    nn.quantize(model, class_predicate=predicate)


def stored_settings(entry: dict, path: str) -> dict:
    """The bits, group size and mode of config.json's `quantization` entry (or a module's own, at `path`), checked
    against what MLX can unpack: a wrong one would fail deep in MLX, or crash the process (a group size of 0)."""
    from ..quantization.recipes import quantization_spec  # the quantization package builds on this module

    where = "config.json's 'quantization' entry" + (f" for {path}" if path else "")
    bits, group_size, mode = entry.get("bits", 8), entry.get("group_size", 64), entry.get("mode", "affine")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (bits, group_size)) or not isinstance(mode, str):
        raise ValueError(
            f"{where}: bits and group_size must be integers and mode a string, got {bits!r}, {group_size!r}, "
            f"{mode!r}; restore it from the folder the checkpoint was converted into"
        )
    try:
        return quantization_spec(bits, group_size, mode)
    except ValueError as e:
        raise ValueError(f"{where}: {e}; restore it from the folder the checkpoint was converted into") from None


def check_stored_groups(weights: dict[str, mx.array], path: str, settings: dict) -> None:
    """The stored scales have a column per group of `settings`' size, else config.json was written for other weights."""
    weight, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    if weight is None or weight.ndim < 2:
        return
    columns = weight.shape[-1] * 32 // settings["bits"]  # the codes are packed into 32-bit words
    if scales.shape[-1] * settings["group_size"] != columns:
        raise ValueError(
            f"{path}: its stored weights {tuple(weight.shape)} and scales {tuple(scales.shape)} do not fit "
            f"config.json's 'quantization' entry ({settings['bits']} bits in groups of {settings['group_size']}); "
            "restore the entry from the folder the checkpoint was converted into"
        )


def module_override(spec: dict, path: str) -> dict | None:
    """A module's own quantization settings, under its path in the checkpoint, which may lack the head model's
    prefix (a quantized bare encoder loaded with a head) or carry one the bare encoder lacks."""
    without_prefix = path.split(".", 1)[-1]
    for key in (path, without_prefix):
        if isinstance(spec.get(key), dict):
            return spec[key]
    return next((v for k, v in spec.items() if isinstance(v, dict) and k.endswith("." + path)), None)


# the word-embedding tables a tied output layer copies, by the end of their keys
EMBEDDING_TABLES = ("word_embeddings.weight", "embed_tokens.weight", "wte.weight", "tok_embeddings.weight")


def stored_apart(model: nn.Module, weights: dict[str, mx.array]) -> str | None:
    """The key of a tied output layer's copy (`ignored_keys`) that the checkpoint stores with other values than the
    word embeddings it would be tied to, or None."""
    if not getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        return None
    for key in getattr(model, "ignored_keys", ()):
        copy = weights.get(key)
        if copy is None or not key.endswith("weight"):
            continue
        tables = [v for k, v in weights.items() if k.endswith(EMBEDDING_TABLES) and v.shape == copy.shape]
        if tables and not any(mx.array_equal(copy, table).item() for table in tables):
            return key
    return None


def is_float(x: mx.array) -> bool:
    return mx.issubdtype(x.dtype, mx.floating)


def droppable(model: nn.Module, key: str) -> bool:
    """Whether `task=` may drop an unused tensor: one of the stored head, or the encoder's pooler. An unused
    encoder tensor (a layer the config does not declare) means a broken checkpoint and still fails."""
    parts = key.split(".")
    if isinstance(model, HeadModel):
        inner = parts[1:] if parts[0] == model.prefix else None
    else:  # a bare encoder: its keys, with or without the base-model prefix
        children = model.children()
        inner = parts if parts[0] in children else parts[1:] if parts[1:] and parts[1] in children else None
    return inner is None or inner[0] == "pooler"


def creatable(model: nn.Module, key: str) -> bool:
    """Whether a missing tensor belongs to what a new head adds: the head itself, or the encoder's pooler."""
    if not isinstance(model, HeadModel):
        return False
    return not key.startswith(model.prefix + ".") or key.startswith(f"{model.prefix}.pooler.")


def fit_weights(
    model: nn.Module, weights: dict[str, mx.array], drop_foreign: bool, new_head: bool, source: Path
) -> tuple[dict[str, mx.array], list[str]]:
    """(the checkpoint tensors the model takes, the keys a new head adds); anything else that does not fit
    fails, naming every missing, unused, mis-shaped or non-float tensor."""
    params = dict(tree_flatten(model.parameters()))
    ignored = set(getattr(model, "ignored_keys", ()))
    unexpected = [k for k in weights if k not in params and k not in ignored]
    if drop_foreign:  # task= asked for another head: drop the stored head's tensors
        unexpected = [k for k in unexpected if not droppable(model, k)]
    missing = [k for k in params if k not in weights]
    created = [k for k in missing if new_head and creatable(model, k)]
    missing = [k for k in missing if k not in created]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(sorted(missing))}")
    if unexpected:
        problems.append(f"not used by {type(model).__name__}: {', '.join(sorted(unexpected))}")
    wrong = [
        f"{k} is {tuple(weights[k].shape)} in the file but {tuple(v.shape)} in the model"
        for k, v in params.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if wrong:
        more = f"; and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        problems.append("shape mismatch: " + "; ".join(wrong[:5]) + more)
    kinds = [
        f"{k} ({str(weights[k].dtype).rsplit('.', 1)[-1]})"
        for k, v in params.items()
        if k in weights and is_float(weights[k]) != is_float(v)
    ]
    if kinds:
        problems.append(f"not float where the model needs float weights (or the reverse): {', '.join(sorted(kinds))}")
    if problems:
        hint = ""
        labelled = task_of_model(model) in LABELLED_TASKS  # a head that labels: one that num_labels creates
        if missing and not new_head and labelled and all(creatable(model, k) for k in missing):
            hint = " | to add this head, pass num_labels= (or id2label=, label2id=, problem_type=)"
        elif missing and all(k.endswith("decoder.weight") or k == "lm_head.weight" for k in missing):
            hint = (
                " | config.json has tie_word_embeddings false, and the checkpoint has no output layer of its own: "
                "if it shares the word embeddings, set tie_word_embeddings to true"
            )
        raise ValueError(
            f"Checkpoint {source} does not fit {type(model).__name__} built from its config.json: "
            + " | ".join(problems)
            + hint
        )
    return {k: v for k, v in weights.items() if k in params}, created


def initialize(model: nn.Module, keys: list[str], module, dtype: mx.Dtype) -> None:
    """transformers' initial values for `keys`: LayerNorm (and RMSNorm) 1 and 0, zero biases, normal(0, std) weights,
    truncated to +-bound where the architecture's `init_std(path, args) -> (std, bound)` says so."""
    modules = dict(model.named_modules())
    params = dict(tree_flatten(model.parameters()))
    values = []
    for key in keys:
        path, name = key.rsplit(".", 1)
        shape = params[key].shape
        if isinstance(modules[path], (nn.LayerNorm, nn.RMSNorm)) and name == "weight":
            value = mx.ones(shape)
        elif name != "weight":
            value = mx.zeros(shape)
        else:
            std, bound = module.init_std(path, model.args) if hasattr(module, "init_std") else (None, None)
            std = model.args.initializer_range if std is None else std
            if bound is None:
                value = std * mx.random.normal(shape, key=next_key())
            else:
                value = std * mx.random.truncated_normal(-bound / std, bound / std, shape, key=next_key())
        values.append((key, value.astype(dtype)))
    model.load_weights(values, strict=False)


def with_labels(config: dict, labels: dict[str, Any]) -> dict:
    """config.json with the requested `num_labels` / `id2label` / `label2id` / `problem_type`."""
    num_labels, id2label, label2id = labels["num_labels"], labels["id2label"], labels["label2id"]
    if label2id is not None:
        if len(set(label2id.values())) != len(label2id):
            raise ValueError(f"label2id gives several labels the same id: {label2id!r}")
        from_names = label_ids({i: label for label, i in label2id.items()}, "label2id")
        if id2label is not None and label_ids(id2label, "id2label") != from_names:
            raise ValueError(f"id2label {id2label!r} and label2id {label2id!r} disagree")
        id2label = from_names
    if id2label is not None:
        id2label = label_ids(id2label, "id2label")
        if num_labels is not None and num_labels != len(id2label):
            raise ValueError(f"num_labels={num_labels} but {len(id2label)} labels were named")
    elif num_labels is not None:
        if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
            raise ValueError(f"num_labels must be a positive integer, got {num_labels!r}")
        stored = config.get("id2label") or {}
        id2label = stored if len(stored) == num_labels else {i: f"LABEL_{i}" for i in range(num_labels)}
    config = {k: v for k, v in config.items() if k not in ("num_labels", "_num_labels", "label2id")}
    if id2label is not None:
        config["id2label"] = {str(i): label for i, label in id2label.items()}
    if labels["problem_type"] is not None:
        config["problem_type"] = labels["problem_type"]
    return config


def build_model(module: ModuleType, config: dict, task: str, weights: dict[str, mx.array]) -> nn.Module:
    """The `task` model of `config`; a head whose layout config.json may leave unsaid takes the one the weights
    hold (its class's `layout_from_weights(config, keys) -> config`: DeBERTa's masked-LM `legacy`)."""
    cls = model_class(config["model_type"], task)
    if hasattr(cls, "layout_from_weights"):
        config = cls.layout_from_weights(config, weights.keys())
    args = module.ModelArgs.from_dict(config)
    if takes_pooler(cls):  # a bare encoder has a pooler exactly when the checkpoint stores one
        return cls(args, add_pooling_layer=any(".pooler." in "." + k for k in weights))
    return cls(args)


def bare(weights: dict[str, mx.array], checkpoint: Checkpoint, task: str) -> bool:
    """Whether the tensors are a bare encoder's alone though config.json names a head (a sentence-transformers
    Transformer saves its bare model so; Qwen3-Embedding's config names the causal LM): each one under a module of
    the encoder (built lazily: MLX allocates no weights until they are used), none under the head's prefix."""
    prefix = model_class(checkpoint.model_type, task).prefix + "."
    if prefix == "." or any(k.startswith(prefix) for k in weights):
        return False
    try:
        encoder = model_class(checkpoint.model_type, "encoder")(
            checkpoint.module.ModelArgs.from_dict(checkpoint.config)
        )
    except (TypeError, ValueError):  # a config the encoder cannot take: building the model says why
        return False
    return all(k.split(".", 1)[0] in encoder.children() for k in weights)


def check_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"Unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)} (or None to keep the stored one)"
    )


def common_float_dtype(named: Iterable[tuple[str, mx.array]]) -> mx.Dtype:
    """The most common float dtype of the tensors that are not quantization scales (float32 if none)."""
    dtypes = [v.dtype for k, v in named if is_float(v) and not k.endswith((".scales", ".biases"))]
    return max(set(dtypes), key=dtypes.count) if dtypes else mx.float32


def all_finite(x: mx.array) -> bool:
    """numpy reads the tensor in place, several times faster than MLX's CPU isfinite; it has no bfloat16, which
    widens to float32 exactly."""
    return bool(np.isfinite(np.asarray(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)).all())


def warn_non_finite(model: nn.Module, source: Path) -> None:
    """Warn, naming the first few, about float tensors holding NaN or inf (a corrupt file, or a cast to float16
    that overflowed): the model's outputs would be NaN without any error."""
    claim_mlx()
    mx.eval(model.parameters())
    bad = [k for k, v in tree_flatten(model.parameters()) if is_float(v) and not all_finite(v)]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        warnings.warn(
            f"The checkpoint at {source} has NaN or inf values in {len(bad)} tensors: {', '.join(bad[:5])}{more}. "
            "The model's outputs will be NaN: re-download or re-convert the checkpoint (or, after a cast to "
            "float16, load it in float32 or bfloat16).",
            UserWarning,
            stacklevel=3,
        )


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every float parameter but, on the CPU, the quantized layers' scales and biases, which keep their stored
    dtype there (the CPU dequantizes in float32; cast to bfloat16 they moved the weights by as much again as the
    quantization did). Elsewhere MLX's quantized kernels take them in the model's dtype: a mix would run in float32."""
    quantized = {path for path, m in model.named_modules() if isinstance(m, QUANTIZED)} if on_cpu() else set()
    cast = [
        (k, v.astype(dtype))
        for k, v in tree_flatten(model.parameters())
        if is_float(v)
        and v.dtype != dtype
        and not (k.endswith((".scales", ".biases")) and k.rsplit(".", 1)[0] in quantized)
    ]
    model.update(tree_unflatten(cast), strict=False)


def in_compute_dtype(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`weights` cast to the dtype the device computes them in (`engine.runtime.compute_dtype`), quantization scales
    and biases aside (the quantized layers widen those themselves)."""
    cast = {}
    for k, v in weights.items():
        wanted = v.dtype if k.endswith((".scales", ".biases")) else compute_dtype(v.dtype)
        cast[k] = v if wanted == v.dtype else v.astype(wanted)
    return cast


@on_own_thread
def load_model(
    path_or_repo: str | Path | Checkpoint,
    dtype: str | mx.Dtype | None = None,
    task: str | None = None,
    revision: str | None = None,
    *,
    num_labels: int | None = None,
    id2label: dict | None = None,
    label2id: dict | None = None,
    problem_type: str | None = None,
    as_stored: bool = False,
) -> nn.Module:
    """Build the model a checkpoint describes (or the `task` head / bare `"encoder"`) and load its weights.

    `dtype=None` keeps each tensor's stored dtype, except that half-precision weights compute in float32 on the CPU
    (`compute_dtype`; `as_stored=True` keeps them too, as convert does); "float32", "float16" or "bfloat16" casts
    everything not quantized.
    `num_labels`, `id2label`, `label2id` or `problem_type` set the labels of a classification head; a head
    the checkpoint lacks (e.g. `task="sequence-classification"`, the task they ask for unless the checkpoint has
    a head with labels, on a masked-LM checkpoint) is then created, initialised as transformers does, with one
    warning naming its new tensors. Without them a missing head fails.
    """
    checkpoint = Checkpoint.open(path_or_repo, revision)
    dtype = check_dtype(dtype)
    labels = dict(num_labels=num_labels, id2label=id2label, label2id=label2id, problem_type=problem_type)
    new_head = any(v is not None for v in labels.values())
    try:
        stored_task = checkpoint.task
    except ValueError:
        if task is None:
            raise
        stored_task = None  # an architecture we do not implement: only its encoder (or `task`) is wanted
    weights, inline = normalize_keys(checkpoint.read_weights()), {}
    if hasattr(checkpoint.module, "inline_adapters"):  # task adapters kept in the weights file (jina's remote code)
        weights, inline = checkpoint.module.inline_adapters(weights, checkpoint.config)
    if hasattr(checkpoint.module, "sanitize"):
        weights = checkpoint.module.sanitize(weights)
    if task is None and new_head and stored_task not in LABELLED_TASKS:  # labels name a classifier to create
        task = "sequence-classification"
    named_head = stored_task not in (None, "encoder")
    if task is None and not new_head and named_head and bare(weights, checkpoint, stored_task):
        task = "encoder"
    task = task or stored_task
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    config = with_labels(checkpoint.config, labels) if new_head else checkpoint.config
    try:
        model = build_model(checkpoint.module, config, task, weights)
    except ValueError as e:
        raise ValueError(f"{checkpoint.path / 'config.json'}: {e}") from e
    weights = fit_prefix(weights, model)
    if apart := stored_apart(model, weights):  # transformers 5 keeps such a head as its own: so do we
        warnings.warn(
            f"{checkpoint.path}: config.json ties the output layer to the word embeddings, but the checkpoint stores "
            f"{apart} with other values; it is loaded as the model's own head (tie_word_embeddings false), as "
            "transformers loads it",
            UserWarning,
            stacklevel=2,
        )
        config = {**config, "tie_word_embeddings": False}
        model = build_model(checkpoint.module, config, task, weights)
        weights = fit_prefix(weights, model)
        for key in dict(tree_flatten(model.parameters())):  # an untied decoder's bias is its head's, as tied
            shared = key.removesuffix(".decoder.bias") + ".bias"
            if key.endswith(".decoder.bias") and key not in weights and shared in weights:
                weights[key] = weights[shared]
    quantize_like(model, weights, config)
    weights, created = fit_weights(model, weights, task != stored_task or new_head, new_head, checkpoint.path)
    stored = common_float_dtype(weights.items())
    widened = dtype is None and not as_stored and compute_dtype(stored) != stored
    if dtype is None and not as_stored:
        weights = in_compute_dtype(weights)
    model.load_weights(list(weights.items()), strict=not created)
    if created:
        initialize(model, created, checkpoint.module, dtype or (stored if as_stored else compute_dtype(stored)))
        warnings.warn(
            f"Some weights of {type(model).__name__} were not in the checkpoint at {checkpoint.path} and are newly "
            f"initialized: {', '.join(sorted(created))}. Train this model on a downstream task before using it "
            "for predictions.",
            UserWarning,
            stacklevel=2,
        )
    if dtype is not None:
        cast_floats(model, dtype)
    warn_non_finite(model, checkpoint.path)
    if hasattr(model, "add_adapter"):  # task adapters in subfolders (jina-embeddings-v3)
        attach_adapters(model, checkpoint.path)
    for name, low_ranks in inline.items():
        model.add_adapter(name, low_ranks)
    model.eval()
    model.path = checkpoint.path
    model.stored_dtype = stored if widened else None  # what `save` writes back by default
    return model
