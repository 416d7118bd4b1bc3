"""Convert a Hugging Face encoder checkpoint into an MLX one: cast, quantize, or dequantize.

The output is the mlx-community layout that mlx-lm's `convert` writes (reference: `mlx_lm/convert.py` and
`mlx_lm/utils.py`: `quantize_model`, `save_model`, `make_shards`, `dequantize_model`): config.json gains
`quantization` (and the same `quantization_config`), each quantized module stores `<path>.weight` (uint32),
`<path>.scales` and `<path>.biases` under the model's own parameter names, and `loading.quantize_like`
reads it back. Affine quantization defaults to group size 32 with float16 scales and biases, GPTQ (Frantar
et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers"; act-order
with static groups) for the Linears, calibrated on built-in standard-library docstrings with every text
weighted alike, and a least-squares grid for the embeddings, whose position and token-type tables stay at
8 bits below that: the same file layout as round to nearest, with less error (see benchmarks/quantize.py).
"""

import fnmatch
import functools
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from .loading import DTYPES, PICKLE_SUFFIXES, load_model, read_config, resolve, weight_files
from .models import model_module

# Supported (bits, group sizes) per quantization mode, from `mx.quantize`'s table; the first is the default.
MODES = {
    "affine": {"bits": (8, 2, 3, 4, 5, 6), "group_size": (32, 64, 128)},
    "mxfp4": {"bits": (4,), "group_size": (32,)},
    "mxfp8": {"bits": (8,), "group_size": (32,)},
    "nvfp4": {"bits": (4,), "group_size": (16,)},
}
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's and transformers' default shard size
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt",
)  # fmt: skip
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
# Encoder layers (`encoder.layer.3.`, `layers.3.`, `transformer.layer.3.`, `albert_layers.0.`) vs the rest.
LAYER_PATTERN = re.compile(r"(^|\.)(layer|layers|albert_layers)\.\d+\.")
# The built-in GPTQ calibration set: standard-library docstrings from this index on (disjoint from the first
# thousands, which the benchmarks and tests evaluate on), each cut to CALIBRATION_TOKENS tokens.
CALIBRATION_START, CALIBRATION_TEXTS, CALIBRATION_TOKENS, CALIBRATION_CHARS = 4000, 256, 256, 4096
# Tables added to every token's input (position, token type): an error in them moves every token of a text
# the same way instead of averaging out. Quantized alone to 4 bits they cost all-MiniLM-L6-v2 0.0009-0.0012
# of mean embedding cosine, more than its whole word table (0.0008), while holding under 1% of its weights.
# Below 8 bits they are kept at 8 (affine only).
SHARED_TABLES = ("*position_embeddings", "*token_type_embeddings")
GRID_ITERATIONS = 8  # alternating refits of each group's scale and bias (see `affine_grid`)
GRID_ROWS = 4096  # rows fitted at once, to bound the memory of large embedding matrices
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


def quantization_spec(bits: int | None, group_size: int | None, mode: str) -> dict:
    """The checked {"group_size", "bits", "mode"} default, with the mode's defaults filled in."""
    if mode not in MODES:
        raise ValueError(f"Unknown quantization mode {mode!r}; choose one of: {', '.join(MODES)}")
    allowed = MODES[mode]
    bits = allowed["bits"][0] if bits is None else bits
    group_size = allowed["group_size"][0] if group_size is None else group_size
    if bits not in allowed["bits"]:
        raise ValueError(f"{mode} quantization supports bits {sorted(allowed['bits'])}, not {bits}")
    if group_size not in allowed["group_size"]:
        raise ValueError(f"{mode} quantization supports group sizes {sorted(allowed['group_size'])}, not {group_size}")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def shared_table(path: str, params: dict) -> dict:
    """`params`, raised to 8 bits for the position and token-type tables (see SHARED_TABLES) when lower."""
    if params["mode"] == "affine" and params["bits"] < 8 and any(fnmatch.fnmatchcase(path, p) for p in SHARED_TABLES):
        return quantization_spec(8, params["group_size"], "affine")
    return params


def recipe_rule(recipe: str | dict | None, spec: dict) -> Callable[[str], dict | bool]:
    """Module path -> quantization params (or False) for a recipe.

    `"mixed_L_H"`: encoder layers at L bits, everything else (embeddings, pooler, heads) at H bits.
    A dict maps fnmatch patterns of module paths to bits, a params dict, or False (keep float); the first
    matching pattern wins and unmatched modules get `spec`. Outside what a dict names, the position and
    token-type tables get at least 8 bits (`shared_table`).
    """
    if recipe is None:
        return lambda path: shared_table(path, spec)
    if isinstance(recipe, str):
        match = re.fullmatch(r"mixed_(\d)_(\d)", recipe)
        if not match:
            raise ValueError(f"Unknown recipe {recipe!r}; use 'mixed_L_H' (e.g. 'mixed_4_8') or a dict of patterns")
        low, high = (quantization_spec(int(b), spec["group_size"], spec["mode"]) for b in match.groups())
        return lambda path: low if LAYER_PATTERN.search(path) else shared_table(path, high)
    rules = {}
    for pattern, value in recipe.items():
        if isinstance(value, int) and not isinstance(value, bool):
            value = quantization_spec(value, spec["group_size"], spec["mode"])
        elif isinstance(value, dict):
            value = quantization_spec(value.get("bits"), value.get("group_size"), value.get("mode", spec["mode"]))
        elif value is not False:
            raise ValueError(f"Recipe entry {pattern!r}: expected bits, a params dict or false, got {value!r}")
        rules[pattern] = value
    return lambda path: next((v for p, v in rules.items() if fnmatch.fnmatchcase(path, p)), shared_table(path, spec))


def recipe_default(recipe: str | dict | None, spec: dict) -> dict:
    """The config.json default for a recipe: the encoder layers' setting, as most weights use it."""
    if isinstance(recipe, str):
        return quantization_spec(int(recipe.split("_")[1]), spec["group_size"], spec["mode"])
    return spec


def quantize_model(
    model: nn.Module,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    recipe: str | dict | None = None,
    hessians: dict[str, np.ndarray] | None = None,
) -> dict:
    """Quantize every nn.Linear and nn.Embedding in place; returns config.json's `quantization` entry.

    A module whose input width does not divide its group size stays float and is recorded as `false`;
    modules whose setting differs from the default get a per-module entry, as mlx-lm writes them.
    Affine scales and biases are stored in float16 (bfloat16 models keep bfloat16). Without `hessians`
    weights are rounded to nearest (`mx.quantize`); with them (from `input_hessians`) affine Linears are
    rounded with GPTQ and every other affine module gets the least-squares grid of `affine_grid`.
    """
    floats = {
        p: np.array(m.weight.astype(mx.float32))
        for p, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and hessians is not None
    }
    spec = quantization_spec(bits, group_size, mode)
    rule = recipe_rule(recipe, spec)
    default = recipe_default(recipe, spec)
    config = dict(default)

    def predicate(path: str, module: nn.Module) -> dict | bool:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        params = rule(path)
        if params is False or module.weight.shape[-1] % params["group_size"]:
            config[path] = False
            return False
        if params != default:
            config[path] = dict(params)
        return dict(params)

    nn.quantize(model, class_predicate=predicate)
    set_scale_dtype(model)
    if hessians is not None:
        apply_gptq(model, hessians, floats)
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    for module in tqdm(quantized, desc="quantizing", unit="module", leave=False):
        mx.eval(module.parameters())  # quantization is lazy: evaluate module by module to show progress
    return config


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: each row's codes as a little-endian bit stream, read as uint32 words."""
    rows, width = codes.shape
    stream = (codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(stream.reshape(rows, width * bits).astype(np.uint8), axis=-1, bitorder="little").view(np.uint32)


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Affine scales/biases: float16 halves their cost vs float32 (the fits round them to float16, so
    codes match the stored values); bfloat16 models keep bfloat16."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def set_scale_dtype(model: nn.Module) -> None:
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and module.mode == "affine":
            module.scales = module.scales.astype(scale_dtype(module.scales.dtype))
            module.biases = module.biases.astype(scale_dtype(module.biases.dtype))


def stored(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`x` as it reads back after storing in `dtype` (float16 scales must be fitted as stored)."""
    return x.astype(dtype).astype(np.float64)


def affine_grid(
    weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases per group minimising the (column-`importance` weighted) squared error.

    Starts from the min-max grid and alternates rounding with the least-squares refit of scale and bias
    for the codes (no snapping of 0 onto the grid, unlike `mx.quantize`), keeping each group's best fit.
    Scales and biases are rounded to `dtype` before use, so the codes fit the stored values.
    """
    w = weight.astype(np.float64).reshape(weight.shape[0], -1, group_size)
    imp = np.ones_like(w) if importance is None else np.broadcast_to(importance.reshape(1, -1, group_size), w.shape)
    levels = 2**bits - 1
    low = w.min(-1, keepdims=True)
    scale, bias = np.maximum((w.max(-1, keepdims=True) - low) / levels, 1e-7), low
    n, best = imp.sum(-1, keepdims=True), None
    for _ in range(GRID_ITERATIONS):
        scale, bias = stored(np.maximum(scale, 1e-7), dtype), stored(bias, dtype)
        codes = np.clip(np.round((w - bias) / scale), 0, levels)
        error = (imp * (codes * scale + bias - w) ** 2).sum(-1, keepdims=True)
        if best is None:
            best = [error, codes, scale, bias]
        else:
            better = error < best[0]
            best = [np.where(better, new, old) for new, old in zip((error, codes, scale, bias), best, strict=True)]
        sq, sqq = (imp * codes).sum(-1, keepdims=True), (imp * codes * codes).sum(-1, keepdims=True)
        sx, sqx = (imp * w).sum(-1, keepdims=True), (imp * codes * w).sum(-1, keepdims=True)
        det = n * sqq - sq * sq
        ok = det > 1e-12 * np.maximum(n * sqq, 1e-30)
        safe = np.where(ok, det, 1.0)
        scale = np.where(ok, (n * sqx - sq * sx) / safe, scale)
        bias = np.where(ok, (sqq * sx - sq * sqx) / safe, bias)
    _, codes, scale, bias = best
    return codes.reshape(weight.shape).astype(np.int64), scale[..., 0], bias[..., 0]


def fit_grid(weight: np.ndarray, bits: int, group_size: int, dtype: np.dtype) -> tuple:
    """`affine_grid` row block by row block (large embeddings), packed: (weight, scales, biases)."""
    parts = [affine_grid(weight[i : i + GRID_ROWS], bits, group_size, dtype) for i in range(0, len(weight), GRID_ROWS)]
    codes, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    return pack(codes, bits), scales.astype(dtype), biases.astype(dtype)


def gptq(
    weight: np.ndarray,
    hessian: np.ndarray,
    bits: int,
    group_size: int,
    dtype=np.float16,
    damp: float = 0.01,
    act_order: bool = True,
) -> tuple:
    """GPTQ (Frantar et al. 2022, Algorithm 1) with act-order and static groups, into MLX affine triplets.

    Each group's grid is first fitted to the float weights (`affine_grid`, weighted by the Hessian's
    diagonal): MLX groups are runs of adjacent columns, so the grid cannot follow the column order. The
    columns are then rounded in order of decreasing Hessian diagonal (the inputs that carry the most
    energy first, "act-order"), each rounding error pushed onto the columns not yet rounded through the
    inverse Hessian of the layer's inputs, so the layer's outputs on calibration data move less than with
    plain rounding (`act_order=False` rounds left to right). At the end `refit_grid` re-solves every scale
    and bias for the chosen codes. Returns (packed uint32 weight, scales, biases).
    """
    levels = 2**bits - 1
    h = hessian.astype(np.float64) + damp * np.mean(np.diag(hessian)) * np.eye(len(hessian))
    _, steps, lows = affine_grid(weight, bits, group_size, dtype, np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h[order][:, order])).T  # upper Cholesky factor of H^-1, permuted
    w = weight.astype(np.float64)[:, order]
    codes = np.zeros(w.shape, np.int64)
    for i, column in enumerate(order):
        step, low = steps[:, column // group_size], lows[:, column // group_size]
        codes[:, column] = np.clip(np.round((w[:, i] - low) / step), 0, levels)
        error = (w[:, i] - (codes[:, column] * step + low)) / u[i, i]
        w[:, i + 1 :] -= np.outer(error, u[i, i + 1 :])
    scales, biases = refit_grid(weight, h, codes, steps, lows, dtype)
    return pack(codes, bits), scales.astype(dtype), biases.astype(dtype)


def output_error(weight: np.ndarray, hessian: np.ndarray, codes: np.ndarray, scales, biases) -> np.ndarray:
    """Per output row, the squared output error on calibration data: (W' - W) H (W' - W)^T."""
    rows, width = codes.shape
    restored = codes.reshape(rows, scales.shape[1], -1) * scales[..., None] + biases[..., None]
    delta = restored.reshape(rows, width) - weight
    return np.einsum("ij,jk,ik->i", delta, hessian, delta)


def refit_grid(
    weight: np.ndarray, hessian: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Every group's scale and bias of a row solved jointly for the row's codes, minimising `output_error`.

    For fixed codes the restored row is linear in its 2G scales and biases, so the optimum is one small
    linear system per row; rows where it does not lower the error (after rounding to `dtype`) keep theirs.
    """
    w = weight.astype(np.float64)
    rows, width = codes.shape
    groups = scales.shape[1]
    q = codes.reshape(rows, groups, -1).astype(np.float64)
    h4 = hessian.reshape(groups, width // groups, groups, width // groups)
    hw = (w @ hessian).reshape(rows, groups, -1)
    qhq = np.einsum("rgj,gjhk,rhk->rgh", q, h4, q, optimize=True)
    qh1 = np.einsum("rgj,gjhk->rgh", q, h4, optimize=True)
    system = np.empty((rows, 2 * groups, 2 * groups))
    system[:, :groups, :groups], system[:, :groups, groups:] = qhq, qh1
    system[:, groups:, :groups], system[:, groups:, groups:] = qh1.transpose(0, 2, 1), h4.sum((1, 3))
    system += 1e-9 * np.trace(hessian) / width * np.eye(2 * groups)
    rhs = np.concatenate([(q * hw).sum(-1), hw.sum(-1)], 1)
    solution = np.linalg.solve(system, rhs[..., None])[..., 0]
    new_scales, new_biases = stored(solution[:, :groups], dtype), stored(solution[:, groups:], dtype)
    new_scales = np.where(np.isfinite(new_scales), new_scales, scales)
    new_biases = np.where(np.isfinite(new_biases), new_biases, biases)
    better = output_error(w, hessian, codes, new_scales, new_biases) < output_error(w, hessian, codes, scales, biases)
    return np.where(better[:, None], new_scales, scales), np.where(better[:, None], new_biases, biases)


class InputRecorder(nn.Module):
    """Wraps a Linear and accumulates X^T W X of its inputs (the GPTQ Hessian, up to a factor).

    `weights["sqrt"]` holds the square roots of the current batch's (B, L) token weights: 0 on padding,
    1/length on a text's tokens, so every calibration text counts the same whatever its length (sentence
    embeddings average a text's tokens; without this, long texts would outweigh short ones). Inputs of
    shape (B, D), such as a pooler's, weigh each text once.
    """

    def __init__(self, linear: nn.Linear, hessians: dict, path: str, weights: dict):
        super().__init__()
        self.linear = linear
        self._hessians, self._path, self._weights = hessians, path, weights

    def __call__(self, x: mx.array) -> mx.array:
        flat = x.astype(mx.float32)
        if flat.ndim == 3:
            flat = flat * self._weights["sqrt"][..., None]
        flat = flat.reshape(-1, x.shape[-1])
        self._hessians[self._path] = self._hessians.get(self._path, 0) + flat.T @ flat
        mx.eval(self._hessians[self._path])
        return self.linear(x)


def input_hessians(
    model: nn.Module, texts: list[str], batch_size: int = 16, max_length: int | None = None
) -> dict[str, np.ndarray]:
    """Input Hessians of every Linear on calibration texts (sorted by length so batches pad little)."""
    from . import load_tokenizer

    tokenizer, hessians, weights = load_tokenizer(model), {}, {}
    limits = [n for n in (max_length, tokenizer.model_max_length, getattr(model.args, "max_tokens", None)) if n]
    max_length = min(limits) if limits else None  # never past the position table
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    model.update_modules(tree_unflatten([(p, InputRecorder(m, hessians, p, weights)) for p, m in linears]))
    try:
        texts = sorted(texts, key=len)
        for i in tqdm(range(0, len(texts), batch_size), desc="calibrating", unit="batch", leave=False):
            batch = tokenizer(texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length)
            mask = mx.array(batch["attention_mask"]).astype(mx.float32)
            weights["sqrt"] = mx.sqrt(mask / mx.maximum(mask.sum(axis=1, keepdims=True), 1))  # once per batch
            model(
                batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch.get("token_type_ids")
            )
    finally:
        model.update_modules(tree_unflatten(linears))
    return {path: np.array(h) for path, h in hessians.items()}


def apply_gptq(model: nn.Module, hessians: dict[str, np.ndarray], floats: dict[str, np.ndarray]) -> None:
    """Re-fit each affine quantized module from its float weight, same layout: GPTQ for Linears with a
    Hessian, the least-squares grid (`affine_grid`) for the rest (embeddings, modules calibration missed)."""
    modules = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine" and path in floats
    ]
    for path, module in tqdm(modules, desc="GPTQ", unit="module", leave=False):
        dtype = module.scales.dtype
        np_dtype = np.float16 if dtype == mx.float16 else np.float32  # bfloat16 is fitted as float32
        if isinstance(module, nn.QuantizedLinear) and path in hessians:
            packed, scales, biases = gptq(floats[path], hessians[path], module.bits, module.group_size, np_dtype)
        else:
            packed, scales, biases = fit_grid(floats[path], module.bits, module.group_size, np_dtype)
        module.weight, module.scales = mx.array(packed), mx.array(scales).astype(dtype)
        module.biases = mx.array(biases).astype(dtype)


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The float dtype of the parameters that are not quantization scales (float32 if there are none)."""
    dtypes = [
        v.dtype
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))
    ]
    return max(set(dtypes), key=dtypes.count) if dtypes else mx.float32


@functools.cache
def builtin_calibration() -> tuple[str, ...]:
    """The default GPTQ calibration texts: CALIBRATION_TEXTS standard-library docstrings (see the constants)."""
    from .corpus import stdlib_docstrings

    texts = stdlib_docstrings(CALIBRATION_START + CALIBRATION_TEXTS, max_chars=CALIBRATION_CHARS)
    return tuple(texts[CALIBRATION_START:] or texts[-CALIBRATION_TEXTS:])


def calibration_texts(calibration: list[str] | bool | None, spec: dict | None, model: nn.Module) -> list[str]:
    """The texts to calibrate GPTQ on, or [] for rounding to nearest.

    `None` means the built-in set for affine quantization of a checkpoint with a tokenizer; `False` rounds.
    """
    from . import load_tokenizer

    if calibration is False or calibration is None and (spec is None or spec["mode"] != "affine"):
        return []
    if calibration is None:
        try:
            load_tokenizer(model)
        except FileNotFoundError:
            return []  # nothing to turn texts into ids: round to nearest
        return list(builtin_calibration())
    return list(calibration)


def dequantize_model(model: nn.Module, dtype: mx.Dtype | None = None) -> int:
    """Replace every quantized module with its float equivalent in place; returns how many were replaced."""
    replaced, float_dtype = [], model_dtype(model)
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        target = dtype or float_dtype
        # affine: widen float16 scales first, so scale * q + bias is computed (and exact) in the target dtype
        scales, biases = module.scales, module.get("biases")
        if module.mode == "affine":
            scales, biases = scales.astype(target), biases.astype(target)
        weight = mx.dequantize(module.weight, scales, biases, module.group_size, module.bits, mode=module.mode)
        weight = weight.astype(target)
        if isinstance(module, nn.QuantizedEmbedding):
            float_module = nn.Embedding(*weight.shape)
        else:
            float_module = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                float_module.bias = module.bias
        float_module.weight = weight
        replaced.append((path, float_module))
    model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    return len(replaced)


def make_shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    shards, shard, size = [], {}, 0
    for key, value in weights.items():
        if shard and size + value.nbytes > max_bytes:
            shards.append(shard)
            shard, size = {}, 0
        shard[key] = value
        size += value.nbytes
    return [*shards, shard]


def save_weights(model: nn.Module, folder: Path, shard_size: int = MAX_SHARD_BYTES) -> list[Path]:
    """`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards with their index past `shard_size`."""
    weights = dict(tree_flatten(model.parameters()))
    shards = make_shards(weights, shard_size)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in tqdm(list(zip(names, shards, strict=True)), desc="writing", unit="file", leave=False):
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
            "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in sorted(shard)},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [folder / name for name in names]


def save_checkpoint(model: nn.Module, config: dict, folder: Path, shard_size: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write the model's weights under its own parameter names, and `config`, into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = save_weights(model, folder, shard_size)
    (folder / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return files


def copy_tokenizer(source: Path, folder: Path) -> list[str]:
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()] + sorted(p.name for p in source.glob("*.model"))
    for name in names:
        shutil.copy2(source / name, folder / name)
    return names


def sentence_modules(source: Path) -> list[Path]:
    """Folders of the sentence-transformers modules (1_Pooling, 2_Dense, ...) listed in modules.json."""
    file = source / "modules.json"
    if not file.is_file():
        return []
    return [source / m["path"] for m in json.loads(file.read_text()) if m.get("path") and (source / m["path"]).is_dir()]


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
                weights = mx.load(str(file))
                if dtype is not None:
                    weights = {
                        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
                    }
                mx.save_safetensors(str(target / file.name), weights, metadata={"format": "pt"})
            elif file.is_file() and file.suffix not in PICKLE_SUFFIXES:
                shutil.copy2(file, target / file.name)
        names.append(module.name + "/")
    return names


def probe_batch(model: nn.Module) -> dict[str, mx.array]:
    """The built-in probe texts through the checkpoint's tokenizer (seeded ids when it has none)."""
    from . import load_tokenizer

    try:
        return load_tokenizer(model)(PROBE_TEXTS, padding=True, truncation=True)
    except FileNotFoundError:
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


def default_mlx_path(source: str | Path, spec: dict | None, recipe: str | dict | None, dequantize: bool) -> Path:
    name = Path(str(source)).name
    if dequantize:
        return Path(f"{name}-dequantized")
    if spec is None:
        return Path(f"{name}-mlx")
    if isinstance(recipe, str):
        return Path(f"{name}-{recipe}")
    return Path(f"{name}-{spec['bits']}bit" if spec["mode"] == "affine" else f"{name}-{spec['mode']}")


@contextmanager
def atomic_folder(target: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside `target`, renamed into place only if the block completes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not force:
                raise FileExistsError(f"{target} appeared during the conversion; pass force=True to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            target.rename(old / target.name)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def upload(folder: Path, repo: str) -> str:
    """Publish `folder` as the model repo `repo` (needs a write token: `hf auth login` or HF_TOKEN)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id=repo, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model")
    return f"https://huggingface.co/{repo}"


def describe_quantization(quantization: dict | None, method: str = "round to nearest") -> str:
    if not quantization:
        return "none (float)"
    spec = {k: quantization[k] for k in ("bits", "group_size", "mode")}
    overrides = {k: v for k, v in quantization.items() if isinstance(v, dict)}
    floats = [k for k, v in quantization.items() if v is False]
    text = f"{spec['bits']}-bit {spec['mode']}, group size {spec['group_size']} ({method})"
    if overrides:
        by_bits = {}
        for path, v in overrides.items():
            by_bits.setdefault(f"{v['bits']}-bit {v['mode']} g{v['group_size']}", []).append(path)
        text += "; " + "; ".join(f"{len(p)} modules at {k}" for k, p in by_bits.items())
    if floats:
        text += f"; left float (input width not divisible by the group size, or by recipe): {', '.join(floats)}"
    return text


def model_card(source: str, folder_name: str, report: dict, repo: str | None) -> str:
    hub_source = not Path(str(source)).expanduser().exists() and str(source).count("/") == 1
    front = ["---", "library_name: mlx", "tags:", "- mlx", "- mlx-encoders", f"- {report['model_type']}"]
    if hub_source:
        front.append(f"base_model: {source}")
    front.append("---")
    fid = report["fidelity"]
    return "\n".join(
        [
            *front,
            f"\n# {folder_name}\n",
            f"MLX weights of `{source}` converted with the `convert` command of mlx-encoders.\n",
            f"- Architecture: {report['model_type']} ({report['architecture']}), {report['parameters']:,} parameters",
            f"- Quantization: {describe_quantization(report['quantization'], report['method'])}",
            f"- Weights on disk: {report['bytes_before'] / 1e6:.1f} MB in the source, "
            f"{report['bytes_after'] / 1e6:.1f} MB here ({report['bits_per_weight']:.2f} bits per weight)",
            f"- Fidelity vs the source on {len(PROBE_TEXTS)} built-in probe texts ({report['output']}): "
            f"cosine mean {fid['cosine_mean']:.6f}, min {fid['cosine_min']:.6f}; "
            f"max abs difference {fid['max_abs_diff']:.4g}",
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
        ("quantization", describe_quantization(report["quantization"], report["method"])),
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
        ("time", f"{report['seconds']:.1f} s"),
    ]
    print(f"Converted {source} -> {target}")
    for name, value in rows:
        print(f"  {name:<13} {value}")


def check_target(target: Path, force: bool) -> None:
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists; pass force=True (--force) to replace it")


def is_quantized(config: dict) -> bool:
    return bool(config.get("quantization") or config.get("quantization_config"))


def check_request(config: dict, quantize: bool, dequantize: bool, path: Path) -> None:
    if quantize and dequantize:
        raise ValueError("quantize and dequantize exclude each other; pick one")
    if dequantize and not is_quantized(config):
        raise ValueError(f"{path} is not a quantized MLX checkpoint (no `quantization` in config.json)")
    if quantize and is_quantized(config):
        raise ValueError(f"{path} is already quantized; convert it with dequantize=True first to re-quantize")


def check_inputs(
    source: str | Path, target: Path, spec: dict | None, recipe, dtype: str | None, dequantize: bool, force: bool
) -> Path:
    """Every check that needs no model, so a bad request fails fast and writes nothing; returns the source folder."""
    if recipe is not None:  # a recipe implies quantizing, so `spec` is set
        recipe_rule(recipe, spec)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    check_target(target, force)
    path = resolve(source)
    config = read_config(path)
    model_module(config.get("model_type", "<missing>"))
    check_request(config, spec is not None, dequantize, path)
    if target.resolve() == path.resolve():
        raise ValueError(f"mlx_path {target} is the source folder; choose another output folder")
    weight_files(path)  # refuses pickle-only checkpoints
    check_sentence_modules(path)
    return path


def write_folder(
    model: nn.Module, config: dict, source: Path, folder: Path, report: dict, dtype: mx.Dtype | None, shard_size: int
) -> None:
    """Weights, config.json, tokenizer and sentence-transformers files; records the bytes written in `report`."""
    files = save_checkpoint(model, config, folder, shard_size)
    copy_tokenizer(source, folder)
    copy_sentence_files(source, folder, dtype)
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

    `quantize` (implied by `bits` or `recipe`) quantizes every Linear and Embedding (`bits` 2-8, default
    8; `group_size` 32/64/128, default 32 for affine; `mode` affine or mxfp4/mxfp8/nvfp4); `recipe`
    "mixed_4_8" keeps embeddings and heads at 8 bits and encoder layers at 4 (or a dict of module patterns
    -> bits). Below 8 bits, affine position and token-type tables get 8 bits unless a recipe pattern
    names them (`{"*": 4}` puts every module at 4 bits).
    Affine quantization uses GPTQ for Linears, calibrated on `calibration` texts (default: 256
    built-in standard-library docstrings), and a least-squares grid for embeddings; `calibration=False`
    rounds every weight to nearest instead (`mx.quantize`, faster, less faithful).
    `dtype` casts everything not quantized. `dequantize` turns a quantized MLX checkpoint back to floats.
    The folder (default `<source name>-<bits>bit`) appears only when complete; `force` replaces it.
    """
    start = time.perf_counter()
    quantize = quantize or bits is not None or recipe is not None or mode != "affine"
    spec = quantization_spec(bits, group_size, mode) if quantize else None
    target = Path(mlx_path) if mlx_path is not None else default_mlx_path(source, spec, recipe, dequantize)
    path = check_inputs(source, target, spec, recipe, dtype, dequantize, force)
    explicit = calibration is not None and calibration is not False
    if explicit and (spec is None or spec["mode"] != "affine" or not calibration):
        raise ValueError("calibration (GPTQ) needs a non-empty list of texts and affine quantization")
    model = load_model(path)
    calibration = calibration_texts(calibration, spec, model)
    hessians = input_hessians(model, calibration, max_length=CALIBRATION_TOKENS) if calibration else None
    batch = probe_batch(model)
    output, reference = main_output(model, batch)
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    config = json.loads(json.dumps(dict(model.config)))  # a plain, deep copy to edit
    if dequantize:
        dequantize_model(model, DTYPES.get(dtype))
        parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
        config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config})
    if spec is not None:
        config["quantization"] = quantize_model(model, spec["bits"], spec["group_size"], spec["mode"], recipe, hessians)
        config["quantization_config"] = config["quantization"]
    report = {
        "model_type": config["model_type"],
        "architecture": type(model).__name__,
        "parameters": parameters,
        "quantization": config.get("quantization"),
        "method": f"GPTQ on {len(calibration)} calibration texts" if hessians else "round to nearest",
        "bytes_before": sum(f.stat().st_size for f in weight_files(path)),
        "output": output,
        "fidelity": fidelity(reference, main_output(model, batch)[1], batch["attention_mask"]),
    }
    with atomic_folder(target, force) as tmp:
        write_folder(model, config, path, tmp, report, DTYPES.get(dtype), shard_size)
        (tmp / "README.md").write_text(model_card(str(source), target.name, report, upload_repo))
    report["seconds"] = time.perf_counter() - start
    print_report(str(source), target, report)
    if upload_repo:
        print(f"Uploaded to {upload(target, upload_repo)}")
    return target
