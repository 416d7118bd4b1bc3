"""A process forked after the package ran MLX gets a clear error at its first call, never a hang: MLX's CPU workers
do not survive a fork (multiprocessing's default start method on Linux before Python 3.14)."""

import subprocess
import sys
import textwrap

import pytest
from checkpoints import MINILM

FORKED_POOL = """
import multiprocessing
from mlx_encoders import SentenceEncoder
from mlx_encoders.engine.runtime import ForkedAfterMLX

encoder = SentenceEncoder({model!r})

def embed(text):
    return encoder.encode([text]).shape

def child(text):
    return {child}

print(embed("in the parent"), flush=True)
with multiprocessing.get_context("fork").Pool(2) as pool:
    try:
        pool.map(child, ["a", "b"])
    except ForkedAfterMLX as e:
        print("refused:", e)
"""


@pytest.mark.parametrize("call", ["encoder.encode([text]).shape", "encoder.similarity([[1.0, 0.0]], [[1.0, 0.0]])"])
def test_a_child_forked_after_mlx_ran_gets_an_error_not_a_hang(call):
    code = textwrap.dedent(FORKED_POOL.format(model=str(MINILM), child=call))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, refused = result.stdout.strip().splitlines()
    assert first == "(1, 384)"
    assert refused.startswith("refused: this process") and "'spawn' or 'forkserver'" in refused
