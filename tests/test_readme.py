"""Code blocks marked `<!-- readme-test -->` in README.md and docs/*.md run word for word, in reading order.

Reading order: README.md, then the docs pages in the order of README's "Documentation" list (the table of
contents), then any page linked elsewhere or not at all. Each block runs in a fresh interpreter; a trailing
`# (...)` comment on the last line states what the block prints.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- readme-test -->\n```python\n(.*?)```", re.S)


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
