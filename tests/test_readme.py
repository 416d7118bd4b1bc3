"""README code blocks marked `<!-- readme-test -->` run word for word."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"<!-- readme-test -->\n```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_tested_blocks():
    assert BLOCKS


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = re.findall(r"#\s*(\(.*)$", code.strip().splitlines()[-1])
    if expected:  # a trailing "# ..." comment on a print states what it prints
        assert result.stdout.strip() == expected[0].strip()
