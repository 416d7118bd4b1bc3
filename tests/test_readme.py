"""Code blocks marked `<!-- readme-test -->` in README.md and docs/*.md run word for word, in reading order.

Reading order: README.md, then the docs pages in the order of README's "Documentation" list (the table of
contents), then any page linked elsewhere or not at all. Each ```python block runs in a fresh interpreter; a
trailing `# (...)` comment on the last line states what the block prints.

A page's ```bash blocks run as a reader types them into one terminal: in order, in one bash (variables and
background jobs carry over; jobs left running are stopped at the end), in an empty folder that holds a link to the
checkout's examples/, with this checkout's `python` and `mlx-encoders` first on PATH and a free port for 8080. A
```text block marked `<!-- readme-test: output -->` after one (prose may stand between) is what it prints to
stdout: the same words and lines, numbers with a decimal point within a rounding tolerance (another machine's
arithmetic), `...` for any text (long vectors), and a line whose first word is in `VOLATILE` (a speed) not compared.
"""

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- readme-test -->\n```python\n(.*?)```", re.S)
MARKER = re.compile(r"^<!-- readme-test.*$", re.M)
FENCE = re.compile(r"```(\w*)\n(.*?)^```\n", re.S | re.M)
OUTPUT_MARKER = "<!-- readme-test: output -->"
SEPARATOR = "@@ readme-test: next block @@"
SHELL_TIMEOUT_S = 600
VOLATILE = ("tokens_s",)  # the machine's speed
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def pages_in_reading_order() -> list[Path]:
    text = README.read_text()
    contents = text.split("\n## Documentation\n", 1)[-1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\((docs/[\w.-]+\.md)", contents + text)
    order = [README] + [ROOT / name for name in dict.fromkeys(linked)]
    return order + [page for page in sorted(DOCS.glob("*.md")) if page not in order]


PAGES = pages_in_reading_order()
BLOCKS = [(page, code) for page in PAGES for code in MARKED.findall(page.read_text())]
IDS = [f"{page.relative_to(ROOT)}:block{i}" for i, (page, _) in enumerate(BLOCKS)]
SHELL_PAGES = [page for page in PAGES if "<!-- readme-test -->\n```bash\n" in page.read_text()]


def test_readme_has_tested_blocks():
    assert any(page == README for page, _ in BLOCKS)


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text()))
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} <= linked


def test_relative_links_resolve():
    for page in PAGES + [ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def reader_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The environment a block runs in: its temporary files (the pages' `tempfile.mkdtemp()` folders, hundreds of
    megabytes of checkpoints) under the test's own folder, which pytest removes once the test passes; MLX's cache
    of compiled CPU kernels, which it keeps in the temporary folder too, stays shared."""
    own, shared = tmp_path / "tmp", Path(tempfile.gettempdir()) / "mlx"
    own.mkdir(exist_ok=True)
    shared.mkdir(exist_ok=True)
    if not (own / "mlx").exists():
        (own / "mlx").symlink_to(shared, target_is_directory=True)
    return dict(os.environ, TMPDIR=str(own), **variables)


@pytest.mark.parametrize("page, code", BLOCKS, ids=IDS)
def test_readme_block_runs(page, code, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=reader_env(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    expected = re.findall(r"#\s*(\(.*)$", code.strip().splitlines()[-1])
    if expected:  # a trailing "# (...)" comment on a print states what it prints
        assert result.stdout.strip() == expected[0].strip()


def shell_steps(page: Path) -> list[tuple[str, str]]:
    """(commands, the output the page shows or "") of each marked ```bash block of `page`, in reading order."""
    text, steps, awaits_output = page.read_text(), [], False
    for marker in MARKER.finditer(text):
        block = FENCE.match(text, marker.end() + 1)
        kind = (marker.group(), block and block[1])
        line = text.count("\n", 0, marker.start()) + 1
        where = f"{page.relative_to(ROOT)}, line {line}"
        if kind == (OUTPUT_MARKER, "text") and awaits_output:
            steps[-1], awaits_output = (steps[-1][0], block[2]), False
        elif kind == ("<!-- readme-test -->", "bash"):
            steps.append((block[2], ""))
            awaits_output = True
            # an output block left unmarked would be shown to readers but never compared
            assert not re.match(r"\s*```", text[block.end() :]), f"{where}: mark the next block {OUTPUT_MARKER}"
        elif kind == ("<!-- readme-test -->", "python"):
            awaits_output = False
        else:
            raise AssertionError(
                f"{where}: {marker.group()} is not on a ```python or ```bash block, nor on a ```text"
                f" block after a marked ```bash block ({OUTPUT_MARKER})"
            )
    return steps


def test_markers_are_on_blocks_the_tests_run():
    for page in PAGES:
        shell_steps(page)


def normalized(text: str) -> str:
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())


def matches(shown: str, printed: str) -> bool:
    """`printed` says what `shown` says: the same words and lines (spacing aside), every number with a decimal point
    within a rounding tolerance, `...` standing for any text, a line that starts with a VOLATILE word for any such
    line."""
    pattern, numbers = [], []
    for line in normalized(shown).splitlines():
        if line.split(" ", 1)[0] in VOLATILE:
            pattern.append(re.escape(line.split(" ", 1)[0]) + r"(?: .*)?")
            continue
        parts = []
        for part in line.split("..."):
            pieces = NUMBER.split(part)  # the text between its numbers
            numbers += NUMBER.findall(part)
            parts.append(f"({NUMBER.pattern})".join(re.escape(piece) for piece in pieces))
        pattern.append("(?s:.*?)".join(parts))
    found = re.fullmatch("\n".join(pattern), normalized(printed))
    return found is not None and all(
        math.isclose(float(a), float(b), rel_tol=1e-2, abs_tol=5e-3)
        for a, b in zip(found.groups(), numbers, strict=True)
    )


def test_printed_output_is_compared_word_for_word_with_numbers_within_rounding():
    shown = """
rank   score  text
   1  0.5850  Paris
          tokens_s  91.3774
{"embedding": [...], "score": 0.88...}"""
    printed = """rank score text
   1  0.5847      Paris
          tokens_s  12.0
{"embedding": [0.1, -0.25], "score": 0.8841}
"""
    assert matches(shown, printed)
    wrong = {
        "word": printed.replace("Paris", "Berlin"),
        "number": printed.replace("0.5847", "0.6200"),
        "integer": printed.replace("1  0.5847", "2  0.5847"),
        "missing line": printed.replace("rank score text\n", ""),
        "extra line": printed + "more\n",
        "line break": printed.replace("\n   1", " 1"),
    }
    assert [name for name, text in wrong.items() if matches(shown, text)] == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_shell(script: str, tmp_path: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `script` in bash, run as a reader runs it (see the module's docstring);
    whatever it leaves running is stopped with it."""
    tools, folder = tmp_path / "bin", tmp_path / "reader"
    tools.mkdir()
    for name, command in (("python", f'"{sys.executable}"'), ("mlx-encoders", f'"{sys.executable}" -m mlx_encoders')):
        (tools / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (tools / name).chmod(0o755)
    folder.mkdir()
    (folder / "examples").symlink_to(ROOT / "examples")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = reader_env(tmp_path, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=path)
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
    steps = [(code.replace("8080", port), shown.replace("8080", port)) for code, shown in shell_steps(page)]
    # a failed step ends the shell, and with it the jobs it started (a server), which hold its output open
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2> /dev/null || true' EXIT"]
    for code, _ in steps:
        script += [f"printf '\\n{SEPARATOR}\\n'", code]
    status, stdout, stderr = run_shell("\n".join(script), tmp_path)
    outputs = stdout.split(f"\n{SEPARATOR}\n")[1:]
    assert status == 0, f"this block failed:\n{steps[len(outputs) - 1][0]}\n{stderr[-3000:]}"
    assert len(outputs) == len(steps)
    for (code, shown), output in zip(steps, outputs, strict=True):
        if shown:
            assert matches(shown, output), f"{code}\nprinted:\n{output}\nthe page shows:\n{shown}\n{stderr[-3000:]}"


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
