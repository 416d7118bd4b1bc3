"""Run README's quick start word for word, as a new user would, and compare what it prints with README's text.

    python tests/quickstart.py [--fresh]

`.ci/run` runs it after the suite. Lines differ only where the machine must: the `time` line is not compared, numbers
may differ by two units in their last printed digit or 0.5% (BLAS builds round differently), the index
folder's digest (of the checkout's path), the Python version in paths is
free, and progress bars are left out, as README says. `--fresh` removes the quick start's venv (/tmp/qs) and
conversion first."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def quick_start(readme: str) -> tuple[str, str]:
    """The quick start's command (its first bash block) and the output README shows (the text block after it)."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return command, expected


def shown(output: str) -> list[str]:
    """The lines a reader compares: progress bars (carriage returns, tqdm's `it/s`) and pip's notices left out."""
    lines = output.split("\n")
    lines = lines[:-1] if lines and not lines[-1] else lines
    # what a terminal shows of a line a bar redrew: the text after its last carriage return, unless blank
    lines = [line.rsplit("\r", 1)[-1] for line in lines if "\r" not in line or line.rsplit("\r", 1)[-1].strip()]
    return [line for line in lines if not re.search(r"it/s]|s/it]|%\|", line) and "[notice]" not in line]


def differences(expected: str, got: list[str]) -> list[str]:
    wanted = shown(expected)
    problems = [] if len(wanted) == len(got) else [f"{len(got)} lines printed, README shows {len(wanted)}"]
    for want, have in zip(wanted, got, strict=False):
        if want.split()[:1] == ["time"] == have.split()[:1]:
            continue
        want, have = (re.sub(r"python3\.\d+", "python3.X", line) for line in (want, have))
        want, have = (re.sub(r"-[0-9a-f]{12}\b", "-<digest>", line) for line in (want, have))  # the checkout's path
        words_equal = NUMBER.sub("#", want) == NUMBER.sub("#", have)
        numbers = list(zip(NUMBER.findall(want), NUMBER.findall(have), strict=False))
        close = all(abs(float(a) - float(b)) <= max(2.5 * 10.0 ** -len(a.partition(".")[2]), 5e-3 * abs(float(a)))
                    for a, b in numbers)  # fmt: skip
        if not (words_equal and close):
            problems.append(f"README: {want!r}\n   got: {have!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh", action="store_true", help="remove /tmp/qs and minilm-8bit first (a fresh clone)")
    parser.add_argument("--blas", help="MLX_ENCODERS_BLAS for the run (default: the package's choice)")
    args = parser.parse_args()
    command, expected = quick_start(README.read_text())
    if args.fresh:  # as on a fresh clone: no venv, no conversion
        shutil.rmtree("/tmp/qs", ignore_errors=True)
        shutil.rmtree(README.parent / "minilm-8bit", ignore_errors=True)
    with tempfile.TemporaryDirectory() as work:
        home = Path(work, "home")
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_ENCODERS_", "VIRTUAL_ENV"))}
        env["HOME"] = str(home)
        env.update({"MLX_ENCODERS_BLAS": args.blas} if args.blas else {})
        start = time.perf_counter()
        run = subprocess.run(["bash", "-c", command], cwd=README.parent, env=env, capture_output=True, timeout=1800)
        # bytes, decoded here: text mode would turn a progress bar's carriage returns into new lines
        run.stdout, run.stderr = run.stdout.decode(), run.stderr.decode()
        seconds = time.perf_counter() - start
    output = run.stdout + run.stderr
    if run.returncode != 0:
        print(output, file=sys.stderr)
        print(f"quick start failed (exit {run.returncode}) after {seconds:.1f} s", file=sys.stderr)
        return 1
    # stdout and stderr apart: the index line (stderr) goes between the report and the results (stdout)
    report, results = run.stdout.split("\n> ", 1) if "\n> " in run.stdout else (run.stdout, "")
    got = shown(report) + shown(run.stderr.replace(str(home), "~")) + shown("\n> " + results if results else "")
    problems = differences(expected.replace("/tmp/qs-home", "~"), got)
    print("\n".join(got))
    print(f"quick start: {seconds:.1f} s in all", file=sys.stderr)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
