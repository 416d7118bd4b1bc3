"""JSON files of a checkpoint or a sentence-transformers folder, read so that a file that fails to parse names
itself. The bottom of the package: the tokenizer and the checkpoint reader both read through it."""

import json
from pathlib import Path
from typing import Any


def read_json(file: Path, required: bool = False) -> Any:
    """The parsed file; {} when it is absent and not `required`. A file that does not parse names itself."""
    if not file.exists():
        if required:
            raise FileNotFoundError(f"No {file.name} in {file.parent}")
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); re-download or re-save it") from e


def read_json_object(file: Path, required: bool = False) -> dict:
    value = read_json(file, required)
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, found {type(value).__name__}")
    return value
