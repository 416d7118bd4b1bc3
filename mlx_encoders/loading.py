"""Find a checkpoint (folder or hub id), read its safetensors and build the matching MLX model.

Loading is strict: every parameter of the model must come from the checkpoint and every checkpoint
tensor must land somewhere, except head tensors dropped on purpose when `task=` asks for less.
Pickle checkpoints are refused, so loading never runs code from a checkpoint.
"""

import json
from pathlib import Path
from types import MappingProxyType

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .models import TASKS, model_class, model_module, task_of_architecture
from .models.base import HeadModel, takes_pooler

HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "README.md"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def resolve(path_or_repo: str | Path, revision: str | None = None) -> Path:
    """A local folder as is, else a hub repo id through the huggingface_hub cache (honours HF_HUB_OFFLINE)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint folder that holds config.json")
    name = str(path_or_repo)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"No checkpoint folder at {name}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:  # cache first: a cached snapshot needs no network round trip
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{name} is neither a local folder nor in the Hugging Face cache, and the hub cannot be reached "
            f"(offline or HF_HUB_OFFLINE=1). Download it once with network, or pass a local folder."
        ) from e
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"Could not fetch {name!r} from the Hugging Face hub: {e}") from e


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"No config.json in {path}; is this a transformers or MLX checkpoint folder?")
    return json.loads(file.read_text())


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{path} holds only pickle weights ({', '.join(pickles)}). mlx_encoders loads safetensors only, "
            "because unpickling can run arbitrary code. Convert once with transformers: "
            "`AutoModel.from_pretrained(path).save_pretrained(path, safe_serialization=True)`, or use the "
            "hub repo's safetensors revision (many repos have a 'refs/pr/N' with model.safetensors)."
        )
    raise FileNotFoundError(f"No model.safetensors (or shards with model.safetensors.index.json) in {path}")


def read_weights(path: Path) -> dict[str, mx.array]:
    weights = {}
    for file in weight_files(path):
        weights.update(mx.load(str(file)))
    return weights


def normalize_keys(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop position_ids buffers; read TF-era `gamma`/`beta` as `weight`/`bias`."""
    renames = {".gamma": ".weight", ".beta": ".bias"}
    out = {}
    for key, value in weights.items():
        if key.endswith("position_ids"):
            continue
        for old, new in renames.items():
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
        candidates = [key]
        if prefix:
            candidates.append(prefix + key)
        else:
            candidates.append(key.split(".", 1)[-1])  # `bert.embeddings...` for a bare encoder
        out[next((c for c in candidates if c in taken), key)] = value
    return out


def quantize_like(model: nn.Module, weights: dict[str, mx.array], config: dict) -> None:
    """Turn exactly the modules whose `<path>.scales` is stored into quantized ones."""
    spec = config.get("quantization") or config.get("quantization_config") or {}
    default = {
        "group_size": spec.get("group_size", 64),
        "bits": spec.get("bits", 8),
        "mode": spec.get("mode", "affine"),
    }

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        override = spec.get(path)
        return {**default, **override} if isinstance(override, dict) else dict(default)

    nn.quantize(model, class_predicate=predicate)


def check_keys(model: nn.Module, weights: dict[str, mx.array], drop_foreign: bool, source: Path) -> dict:
    params = dict(tree_flatten(model.parameters()))
    ignored = set(getattr(model, "ignored_keys", ()))
    unexpected = [k for k in weights if k not in params and k not in ignored]
    if drop_foreign:  # task= asked for another head: drop tensors of modules this head does not have
        modules = {path for path, _ in model.named_modules()}
        unexpected = [k for k in unexpected if k.rsplit(".", 1)[0] in modules]
    missing = [k for k in params if k not in weights]
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
    if problems:
        raise ValueError(
            f"Checkpoint {source} does not fit {type(model).__name__} built from its config.json: "
            + " | ".join(problems)
        )
    return {k: v for k, v in weights.items() if k in params}


def checkpoint_task(config: dict) -> str:
    architectures = config.get("architectures") or []
    return task_of_architecture(architectures[0]) if architectures else "encoder"


def build_model(config: dict, task: str, weights: dict[str, mx.array]) -> nn.Module:
    cls = model_class(config.get("model_type", "<missing>"), task)
    args = model_module(config["model_type"]).ModelArgs.from_dict(config)
    if takes_pooler(cls):  # a bare encoder has a pooler exactly when the checkpoint stores one
        return cls(args, add_pooling_layer=any(".pooler." in "." + k for k in weights))
    return cls(args)


def load_model(
    path_or_repo: str | Path,
    dtype: str | mx.Dtype | None = None,
    task: str | None = None,
    revision: str | None = None,
) -> nn.Module:
    """Build the model a checkpoint describes (or the `task` head / bare `"encoder"`) and load its weights.

    `dtype=None` keeps the stored dtype; "float32", "float16" or "bfloat16" casts everything not quantized.
    """
    path = resolve(path_or_repo, revision)
    config = read_config(path)
    model_module(config.get("model_type", "<missing>"))  # unknown architectures fail before reading weights
    stored_task = checkpoint_task(config)
    task = task or stored_task
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    weights = normalize_keys(read_weights(path))
    model = build_model(config, task, weights)
    weights = fit_prefix(weights, model)
    quantize_like(model, weights, config)
    weights = check_keys(model, weights, drop_foreign=task != stored_task, source=path)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(DTYPES[dtype] if isinstance(dtype, str) else dtype)
    mx.eval(model.parameters())
    model.eval()
    model.path = path
    model.config = MappingProxyType(config)  # read-only, and not a dict that nn.Module would treat as a child
    return model
