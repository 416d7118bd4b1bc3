"""Quantize and dequantize a model in place, as mlx-lm's `quantize_model` and `dequantize_model` do
(`mlx_lm/utils.py`): `nn.quantize` with a per-module predicate, returning config.json's `quantization` entry;
given input Hessians, the affine modules are then re-fitted (GPTQ, least-squares grid) by `rounding`.
"""

import warnings
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..checkpoint.build import common_float_dtype
from ..models.base import QuantizedDecoder, TiedDecoder
from ..models.layers import Embedding, Linear
from .recipes import OptionError, quantization_spec, recipe_default, recipe_rule, unmatched_patterns
from .rounding import apply_gptq


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
        if quantizable(m) and hessians is not None
    }
    config, settings = quantization_plan(model, bits, group_size, mode, recipe)
    nn.quantize(model, class_predicate=lambda path, module: settings.get(path, False))
    set_scale_dtype(model)
    if hessians is not None:
        apply_gptq(model, hessians, floats)
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    for module in tqdm(quantized, desc="quantizing", unit="module", leave=False):
        mx.eval(module.parameters())  # quantization is lazy: evaluate module by module to show progress
    return config


def quantization_plan(
    model: nn.Module,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    recipe: str | dict | None = None,
) -> tuple[dict, dict[str, dict]]:
    """(config.json's `quantization` entry, each module's settings to quantize it with) of `quantize_model`'s
    arguments, checked before any work: an OptionError when nothing would be quantized, a ValueError for a model
    quantized already. Modules quantized before keep their settings, recorded where they differ."""
    already = {p: m for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    modules = {p: m for p, m in model.named_modules() if quantizable(m)}
    if already and not modules:
        raise ValueError(
            f"The model is quantized already ({len(already)} modules, e.g. {next(iter(already))}): quantizing again "
            "would change nothing; dequantize_model(model) first to quantize it at other settings"
        )
    spec = quantization_spec(bits, group_size, mode)
    rule = recipe_rule(recipe, spec, group_size)
    default = recipe_default(recipe, spec, group_size)
    config = dict(default)
    for path, module in already.items():
        own = {key: getattr(module, key) for key in default}
        if own != default:
            config[path] = own
    warn_unmatched_patterns(recipe, list(modules))
    settings, misfits = {}, {}
    for path, module in modules.items():
        params, width = rule(path), module.weight.shape[-1]
        if params is not False and width % params["group_size"]:
            misfits[path] = (width, params["group_size"])
        if params is False or path in misfits:
            config[path] = False
            continue
        settings[path] = dict(params)
        if params != default:
            config[path] = dict(params)
    if modules and not settings:
        from_recipe = any(group != spec["group_size"] for _, group in misfits.values())
        raise OptionError(nothing_quantized(misfits, from_recipe))
    return config, settings


def quantizable(module: nn.Module) -> bool:
    """Every nn.Linear and nn.Embedding, and an untied output head (a decoder with a weight of its own)."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or (isinstance(module, TiedDecoder) and "weight" in module)


def quantizable_paths(model: nn.Module) -> list[str]:
    """The paths of the modules a recipe's patterns match: every nn.Linear and nn.Embedding."""
    return [p for p, m in model.named_modules() if quantizable(m)]


def warn_unmatched_patterns(recipe: str | dict | None, paths: list[str]) -> None:
    """A recipe pattern that matches none of the module `paths` is likely a typo: it changes nothing."""
    example = next(iter(paths), "")
    for pattern in unmatched_patterns(recipe, paths):
        warnings.warn(f"Recipe pattern {pattern!r} matches no Linear or Embedding of this model, so it changes "
                      f"nothing; patterns match module paths such as {example!r}", stacklevel=3)  # fmt: skip


def nothing_quantized(misfits: dict[str, tuple[int, int]], from_recipe: bool = False) -> str:
    """Why a request would quantize nothing, and the affine group size that would fit (largest first); where the
    recipe's entries set the group size, the advice is to change them."""
    if not misfits:
        return "the recipe keeps every Linear and Embedding float: nothing to quantize; give it bits, or don't quantize"
    widths = sorted({w for w, _ in misfits.values()})
    groups = ", ".join(str(g) for g in sorted({g for _, g in misfits.values()}))
    fits = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths)]
    fits = fits or [g for g in (128, 64, 32) if any(w % g == 0 for w in widths)]
    where = "the recipe's group_size" if from_recipe else "group_size, --group-size"
    advice = "no affine group size (128, 64, 32) divides them; keep this model float"
    if fits:
        use = f'"group_size": {fits[0]} in the recipe\'s entries' if from_recipe else f"--group-size {fits[0]}"
        advice = f"use group_size={fits[0]} ({use}, affine mode)"
    return (
        f"group size {groups} ({where}) divides none of this model's input widths "
        f"({', '.join(map(str, widths))}), so nothing would be quantized; {advice}"
    )


def applied_settings(model: nn.Module) -> Counter:
    """How many modules are quantized with each (bits, mode, group size): what a report should describe."""
    quantized = (m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))
    return Counter((m.bits, m.mode, m.group_size) for m in quantized)


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Affine scales/biases: float16 halves their cost vs float32 (the fits round them to float16, so
    codes match the stored values); bfloat16 models keep bfloat16."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def set_scale_dtype(model: nn.Module) -> None:
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and module.mode == "affine":
            module.scales = module.scales.astype(scale_dtype(module.scales.dtype))
            module.biases = module.biases.astype(scale_dtype(module.biases.dtype))


def dequantize_model(model: nn.Module, dtype: mx.Dtype | None = None) -> int:
    """Replace every quantized module with its float equivalent in place; returns how many were replaced."""
    replaced, float_dtype = [], common_float_dtype(tree_flatten(model.parameters()))
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        target = dtype or float_dtype
        # affine: scale * q + bias computed in float32 (the stored scales widened exactly), then rounded once to the
        # target dtype: computed in bfloat16 or float16 it rounded at every step
        scales, biases = module.scales, module.get("biases")
        if module.mode == "affine":
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        weight = mx.dequantize(module.weight, scales, biases, module.group_size, module.bits, mode=module.mode)
        weight = weight.astype(target)
        if isinstance(module, nn.QuantizedEmbedding):
            float_module = Embedding(*weight.shape)
        elif isinstance(module, QuantizedDecoder):  # an untied output head, called with the word embeddings
            float_module = TiedDecoder(weight.shape[1], weight.shape[0], tied=False, bias="bias" in module)
            if "bias" in module:
                float_module.bias = module.bias
        else:
            float_module = Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                float_module.bias = module.bias
        float_module.weight = weight
        replaced.append((path, float_module))
    model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    return len(replaced)
