"""Reading a checkpoint folder: resolve it once (folder or hub id), then its JSON files and safetensors.

Every file that fails to parse names itself, paths listed inside a folder's files never leave the folder,
and pickle weights are refused, so reading never runs code from a checkpoint.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np

from ..jsonfile import read_json, read_json_object
from ..models import model_module, native_config, task_of_architecture

# what a hub download fetches: configs, weights, tokenizer and chat template files, BGE-M3's heads (read as plain
# tensors, never unpickled as code: checkpoint.foreign)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "README.md", "sparse_linear.pt",
                "colbert_linear.pt"]  # fmt: skip
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX = "model.safetensors.index.json"
# sentence-transformers' files beside a checkpoint: its module list, the model's settings, the Transformer's config
MODULES_FILE, SETTINGS_FILE, SENTENCE_CONFIG_FILE = (
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"
)  # fmt: skip
GENERATION_FILE = "generation_config.json"
COLBERT_LAYOUT = (
    "a ColBERT folder in {layout}'s layout, whose query and document markers, expansion and projection mlx_encoders "
    "does not read. sentence-transformers 6 converts it as it loads: "
    "`sentence_transformers.MultiVectorEncoder(path).save(new_path)`, then load new_path"
)  # a causal LM's decoding defaults, as transformers saves them
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja",
)  # fmt: skip


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
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )  # fmt: skip

    at = f" at revision {revision!r}" if revision else ""
    # One call, as transformers makes it: with network it completes a partial cache and follows a moved branch
    # (reusing cached files); offline, or when the hub cannot be reached, it returns the cached snapshot.
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS))
    except HFValidationError as e:
        raise FileNotFoundError(f"No checkpoint folder at {name}, and {name!r} is not a valid hub id") from e
    except IncompleteSnapshotError as e:
        raise FileNotFoundError(
            f"The cached copy of {name}{at} is incomplete and the hub cannot be reached (offline or "
            f"HF_HUB_OFFLINE=1); download it again with network. {e}"
        ) from e
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{name}{at} is neither a local folder nor in the Hugging Face cache, and the hub cannot be reached "
            f"(offline or HF_HUB_OFFLINE=1). Download it once with network, or pass a local folder."
        ) from e
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"Could not fetch {name!r}{at} from the Hugging Face hub: {e}") from e


def hub_snapshot(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder in the Hugging Face cache (`models--org--name/snapshots/<sha>`), else None."""
    parts = path.absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    return parts[-3].removeprefix("models--").replace("--", "/"), parts[-1]


def hub_pickles(path: Path) -> list[str]:
    """The pickle weights a hub snapshot's repo holds at its commit (never downloaded: HUB_PATTERNS leaves them
    out); [] for a local folder, or when the hub cannot be asked."""
    repo = hub_snapshot(path)
    if repo is None:
        return []
    try:
        from huggingface_hub import HfApi

        names = HfApi().list_repo_files(repo[0], revision=repo[1])
    except Exception:  # offline, unreachable or refused: the plain message stands
        return []
    return sorted(n for n in names if "/" not in n and Path(n).suffix in PICKLE_SUFFIXES)


def inside(folder: Path, name: Any, listed_in: Path) -> Path:
    """`folder / name` for a relative path that stays inside `folder`; refused otherwise (absolute, `..`)."""
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"{listed_in} lists {name!r}, which is not a relative path inside {folder}; refusing it")
    return folder / name


# Weights in other formats (pickles, ONNX, TensorFlow, Flax), which loading never reads
OTHER_FORMATS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".ot", ".onnx", ".onnx_data", ".xml")


def folder_digest(folder: Path, exclude: tuple[str, ...] = ()) -> str:
    """SHA-256 over the relative names and contents of the files under `folder` that loading can read (not
    `exclude`, not .git, no weights in other formats): the same files give the same digest, whenever and wherever
    they were written."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.relative_to(folder).parts):
        name = file.relative_to(folder).as_posix()
        if name in exclude or file.suffix in OTHER_FORMATS:
            continue
        digest.update(name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def read_modules(folder: Path) -> list[tuple[str, Path]]:
    """sentence-transformers' modules.json: (module type, module folder) per entry; [] without the file."""
    file = folder / MODULES_FILE
    if not file.exists():
        return []
    entries = read_json(file)
    if not isinstance(entries, list) or not all(isinstance(m, dict) for m in entries):
        raise ValueError(f"{file} must hold a JSON list of module entries")
    for i, m in enumerate(entries):
        wrong = [key for key in ("type", "path") if not isinstance(m.get(key), str) or (key == "type" and not m[key])]
        if wrong:
            raise ValueError(
                f"{file}: entry {i} ({m.get('name', 'unnamed')}) has no {' or '.join(repr(k) for k in wrong)} string; "
                'each entry names its module class ("type") and its folder ("path", "" for the root), as '
                "sentence-transformers writes them"
            )
    return [(m["type"], inside(folder, m["path"], file)) for m in entries]


# Bytes per element of safetensors' dtypes (the format's `Dtype`); a file naming another is left to MLX's reader.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound


def check_layout(file: Path) -> None:
    """The header's tensors, in offset order, fill the data exactly, each the size its shape and dtype give: the
    safetensors library's rule. MLX's reader does not check it, and two tensors over the same bytes load as
    wrong weights without a word."""
    if not file.is_file():  # a FIFO or device would block the read, or never end it
        raise ValueError("not a regular file")
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")
    tensors = sorted(
        ((name, info) for name, info in header.items() if name != "__metadata__"),
        key=lambda item: tuple(item[1].get("data_offsets", (-1, -1))) if isinstance(item[1], dict) else (-1, -1),
    )
    position = 0
    for name, info in tensors:
        try:
            start, end = info["data_offsets"]
            shape, dtype = [int(n) for n in info["shape"]], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has no dtype, shape and data_offsets") from None
        if start != position or end < start:
            raise ValueError(
                f"tensor {name!r} starts at byte {start} of the data, where the one before ends at {position}"
            )
        needed = math.prod(shape) * DTYPE_BYTES.get(dtype, 0)
        if dtype in DTYPE_BYTES and end - start != needed:
            raise ValueError(f"tensor {name!r} holds {end - start} bytes, not the {needed} of {dtype} {shape}")
        position = end
    if position != file.stat().st_size - 8 - size:
        raise ValueError(f"its tensors end at byte {position} of {file.stat().st_size - 8 - size} bytes of data")


def read_safetensors(file: Path) -> dict[str, mx.array]:
    """The tensors of a safetensors file; float64 ones (which MLX does not read) as float32, as transformers reads a
    double-precision checkpoint into a float32 model."""
    try:
        check_layout(file)
    except (ValueError, TypeError) as e:  # a JSON or Unicode error is a ValueError; offsets of other types, TypeError
        raise ValueError(f"{file} is not a readable safetensors file ({e}); re-download or re-save it") from e
    try:
        return mx.load(str(file))
    except (RuntimeError, ValueError) as e:
        if "F64" in str(e):
            return read_with_float64(file)
        raise ValueError(f"{file} is not a readable safetensors file ({e}); re-download or re-save it") from e


NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip


def read_with_float64(file: Path) -> dict[str, mx.array]:
    """A safetensors file that holds float64 tensors, read by its header (the format's own layout): float64 as float32,
    bfloat16 as itself, the rest as stored. The file is read whole: such checkpoints are small."""
    data = file.read_bytes()
    try:
        size = int.from_bytes(data[:8], "little")
        header, base, out = json.loads(data[8 : 8 + size]), 8 + size, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            values = np.frombuffer(data[base + start : base + end], NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"])
            if info["dtype"] == "BF16":
                out[name] = mx.array(values).view(mx.bfloat16)
            else:
                out[name] = mx.array(values.astype(np.float32) if values.dtype == np.float64 else values)
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e!r}); re-download or re-save it") from e


def weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's map of each tensor to its shard's file name, checked."""
    listed = read_json_object(index).get("weight_map")
    if not isinstance(listed, dict) or not listed:
        raise ValueError(f"{index} has no 'weight_map' object naming the shards; re-download it")
    for key, name in listed.items():
        if not isinstance(name, str):
            raise ValueError(f"{index}: weight_map[{key!r}] must be a shard's file name, got {name!r}")
    return listed


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the weights: `model.safetensors`, else the index's shards, else the one
    `*.safetensors` file, in transformers' order (its `save_pretrained` leaves an old index beside a new single
    file). Several files and no index are ambiguous and refused; pickles are refused."""
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    index = path / INDEX
    if index.exists():
        files = [inside(path, name, index) for name in sorted(set(weight_map(index).values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {path}: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return files
    if files:
        raise ValueError(
            f"{path} holds several safetensors files ({', '.join(f.name for f in files)}) and no {INDEX} that "
            "says how they make up one model; keep only the model's file, or add the index"
        )
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) or hub_pickles(path)
    if pickles:
        config = read_json_object(path / "config.json") if (path / "config.json").exists() else {}
        kind = next(iter(config.get("architectures") or []), None)
        kind = kind if isinstance(kind, str) else "AutoModel"
        raise ValueError(
            f"{path} holds only pickle weights ({', '.join(pickles)}). mlx_encoders loads safetensors only, "
            "because unpickling can run arbitrary code. Convert once with transformers, into a new folder and by "
            f"the checkpoint's own class (AutoModel would drop its head): `transformers.{kind}.from_pretrained(path)"
            ".save_pretrained(new_path)` (and the tokenizer's save_pretrained(new_path)), or use the hub repo's "
            "safetensors revision (many repos have a 'refs/pr/N' with model.safetensors)."
        )
    raise FileNotFoundError(f"No model.safetensors (or shards with {INDEX}) in {path}")


def missing_config(path: Path) -> str:
    """Why `path` is no checkpoint; a training run's output folder holds its model in `model/`."""
    if (path / "model" / "config.json").exists():
        return f"No config.json in {path}; it looks like a training run's output: pass {path / 'model'}"
    transformer = next((f for kind, f in read_modules(path) if kind.rsplit(".", 1)[-1].endswith("Transformer")), None)
    if transformer is not None and transformer != path and (transformer / "config.json").exists():
        return (
            f"No config.json in {path}: its modules.json keeps the Transformer in {transformer}. Pass that folder "
            "to load or convert the model alone, or open the whole folder with SentenceEncoder"
        )
    return f"No config.json in {path}; is this a transformers or MLX checkpoint folder?"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder, resolved once, and its config.json, read once; every front end starts here."""

    path: Path
    config: dict

    @classmethod
    def open(cls, source: "str | Path | Checkpoint", revision: str | None = None) -> "Checkpoint":
        if isinstance(source, Checkpoint):
            return source
        path = resolve(source, revision)
        file = path / "config.json"
        if not file.exists():
            raise FileNotFoundError(missing_config(path))
        checkpoint = cls(path, native_config(read_json_object(file)))
        checkpoint.check_architecture()
        return checkpoint

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "<missing>")

    @property
    def module(self) -> ModuleType:
        return model_module(self.model_type)

    @cached_property
    def args(self):
        """config.json as the architecture's `ModelArgs`, for what is known before the model is built."""
        try:
            return self.module.ModelArgs.from_dict(self.config)
        except ValueError as e:
            raise ValueError(f"{self.path / 'config.json'}: {e}") from e

    def check_architecture(self) -> None:
        """An unknown model_type, or Stanford's ColBERT (HF_ColBERT: its projection inline, read by no front end),
        fails, naming the file, before anything else is read."""
        try:
            model_module(self.model_type)
        except ValueError as e:
            raise ValueError(f"{self.path / 'config.json'}: {e}") from e
        if "HF_ColBERT" in (self.config.get("architectures") or []):
            raise ValueError(f"{self.path / 'config.json'} (HF_ColBERT): {COLBERT_LAYOUT.format(layout='Stanford')}")

    @cached_property
    def task(self) -> str:
        """The head config.json `architectures[0]` names ('encoder' when it names none)."""
        architectures = self.config.get("architectures") or []
        if not architectures:
            return "encoder"
        try:
            if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
                raise ValueError(f"config key 'architectures' must be a list of class names, got {architectures!r}")
            return task_of_architecture(architectures[0])
        except ValueError as e:
            raise ValueError(f"{self.path / 'config.json'}: {e}") from e

    def weight_files(self) -> list[Path]:
        return weight_files(self.path)

    def read_weights(self) -> dict[str, mx.array]:
        weights, files = {}, self.weight_files()
        index = self.path / INDEX
        sharded = files[0].name != "model.safetensors" and index.exists()
        listed = weight_map(index) if sharded else {}
        for file in files:
            found = read_safetensors(file)
            if lacking := sorted(k for k, name in listed.items() if name == file.name and k not in found):
                more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
                raise ValueError(
                    f"{file} lacks {', '.join(lacking[:3])}{more}, which {index.name} says it holds: the shard is "
                    "damaged or of another download; re-download it"
                )
            weights.update(found)
        return weights
