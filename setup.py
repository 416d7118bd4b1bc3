"""The dependencies, chosen at install: MLX's Linux wheel holds no backend, and pip's extras can add a requirement but
never drop one, so the backend cannot be an extra beside a default. On Linux the package asks for MLX's CUDA backend
when `MLX_ENCODERS_BACKEND=cuda`, or, unset, when an NVIDIA driver is loaded, and its CPU backend otherwise; on a Mac,
Metal. `pip install -e ".[cuda]"` is the same install, spelled for the reader."""

import os
import sys
from pathlib import Path

BACKENDS = ("cpu", "cuda")


def linux_backend() -> str:
    chosen = os.environ.get("MLX_ENCODERS_BACKEND", "").strip().lower()
    if chosen and chosen not in BACKENDS:
        raise SystemExit(f"MLX_ENCODERS_BACKEND={chosen!r}: use one of {', '.join(BACKENDS)}")
    return chosen or ("cuda" if Path("/proc/driver/nvidia/version").exists() else "cpu")


def dependencies() -> list[str]:
    """mlx with one backend, the fast BLAS MLX's CPU products get on Linux (engine/runtime.py), and the rest."""
    common = ["numpy>=1.24", "safetensors>=0.4", "huggingface_hub>=0.24", "tokenizers>=0.19", "tqdm>=4.60"]
    if not sys.platform.startswith("linux"):
        return ["mlx>=0.30", *common]
    blas = "scipy-openblas32>=0.3.27; platform_machine == 'x86_64' or platform_machine == 'aarch64'"
    return [f"mlx[{linux_backend()}]>=0.30", blas, *common]


if __name__ == "__main__":
    from setuptools import setup

    setup(install_requires=dependencies())
