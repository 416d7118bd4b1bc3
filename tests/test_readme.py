"""Code blocks marked `<!-- readme-test -->` in README.md and docs/*.md run word for word, in reading order.

Reading order: README.md, then the docs pages in the order of README's "Documentation" list (the table of
contents), then any page linked elsewhere or not at all. Each block runs in a fresh interpreter; a trailing
`# (...)` comment on the last line states what the block prints.

Shell blocks marked `<!-- readme-test: commands -->` run too: a page's blocks one after another in one bash, in
an empty folder, as a reader types them into one terminal (`python` and `mlx-encoders` are this checkout's). A
block marked `<!-- readme-test: output -->` after one is what it prints to stdout: the same words, numbers with
a decimal point within a rounding tolerance (another machine's arithmetic), a line of `VOLATILE` not compared.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- readme-test -->\n```python\n(.*?)```", re.S)
SHELL = re.compile(r"<!-- readme-test: (commands|output) -->\n```\w*\n(.*?)```", re.S)
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


SHELL_PAGES = [(page, SHELL.findall(page.read_text())) for page in PAGES]
SHELL_PAGES = [(page, blocks) for page, blocks in SHELL_PAGES if blocks]


def test_shell_blocks_alternate_commands_and_their_output():
    for page, blocks in SHELL_PAGES:
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


@pytest.mark.parametrize("page, blocks", SHELL_PAGES, ids=[str(p.relative_to(ROOT)) for p, _ in SHELL_PAGES])
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
