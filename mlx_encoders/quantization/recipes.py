"""Which modules get which quantization: the supported modes, mixed recipes and per-module patterns.

The `mixed_L_H` recipes are named as mlx-lm's (`mixed_quant_predicate_builder` in `mlx_lm/convert.py`: a
low and a high bit width); here the encoder layers take the low one and embeddings, pooler and heads the
high one. Settings that differ from the default become per-module entries of config.json's `quantization`,
as mlx-lm's `quantize_model` (`mlx_lm/utils.py`) writes them.
"""

import fnmatch
import re
from collections.abc import Callable

from ..errors import OptionError

# Supported (bits, group sizes) per quantization mode, from `mx.quantize`'s table; the first is the default.
MODES = {
    "affine": {"bits": (8, 2, 3, 4, 5, 6), "group_size": (64, 32, 128)},
    "mxfp4": {"bits": (4,), "group_size": (32,)},
    "mxfp8": {"bits": (8,), "group_size": (32,)},
    "nvfp4": {"bits": (4,), "group_size": (16,)},
}
# Layers (`encoder.layer.3.`, `layers.3.`, `transformer.layer.3.`, `albert_layers.0.`, GPT-2's `h.3.`) vs the rest.
LAYER_PATTERN = re.compile(r"(^|\.)(layer|layers|albert_layers|h)\.\d+\.")
# Tables added to every token's input (position, token type): an error in them moves every token of a text
# the same way instead of averaging out, so at 4 bits they cost more fidelity than the whole word table while
# holding a tiny share of the weights.
# Below 8 bits they are kept at 8 (affine only); GPT-2's `wpe` is such a table, and so is DeBERTa's
# `rel_embeddings`, which every attention score of every layer reads.
SHARED_TABLES = ("*position_embeddings", "*token_type_embeddings", "*wpe", "*rel_embeddings")


# Affine group sizes below which the default of 64 (mlx-lm's) loses too much: at 4 bits, all-MiniLM-L6-v2's mean
# embedding cosine with float is 0.98977 at group size 64 and 0.99265 at 32 (GPTQ both; the target is 0.99).
SMALL_GROUPS = {"affine": {2: 32, 3: 32, 4: 32}}
# What a recipe's params dict may set; anything else (a typo such as "bit") would be silently ignored.
PARAM_KEYS = ("bits", "group_size", "mode")


def default_group_size(bits: int, mode: str) -> int:
    return SMALL_GROUPS.get(mode, {}).get(bits, MODES[mode]["group_size"][0])


def quantization_spec(bits: int | None, group_size: int | None, mode: str) -> dict:
    """The checked {"group_size", "bits", "mode"} default, with the mode's defaults filled in (the group size by
    bit width: `default_group_size`)."""
    if mode not in MODES:
        raise OptionError(f"Unknown quantization mode {mode!r}; choose one of: {', '.join(MODES)}")
    allowed = MODES[mode]
    bits = allowed["bits"][0] if bits is None else bits
    group_size = default_group_size(bits, mode) if group_size is None else group_size
    if bits not in allowed["bits"]:
        raise OptionError(f"{mode} quantization supports bits {sorted(allowed['bits'])}, not {bits}")
    if group_size not in allowed["group_size"]:
        raise OptionError(f"{mode} quantization supports group sizes {sorted(allowed['group_size'])}, not {group_size}")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def shared_table(path: str, params: dict) -> dict:
    """`params`, raised to 8 bits for the position and token-type tables (see SHARED_TABLES) when lower."""
    if params["mode"] == "affine" and params["bits"] < 8 and any(fnmatch.fnmatchcase(path, p) for p in SHARED_TABLES):
        return quantization_spec(8, params["group_size"], "affine")
    return params


def recipe_rule(recipe: str | dict | None, spec: dict, group_size: int | None = None) -> Callable[[str], dict | bool]:
    """Module path -> quantization params (or False) for a recipe.

    `"mixed_L_H"`: encoder layers at L bits, everything else (embeddings, pooler, heads) at H bits.
    A dict maps fnmatch patterns of module paths to bits, a params dict, or False (keep float); the first
    matching pattern wins and unmatched modules get `spec`. Outside what a dict names, the position and
    token-type tables get at least 8 bits (`shared_table`). Bit widths a recipe names get `group_size` if the
    user asked for one, else their own default.
    """
    if recipe is None:
        return lambda path: shared_table(path, spec)
    if isinstance(recipe, str):
        match = re.fullmatch(r"mixed_(\d)_(\d)", recipe)
        if not match:
            raise OptionError(f"Unknown recipe {recipe!r}; use 'mixed_L_H' (e.g. 'mixed_4_8') or a dict of patterns")
        try:
            low, high = (quantization_spec(int(b), group_size, spec["mode"]) for b in match.groups())
        except ValueError as e:  # the bits are the recipe's, not --bits: say so
            raise OptionError(f"recipe {recipe!r}: {e}") from None
        return lambda path: low if LAYER_PATTERN.search(path) else shared_table(path, high)
    rules = {}
    for pattern, value in recipe.items():
        rules[pattern] = recipe_entry(pattern, value, spec, group_size)
    return lambda path: next((v for p, v in rules.items() if fnmatch.fnmatchcase(path, p)), shared_table(path, spec))


def recipe_entry(pattern: str, value, spec: dict, group_size: int | None) -> dict | bool:
    """The params of one dict-recipe entry (bits, a params dict or False), checked; errors name the entry."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return quantization_spec(value, group_size, spec["mode"])
        if isinstance(value, dict):
            if unknown := sorted(set(value) - set(PARAM_KEYS)):
                keys = ", ".join(map(repr, unknown))
                raise OptionError(f"unknown key(s) {keys}; a params dict may set only {', '.join(PARAM_KEYS)}")
            # a key left out follows the run's (--bits, --group-size, --mode), as a bits entry does
            mode = value.get("mode", spec["mode"])
            bits = value.get("bits", spec["bits"] if mode == spec["mode"] else None)
            return quantization_spec(bits, value.get("group_size", group_size), mode)
    except ValueError as e:
        raise OptionError(f"Recipe entry {pattern!r}: {e}") from None
    if value is not False:
        raise OptionError(f"Recipe entry {pattern!r}: expected bits, a params dict or false, got {value!r}")
    return False


def unmatched_patterns(recipe: str | dict | None, paths: list[str]) -> list[str]:
    """The patterns of a dict recipe that match none of `paths` (likely a typo: they change nothing)."""
    if not isinstance(recipe, dict):
        return []
    return [p for p in recipe if not any(fnmatch.fnmatchcase(path, p) for path in paths)]


def recipe_default(recipe: str | dict | None, spec: dict, group_size: int | None = None) -> dict:
    """The config.json default for a recipe: the encoder layers' setting, as most weights use it."""
    if isinstance(recipe, str):
        return quantization_spec(int(recipe.split("_")[1]), group_size, spec["mode"])
    return spec
