import os

import pytest

# Two xdist workers share the cores: every OpenBLAS's idle threads sleep rather than spin, numpy's and those of the
# tests' subprocesses too (mlx_encoders does it for MLX's own alone).
os.environ["OPENBLAS_THREAD_TIMEOUT"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT") or "4"

import mlx_encoders  # noqa: E402, F401  (before any `import mlx`: it gives MLX a fast BLAS on Linux)

# Tests never reach the network: hub ids resolve from caches the tests build.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests: tiny reference models only add contention with more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """`checkpoint(model_type, task, **config_overrides)` -> folder, built once per session. Do not modify it:
    copy it first (`shutil.copytree`) when a test needs to change files."""
    from checkpoints import make_checkpoint

    built = {}

    def build(model_type: str, task: str = "encoder", **overrides):
        key = (model_type, task, repr(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"{model_type}-{task}")
            built[key] = make_checkpoint(folder, model_type, task, **overrides)
        return built[key]

    return build


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """`hub_cache(repo_id, folder)` places `folder` in an offline Hugging Face cache under `repo_id`, in the
    standard `models--org--name/snapshots/<sha>` layout, and returns the snapshot folder."""
    import shutil

    import huggingface_hub.constants as constants

    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import time; the functions look them up on each call.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def place(repo_id: str, folder) -> str:
        sha = "0123456789abcdef0123456789abcdef01234567"
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        shutil.copytree(folder, repo / "snapshots" / sha)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(sha)
        return repo / "snapshots" / sha

    return place


def pytest_collection_modifyitems(items):
    """`@pytest.mark.cpu_only(reason)` tests check what the engine does on MLX's CPU backend alone (its BLAS, its
    streams, half precision widened to float32): skipped, with their reason, when MLX's default device is another."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"CPU only ({mx.default_device()} here): {marker.args[0]}"))


def pytest_terminal_summary(terminalreporter):
    """Print what tests recorded as `record_property("summary", line)` (the property campaigns' case counts), so
    the counts show at the end of every run, `-q` included."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "summary"
    ]
    if lines:
        terminalreporter.write_sep("-", "case counts")
        for line in lines:
            terminalreporter.write_line(line)
