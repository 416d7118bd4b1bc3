"""Convert a Hugging Face encoder checkpoint into an MLX one: cast, quantize, or dequantize.

The command of mlx-lm's `convert` (reference: `mlx_lm/convert.py`; `save_model` and `make_shards` in
`mlx_lm/utils.py`): it checks the request before loading anything, quantizes or dequantizes through
`mlx_encoders.quantization`, measures the result against the source on built-in probe texts, and writes the
mlx-community layout (weights under the model's own parameter names, config.json with `quantization` and
the same `quantization_config`, tokenizer and sentence-transformers files, a model card) into a folder that
appears only when complete, then optionally uploads it to the hub.
Foreign files are read by `checkpoint/foreign.py`, fidelity measured by `quantization/fidelity.py`, the report,
card and upload are `card.py`'s.
"""

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import __version__
from ..checkpoint import (
    DTYPES,
    MAX_SHARD_BYTES,
    Checkpoint,
    atomic_folder,
    folder_digest,
    load_model,
    model_config,
    read_json,
    write_checkpoint,
)
from ..checkpoint.adapters import adapter_folders
from ..checkpoint.atomic import check_target, remove_stale
from ..checkpoint.build import build_model, check_dtype, normalize_keys
from ..checkpoint.files import GENERATION_FILE
from ..checkpoint.foreign import check_sentence_modules, convert_torch_heads, copy_sentence_files
from ..checkpoint.write import copy_tokenizer_files
from ..models import task_of_model
from ..quantization import (
    CALIBRATION_TOKENS,
    OptionError,
    applied_settings,
    calibration_texts,
    dequantize_model,
    input_hessians,
    quantizable_paths,
    quantization_plan,
    quantization_spec,
    quantize_model,
    recipe_rule,
    warn_unmatched_patterns,
)
from ..quantization.fidelity import fidelity, main_output, perplexity, probe_batch
from ..tokenizer import Tokenizer
from .card import model_card, print_report, upload

RECORD = "conversion.json"  # what a folder was converted from and how, to reuse it for the same request


def source_tokenizer(model: nn.Module, checkpoint: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    from .. import load_tokenizer

    try:
        return load_tokenizer(model, checkpoint)
    except FileNotFoundError:
        return None


def check_finite(source, reference: mx.array, measured: dict[str, float], dtype: str | None, spec) -> None:
    """A conversion whose outputs on the probe texts are not finite is refused before anything is written."""
    if all(math.isfinite(v) for v in measured.values()):
        return
    if not mx.all(mx.isfinite(reference)).item():
        why = "the source model's own outputs are not finite: check its weights"
    elif dtype in ("float16", "fp16"):
        why = "its values overflow float16 (which holds up to 65504): keep float32, or convert with --dtype bfloat16"
    elif spec is not None:
        why = "the quantized weights give them: try more bits or a smaller group size"
    else:
        why = f"the cast to {dtype} gives them: keep float32"
    raise ValueError(f"Converting {source} gives non-finite outputs (NaN or infinity) on the probe texts; {why}. "
                     "Nothing was written.")  # fmt: skip


def default_mlx_path(source: str | Path, spec: dict | None, recipe: str | dict | None, dequantize: bool) -> Path:
    """`<name>-<bits>bit` (or -<recipe>, -<mode>, -mlx for a cast alone, -dequantized) in the working folder,
    named after the source folder (a local path resolved: `.` names the folder it is), or beside the source when
    the working folder is inside it."""
    local = Path(str(source))
    folder = local.resolve() if local.exists() else None
    name = local.name if local.name not in ("", "..") or folder is None else folder.name
    target = suffixed(name, spec, recipe, dequantize)
    if folder is not None and Path.cwd().resolve().is_relative_to(folder):  # never a folder inside the model's
        return folder.parent / target
    return target


def suffixed(name: str, spec: dict | None, recipe: str | dict | None, dequantize: bool) -> Path:
    if dequantize:
        return Path(f"{name}-dequantized")
    if spec is None:
        return Path(f"{name}-mlx")
    if isinstance(recipe, str):
        return Path(f"{name}-{recipe}")
    return Path(f"{name}-{spec['bits']}bit" if spec["mode"] == "affine" else f"{name}-{spec['mode']}")


def is_quantized(config: dict) -> bool:
    return bool(config.get("quantization") or config.get("quantization_config"))


def source_name(source: str | Path, checkpoint: Checkpoint) -> str:
    """The source as the card and the report name it: as given, but a local "." or ".." by its folder's name."""
    return checkpoint.path.resolve().name if Path(source).name in ("", ".", "..") else str(source)


def check_request(config: dict, quantize: bool, dequantize: bool, path: Path) -> None:
    if quantize and dequantize:
        raise OptionError(
            "quantize (asked for, or implied by bits, group_size, recipe or mode) and dequantize exclude each other; "
            "pick one"
        )
    if dequantize and not is_quantized(config):
        raise ValueError(f"{path} is not a quantized MLX checkpoint (no `quantization` in config.json)")
    if quantize and is_quantized(config):
        raise ValueError(f"{path} is already quantized; convert it with dequantize=True first to re-quantize")
    if is_quantized(config) and not dequantize:  # a cast alone would misreport its packed weights and drop entries
        raise ValueError(
            f"{path} is already quantized: convert it with dequantize=True (--dequantize) to get floats, or convert "
            "its float source with the options you want"
        )


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
    if checkpoint.path.resolve() in target.resolve().parents:  # it would become one of the source's files
        raise OptionError(f"mlx_path (--mlx-path) {target} is inside the source folder; choose a folder outside it")
    if target.resolve() in checkpoint.path.resolve().parents:  # replacing the output (--force) would delete it
        raise OptionError(f"mlx_path (--mlx-path) {target} holds the source folder; choose a folder outside it")
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
    # task adapters stay float (they are small): the source's adapter folders copied as they are, else the ones
    # loaded from its weights (jina-embeddings-v3's own layout keeps them inside model.safetensors) written as PEFT's
    copied = adapter_folders(source)
    files = write_checkpoint(model, config, folder, shard_size, adapters=not copied)
    copy_tokenizer_files(source, folder)
    if (source / GENERATION_FILE).is_file():
        shutil.copy2(source / GENERATION_FILE, folder / GENERATION_FILE)
    copy_sentence_files(source, folder, dtype)
    for name, adapter in copied.items():
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
    mode: str | None = None,
    dtype: str | None = None,
    recipe: str | dict | None = None,
    dequantize: bool = False,
    upload_repo: str | None = None,
    force: bool = False,
    shard_size: int = MAX_SHARD_BYTES,
    calibration: list[str] | bool | None = None,
) -> Path:
    """Convert a checkpoint (local folder or hub id) into an MLX checkpoint folder; returns its path.

    `quantize` (implied by `bits`, `group_size`, `recipe` or `mode`) quantizes every Linear and Embedding
    (`bits` 2-8, default 8; `group_size` 32/64/128, default 64 for affine, 32 at 4 bits and fewer; `mode`
    affine or mxfp4/mxfp8/nvfp4); `recipe` "mixed_4_8" keeps embeddings and heads at 8 bits and encoder layers
    at 4 (or a dict of module patterns -> bits). Below 8 bits, affine position and token-type tables get 8 bits
    unless a recipe pattern names them (`{"*": 4}` puts every module at 4 bits).
    Affine quantization uses GPTQ for Linears, calibrated on `calibration` texts (default: 128
    built-in standard-library docstrings), and a least-squares grid for embeddings; `calibration=False`
    rounds every weight to nearest instead (`mx.quantize`, faster, less faithful).
    `dtype` casts everything not quantized. `dequantize` turns a quantized MLX checkpoint back to floats.
    The folder (default `<source name>-<bits>bit`, or as `default_mlx_path` names it) appears only when complete;
    `force` replaces it, but a folder converted from the same source files with the same options is kept and
    reused as it is. Ctrl-C, SIGTERM and SIGHUP remove the partial folder; what a SIGKILL leaves, the next run
    into it removes.
    """
    start = time.perf_counter()
    if isinstance(recipe, str) and bits is not None:  # mixed_L_H sets every module's bits: `bits` would be ignored
        raise OptionError(
            f"recipe {recipe!r} and bits={bits} (--bits) conflict: the recipe sets every module's bits; drop one"
        )
    quantize = quantize or bits is not None or group_size is not None or recipe is not None or mode is not None
    spec = quantization_spec(bits, group_size, mode or "affine") if quantize else None
    target = Path(mlx_path) if mlx_path is not None else default_mlx_path(source, spec, recipe, dequantize)
    remove_stale(target)  # a run killed mid-write: free its space now, and put back a target it had moved aside
    checkpoint = check_inputs(source, target, spec, recipe, dtype, dequantize)
    check_patterns(checkpoint, recipe)
    explicit = calibration is not None and calibration is not False
    if explicit and not isinstance(calibration, (str, bytes, Path, bool, dict)) and hasattr(calibration, "__iter__"):
        calibration = [t.item() if hasattr(t, "item") else t for t in calibration]  # a tuple, generator, column
    if explicit and (not isinstance(calibration, list) or not all(isinstance(t, str) for t in calibration)):
        raise OptionError(
            f"calibration takes a list of texts, got {type(calibration).__name__}: {calibration!r:.60} (a file's "
            "lines: Path(file).read_text().splitlines(), as the command's --calibration FILE reads them)"
        )
    if explicit and (spec is None or spec["mode"] != "affine" or not calibration):
        raise OptionError("calibration (GPTQ) needs a non-empty list of texts and affine quantization")
    if calibration is False and spec is None:
        raise OptionError(
            "calibration=False (--no-calibration) rounds the quantized weights to nearest, and this conversion "
            "quantizes nothing: add quantize=True (-q, or --bits), or leave it out"
        )
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
    check_target(target, force, option="force=True (--force)")  # before the model loads
    model = load_model(checkpoint, as_stored=True)  # each tensor's dtype kept unless --dtype says otherwise
    tokenizer = source_tokenizer(model, checkpoint)
    if explicit and tokenizer is None:
        raise OptionError(
            f"calibration (--calibration) tokenizes its texts, and {checkpoint.path} has no tokenizer.json: add the "
            "source's tokenizer files, or quantize without calibration (--no-calibration)"
        )
    if spec is not None and not dequantize:  # a group size that fits nothing is refused before calibrating
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recipe pattern .* matches no Linear or Embedding")
            quantization_plan(model, spec["bits"], group_size, spec["mode"], recipe)
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
    applied = applied_settings(model)
    method = f"GPTQ on {len(calibration)} calibration texts" if hessians else "round to nearest"
    rounded = sorted({mode for _, mode, _ in applied if mode != "affine"})
    if hessians and rounded:  # GPTQ fits affine modules alone
        method = f"GPTQ on {len(calibration)} calibration texts for affine; {', '.join(rounded)} rounded to nearest"
    report = {
        "model_type": config["model_type"],
        "architecture": type(model).__name__,
        "parameters": parameters,
        "quantization": config.get("quantization"),
        "applied": applied,
        "method": method,
        "bytes_before": sum(f.stat().st_size for f in checkpoint.weight_files()),
        "output": output,
        "fidelity": fidelity(reference, result := main_output(model, batch)[1], batch["attention_mask"]),
    }
    if task_of_model(model) == "causal-lm":  # a decoder's fidelity: how much worse it predicts the probe texts
        report["perplexity"] = {"source": perplexity(reference, batch), "result": perplexity(result, batch)}
    check_finite(source, reference, report["fidelity"], dtype, spec)
    with atomic_folder(target, force, option="force=True (--force)") as tmp:
        write_folder(model, config, checkpoint.path, tmp, report, DTYPES.get(dtype), shard_size)
        name = Path(os.path.abspath(target)).name  # "." or ".." names no folder
        card = model_card(source_name(source, checkpoint), name, report, upload_repo, tokenizer is not None)
        (tmp / "README.md").write_text(card)
        (tmp / RECORD).write_text(json.dumps({**record, "output": folder_digest(tmp)}, indent=2))
    report["seconds"] = time.perf_counter() - start
    print_report(source_name(source, checkpoint), target, report)
    if upload_repo:
        print(f"Uploaded to {upload(target, upload_repo)}")
    return target
