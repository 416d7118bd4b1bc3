"""Convert a Hugging Face encoder checkpoint into an MLX one: cast, quantize, or dequantize.

The command of mlx-lm's `convert` (reference: `mlx_lm/convert.py`; `save_model` and `make_shards` in
`mlx_lm/utils.py`): it checks the request before loading anything, quantizes or dequantizes through
`mlx_encoders.quantization`, measures the result against the source on built-in probe texts, and writes the
mlx-community layout (weights under the model's own parameter names, config.json with `quantization` and
the same `quantization_config`, tokenizer and sentence-transformers files, a model card) into a folder that
appears only when complete, then optionally uploads it to the hub.
Longer than most modules: it is convert's one pipeline (load, quantize, check fidelity, write, card, upload).
"""

import hashlib
import json
import math
import shutil
import time
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import __version__
from .bge_m3 import HEADS as BGE_M3_HEADS
from .checkpoint import (
    DTYPES,
    MAX_SHARD_BYTES,
    PICKLE_SUFFIXES,
    Checkpoint,
    atomic_folder,
    folder_digest,
    load_model,
    model_config,
    read_json,
    read_modules,
    read_safetensors,
    write_checkpoint,
)
from .checkpoint.adapters import adapter_folders
from .checkpoint.atomic import remove_stale
from .checkpoint.build import build_model, check_dtype, normalize_keys
from .checkpoint.write import copy_tokenizer_files
from .models import task_of_model
from .quantization import (
    CALIBRATION_TOKENS,
    OptionError,
    applied_settings,
    calibration_texts,
    dequantize_model,
    input_hessians,
    quantizable_paths,
    quantization_spec,
    quantize_model,
    recipe_rule,
    warn_unmatched_patterns,
)
from .tokenizer import Tokenizer

RECORD = "conversion.json"  # what a folder was converted from and how, to reuse it for the same request
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
PROBE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "MLX is an array framework for machine learning on Apple silicon.",
    "Paris is the capital of France.",
    "A short one.",
    "Quantization stores weights in fewer bits, trading a little accuracy for a much smaller model.",
    "def add(a, b): return a + b",
    "How many parameters does this encoder have?",
    "Les modèles multilingues comprennent aussi le français, 12345 et les émojis 🙂.",
]


def sentence_modules(source: Path) -> list[Path]:
    """Folders of the sentence-transformers modules (1_Pooling, 2_Dense, ...) listed in modules.json."""
    return [folder for _, folder in read_modules(source) if folder != source and folder.is_dir()]


def check_sentence_modules(source: Path) -> None:
    """Refuse sentence-transformers modules whose weights are pickle only (unpickling runs code)."""
    for folder in sentence_modules(source):
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles and not list(folder.glob("*.safetensors")):
            raise ValueError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}); mlx_encoders converts safetensors "
                "only. Re-save the module with sentence-transformers (safe_serialization=True) first."
            )


def copy_sentence_files(source: Path, folder: Path, dtype: mx.Dtype | None) -> list[str]:
    """Copy modules.json & co and each module folder; float weights (2_Dense/) are cast to `dtype`."""
    names = [n for n in SENTENCE_FILES if (source / n).is_file()]
    for name in names:
        shutil.copy2(source / name, folder / name)
    for module in sentence_modules(source):
        target = folder / module.name
        target.mkdir()
        for file in sorted(module.iterdir()):
            if file.suffix == ".safetensors":
                weights = read_safetensors(file)
                if dtype is not None:
                    weights = {
                        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
                    }
                mx.save_safetensors(str(target / file.name), weights, metadata={"format": "pt"})
            elif file.is_file() and file.suffix not in PICKLE_SUFFIXES:
                shutil.copy2(file, target / file.name)
        names.append(module.name + "/")
    return names


def convert_torch_heads(source: Path, folder: Path, dtype: mx.Dtype | None) -> list[str]:
    """BGE-M3's extra heads (sparse_linear, colbert_linear) as safetensors in `folder`: copied when the source
    has them so, else read from their .pt pickles with torch's weights-only loader, which refuses anything but
    tensors. Returns the names written."""
    written = []
    for name in BGE_M3_HEADS:
        target = folder / f"{name}.safetensors"
        if (source / target.name).is_file():
            weights = read_safetensors(source / target.name)
        elif (source / f"{name}.pt").is_file():
            weights = read_torch_weights(source / f"{name}.pt")
        else:
            continue
        if dtype is not None:
            weights = {k: v.astype(dtype) for k, v in weights.items()}
        mx.save_safetensors(str(target), weights, metadata={"format": "pt"})
        written.append(target.name)
    return written


def read_torch_weights(file: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"Converting {file} (a torch pickle) needs torch: pip install torch") from e
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError or RuntimeError for what its safe loader refuses
        raise ValueError(
            f"{file} is not a plain state dict of tensors that torch's weights-only loader reads: {e}"
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} must hold a state dict of tensors (a Linear's weight and bias)")
    return {k: mx.array(v.detach().to(torch.float32).numpy()) for k, v in state.items()}


def source_tokenizer(model: nn.Module, checkpoint: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    from . import load_tokenizer

    try:
        return load_tokenizer(model, checkpoint)
    except FileNotFoundError:
        return None


def probe_batch(model: nn.Module, tokenizer: Tokenizer | None) -> dict[str, mx.array]:
    """The built-in probe texts through the checkpoint's tokenizer (seeded ids when it has none)."""
    if tokenizer is not None:
        return tokenizer(PROBE_TEXTS, padding=True, truncation=True)
    ids = np.random.default_rng(0).integers(0, model.args.vocab_size, (len(PROBE_TEXTS), 16))
    return {"input_ids": mx.array(ids, dtype=mx.int32), "attention_mask": mx.ones(ids.shape, dtype=mx.int32)}


def main_output(model: nn.Module, batch: dict[str, mx.array]) -> tuple[str, mx.array]:
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids"))
    name = "logits" if out.logits is not None else "last_hidden_state"
    value = getattr(out, name).astype(mx.float32)
    mx.eval(value)
    return name, value


def fidelity(reference: mx.array, result: mx.array, attention_mask: mx.array) -> dict[str, float]:
    """Per-text cosine (over its real tokens' outputs) and max abs difference, result vs reference."""
    if reference.ndim == 3:  # token outputs: padding positions are not part of the text
        mask = attention_mask.astype(mx.float32)[..., None]
        reference, result = reference * mask, result * mask
    a, b = reference.reshape(reference.shape[0], -1), result.reshape(result.shape[0], -1)
    cosine = (a * b).sum(-1) / mx.maximum(mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1), 1e-12)
    return {
        "cosine_mean": cosine.mean().item(),
        "cosine_min": cosine.min().item(),
        "max_abs_diff": mx.abs(a - b).max().item(),
    }


def perplexity(logits: mx.array, batch: dict[str, mx.array]) -> float:
    """exp of the mean next-token cross-entropy over the real tokens of the batch (a causal LM's fidelity)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].astype(mx.float32)
    losses = nn.losses.cross_entropy(logits[:, :-1], ids[:, 1:], reduction="none")
    keep = mask[:, 1:] * mask[:, :-1]
    return math.exp(((losses * keep).sum() / keep.sum()).item())


def describe_perplexity(report: dict) -> str:
    before, after = report["perplexity"]["source"], report["perplexity"]["result"]
    return f"{before:.4f} -> {after:.4f} ({100 * (after / before - 1):+.2f}%)"


def default_mlx_path(source: str | Path, spec: dict | None, recipe: str | dict | None, dequantize: bool) -> Path:
    name = Path(str(source)).name
    if dequantize:
        return Path(f"{name}-dequantized")
    if spec is None:
        return Path(f"{name}-mlx")
    if isinstance(recipe, str):
        return Path(f"{name}-{recipe}")
    return Path(f"{name}-{spec['bits']}bit" if spec["mode"] == "affine" else f"{name}-{spec['mode']}")


def upload(folder: Path, repo: str) -> str:
    """Publish `folder` as the model repo `repo` (needs a write token: `hf auth login` or HF_TOKEN)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id=repo, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model")
    return f"https://huggingface.co/{repo}"


def describe_quantization(
    quantization: dict | None, method: str = "round to nearest", applied: dict | None = None
) -> str:
    """The settings `applied` ({(bits, mode, group size): modules}, from `applied_settings`) and the modules left
    float: what was done, which config.json's default alone does not say (a recipe may override it everywhere)."""
    if not quantization:
        return "none (float)"
    applied = applied or {(quantization["bits"], quantization["mode"], quantization["group_size"]): None}
    if len(applied) == 1:
        (bits, mode, group_size), _ = next(iter(applied.items()))
        text = f"{bits}-bit {mode}, group size {group_size} ({method})"
    else:
        parts = [f"{b}-bit {m} (g{g}) for {n} modules" for (b, m, g), n in sorted(applied.items(), key=lambda i: -i[1])]
        text = f"mixed: {', '.join(parts)} ({method})"
    floats = [k for k, v in quantization.items() if v is False]
    if floats:
        text += f"; {len(floats)} modules left float (input width not divisible by the group size, or by recipe): "
        text += ", ".join(floats)
    return text


def model_card(source: str, folder_name: str, report: dict, repo: str | None) -> str:
    hub_source = not Path(str(source)).expanduser().exists() and str(source).count("/") == 1
    front = ["---", "library_name: mlx", "tags:", "- mlx", "- mlx-encoders", f"- {report['model_type']}"]
    if hub_source:
        front.append(f"base_model: {source}")
    front.append("---")
    fid = report["fidelity"]
    perplexity_lines = []
    if "perplexity" in report:  # a causal LM's
        perplexity_lines = [f"- Perplexity on the probe texts, source -> here: {describe_perplexity(report)}"]
    return "\n".join(
        [
            *front,
            f"\n# {folder_name}\n",
            f"MLX weights of `{source}` converted with the `convert` command of mlx-encoders.\n",
            f"- Architecture: {report['model_type']} ({report['architecture']}), {report['parameters']:,} parameters",
            f"- Quantization: {describe_quantization(report['quantization'], report['method'], report['applied'])}",
            f"- Weights on disk: {report['bytes_before'] / 1e6:.1f} MB in the source, "
            f"{report['bytes_after'] / 1e6:.1f} MB here ({report['bits_per_weight']:.2f} bits per weight)",
            f"- Fidelity vs the source on {len(PROBE_TEXTS)} built-in probe texts ({report['output']}): "
            f"cosine mean {fid['cosine_mean']:.6f}, min {fid['cosine_min']:.6f}; "
            f"max abs difference {fid['max_abs_diff']:.4g}",
            *perplexity_lines,
            "\n## Use\n",
            "```python",
            "import mlx_encoders",
            "",
            f'model, tokenizer = mlx_encoders.load("{repo or folder_name}")',
            'batch = tokenizer(["Hello world"], padding=True)',
            'out = model(batch["input_ids"], attention_mask=batch["attention_mask"])',
            "```",
            "",
        ]
    )


def print_report(source: str, target: Path, report: dict) -> None:
    fid = report["fidelity"]
    ratio = report["bytes_after"] / report["bytes_before"]
    rows = [
        ("architecture", f"{report['model_type']} ({report['architecture']})"),
        ("parameters", f"{report['parameters']:,}"),
        ("quantization", describe_quantization(report["quantization"], report["method"], report["applied"])),
        (
            "size on disk",
            f"{report['bytes_before'] / 1e6:.2f} MB -> {report['bytes_after'] / 1e6:.2f} MB ({ratio:.3f}x)",
        ),
        ("bits/weight", f"{report['bits_per_weight']:.2f}"),
        (
            "fidelity",
            f"{report['output']} on {len(PROBE_TEXTS)} probe texts: cosine mean {fid['cosine_mean']:.6f}, "
            f"min {fid['cosine_min']:.6f}; max abs diff {fid['max_abs_diff']:.4g}",
        ),
        *([("perplexity", f"{describe_perplexity(report)} on the probe texts")] if "perplexity" in report else []),
        ("time", f"{report['seconds']:.1f} s"),
    ]
    print(f"Converted {source} -> {target}")
    for name, value in rows:
        print(f"  {name:<13} {value}")


def is_quantized(config: dict) -> bool:
    return bool(config.get("quantization") or config.get("quantization_config"))


def check_request(config: dict, quantize: bool, dequantize: bool, path: Path) -> None:
    if quantize and dequantize:
        raise OptionError("quantize and dequantize exclude each other; pick one")
    if dequantize and not is_quantized(config):
        raise ValueError(f"{path} is not a quantized MLX checkpoint (no `quantization` in config.json)")
    if quantize and is_quantized(config):
        raise ValueError(f"{path} is already quantized; convert it with dequantize=True first to re-quantize")


def check_inputs(source: str | Path, target: Path, spec: dict | None, recipe, dtype: str | None, dequantize: bool
                 ) -> Checkpoint:  # fmt: skip
    """Every check that needs no model, so a bad request fails fast and writes nothing; returns the source."""
    if recipe is not None:  # a recipe implies quantizing, so `spec` is set
        recipe_rule(recipe, spec)
    try:
        check_dtype(dtype)
    except ValueError as e:
        raise OptionError(f"dtype (--dtype): {e}") from None
    checkpoint = Checkpoint.open(source)
    check_request(checkpoint.config, spec is not None, dequantize, checkpoint.path)
    if target.resolve() == checkpoint.path.resolve():
        raise OptionError(f"mlx_path (--mlx-path) {target} is the source folder; choose another output folder")
    checkpoint.weight_files()  # refuses pickle-only checkpoints
    check_sentence_modules(checkpoint.path)
    return checkpoint


def check_patterns(checkpoint: Checkpoint, recipe: str | dict | None) -> None:
    """Warn of a recipe pattern that matches no module before the weights load: the model is built from config.json
    and the weights' names alone (MLX reads a tensor only when it is used, and nothing here uses one)."""
    if not isinstance(recipe, dict):
        return
    weights = normalize_keys(checkpoint.read_weights())
    if hasattr(checkpoint.module, "sanitize"):
        weights = checkpoint.module.sanitize(weights)
    try:
        model = build_model(checkpoint.module, checkpoint.config, checkpoint.task, weights)
    except ValueError:
        return  # load_model reports it, naming the file
    warn_unmatched_patterns(recipe, quantizable_paths(model))


def conversion_record(checkpoint: Checkpoint, request: dict) -> dict:
    """The source's content and every option that shapes the result, with the code versions that make it."""
    calibration = request["calibration"]
    if isinstance(calibration, list):
        request = {**request, "calibration": hashlib.sha256(json.dumps(calibration).encode()).hexdigest()}
    versions = {"mlx_encoders": __version__, "mlx": mx.__version__}
    return {"source": folder_digest(checkpoint.path), "request": request, "versions": versions}


def reusable(target: Path, record: dict) -> bool:
    """Whether `target` is an unchanged conversion made from `record`'s source and options."""
    stored = read_json(target / RECORD) if (target / RECORD).is_file() else None
    if not isinstance(stored, dict) or stored.get("output") is None:
        return False
    same = {k: v for k, v in stored.items() if k != "output"} == record
    return same and stored["output"] == folder_digest(target, exclude=(RECORD,))


def write_folder(
    model: nn.Module, config: dict, source: Path, folder: Path, report: dict, dtype: mx.Dtype | None, shard_size: int
) -> None:
    """Weights, config.json, tokenizer and sentence-transformers files; records the bytes written in `report`."""
    files = write_checkpoint(model, config, folder, shard_size)
    copy_tokenizer_files(source, folder)
    copy_sentence_files(source, folder, dtype)
    for name, adapter in adapter_folders(source).items():  # task adapters stay float: they are small
        shutil.copytree(adapter, folder / name)
    convert_torch_heads(source, folder, dtype)
    report["bytes_after"] = sum(f.stat().st_size for f in files)
    report["bits_per_weight"] = 8 * report["bytes_after"] / report["parameters"]


def convert(
    source: str | Path,
    mlx_path: str | Path | None = None,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    dtype: str | None = None,
    recipe: str | dict | None = None,
    dequantize: bool = False,
    upload_repo: str | None = None,
    force: bool = False,
    shard_size: int = MAX_SHARD_BYTES,
    calibration: list[str] | bool | None = None,
) -> Path:
    """Convert a checkpoint (local folder or hub id) into an MLX checkpoint folder; returns its path.

    `quantize` (implied by `bits` or `recipe`) quantizes every Linear and Embedding (`bits` 2-8, default 8;
    `group_size` 32/64/128, default 64 for affine, 32 at 4 bits and fewer; `mode` affine or mxfp4/mxfp8/nvfp4);
    `recipe` "mixed_4_8" keeps embeddings and heads at 8 bits and encoder layers at 4 (or a dict of module patterns
    -> bits). Below 8 bits, affine position and token-type tables get 8 bits unless a recipe pattern names them
    (`{"*": 4}` puts every module at 4 bits).
    Affine quantization uses GPTQ for Linears, calibrated on `calibration` texts (default: 128
    built-in standard-library docstrings), and a least-squares grid for embeddings; `calibration=False`
    rounds every weight to nearest instead (`mx.quantize`, faster, less faithful).
    `dtype` casts everything not quantized. `dequantize` turns a quantized MLX checkpoint back to floats.
    The folder (default `<source name>-<bits>bit`) appears only when complete; `force` replaces it, but a folder
    converted from the same source files with the same options is kept and reused as it is. Ctrl-C,
    SIGTERM and SIGHUP remove the partial folder; what a SIGKILL leaves, the next run into it removes.
    """
    start = time.perf_counter()
    if isinstance(recipe, str) and bits is not None:  # mixed_L_H sets every module's bits: `bits` would be ignored
        raise OptionError(
            f"recipe {recipe!r} and bits={bits} (--bits) conflict: the recipe sets every module's bits; drop one"
        )
    quantize = quantize or bits is not None or recipe is not None or mode != "affine"
    spec = quantization_spec(bits, group_size, mode) if quantize else None
    target = Path(mlx_path) if mlx_path is not None else default_mlx_path(source, spec, recipe, dequantize)
    remove_stale(target)  # a run killed mid-write: free its space now, and put back a target it had moved aside
    checkpoint = check_inputs(source, target, spec, recipe, dtype, dequantize)
    check_patterns(checkpoint, recipe)
    explicit = calibration is not None and calibration is not False
    if explicit and (spec is None or spec["mode"] != "affine" or not calibration):
        raise OptionError("calibration (GPTQ) needs a non-empty list of texts and affine quantization")
    request = dict(spec=spec, group_size=group_size, recipe=recipe, dtype=dtype, dequantize=dequantize,
                   calibration=calibration, shard_size=shard_size)  # fmt: skip
    record = conversion_record(checkpoint, request)
    if target.exists() and reusable(target, record):
        # the same source and options give the same files: a rerun keeps them (and what was built from them)
        print(f"{target} is already a conversion of {source} with these options; reusing it (delete it to convert "
              "again)")  # fmt: skip
        if upload_repo:
            print(f"Uploaded to {upload(target, upload_repo)}")
        return target
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists; pass force=True (--force) to replace it")
    model = load_model(checkpoint, as_stored=True)  # each tensor's dtype kept unless --dtype says otherwise
    tokenizer = source_tokenizer(model, checkpoint)
    calibration = calibration_texts(calibration, spec, tokenizer)
    hessians = input_hessians(model, tokenizer, calibration, max_length=CALIBRATION_TOKENS) if calibration else None
    batch = probe_batch(model, tokenizer)
    output, reference = main_output(model, batch)
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    if dequantize:
        dequantize_model(model, DTYPES.get(dtype))
        parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    quantization = None
    if spec is not None:
        # the asked group size, not the spec's: a recipe's other bit widths take their own default
        with warnings.catch_warnings():  # check_patterns has warned of the patterns that match nothing
            warnings.filterwarnings("ignore", message="Recipe pattern .* matches no Linear or Embedding")
            quantization = quantize_model(model, spec["bits"], group_size, spec["mode"], recipe, hessians)
    config = model_config(model)
    if quantization:  # convert's entry also names the modules it left float
        config["quantization"] = config["quantization_config"] = quantization
    report = {
        "model_type": config["model_type"],
        "architecture": type(model).__name__,
        "parameters": parameters,
        "quantization": config.get("quantization"),
        "applied": applied_settings(model),
        "method": f"GPTQ on {len(calibration)} calibration texts" if hessians else "round to nearest",
        "bytes_before": sum(f.stat().st_size for f in checkpoint.weight_files()),
        "output": output,
        "fidelity": fidelity(reference, result := main_output(model, batch)[1], batch["attention_mask"]),
    }
    if task_of_model(model) == "causal-lm":  # a decoder's fidelity: how much worse it predicts the probe texts
        report["perplexity"] = {"source": perplexity(reference, batch), "result": perplexity(result, batch)}
    with atomic_folder(target, force) as tmp:
        write_folder(model, config, checkpoint.path, tmp, report, DTYPES.get(dtype), shard_size)
        (tmp / "README.md").write_text(model_card(str(source), target.name, report, upload_repo))
        (tmp / RECORD).write_text(json.dumps({**record, "output": folder_digest(tmp)}, indent=2))
    report["seconds"] = time.perf_counter() - start
    print_report(str(source), target, report)
    if upload_repo:
        print(f"Uploaded to {upload(target, upload_repo)}")
    return target
