"""`index build --shard i/n`: each part of a corpus embedded by a separate run (any machine, no mlx.launch) into
`shards/part-<i>-of-<n>.sqlite`, then merged by an ordinary build of the folder holding every part: the index a
one-process build gives. Parts are cut as `mlx.launch` ranks cut the corpus (sorted SHA-256 keys, chunks dealt
round-robin), checked here against that rule written out."""

import hashlib
import importlib
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from test_index import FILES, assert_same_index, model, st_model, write_corpus  # noqa: F401 (model: a fixture)

from mlx_encoders import SentenceEncoder
from mlx_encoders.__main__ import main as cli
from mlx_encoders.distributed import World
from mlx_encoders.index import StoreError, build, read_corpus
from mlx_encoders.index.lock import BuildLock, IndexBusy

CORPUS = {**FILES, "long.txt": "\n\n".join(f"Sentence {i} about topic {i % 5}." for i in range(20))}  # 28 texts


@pytest.fixture(scope="module")
def encoder(model) -> SentenceEncoder:  # noqa: F811 (the fixture imported above)
    return SentenceEncoder(model)


def part_texts(folder: Path, part: int, parts: int) -> set[str]:
    with closing(sqlite3.connect(folder / "shards" / f"part-{part}-of-{parts}.sqlite")) as con:
        return {text for (text,) in con.execute("SELECT text FROM staged")}


def dealt(corpus: Path, chunk: int, parts: int) -> list[set[str]]:
    """The texts of each part: distinct texts sorted by SHA-256, cut into chunks, dealt round-robin."""
    texts = sorted({text for _, text in read_corpus(corpus)}, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    return [{t for c in chunks[p::parts] for t in c} for p in range(parts)]


@pytest.fixture
def encoded(monkeypatch) -> list[str]:
    """Every text sent to the encoder."""
    texts, real = [], SentenceEncoder.encode
    monkeypatch.setattr(SentenceEncoder, "encode", lambda self, t, *a, **k: texts.extend(t) or real(self, t, *a, **k))
    return texts


def test_parts_built_apart_and_merged_equal_a_one_process_build(tmp_path, encoder, encoded):
    corpus = write_corpus(tmp_path / "corpus", CORPUS)
    machines = [tmp_path / "machine-1", tmp_path / "machine-2"]
    for part, folder in enumerate(machines, 1):
        counts = build(corpus, folder, encoder, chunk=3, shard=(part, 2), quiet=True)
        path = folder / "shards" / f"part-{part}-of-2.sqlite"
        assert counts == {"part": f"{part}/2", "texts": len(dealt(corpus, 3, 2)[part - 1]), "added": counts["texts"],
                          "path": str(path)}  # fmt: skip
        assert part_texts(folder, part, 2) == dealt(corpus, 3, 2)[part - 1]
        assert not (folder / "index.sqlite").exists()  # a part alone writes no index
    assert build(corpus, machines[0], encoder, chunk=3, shard=(1, 2), quiet=True)["added"] == 0  # done already

    shutil.copy(machines[1] / "shards" / "part-2-of-2.sqlite", machines[0] / "shards")
    encoded.clear()
    counts = build(corpus, machines[0], encoder, chunk=3, quiet=True)
    assert counts == {"documents": 28, "texts": 28, "added": 28, "dropped": 0} and encoded == []  # merged only
    assert not (machines[0] / "shards").exists()
    build(corpus, tmp_path / "single", encoder, chunk=3, quiet=True)
    assert_same_index(machines[0], tmp_path / "single", encoder.path, rows=True)  # ties rank alike


def test_a_part_being_built_is_neither_merged_nor_built_twice(tmp_path, encoder):
    corpus, folder = write_corpus(tmp_path / "corpus", CORPUS), tmp_path / "index"
    for part in (1, 2):
        build(corpus, folder, encoder, chunk=3, shard=(part, 2), quiet=True)
    parts = sorted(p.name for p in (folder / "shards").iterdir())
    assert parts == ["part-1-of-2.sqlite", "part-2-of-2.sqlite"]  # each part's lock gone with its build
    with BuildLock(folder / "shards", name="part-2-of-2.lock"):  # a build of part 2 still writing it
        busy = rf"Another build is writing part 2/2 of the index {folder}: pid \d+ .* holds .*part-2-of-2.lock"
        with pytest.raises(IndexBusy, match=busy + r"\. Merge once every part's build has ended"):
            build(corpus, folder, encoder, chunk=3, quiet=True)
        assert sorted(p.name for p in (folder / "shards").glob("*.sqlite")) == parts  # nothing merged or removed
        assert not (folder / "build.lock").exists()  # the refused merge let the folder go
        with pytest.raises(IndexBusy, match=busy + r"\. Two builds of one part would embed its texts twice"):
            build(corpus, folder, encoder, chunk=3, shard=(2, 2), quiet=True)
    with BuildLock(folder):  # a build of the whole index (a merge) running: no part starts meanwhile
        with pytest.raises(IndexBusy, match="A part is built while no build of the whole index runs"):
            build(corpus, folder, encoder, chunk=3, shard=(1, 2), quiet=True)
    assert build(corpus, folder, encoder, chunk=3, quiet=True)["documents"] == 28
    assert not (folder / "shards").exists()


def test_parts_of_a_grown_corpus_add_to_a_copy_of_the_index(tmp_path, encoder, encoded):
    """Each machine holds a copy of the index: parts deal only the texts it lacks, so the copies agree."""
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    (corpus / "long.txt").write_text(CORPUS["long.txt"])
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    build(corpus, index, encoder, chunk=3, shard=(1, 2), quiet=True)
    build(corpus, copy, encoder, chunk=3, shard=(2, 2), quiet=True)
    new = {text for _, text in read_corpus(corpus)} - {text for _, text in read_corpus(tmp_path / "corpus")}
    assert part_texts(index, 1, 2) | part_texts(copy, 2, 2) == set(CORPUS["long.txt"].split("\n\n")) != new
    assert not part_texts(index, 1, 2) & part_texts(copy, 2, 2)
    shutil.copy(copy / "shards" / "part-2-of-2.sqlite", index / "shards")
    encoded.clear()
    assert build(corpus, index, encoder, chunk=3, quiet=True)["added"] == 20 and encoded == []


def test_a_part_that_stopped_resumes_and_a_missing_part_is_embedded_by_the_merge(tmp_path, encoder, encoded, capsys):
    corpus, folder = write_corpus(tmp_path / "corpus", CORPUS), tmp_path / "index"
    module = importlib.import_module("mlx_encoders.index.build")  # `mlx_encoders.index.build` is the function
    real, staged = module.Store.stage, []

    def stage_then_stop(self, *args):
        real(self, *args)
        staged.append(1)
        if len(staged) == 2:
            raise KeyboardInterrupt

    module.Store.stage = stage_then_stop
    try:
        with pytest.raises(KeyboardInterrupt):
            build(corpus, folder, encoder, chunk=3, shard=(1, 3), quiet=True)
    finally:
        module.Store.stage = real
    first = part_texts(folder, 1, 3)
    assert len(first) == 6
    encoded.clear()
    counts = build(corpus, folder, encoder, chunk=3, shard=(1, 3), quiet=True)
    assert counts["added"] == counts["texts"] - 6 and not first & set(encoded)
    assert part_texts(folder, 1, 3) == first | set(encoded) == dealt(corpus, 3, 3)[0]

    encoded.clear()
    assert build(corpus, folder, encoder, chunk=3)["added"] == 28
    assert set(encoded) == dealt(corpus, 3, 3)[1] | dealt(corpus, 3, 3)[2]
    assert "parts [2, 3] of 3 are not in" in capsys.readouterr().err


def test_a_part_of_another_model_or_corpus_is_refused_naming_it(tmp_path, encoder):
    corpus, folder = write_corpus(tmp_path / "corpus", CORPUS), tmp_path / "index"
    other = st_model(tmp_path / "other", seed=1)
    build(corpus, tmp_path / "elsewhere", other, shard=(2, 2), quiet=True)
    (folder / "shards").mkdir(parents=True)
    part = folder / "shards" / "part-2-of-2.sqlite"
    shutil.copy(tmp_path / "elsewhere" / "shards" / "part-2-of-2.sqlite", part)
    with pytest.raises(StoreError, match=f"{part} was built with the model '{other}'.*Delete {part} to re-embed"):
        build(corpus, folder, encoder, quiet=True)

    another = write_corpus(tmp_path / "another", {"a.txt": "Another corpus.\n\nOf two texts.\n"})
    build(another, tmp_path / "another-index", encoder, chunk=1, shard=(2, 2), quiet=True)
    shutil.copy(tmp_path / "another-index" / "shards" / "part-2-of-2.sqlite", part)
    message = f"{part} holds 1 texts that are not in this corpus \\(such as '(Another corpus.|Of two texts.)'\\)"
    with pytest.raises(StoreError, match=message + ": it was embedded from another corpus"):
        build(corpus, folder, encoder, quiet=True)
    assert part.exists()  # not merged


def test_shard_options_are_checked(tmp_path, model, encoder, monkeypatch, capsys):  # noqa: F811
    corpus = write_corpus(tmp_path / "corpus")
    for bad in ("0/2", "3/2", "1", "a/b", "1/2/3"):
        with pytest.raises(SystemExit) as e:
            cli(["index", "build", "--corpus", str(corpus), "--index", str(tmp_path / "i"), "--shard", bad])
        assert e.value.code == 2 and "must be a part i/n of the corpus" in capsys.readouterr().err
    with pytest.raises(ValueError, match="1 <= i <= n, got 3/2"):
        build(corpus, tmp_path / "i", encoder, shard=(3, 2))
    module = importlib.import_module("mlx_encoders.index.build")
    monkeypatch.setattr(module, "world", lambda: World(None, 2, 0))
    with pytest.raises(ValueError, match="under mlx.launch the ranks share the corpus by themselves"):
        build(corpus, tmp_path / "i", encoder, shard=(1, 2))
    monkeypatch.undo()
    args = ["index", "build", "--corpus", str(corpus), "--index", str(tmp_path / "i"), "--model", str(model)]
    assert cli([*args, "--shard", "2/2", "--chunk", "2"]) == 0
    out, err = capsys.readouterr()
    path = tmp_path / "i" / "shards" / "part-2-of-2.sqlite"
    assert out == f"{path}: part 2/2, 4 texts (4 added)\n" and "part 2 of 2: 4 of 8 distinct texts, 4 to embed" in err


def test_graph_searches_from_threads_walk_each_with_its_own_width():
    """The width is the graph's state: a search sets it and must walk with it, whatever other threads set."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from mlx_encoders.index import ann

    class Graph:  # usearch's Index as candidates_of uses it: a width set, then a search that reads it
        expansion_search = 0

        def search(self, query, count, threads=0):
            width = self.expansion_search
            time.sleep(0.01)  # another thread may set its own width meanwhile
            return type("Matches", (), {"keys": [self.expansion_search, width]})()

    graph, start = Graph(), threading.Barrier(4)

    def walk(width: int) -> list[int]:
        start.wait(timeout=10)
        return [ann.candidates_of(graph, np.zeros(4, np.float32), 1, width, "float32").tolist() for _ in range(5)]

    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(walk, [10, 20, 30, 40]))
    assert found == [[[w, w]] * 5 for w in (10, 20, 30, 40)]
