"""`python -m convert [options] SOURCE` (or `mlx-encoders-convert`): turn a Hugging Face encoder checkpoint into an
MLX checkpoint.

A thin argparse layer over `mlx_encoders.conversion.convert`, which checks the options (exit 2 on a refused option,
as argparse's own errors; 1 when the conversion fails: a missing or unreadable checkpoint, a full disk); it also
accepts mlx-lm's spellings (`--hf-path`, `--q-bits`, `--q-group-size`), as in `mlx_lm.convert`.
"""

import argparse
import json
import sys
from pathlib import Path

from mlx_encoders.checkpoint import DTYPES
from mlx_encoders.conversion import MAX_SHARD_BYTES, convert
from mlx_encoders.errors import add_debug_option, run_command
from mlx_encoders.quantization import MODES
from mlx_encoders.quantization.recipes import SMALL_GROUPS
from mlx_encoders.records import text_lines

SCRIPT = "mlx-encoders-convert"  # pyproject.toml's console script; otherwise this runs as `python -m convert`


def recipe_arg(text: str) -> str | dict:
    """`mixed_4_8`, or a JSON object of module patterns -> bits / params / false."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({e.msg} at character {e.pos}): give an object of module patterns, "
            """e.g. '{"*.attention.*": 8, "*": 4}', or a mixed recipe such as mixed_4_8"""
        ) from e


def calibration_arg(path: str) -> list[str]:
    """The texts of a calibration file, one a line, read as every text file of the package (its byte-order mark
    dropped, lines split at line ends only)."""
    try:
        texts = [record.value.strip() for record in text_lines(path)]
    except OSError as e:
        message = f"cannot read {path} ({e.strerror}); give a text file, one text per line"
        raise argparse.ArgumentTypeError(message) from e
    except ValueError as e:  # not UTF-8, a folder, no such file: the message names the file and says what to do
        raise argparse.ArgumentTypeError(str(e)) from e
    if not texts:
        raise argparse.ArgumentTypeError(f"{path} holds no text; give one calibration text per line")
    return texts


def per_mode(key: str) -> str:
    """What each mode supports, for the help: 'affine 32, 64, 128 (default 64; 32 at 4 bits and fewer); ...'."""
    parts = []
    for mode, allowed in MODES.items():
        values = allowed[key]
        default = f" (default {values[0]}" if len(values) > 1 else ""
        if default and key == "group_size" and SMALL_GROUPS.get(mode):
            default += f"; {min(SMALL_GROUPS[mode].values())} at {max(SMALL_GROUPS[mode])} bits and fewer"
        parts.append(f"{mode} {', '.join(map(str, sorted(values)))}{default}{')' if default else ''}")
    return "; ".join(parts)


def program() -> str:
    """The name this command was run by, for its usage line and errors."""
    return SCRIPT if Path(sys.argv[0]).name == SCRIPT else "python -m convert"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program(),
        description="Convert a Hugging Face encoder checkpoint (hub id or folder) into an MLX checkpoint.",
    )
    p.add_argument("source", nargs="?", help="hub repo id (e.g. answerdotai/ModernBERT-base) or local folder")
    p.add_argument("--hf-path", dest="hf_path", help="same as SOURCE (mlx-lm spelling)")
    p.add_argument(
        "--mlx-path",
        help="output folder (default: <source name>-<bits>bit, -<recipe>, -<mode>, -mlx for a cast alone or "
        "-dequantized, in the current folder)",
    )
    p.add_argument("-q", "--quantize", action="store_true", help="quantize every Linear and Embedding")
    p.add_argument("--bits", "--q-bits", type=int, help=f"bits per weight: {per_mode('bits')}")
    p.add_argument("--group-size", "--q-group-size", type=int, help=f"group size: {per_mode('group_size')}")
    p.add_argument("--mode", "--q-mode", help=f"quantization mode: {', '.join(MODES)} (default affine)")
    p.add_argument("--recipe", type=recipe_arg, help="'mixed_4_8': layers at 4 bits, embeddings/heads at 8; or JSON")
    p.add_argument("--calibration", type=calibration_arg, help="text file, one text per line: quantize with GPTQ")
    p.add_argument(
        "--no-calibration", action="store_true", help="round to nearest instead of GPTQ on built-in texts (faster)"
    )
    p.add_argument("--dtype", help=f"dtype of everything not quantized: {', '.join(DTYPES)}")
    p.add_argument("-d", "--dequantize", action="store_true", help="turn a quantized MLX checkpoint back to floats")
    p.add_argument("--upload-repo", help="publish the result to this hub repo (needs a write token)")
    p.add_argument("--force", action="store_true", help="replace an existing output checkpoint folder")
    p.add_argument("--shard-size", type=int, default=MAX_SHARD_BYTES, help=argparse.SUPPRESS)
    add_debug_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    source = args.source or args.hf_path
    if not source or (args.source and args.hf_path and args.source != args.hf_path):
        p.error("give the checkpoint once: SOURCE or --hf-path")
    if args.no_calibration and args.calibration is not None:
        p.error("--calibration and --no-calibration conflict: give a text file to calibrate on, or neither")
    # a refused option exits 2 (an OptionError), as argparse's own errors do; a failed conversion 1
    return run_command(p.prog, lambda: run(source, args), args.debug)


def run(source: str, args: argparse.Namespace) -> None:
    convert(
        source,
        args.mlx_path,
        quantize=args.quantize,
        bits=args.bits,
        group_size=args.group_size,
        mode=args.mode,
        dtype=args.dtype,
        recipe=args.recipe,
        dequantize=args.dequantize,
        upload_repo=args.upload_repo,
        force=args.force,
        shard_size=args.shard_size,
        calibration=False if args.no_calibration else args.calibration,
    )


if __name__ == "__main__":
    sys.exit(main())
