import os

import pytest

# Tests never reach the network: hub ids resolve from caches the tests build.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
