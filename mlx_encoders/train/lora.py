"""LoRA and QLoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; Dettmers et al. 2023,
"QLoRA"): `W x + (alpha / r) B A x` on chosen linears, A (r, in) kaiming-uniform as PEFT draws it, B (out, r) zero,
so an adapted model starts equal to its base. Shaped after mlx-lm's `tuner/lora.py`; A and B are stored in PEFT's
(torch Linear) orientation. The base weights, float or quantized, stay frozen and are never dequantized in training;
the task head (everything outside the encoder) trains in full. `save_adapters` writes the trainable parameters
alone, `fuse` merges the adapters into the weights (a quantized base's adapted linears become float; with
`requantize=True`, rounded again with the base's settings).
"""

import json
import math
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..checkpoint import read_safetensors
from ..checkpoint.atomic import atomic_folder
from ..engine.quantized import QuantizedLinear, dequantize, freeze_quantized
from ..models.base import HeadModel, QuantizedDecoder, TiedDecoder
from ..models.layers import Dropout, Linear, next_key

# The attention projections of each architecture (config.json `model_type`), the LoRA paper's choice.
DEFAULT_TARGETS = {
    "bert": ["query", "key", "value"],
    "roberta": ["query", "key", "value"],
    "xlm-roberta": ["query", "key", "value"],
    "albert": ["query", "key", "value"],
    "distilbert": ["q_lin", "k_lin", "v_lin"],
    "modernbert": ["Wqkv"],
    "mpnet": ["q", "k", "v"],
    "electra": ["query", "key", "value"],
    "deberta-v2": ["query_proj", "key_proj", "value_proj"],
    "deberta": ["in_proj"],
    "nomic_bert": ["q_proj", "k_proj", "v_proj"],
    "gte": ["q_proj", "k_proj", "v_proj"],
    "eurobert": ["q_proj", "k_proj", "v_proj"],
    "jina_embeddings_v3": ["q_proj", "k_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "qwen3": ["q_proj", "k_proj", "v_proj"],
    "gemma3_text": ["q_proj", "k_proj", "v_proj"],
    "embedding_gemma2": ["q_proj", "k_proj", "v_proj"],
    "embedding_gemma2_text": ["q_proj", "k_proj", "v_proj"],
}
ADAPTERS_FILE, CONFIG_FILE = "adapters.safetensors", "adapter_config.json"
LINEARS = (nn.Linear, nn.QuantizedLinear)


@dataclass
class LoRAConfig:
    """What `apply_lora` did to a model (kept on it as `model.lora_config`), written to adapter_config.json."""

    rank: int
    alpha: float
    dropout: float
    targets: list[str]


class LoRALinear(nn.Module):
    """`linear(x) + (alpha / rank) * dropout(x) A^T B^T` over a frozen nn.Linear or nn.QuantizedLinear."""

    def __init__(self, linear: nn.Linear | nn.QuantizedLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        out_dims, in_dims = dims(linear)
        self.linear = linear
        self.dropout = Dropout(dropout)
        self.scale = alpha / rank
        bound = 1 / math.sqrt(in_dims)  # torch's kaiming_uniform_(a=sqrt(5)), PEFT's init of lora_A
        self.lora_a = mx.random.uniform(-bound, bound, (rank, in_dims), key=next_key())
        self.lora_b = mx.zeros((out_dims, rank))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a.T) @ self.lora_b.T
        return y + (self.scale * z).astype(y.dtype)

    def delta(self) -> mx.array:
        """(alpha / r) B A, the (out, in) change of the weight, in float32."""
        return self.scale * (self.lora_b.astype(mx.float32) @ self.lora_a.astype(mx.float32))


def dims(linear: nn.Linear | nn.QuantizedLinear) -> tuple[int, int]:
    """(out, in) of a float or quantized linear (a quantized weight packs several values per uint32)."""
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[0], linear.scales.shape[1] * linear.group_size
    return linear.weight.shape


def encoder_of(model: nn.Module) -> tuple[str, nn.Module]:
    """(prefix, encoder): a head model's encoder under its checkpoint prefix, or a bare encoder itself."""
    return (model.prefix + ".", model.encoder) if isinstance(model, HeadModel) else ("", model)


def matches(path: str, targets: list[str]) -> bool:
    """A target is a module name (`query`), the end of a path after a dot (`attention.self.query`, as PEFT's
    `target_modules` list), or a regular expression over the name or the full path (`.*intermediate.dense`)."""
    name = path.rsplit(".", 1)[-1]
    return any(path.endswith("." + t) or re.fullmatch(t, name) or re.fullmatch(t, path) for t in targets)


def default_targets(model: nn.Module) -> list[str]:
    return DEFAULT_TARGETS[model.args.model_type]


def apply_lora(
    model: nn.Module, rank: int = 8, alpha: float = 16.0, targets: list[str] | None = None, dropout: float = 0.0
) -> list[str]:
    """Wrap the encoder's linears that match `targets` (default: `DEFAULT_TARGETS` of the model type) in
    LoRALinear, in place, and leave only the adapters and the task head trainable. Returns the adapted paths."""
    prefix, encoder = encoder_of(model)
    targets = targets or default_targets(model)
    chosen = [(p, m) for p, m in encoder.named_modules() if isinstance(m, LINEARS) and matches(prefix + p, targets)]
    if not chosen:
        names = sorted(
            {re.sub(r"\.\d+\.", ".N.", prefix + p) for p, m in encoder.named_modules() if isinstance(m, LINEARS)}
        )
        raise ValueError(
            f"No linear of the {model.args.model_type} encoder matches the LoRA targets {targets}: a target is a "
            f"module name, the end of its path or a regular expression; its linears: {', '.join(names)}"
        )
    encoder.update_modules(tree_unflatten([(p, LoRALinear(m, rank, alpha, dropout)) for p, m in chosen]))
    freeze_base(model)
    model.lora_config = LoRAConfig(rank, alpha, dropout, targets)
    return [prefix + p for p, _ in chosen]


def freeze_base(model: nn.Module) -> None:
    """Freeze the encoder but its adapters; the head trains in full, a quantized one (`convert` quantizes every
    linear) made float first: quantized weights cannot train."""
    prefix, encoder = encoder_of(model)
    head = [
        (p, m) for p, m in model.named_modules() if isinstance(m, QuantizedLinear) and not f"{p}.".startswith(prefix)
    ]
    if encoder is not model and head:
        model.update_modules(tree_unflatten([(p, float_linear(m)) for p, m in head]))
    model.unfreeze()
    encoder.freeze()
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
    freeze_quantized(model)


def save_adapters(model: nn.Module, folder: str | Path) -> Path:
    """Write the trainable parameters (adapters and head) to `adapters.safetensors`, and rank, alpha, dropout,
    targets and model type to `adapter_config.json`, in `folder`; returns the folder."""
    check_adapted(model, "save_adapters")
    folder = Path(folder)
    # whole or not at all: a write cut short left truncated adapters beside the previous config
    with atomic_folder(folder, replace=True, holds=(ADAPTERS_FILE, CONFIG_FILE)) as tmp:
        write_adapters(model, tmp)
    return folder


def check_adapted(model: nn.Module, what: str) -> None:
    if getattr(model, "lora_config", None) is None:
        raise ValueError(f"{what}: the model has no LoRA adapters (apply_lora or load_adapters gives it some)")


def write_adapters(model: nn.Module, folder: Path) -> None:
    """`save_adapters`' files, written into `folder` as they are (a checkpoint's folder, itself written whole)."""
    mx.save_safetensors(str(folder / ADAPTERS_FILE), dict(tree_flatten(model.trainable_parameters())))
    config = {**asdict(model.lora_config), "model_type": model.args.model_type}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_adapters(model: nn.Module, folder: str | Path) -> nn.Module:
    """Adapt a base `model` as `save_adapters` recorded in `folder` and load the saved adapters and head onto it,
    in place; fails naming any saved tensor the adapted model lacks or holds with another shape."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    if "model_type" not in config or "rank" not in config:
        peft = " (a PEFT adapter: load it with the model, or convert it)" if "peft_type" in config else ""
        raise ValueError(f"{folder / CONFIG_FILE} is not a save_adapters folder's config{peft}")
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("The model already has LoRA adapters: load these onto a base model without them")
    if config["model_type"] != model.args.model_type:
        raise ValueError(f"The adapters in {folder} are for {config['model_type']}, not {model.args.model_type}")
    apply_lora(model, config["rank"], config["alpha"], config["targets"], config["dropout"])
    return load_adapter_weights(model, folder)


def load_adapter_weights(model: nn.Module, folder: Path) -> nn.Module:
    """Load `folder`'s adapters and head onto an adapted `model`, in place, checking every name and shape."""
    weights = read_safetensors(folder / ADAPTERS_FILE)
    current = dict(tree_flatten(model.trainable_parameters()))
    if not any(k.startswith("dense.") for k in current) and any(k.startswith("dense.") for k in weights):
        # an embedding run's transformer (under `model.`) and its Dense modules: the transformer's part goes on a
        # bare transformer; the Dense modules trained in full are the run's model/ folder's
        dense = sorted(k for k in weights if k.startswith("dense."))
        warnings.warn(
            f"{folder / ADAPTERS_FILE} also holds the trained Dense modules ({', '.join(dense)}), which a bare "
            "transformer has no place for: the run's model/ folder holds them (its Dense module folders)",
            stacklevel=3,
        )
        weights = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    every = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():
        if key not in current or current[key].shape != value.shape:
            found = (
                f"has {current[key].shape}" if key in current
                else "has it frozen (a quantized weight cannot train: adapters trained on a float model go on a "
                "float base)" if key in every
                else "has no such trainable parameter"
            )  # fmt: skip
            raise ValueError(f"{folder / ADAPTERS_FILE}: {key} has shape {value.shape}; the model {found}")
    missing = sorted(k for k in current if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") and k not in weights)
    if missing:  # adapters of a smaller model (fewer layers) would leave these at their start, silently
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"{folder / ADAPTERS_FILE} lacks adapters the model's targets need: {', '.join(missing[:5])}{more}; "
            "the adapters belong to another model (other layers): load them onto the base they were trained on"
        )
    model.load_weights(list(weights.items()), strict=False)
    return model


def fuse(model: nn.Module, requantize: bool = False) -> nn.Module:
    """Merge every adapter into its linear (W + (alpha / r) B A), in place, as an nn.Linear: exact, for a quantized
    base too (its adapted linears become float, the others stay quantized). `requantize=True` rounds a quantized
    base's merged weights again with its bits, group size and mode (smaller; the rounding can undo much of what
    the adapters learned at 4 bits). The result is a plain model, ready for `mlx_encoders.save`; returns it."""
    check_adapted(model, "fuse")
    fused = [(p, fused_linear(m, requantize)) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    model.update_modules(tree_unflatten(fused))
    model.unfreeze()  # as loaded: every float parameter trainable
    freeze_quantized(model)
    del model.lora_config
    return model


def fused_linear(lora: LoRALinear, requantize: bool = False) -> nn.Linear | nn.QuantizedLinear:
    base = lora.linear
    if isinstance(base, nn.QuantizedLinear) and requantize:
        return requantized(base, dequantized(base) + lora.delta())
    quantized = isinstance(base, nn.QuantizedLinear)
    weight = dequantized(base) if quantized else base.weight.astype(mx.float32)
    # a quantized base's float parameters (its bias) are in the dtype the model computes in
    dtype = (base.bias.dtype if "bias" in base else mx.float32) if quantized else base.weight.dtype
    fused = Linear(*reversed(weight.shape), bias="bias" in base)
    if "bias" in base:
        fused.bias = base.bias
    fused.weight = (weight + lora.delta()).astype(dtype)
    return fused


def float_linear(linear: nn.QuantizedLinear) -> Linear | TiedDecoder:
    """A quantized linear as a float32 one of its dequantized weight (and its bias); an untied output head as the
    decoder it was."""
    weight = dequantized(linear)
    if isinstance(linear, QuantizedDecoder):
        out = TiedDecoder(weight.shape[1], weight.shape[0], tied=False, bias="bias" in linear)
    else:
        out = Linear(weight.shape[1], weight.shape[0], bias="bias" in linear)
    out.weight = weight
    if "bias" in linear:
        out.bias = linear.bias.astype(mx.float32)
    return out


def dequantized(linear: nn.QuantizedLinear) -> mx.array:
    """The float32 weight of a quantized linear (affine scales widened first, as `dequantize_model` does)."""
    return dequantize(linear.weight, linear.scales, linear.get("biases"), linear.group_size, linear.bits, linear.mode)


def requantized(linear: nn.QuantizedLinear, weight: mx.array) -> nn.QuantizedLinear:
    """A copy of `linear` holding `weight` rounded to nearest with its settings, scales and biases in their dtypes
    (the constructor's random weight is lazy, replaced before it is ever computed)."""
    out_dims, in_dims = weight.shape
    fused = QuantizedLinear(in_dims, out_dims, "bias" in linear, linear.group_size, linear.bits, mode=linear.mode)
    packed = mx.quantize(weight, linear.group_size, linear.bits, mode=linear.mode)
    fused.weight, fused.scales = packed[0], packed[1].astype(linear.scales.dtype)
    if "biases" in linear:
        fused.biases = packed[2].astype(linear.biases.dtype)
    if "bias" in linear:
        fused.bias = linear.bias
    return fused
