"""PEFT LoRA adapters stored beside a checkpoint, one per subfolder (`adapter_config.json` and
`adapter_model.safetensors`, as PEFT's `save_pretrained` writes them): the task adapters of models that select one
per call (jina-embeddings-v3's retrieval_query, retrieval_passage, separation, classification, text_matching).

`read_lora` gives, per adapted module, its path in the encoder and (A, B, scale) as PEFT computes them:
`lora_A.weight` (r, in) and `lora_B.weight` (out, r) of a Linear, `lora_embedding_A` (r, vocab) and
`lora_embedding_B` (H, r) of an Embedding, scale `lora_alpha / r` (`/ sqrt(r)` with `use_rslora`; a module's own
r and alpha from `rank_pattern` / `alpha_pattern`, matched as PEFT matches them). `write_lora` writes them back.
"""

import json
import math
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx

from .files import read_json_object, read_safetensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PARTS = {".lora_A.weight": "a", ".lora_B.weight": "b", ".lora_embedding_A": "a", ".lora_embedding_B": "b"}


def adapter_folders(path: Path) -> dict[str, Path]:
    """The subfolders of a checkpoint folder that hold a PEFT adapter, by folder name."""
    return {p.name: p for p in sorted(path.iterdir()) if (p / CONFIG).is_file()} if path.is_dir() else {}


def check_config(config: dict, file: Path) -> float:
    """lora_alpha of a plain LoRA adapter; other PEFT methods and options that change the math are refused."""
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [f"{k}={config.get(k)!r}" for k, on in refused.items() if on]
    if bad:
        raise ValueError(
            f"{file}: {', '.join(bad)} is not supported; only plain LoRA adapters (peft_type LORA, bias 'none', no "
            "DoRA, fan_in_fan_out or modules_to_save) are read. Merge this adapter with PEFT "
            "(`merge_and_unload`) and load the merged model instead"
        )
    return float(config.get("lora_alpha", 8))


def pattern_value(patterns: dict, path: str, default):
    """PEFT's `get_pattern_key`: the value of the first pattern that matches the end of `path`, else `default`."""
    return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", path)), default)


def read_lora(folder: Path, prefix: str = "") -> dict[str, tuple[mx.array, mx.array, float]]:
    """{module path in the encoder: (A, B, scale)} of the PEFT LoRA adapter in `folder`; `prefix` (a head
    model's encoder name, "roberta") is stripped from paths adapted on a head."""
    file = folder / CONFIG
    config = read_json_object(file, required=True)
    alpha = check_config(config, file)
    weights_file = folder / WEIGHTS
    if not weights_file.is_file():
        raise FileNotFoundError(f"No {WEIGHTS} in {folder}: PEFT adapters are read from safetensors only")
    parts: dict[str, dict[str, mx.array]] = {}
    for key, value in read_safetensors(weights_file).items():
        suffix = next((s for s in PARTS if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{weights_file}: {key} is not a LoRA A or B tensor; only plain LoRA adapters are read")
        path = key[: -len(suffix)].removeprefix("base_model.model.")
        parts.setdefault(path, {})[PARTS[suffix]] = value.astype(mx.float32)
    out = {}
    for path, ab in parts.items():
        if set(ab) != {"a", "b"} or ab["a"].shape[0] != ab["b"].shape[1]:
            found = {k: tuple(v.shape) for k, v in ab.items()}
            raise ValueError(f"{weights_file}: {path} needs an A (r, in) and a B (out, r) of one rank r; found {found}")
        rank = ab["a"].shape[0]  # rank_pattern's, where it gives the module its own
        own_alpha = float(pattern_value(config.get("alpha_pattern") or {}, path, alpha))
        scale = own_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        out[path.removeprefix(prefix + ".") if prefix else path] = (ab["a"], ab["b"], scale)
    if not out:
        raise ValueError(f"{weights_file} holds no LoRA tensors")
    return out


def attach_adapters(model, path: Path) -> list[str]:
    """Add to `model` (one with `add_adapter`) every adapter in the subfolders of its checkpoint folder `path`;
    returns their names."""
    prefix = getattr(model, "prefix", "")
    folders = adapter_folders(path)
    for name, folder in folders.items():
        model.add_adapter(name, read_lora(folder, prefix))
    return list(folders)


def write_lora(folder: Path, low_ranks: dict[str, tuple[mx.array, mx.array, float, bool]]) -> None:
    """Write one adapter ({path: (A, B, scale, table)}) as PEFT saves it: the most common rank and alpha as `r` and
    `lora_alpha`, other modules' in `rank_pattern` / `alpha_pattern` under their escaped full paths."""
    folder.mkdir(parents=True)
    ranks = {path: a.shape[0] for path, (a, _, _, _) in low_ranks.items()}
    alphas = {path: scale * ranks[path] for path, (_, _, scale, _) in low_ranks.items()}
    r, alpha = (Counter(values.values()).most_common(1)[0][0] for values in (ranks, alphas))
    config = {
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "lora_dropout": 0.0, "inference_mode": True, "base_model_name_or_path": None,
        "task_type": None, "target_modules": sorted({path.rsplit(".", 1)[-1] for path in low_ranks}),
        "rank_pattern": {re.escape(p): v for p, v in ranks.items() if v != r},
        "alpha_pattern": {re.escape(p): v for p, v in alphas.items() if v != alpha},
    }  # fmt: skip
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    names = {True: ("lora_embedding_A", "lora_embedding_B"), False: ("lora_A.weight", "lora_B.weight")}
    weights = {}
    for path, (a, b, _, table) in low_ranks.items():
        name_a, name_b = names[table]
        weights[f"base_model.model.{path}.{name_a}"], weights[f"base_model.model.{path}.{name_b}"] = a, b
    mx.save_safetensors(str(folder / WEIGHTS), weights, metadata={"format": "pt"})
