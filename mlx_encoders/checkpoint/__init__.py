"""The checkpoint layer: the one place that reads, fits, builds, initialises and writes checkpoints.

- `files`: resolve a folder or hub id once, read config.json, JSON files, safetensors, shards and the index.
- `build`: fit tensors to a model (prefixes, tied copies, legacy names, each architecture's `sanitize`),
  build a model from config + task, initialise heads the checkpoint lacks, `load_model`.
- `tokenizer`: the checkpoint's tokenizer, fitted to its model (positions, vocabulary).
- `write`: `save` (transformers-readable folders) and the writers convert uses; `atomic`: folders that
  appear only when complete, whatever interrupts the writer.

`load`, `load_model`, convert, `SentenceEncoder` and the pipelines all go through here.
"""

from .atomic import atomic_folder
from .build import DTYPES, load_model
from .files import (
    PICKLE_SUFFIXES,
    Checkpoint,
    folder_digest,
    inside,
    read_json,
    read_json_object,
    read_modules,
    read_safetensors,
    resolve,
    weight_files,
)
from .tokenizer import load_tokenizer, tokenizer_for
from .write import MAX_SHARD_BYTES, model_config, save, write_checkpoint

__all__ = [
    "Checkpoint", "DTYPES", "MAX_SHARD_BYTES", "PICKLE_SUFFIXES", "atomic_folder", "folder_digest", "inside",
    "load_model", "load_tokenizer", "model_config", "read_json", "read_json_object", "read_modules",
    "read_safetensors", "resolve", "save", "tokenizer_for", "weight_files", "write_checkpoint",
]  # fmt: skip
