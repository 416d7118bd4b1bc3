"""Code blocks marked `<!-- readme-test -->` in README.md and docs/*.md run word for word, in reading order.

Reading order: README.md, then the docs pages in the order of README's "Documentation" list (the table of
contents), then any page linked elsewhere or not at all. Each block runs in a fresh interpreter; a trailing
`# (...)` comment on the last line states what the block prints.

Marked ```bash blocks of a page run as a reader runs them: in order, in one shell (its variables and background
jobs carry over), in a fresh folder that holds a link to the checkout's examples/, with this interpreter's `python`
and `mlx-encoders` first on PATH and a free port in place of 8080. A ```text block right after a command block
states its standard output; `...` there stands for any text (floats that depend on the BLAS, long vectors).

Shell blocks marked `<!-- readme-test: commands -->` run too: a page's blocks one after another in one bash, in
an empty folder, as a reader types them into one terminal (`python` and `mlx-encoders` are this checkout's). A
block marked `<!-- readme-test: output -->` after one is what it prints to stdout: the same words, numbers with
a decimal point within a rounding tolerance (another machine's arithmetic), a line of `VOLATILE` not compared.
"""

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- readme-test -->\n```python\n(.*?)```", re.S)
SHELL = re.compile(r"<!-- readme-test -->\n```bash\n(.*?)```\n(?:\n?```text\n(.*?)```\n)?", re.S)
SEPARATOR = "@@ readme-test: next block @@"
SHELL_TIMEOUT_S = 300
COMMANDS = re.compile(r"<!-- readme-test: (commands|output) -->\n```\w*\n(.*?)```", re.S)
VOLATILE = ("tokens_s",)  # the machine's speed
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")
BLOCK_END = "readme-test: end of block"


def pages_in_reading_order() -> list[Path]:
    text = README.read_text()
    contents = text.split("\n## Documentation\n", 1)[-1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\((docs/[\w.-]+\.md)", contents + text)
    order = [README] + [ROOT / name for name in dict.fromkeys(linked)]
    return order + [page for page in sorted(DOCS.glob("*.md")) if page not in order]


PAGES = pages_in_reading_order()
BLOCKS = [(page, code) for page in PAGES for code in MARKED.findall(page.read_text())]
IDS = [f"{page.relative_to(ROOT)}:block{i}" for i, (page, _) in enumerate(BLOCKS)]
SHELL_PAGES = [page for page in PAGES if SHELL.search(page.read_text())]


def test_readme_has_tested_blocks():
    assert any(page == README for page, _ in BLOCKS)


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text()))
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} <= linked


def test_relative_links_resolve():
    for page in PAGES + [ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


@pytest.mark.parametrize("page, code", BLOCKS, ids=IDS)
def test_readme_block_runs(page, code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    expected = re.findall(r"#\s*(\(.*)$", code.strip().splitlines()[-1])
    if expected:  # a trailing "# (...)" comment on a print states what it prints
        assert result.stdout.strip() == expected[0].strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def matches(expected: str, output: str) -> bool:
    """`output` equals `expected`, each `...` of which stands for any text."""
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("..."))
    return re.fullmatch(pattern, output.strip(), re.S) is not None


def run_shell(script: str, folder: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `script` in bash; whatever it leaves running is stopped with it."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    shell = subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = shell.communicate(timeout=SHELL_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a step that waits forever, as on a server that did not start
        os.killpg(shell.pid, signal.SIGKILL)
        out, err = shell.communicate()
        err += f"\n(stopped after {SHELL_TIMEOUT_S} s)"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGKILL)  # whatever a failed page left running
    return shell.returncode, out, err


@pytest.mark.parametrize("page", SHELL_PAGES, ids=[str(page.relative_to(ROOT)) for page in SHELL_PAGES])
def test_shell_blocks_run_in_order_and_print_what_the_page_shows(page, tmp_path):
    port = str(free_port())
    blocks = [(code.replace("8080", port), out.replace("8080", port)) for code, out in SHELL.findall(page.read_text())]
    # a failed step ends the shell, and with it the jobs it started (a server), which hold its output open
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2> /dev/null || true' EXIT"]
    for code, _ in blocks:
        script += [f"printf '\\n{SEPARATOR}\\n'", code]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    status, stdout, stderr = run_shell("\n".join(script), tmp_path)
    outputs = stdout.split(f"\n{SEPARATOR}\n")[1:]
    assert status == 0, f"this block failed:\n{blocks[len(outputs) - 1][0]}\n{stderr[-3000:]}"
    assert len(outputs) == len(blocks)
    for (code, expected), output in zip(blocks, outputs, strict=True):
        if expected:
            assert matches(expected, output), (
                f"{code}\nprinted:\n{output}\nthe page shows:\n{expected}\n{stderr[-3000:]}"
            )


def results_sections() -> list[str]:
    """benchmarks/RESULTS.md cut at its ## and ### headings."""
    return re.split(r"\n(?=#{2,3} )", (ROOT / "benchmarks" / "RESULTS.md").read_text())


def headline_rows() -> list[tuple[str, str, str]]:
    """README's "Headline figures" table: (what, figure, command) per row."""
    table = README.read_text().split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return [(what.strip(), figure.strip(), command.strip().strip("`")) for what, figure, command in rows[1:]]


def test_headline_figures_are_rows_of_benchmark_results():
    """Every number of a headline figure appears in a RESULTS.md section that gives the row's command (as it is, or
    with more options), all of the row's numbers in the same section."""
    rows = headline_rows()
    assert len(rows) >= 5
    for what, figure, command in rows:
        numbers = re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?", figure)
        assert numbers, f"headline row {what!r} states no figure"
        runs = [s for s in results_sections() if re.search(rf"^{re.escape(command)}( .*)?$", s, re.M)]
        assert runs, f"no section of benchmarks/RESULTS.md gives the command of {what!r}: {command}"
        missing = [
            [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", section)] for section in runs
        ]
        assert min(missing, key=len) == [], f"{what!r}: {min(missing, key=len)} not in RESULTS.md for {command}"


COMMAND_PAGES = [(page, COMMANDS.findall(page.read_text())) for page in PAGES]
COMMAND_PAGES = [(page, blocks) for page, blocks in COMMAND_PAGES if blocks]


def test_shell_blocks_alternate_commands_and_their_output():
    for page, blocks in COMMAND_PAGES:
        kinds = [kind for kind, _ in blocks]
        follows = [
            previous == "commands"
            for previous, kind in zip(["output", *kinds[:-1]], kinds, strict=True)
            if kind == "output"
        ]
        assert all(follows), f"{page.relative_to(ROOT)}: an output block follows no commands block"


def assert_prints(printed: str, shown: str, where: str) -> None:
    got, want = printed.strip().splitlines(), shown.strip().splitlines()
    assert len(got) == len(want), f"{where} printed:\n{printed}"
    for line, expected in zip(got, want, strict=True):
        if expected.split()[:1] and expected.split()[0] in VOLATILE:
            continue
        assert NUMBER.sub("#", line).split() == NUMBER.sub("#", expected).split(), f"{where}: {line!r}"
        for found, number in zip(NUMBER.findall(line), NUMBER.findall(expected), strict=True):
            assert math.isclose(float(found), float(number), rel_tol=1e-2, abs_tol=5e-3), f"{where}: {line!r}"


def test_printed_output_is_compared_word_for_word_with_numbers_within_rounding():
    assert_prints("   1  0.5847      0  Paris\n", "   1  0.5850  0  Paris", "example")
    assert_prints("tokens_s  12.0", "tokens_s  91.3774", "example")  # the machine's speed
    for printed in ("1 0.6200 0 Paris", "1 0.5847 0 Berlin", "2 0.5847 0 Paris", "1 0.5847 0 Paris\nmore"):
        with pytest.raises(AssertionError):
            assert_prints(printed, "1 0.5850 0 Paris", "example")


@pytest.mark.parametrize("page, blocks", COMMAND_PAGES, ids=[str(p.relative_to(ROOT)) for p, _ in COMMAND_PAGES])
def test_shell_blocks_run_and_print_what_the_page_shows(page, blocks, tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, command in (("python", f'"{sys.executable}"'), ("mlx-encoders", f'"{sys.executable}" -m mlx_encoders')):
        (tools / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (tools / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    commands = [text for kind, text in blocks if kind == "commands"]
    script = "set -eo pipefail\n" + "".join(f"{text}\necho '{BLOCK_END}'\n" for text in commands)
    (tmp_path / "work").mkdir()
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path / "work", env=env
    )
    assert result.returncode == 0, result.stderr[-5000:]
    printed = iter(result.stdout.split(f"{BLOCK_END}\n"))
    for i, (kind, text) in enumerate(blocks):
        if kind == "commands":
            output = next(printed)
        else:
            assert_prints(output, text, f"{page.relative_to(ROOT)}, block {i}")
