"""Hub ids resolved as transformers resolves them: with network, a partial or stale cache is completed from the hub;
offline, the cache answers and the errors name what is missing."""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_encoders

HERE = Path(__file__).parent
OLD, NEW, PICKLE = "a" * 40, "e" * 40, "1" * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cached(cache: Path, repo: str, sha: str, folder: Path, only: tuple[str, ...] | None = None) -> None:
    """`folder` (or its files named in `only`) as the cache's snapshot `sha` of `repo`, `main` pointing at it."""
    root = cache / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        if only is None or file.name in only:
            shutil.copy(file, snapshot / file.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(sha)


SCRIPT = """
import mlx_encoders
from mlx_encoders.checkpoint import resolve
for repo in ("org/partial", "org/moved"):
    model, _ = mlx_encoders.load(repo)
    print(repo, resolve(repo).name, len(model.config["id2label"]))
try:
    mlx_encoders.load("org/pickled")
except ValueError as e:
    print("pickled:", e)
"""


def test_online_load_completes_a_partial_cache_follows_main_and_names_pickle_weights(checkpoint, tmp_path):
    """A partial snapshot (config and tokenizer only, as AutoTokenizer leaves one) is completed, a cached `main` the
    hub moved on is followed, and a repo of pickle weights alone says so rather than 'no model.safetensors'."""
    old = checkpoint("bert", "sequence-classification")
    new = shutil.copytree(old, tmp_path / "new")
    config = json.loads((new / "config.json").read_text())
    config["id2label"] = {str(i): f"L{i}" for i in range(5)}
    config["label2id"] = {f"L{i}": i for i in range(5)}
    (new / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import load_file, save_file

    weights = load_file(old / "model.safetensors")
    weights = {k: (v[:1].repeat(5, 0) if k.startswith("classifier.weight") else v) for k, v in weights.items()}
    weights["classifier.bias"] = weights["classifier.bias"][:1].repeat(5)
    save_file(weights, new / "model.safetensors", metadata={"format": "pt"})
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(old / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    spec = {"org/partial": {"main": [OLD, str(old)]}, "org/moved": {"main": [NEW, str(new)]},
            "org/pickled": {"main": [PICKLE, str(pickled)]}}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))

    home = tmp_path / "hf"
    cached(home, "org/partial", OLD, old, only=("config.json", "tokenizer.json", "tokenizer_config.json"))
    cached(home, "org/moved", OLD, old)
    port = free_port()
    hub = subprocess.Popen([sys.executable, str(HERE / "fake_hub.py"), str(port), str(tmp_path / "spec.json")])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        env = {"HF_HOME": str(home), "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DISABLE_XET": "1",
               "HF_HUB_OFFLINE": "0", "PATH": "/usr/bin:/bin"}  # fmt: skip
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    finally:
        hub.kill()
        hub.wait()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    labels = len(json.loads((old / "config.json").read_text())["id2label"])
    assert labels != 5 and lines[0] == f"org/partial {OLD} {labels}", run.stdout
    assert lines[1] == f"org/moved {NEW} 5", run.stdout
    assert lines[2].startswith("pickled:") and "only pickle weights (pytorch_model.bin)" in lines[2], run.stdout


def test_offline_errors_name_the_revision(hub_cache):
    with pytest.raises(FileNotFoundError, match="some-org/absent at revision 'v1.0' is neither"):
        mlx_encoders.load("some-org/absent", revision="v1.0")


def test_a_sentence_transformers_folder_with_its_transformer_in_a_subfolder_names_it(checkpoint, tmp_path):
    folder = tmp_path / "st"
    shutil.copytree(checkpoint("bert"), folder / "0_Transformer")
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(FileNotFoundError, match="keeps the Transformer in .*0_Transformer"):
        mlx_encoders.load(folder)
