"""The recall knob of `mlx_encoders.index`: the HNSW graph is calibrated at build on held-out vectors, a search
walks with the least expansion that reached the recall it asks for (or answers exactly where the graph cannot, or
is no faster), says which way it answered, and reaches that recall on queries it has not seen (against numpy's
exact top 10)."""

import json

import numpy as np
import pytest
from test_index import model, recall_at_10, unit_vectors, write_corpus, write_vectors  # noqa: F401 (model: a fixture)

from mlx_encoders.__main__ import main as cli
from mlx_encoders.index import Index, ann
from mlx_encoders.index.ann import CALIBRATION_QUERIES, plan


def calibration(levels: list, exact_ms: float) -> dict:
    return {"calibration": {"queries": 100, "k": 10, "candidates": 100, "exact_ms": exact_ms, "levels": levels}}


def test_the_plan_is_the_least_expansion_that_reached_the_recall_where_the_graph_is_faster():
    info = calibration([[100, 0.8, 1.0], [200, 0.93, 2.0], [400, 0.97, 3.0]], exact_ms=5.0)
    assert plan(info, 0.9, forced=False) == {"expansion_search": 200, "recall": 0.93, "ms": 2.0}
    assert plan(info, 0.95, forced=False)["expansion_search"] == 400
    assert plan(info, 0.99, forced=False) is None  # never reached: exact
    assert plan(info, 0.99, forced=True)["expansion_search"] == 400  # the graph at any cost: its widest walk
    slower = calibration(info["calibration"]["levels"], exact_ms=2.5)
    assert plan(slower, 0.9, forced=False) == {"expansion_search": 200, "recall": 0.93, "ms": 2.0}
    assert plan(slower, 0.95, forced=False) is None and plan(slower, 0.95, forced=True)["expansion_search"] == 400
    assert plan(calibration([], 0.0), 0.95, forced=False)["recall"] == 1.0  # too few vectors: all are candidates


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """(folder, vectors) of 5,000 uniform unit vectors of 128 dimensions: no clusters, hard for a graph."""
    folder, vectors = tmp_path_factory.mktemp("uniform") / "index", unit_vectors(5_000, 128, seed=0)
    write_vectors(folder, vectors)
    return folder, vectors


def test_the_recall_asked_for_is_reached_on_new_queries(uniform):
    folder, vectors = uniform
    queries = unit_vectors(100, 128, seed=1)
    record = folder / "ann-float32.json"
    found = {}
    for recall in (0.8, 0.95):
        index = Index(folder, ann=True, recall=recall)
        assert index.way["method"] == "graph" and index.way["recall"] >= recall, index.way
        found[recall] = (index.way["expansion_search"], recall_at_10(index, vectors, queries))
    print(f"\n(expansion_search, recall@10) by recall asked: {found}")
    assert found[0.8][0] < found[0.95][0]
    assert found[0.8][1] >= 0.75 and found[0.95][1] >= 0.9  # 1,000 neighbours: a sampling margin
    measured = json.loads(record.read_text())["calibration"]
    assert measured["queries"] == CALIBRATION_QUERIES and measured["k"] == 10


def test_a_search_for_every_vector_is_exact_whatever_the_graph_reaches(uniform, monkeypatch):
    """A graph may leave a few nodes unreachable; candidates asked for that are every vector come from the exact
    product, so no document is lost from a search that wants them all."""
    folder, vectors = uniform
    index = Index(folder, ann=True)
    assert index.graph is not None
    reached = ann.candidates_of
    monkeypatch.setattr(ann, "candidates_of", lambda *a: list(reached(*a))[1:])  # the best node never reached
    assert index.search(vectors[17], 1)[0].id != "17"  # below the bound: the graph's answer
    assert {h.id for h in index.search(vectors[0], len(vectors))} == {str(i) for i in range(len(vectors))}


def test_search_says_which_way_it_answers_and_may_choose_exact(uniform, tmp_path):
    folder, vectors = uniform
    Index(folder, ann=True)  # the graph and its record
    record = folder / "ann-float32.json"
    info = json.loads(record.read_text())
    for exact_ms, method in ((1e9, "graph"), (0.0, "exact")):  # the exact product as timed at build
        record.write_text(json.dumps({**info, "calibration": {**info["calibration"], "exact_ms": exact_ms}}))
        index = Index(folder, ann_threshold=0, recall=0.9)
        assert index.way["method"] == method
        assert index.search(vectors[17], 1)[0].id == "17"
    assert index.describe() == (
        "exact search over 5000 vectors (float32; the graph is no faster at recall@10 0.9 (calibrated at build))"
    )
    index = Index(folder, ann=True, recall=0.9)
    way = index.way
    assert index.describe() == (
        f"HNSW graph search over 5000 vectors (float32): connectivity 16, expansion_search {way['expansion_search']}, "
        f"100 candidates re-scored; recall@10 {way['recall']} measured at build"
    )
    assert Index(folder, ann=True, ef_search=37).way["expansion_search"] == 37

    del info["calibration"]  # a graph of an earlier version: measured once, when opened with write
    record.write_text(json.dumps(info))
    assert Index(folder, ann=True, write=False).way["recall"] is None
    assert "not measured" in Index(folder, ann=True, write=False).describe()
    assert Index(folder, ann=True).way["recall"] is not None
    assert "calibration" in json.loads(record.read_text())


def test_command_line_search_reports_its_way_and_checks_the_recall(tmp_path, model, capsys):  # noqa: F811
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert cli(["index", "build", "--corpus", str(corpus), "--index", str(index), "--model", str(model)]) == 0
    capsys.readouterr()
    search = ["index", "search", "--index", str(index), "Cacti store water.", "-k", "1"]
    assert cli(search) == 0
    assert "mlx-encoders index: exact search over 8 vectors (float32)\n" in capsys.readouterr().err
    assert cli([*search, "--ann", "--recall", "0.9"]) == 0
    out, err = capsys.readouterr()
    assert "mlx-encoders index: HNSW graph search over 8 vectors (float32): connectivity 16" in err
    assert "more.jsonl:2" in out
    for bad in ("1.5", "0", "zero"):
        with pytest.raises(SystemExit) as e:
            cli([*search, "--recall", bad])
        assert e.value.code == 2 and "must be a recall in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("held", [True, False])
def test_calibrations_exact_neighbours_equal_numpys_over_blocks(monkeypatch, held):
    """The calibration's true neighbours, from one product a block of vectors at a time (blocks smaller than k
    included), equal numpy's top 10 of each query's own product, leaving out the held-out queries or the query."""
    monkeypatch.setattr(ann, "EXACT_BLOCK", 7)
    vectors = unit_vectors(300, 16, seed=3)
    picks = np.sort(np.random.default_rng(4).choice(300, 20, replace=False))
    found = ann.exact_neighbours(vectors, picks, 10, held)
    for position, neighbours in zip(picks, found, strict=True):
        scores = vectors @ vectors[position]
        scores[picks if held else position] = -np.inf
        assert neighbours == set(np.argsort(-scores)[:10].tolist())


def test_a_binary_graphs_ladder_reaches_past_32_times_and_stops_at_the_index_size(tmp_path, monkeypatch):
    vectors = unit_vectors(6_000, 32, seed=5)
    write_vectors(tmp_path / "index", vectors)
    record = tmp_path / "index" / "ann-binary.json"
    monkeypatch.setattr(ann, "SLOWER", float("inf"))  # this small graph's walks are all slower than the exact product
    Index(tmp_path / "index", ann=True, precision="binary", recall=0.99)
    levels = json.loads(record.read_text())["calibration"]["levels"]
    widths = [width for width, _, _ in levels]
    assert widths == [round(100 * m) for m in ann.BINARY_LADDER[: len(widths)]]
    assert widths[-1] >= 5_500 or levels[-1][1] >= ann.ENOUGH  # every vector kept (5,500 in the graph), or enough
    assert all(width < 5_500 for width in widths[:-1])

    monkeypatch.undo()  # past the recall built for, walks four times the exact product's time end the ladder
    record.unlink()
    Index(tmp_path / "index", ann=True, precision="binary", recall=0.99)
    calibration = json.loads(record.read_text())["calibration"]
    *before, last = calibration["levels"]
    slow = ann.SLOWER * calibration["exact_ms"]
    assert not any(ms > slow and found >= 0.99 for _, found, ms in before)  # built for 0.99
    assert (last[2] > slow and last[1] >= 0.99) or last[1] >= ann.ENOUGH or last[0] >= 5_500
