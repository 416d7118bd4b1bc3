"""Quantized HNSW graphs of `mlx_encoders.index`: an int8 or binary graph re-scores every candidate of its walk
with float32 vectors memory-mapped from a file beside it (checked against its record), reaches the recall asked
for against numpy's exact top 10 on queries it has not seen, and holds no float32 vectors in memory; the graph's
parameters follow its size and the recall asked for."""

import json

import numpy as np
import pytest
from test_index import recall_at_10, unit_vectors, write_vectors
from tolerance import float32_tolerance

from mlx_encoders.index import Index
from mlx_encoders.index.ann import floats_path, int8_scale, parameters

COUNT, DIMENSION = 4_000, 64


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    """(folder, vectors) of COUNT uniform unit vectors: no clusters, the hardest case for quantized distances."""
    folder, vectors = tmp_path_factory.mktemp("quantized") / "index", unit_vectors(COUNT, DIMENSION, seed=0)
    write_vectors(folder, vectors)
    return folder, vectors


def test_the_graph_follows_the_size_and_the_recall_asked_for():
    assert parameters(10_000, 0.9) == {"connectivity": 16, "expansion_add": 64}
    assert parameters(10_000, 0.95) == {"connectivity": 16, "expansion_add": 128}
    assert parameters(1_000_000, 0.95) == {"connectivity": 32, "expansion_add": 200}
    quantized = {"connectivity": 16, "expansion_add": 96}  # cheap walks: a sparser graph, a narrower insertion
    assert parameters(1_000_000, 0.95, "int8") == parameters(10_000, 0.95, "binary") == quantized
    assert parameters(10_000, 0.99) == parameters(1_000_000, 0.99) == {"connectivity": 32, "expansion_add": 200}


@pytest.mark.parametrize("precision", ["int8", "binary"])
def test_a_quantized_graph_reaches_the_recall_asked_for_from_memory_mapped_floats(vectors, precision):
    folder, data = vectors
    index = Index(folder, ann=True, precision=precision, recall=0.95)
    assert index.way["method"] == "graph" and index.way["recall"] >= 0.95, index.way
    walked = index.way["expansion_search"]  # a binary walk's every candidate re-scored, an int8 walk's best 100
    assert index.way["candidates"] == (walked if precision == "binary" else 100)
    assert isinstance(index.vectors, np.memmap) and index.memory()["float32 vectors"] == 0
    stages = json.loads((folder / f"ann-{precision}.json").read_text())["seconds"]  # the build's stages, timed
    assert set(stages) == {"insert", "calibrate"} and all(s >= 0 for s in stages.values())
    np.testing.assert_array_equal(index.vectors, data)  # the store's float32 vectors, in row order
    found = recall_at_10(index, data, unit_vectors(100, DIMENSION, seed=1))
    print(f"\n{precision}: {index.describe()}; recall@10 on new queries {found}")
    assert found >= 0.9  # 1,000 neighbours: a sampling margin below the 0.95 calibrated
    hit = index.search(data[123], 1)[0]
    assert hit.id == "123" and abs(hit.score - 1) <= float32_tolerance(DIMENSION, 1.0)  # a float32 score


def test_int8_codes_use_the_whole_range(vectors):
    folder, data = vectors
    index = Index(folder, ann=True, precision="int8")
    scale = json.loads((folder / "ann-int8.json").read_text())["scale"]
    assert scale == int8_scale(data) == pytest.approx(1 / np.abs(data).max())
    codes = np.stack([index.graph.get(key) for key in index.rows[:500].astype(np.uint64)])
    np.testing.assert_array_equal(codes, np.round(data[:500] * scale * 127).astype(np.int8))


def test_a_damaged_or_missing_floats_file_is_rebuilt_or_searched_without(vectors, capsys):
    folder, data = vectors
    Index(folder, ann=True, precision="int8")
    file = floats_path(folder, "int8")
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0xFF
    file.write_bytes(bytes(raw))
    capsys.readouterr()
    index = Index(folder, ann=True, precision="int8", write=False)
    assert index.way["method"] == "exact" and index.graph is None and not isinstance(index.vectors, np.memmap)
    assert f"searching exactly, without {folder / 'ann-int8.usearch'} (its float32 file {file}" in (
        capsys.readouterr().err
    )
    assert index.search(data[7], 1)[0].id == "7"
    assert file.read_bytes() == bytes(raw)  # write=False: left as it was
    file.unlink()
    index = Index(folder, ann=True, precision="int8")
    assert "rebuilding" in capsys.readouterr().err and index.way["method"] == "graph"
    np.testing.assert_array_equal(np.memmap(file, "<f4", "r", offset=8 * COUNT).reshape(COUNT, -1), data)


def test_a_graphs_memory_is_the_bytes_its_nodes_fill(vectors):
    """`Index.memory()["graph"]` is what the nodes, links and vectors fill (the saved graph's size), not usearch's
    `memory_usage`, which counts arenas reserved for growth (the same for every precision at this size)."""
    folder, data = vectors
    held = {}
    for precision in ("float32", "int8", "binary"):
        index = Index(folder, ann=True, precision=precision)
        held[precision] = index.memory()["graph"]
        assert held[precision] == (folder / f"ann-{precision}.usearch").stat().st_size
    links = held["float32"] - data.nbytes  # the same connectivity at each precision: the same links
    assert links > 0
    assert held["int8"] == pytest.approx(links + data.nbytes / 4, rel=0.01)
    assert held["binary"] == pytest.approx(links + data.nbytes / 32, rel=0.01)
