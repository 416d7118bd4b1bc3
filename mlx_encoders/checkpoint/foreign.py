"""Files a checkpoint brings from other libraries, read without running their code: a sentence-transformers folder's
module files (copied, their safetensors cast) and BGE-M3's extra heads, read from torch pickles with torch's
weights-only loader when they come in no other format."""

import shutil
from pathlib import Path

import mlx.core as mx

from .files import MODULES_FILE, PICKLE_SUFFIXES, SENTENCE_CONFIG_FILE, SETTINGS_FILE, read_modules, read_safetensors

BGE_M3_HEADS = ("sparse_linear", "colbert_linear")  # BGE-M3's heads beside its encoder: one file each


SENTENCE_FILES = (MODULES_FILE, SENTENCE_CONFIG_FILE, SETTINGS_FILE)


def sentence_modules(source: Path) -> list[Path]:
    """Folders of the sentence-transformers modules (1_Pooling, 2_Dense, ...) listed in modules.json."""
    return [folder for _, folder in read_modules(source) if folder != source and folder.is_dir()]


def check_sentence_modules(source: Path) -> None:
    """Refuse sentence-transformers modules whose weights are pickle only (unpickling runs code), and a listed Dense
    module whose folder or weights are missing (its projection would be lost)."""
    for kind, folder in read_modules(source):
        if kind.rsplit(".", 1)[-1] != "Dense":
            continue
        missing = "config.json" if not (folder / "config.json").is_file() else None
        if (
            missing is None
            and not any(folder.glob("*.safetensors"))
            and not any(p.suffix in PICKLE_SUFFIXES for p in folder.iterdir())
        ):
            missing = "weights (model.safetensors)"
        if missing:
            raise ValueError(
                f"{source / 'modules.json'} lists a Dense module at {folder}, which has no {missing}; copy the "
                "folder from the original sentence-transformers model: without its projection the embeddings would "
                "be wrong"
            )
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
