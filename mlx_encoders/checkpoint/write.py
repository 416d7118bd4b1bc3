"""Writing checkpoints that transformers and mlx_encoders both read back.

`save` writes config.json (every config key, `architectures`, labels both ways), the weights under
transformers' key names (the model's own parameter names; tied copies are left out, as transformers
leaves them out) in `model.safetensors`, or shards with an index past 5 GiB (mlx-lm's
default) and the tokenizer files, into a temporary folder renamed into place, so a failure leaves nothing
half-written (what a killed writer leaves, the next write into the same place removes). Quantized models are
written in the mlx-community layout (mlx-lm's `save_model`): `quantization` in config.json and
`<path>.weight` / `.scales` / `.biases` per quantized module.
"""

import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..engine.quantized import QUANTIZED
from ..models import model_module
from .adapters import write_lora
from .atomic import atomic_folder
from .build import check_dtype, common_float_dtype, is_float
from .files import GENERATION_FILE, INDEX, TOKENIZER_FILES

MAX_SHARD_BYTES = 5 << 30
DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def quantization_entry(model: nn.Module) -> dict | None:
    """config.json's `quantization` for the model's quantized modules: the most common setting as the default,
    per-module entries for the others (mlx-lm's layout); None when nothing is quantized."""
    settings = {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
        for path, m in model.named_modules()
        if isinstance(m, QUANTIZED)
    }
    if not settings:
        return None
    counts = Counter(tuple(s.items()) for s in settings.values())
    default = dict(counts.most_common(1)[0][0])
    return {**default, **{path: s for path, s in settings.items() if s != default}}


def model_config(model: nn.Module, dtype: mx.Dtype | None = None) -> dict:
    """The config.json that describes `model` (its weights written in `dtype`, or as they are), loaded or built in
    code from its `ModelArgs`."""
    config = model.config
    config["dtype"] = DTYPE_NAMES[dtype or common_float_dtype(tree_flatten(model.parameters()))]
    config.pop("torch_dtype", None)  # transformers 5 reads `dtype`
    quantization = quantization_entry(model)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    return config


def make_shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    shards, shard, size = [], {}, 0
    for key, value in weights.items():
        if shard and size + value.nbytes > max_bytes:
            shards.append(shard)
            shard, size = {}, 0
        shard[key] = value
        size += value.nbytes
    return [*shards, shard]


def write_weights(
    model: nn.Module, folder: Path, shard_size: int = MAX_SHARD_BYTES, dtype: mx.Dtype | None = None
) -> list[Path]:
    """`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards with their index past `shard_size`; float
    weights cast to `dtype` when given (quantization scales and biases as they are)."""
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if is_float(v) and not k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    module = model_module(model.args.model_type)
    if hasattr(module, "checkpoint_weights"):  # the inverse of its `sanitize` (GPT-2's Conv1D layout)
        weights = module.checkpoint_weights(weights)
    shards = make_shards(weights, shard_size)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    # transformers reads only files marked "pt" (or "mlx", which it refuses to load for torch)
    metadata = {"format": "mlx" if quantization_entry(model) else "pt"}
    for name, shard in tqdm(list(zip(names, shards, strict=True)), desc="writing", unit="file", leave=False):
        mx.save_safetensors(str(folder / name), shard, metadata=metadata)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
            "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in sorted(shard)},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [folder / name for name in names]


def write_checkpoint(
    model: nn.Module,
    config: dict,
    folder: Path,
    shard_size: int = MAX_SHARD_BYTES,
    adapters: bool = True,
    dtype: mx.Dtype | None = None,
) -> list[Path]:
    """Write the model's weights under its own parameter names, and `config`, into `folder`; with `adapters`, its
    task adapters too (jina-embeddings-v3's, one PEFT folder each, as the loader reads them; none while one is
    merged into the weights). Returns the weight files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = write_weights(model, folder, shard_size, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    for name, low_ranks in (model.adapter_tensors() if adapters and hasattr(model, "adapter_tensors") else {}).items():
        write_lora(folder / name, low_ranks)
    return files


def copy_tokenizer_files(source: Path, folder: Path) -> list[str]:
    """Copy a checkpoint's tokenizer files as they are (convert keeps every file the source ships)."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()] + sorted(p.name for p in source.glob("*.model"))
    for name in names:
        shutil.copy2(source / name, folder / name)
    return names


def save(
    model: nn.Module,
    folder: str | Path,
    tokenizer=None,
    *,
    dtype: str | mx.Dtype | None = None,
    overwrite: bool = False,
    shard_size: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `model` (and `tokenizer`'s files) as a checkpoint folder that transformers'
    `AutoModelFor...from_pretrained` and `mlx_encoders.load` read back; returns the folder.

    The folder appears only when complete; an existing one is replaced only with `overwrite=True`, and only
    if it holds checkpoint files alone (weights, config.json, tokenizer files), as nothing else is rewritten.
    `dtype` ("float32", "float16", "bfloat16") casts the float weights as they are written; by default a
    half-precision checkpoint that loading widened to float32 for the CPU is written back in its stored dtype, as
    transformers writes it, and any other model's weights as they are.
    Without `tokenizer`, the folder's own tokenizer files are kept: loading the folder needs them. A model's task
    adapters are written as PEFT adapter subfolders, unless one is merged into the weights.
    """
    folder = Path(folder)
    dtype = check_dtype(dtype) or getattr(model, "stored_dtype", None)
    adapters = tuple(model.adapter_tensors()) if hasattr(model, "adapter_tensors") else ()  # the subfolders it writes
    with atomic_folder(folder, overwrite, whole=False, adapters=adapters) as tmp:
        write_checkpoint(model, model_config(model, dtype), tmp, shard_size, dtype=dtype)  # with its task adapters
        if tokenizer is not None:
            tokenizer.save(tmp)
        elif folder.is_dir():
            copy_tokenizer_files(folder, tmp)
        # the decoding defaults `generate` reads: the loaded model's, else the replaced folder's
        sources = [Path(p) for p in (getattr(model, "path", None), folder if folder.is_dir() else None) if p]
        if found := next((p / GENERATION_FILE for p in sources if (p / GENERATION_FILE).is_file()), None):
            shutil.copy2(found, tmp / GENERATION_FILE)
    return folder
