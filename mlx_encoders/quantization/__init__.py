"""Quantization of encoder checkpoints: recipes, GPTQ and its calibration, and dequantization.

`quantize_model` and `dequantize_model` match mlx-lm's (reference: `mlx_lm/utils.py`): each quantized module stores
`<path>.weight` (uint32), `<path>.scales` and `<path>.biases` under the model's own parameter names, and
config.json's `quantization` entry, which `checkpoint.build.quantize_like` reads back, holds the default and the
per-module settings. Affine quantization defaults to group size 64 (32 at 4 bits and fewer) with float16 scales and
biases, GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"; act-order with static groups) for the Linears, calibrated on built-in standard-library docstrings
with every text weighted alike, and a least-squares grid for the embeddings, whose position and token-type tables
stay at 8 bits below that: the same file layout as round to nearest, with less error (see benchmarks/quantize.py).

`recipes`: which module gets which setting; `quantize`: the model in place; `rounding`: least-squares grid
and GPTQ; `calibration`: the calibration texts and the input Hessians measured on them.
"""

from .calibration import CALIBRATION_TOKENS, builtin_calibration, calibration_texts, input_hessians
from .quantize import (
    applied_settings,
    dequantize_model,
    quantizable_paths,
    quantization_plan,
    quantize_model,
    warn_unmatched_patterns,
)
from .recipes import MODES, OptionError, quantization_spec, recipe_rule
from .rounding import affine_grid, gptq, output_error

__all__ = [
    "MODES", "OptionError", "quantization_spec", "recipe_rule", "quantize_model", "dequantize_model",
    "applied_settings", "affine_grid", "gptq", "output_error", "CALIBRATION_TOKENS", "builtin_calibration",
    "calibration_texts", "input_hessians", "quantizable_paths", "quantization_plan", "warn_unmatched_patterns",
]  # fmt: skip
