"""engine.runtime.huge_pages: the anonymous mappings made inside the block (a search graph's memory) are advised
onto 2 MB transparent huge pages, as far as the kernel takes the advice; nothing else, and nothing with tuning off."""

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_encoders.engine import runtime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
SIZE = 8 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The system's transparent huge page mode ("always", "madvise", "never"), None where there is none."""
    if not THP.exists():
        return None
    return THP.read_text().split("[", 1)[1].split("]", 1)[0]


def smaps(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (numbers: kB or flags) of the mapping that holds `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            inside = start <= address < end
        elif inside and len(head) >= 2 and head[1].isdigit():
            fields[head[0].rstrip(":")] = int(head[1])
    return fields


def touched_block() -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of SIZE bytes, every page written, and the address of its middle (within the
    2 MB-aligned part the advice covers; the unaligned ends stay on small pages)."""
    block = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.write(b"\1" * SIZE)
    return block, ctypes.addressof(ctypes.c_char.from_buffer(block)) + SIZE // 2


def test_a_mapping_made_inside_is_advised_onto_huge_pages():
    with runtime.huge_pages():
        block, address = touched_block()
    advised, (other, other_address) = smaps(address), touched_block()  # one made outside: not advised
    try:
        if thp_mode() == "madvise":  # "always" makes every mapping eligible, "never" none
            assert advised["THPeligible"] == 1
            assert smaps(other_address)["THPeligible"] == 0
        assert block[:4] == b"\1\1\1\1" and block[SIZE - 1 :] == b"\1"  # advice moves pages, never their bytes
    finally:
        block.close()
        other.close()


def test_tuning_off_advises_nothing(monkeypatch):
    monkeypatch.setenv("MLX_ENCODERS_CPU_TUNING", "0")
    with runtime.huge_pages():
        block, address = touched_block()
    try:
        if thp_mode() == "madvise":
            assert smaps(address)["THPeligible"] == 0
    finally:
        block.close()


def test_a_graph_on_huge_pages_answers_as_before(tmp_path, monkeypatch):
    """The same graph file restored with and without the advice finds the same neighbours."""
    pytest.importorskip("usearch")
    from mlx_encoders.index import ann

    vectors = np.random.default_rng(0).standard_normal((20_000, 64)).astype(np.float32)
    graph = ann.usearch_index()(ndim=64, metric="ip", dtype="f32", connectivity=16, expansion_add=64)
    graph.add(np.arange(len(vectors), dtype=np.uint64), vectors, threads=1)
    graph.save(str(tmp_path / "g.usearch"))
    answers = []
    for tuning in ("1", "0"):
        monkeypatch.setenv("MLX_ENCODERS_CPU_TUNING", tuning)
        with runtime.huge_pages():
            restored = ann.usearch_index().restore(str(tmp_path / "g.usearch"))
        restored.expansion_search = 64
        answers.append(np.stack([restored.search(v, 10).keys for v in vectors[:50]]))
    np.testing.assert_array_equal(*answers)
