"""The public entry points called from an application's threads (a web framework's pool, a thread per request):
their MLX work runs on a few threads the package keeps (`engine.threads.on_own_thread`), so the process neither
aborts at exit nor gains an OS thread per calling thread. Each case runs in a subprocess: the abort is at exit."""

import subprocess
import sys
import textwrap

import pytest
from checkpoints import make_checkpoint

SCRIPT = """
import os, sys, threading
from mlx_encoders import CrossEncoder, SentenceEncoder, pipeline

encoder, cross = SentenceEncoder(sys.argv[1]), CrossEncoder(sys.argv[2])
classify = pipeline("text-classification", model=sys.argv[2])
texts = [f"text number {i} " * (1 + i % 5) for i in range(12)]
expected = encoder.encode(texts)
results = []

def request(i):
    results.append(abs(encoder.encode(texts) - expected).max())
    cross.predict([("a query", texts[i % 12])])
    classify(texts[i % 12])

def tasks():
    return len(os.listdir("/proc/self/task"))

counts = []
for i in range(24):  # a thread per request
    thread = threading.Thread(target=request, args=(i,))
    thread.start()
    thread.join()
    counts.append(tasks())
print("grown", counts[-1] - counts[5], "worst", max(results), flush=True)
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("callers")
    return make_checkpoint(root / "bert", "bert"), make_checkpoint(root / "ce", "bert", "sequence-classification")


def test_calls_from_threads_of_the_application_exit_cleanly_and_keep_the_thread_count(folders):
    for _ in range(3):  # the abort at exit came in most runs, not all
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SCRIPT), *map(str, folders)],
            capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        grown, worst = done.stdout.split()[1], float(done.stdout.split()[3])
        # the kept threads and their streams are made on first use, a few at most; each caller added two or more
        assert int(grown) <= 8, done.stdout
        assert worst <= 1e-5, done.stdout


FORK = """
import os, sys, threading
from concurrent.futures import ThreadPoolExecutor
from mlx_encoders import SentenceEncoder
from mlx_encoders.engine.runtime import ForkedAfterMLX

encoder = SentenceEncoder(sys.argv[1])
with ThreadPoolExecutor(4) as pool:  # the package's caller threads exist in the parent
    list(pool.map(lambda _: encoder.encode(["a text"]), range(8)))
child = os.fork()
if child == 0:
    box = []
    def call():
        try:
            encoder.encode(["a text"])
            box.append("encoded")
        except ForkedAfterMLX:
            box.append("refused")
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=30)
    os._exit(0 if box == ["refused"] else 3)
_, status = os.waitpid(child, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_s_call_from_a_thread_is_refused_not_left_waiting(folders):
    """The child has none of the parent's kept threads: its call makes its own, which refuses MLX after a fork."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORK), str(folders[0])],
        capture_output=True, text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["child", "0"], done.stdout + done.stderr[-2000:]
