"""One MLX backend per install, chosen by setup.py (CPU or CUDA on Linux, Metal on a Mac), and the pip OpenBLAS that
MLX's CPU products get on Linux: read from the installed distributions and from setup.py's own choice."""

import importlib.metadata as metadata
import runpy
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "setup.py"
BACKENDS = {"mlx-cpu", "mlx-cuda", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal"}


def installed(names: set[str]) -> set[str]:
    found = set()
    for name in names:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
    return found


def test_exactly_one_mlx_backend_is_installed():
    backends = installed(BACKENDS)
    assert len(backends) == 1, f"MLX backends installed side by side: {sorted(backends)}"
    if sys.platform == "darwin":
        assert backends == {"mlx-metal"}
    elif not Path("/proc/driver/nvidia/version").exists():
        assert backends == {"mlx-cpu"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pip OpenBLAS is for MLX's Linux wheel")
def test_the_pip_openblas_is_installed_on_linux():
    assert installed({"scipy-openblas32"}) == {"scipy-openblas32"}


def dependencies(monkeypatch, backend: str | None) -> list[str]:
    if backend is None:
        monkeypatch.delenv("MLX_ENCODERS_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MLX_ENCODERS_BACKEND", backend)
    monkeypatch.setattr(sys, "platform", "linux")
    return runpy.run_path(str(SETUP), run_name="setup")["dependencies"]()


def test_setup_asks_for_one_backend(monkeypatch):
    for backend in ("cpu", "cuda", "CUDA "):
        mlx = [d for d in dependencies(monkeypatch, backend) if d.startswith("mlx")]
        assert mlx == [f"mlx[{backend.strip().lower()}]>=0.30"]
    with pytest.raises(SystemExit, match="MLX_ENCODERS_BACKEND='metal': use one of cpu, cuda"):
        dependencies(monkeypatch, "metal")


def test_the_installed_requirements_are_setups():
    """The installed metadata asks for one backend, as setup.py chose on this machine."""
    wanted = [r for r in metadata.requires("mlx-encoders") if r.startswith("mlx") and "extra ==" not in r]
    assert len(wanted) == 1 and wanted[0].startswith(("mlx[cpu]", "mlx[cuda]", "mlx>")), wanted
