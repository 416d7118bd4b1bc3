"""mlx_encoders.index: build (incremental, resumable, sharded over 2 ranks), search (exact, HNSW, int8/binary with
re-scoring), its faults, and the `mlx-encoders index` command. Vectors are checked against sentence-transformers,
rankings against numpy's exact search."""

import importlib
import io
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from contextlib import closing, contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from checkpoints import make_checkpoint
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tolerance import assert_float32_close, encoder_terms, float32_tolerance

from mlx_encoders import SentenceEncoder, records
from mlx_encoders.__main__ import main as cli
from mlx_encoders.distributed import World
from mlx_encoders.index import CorpusError, Index, StaleIndex, StoreError, build, read_corpus, search
from mlx_encoders.index.build import open_shard
from mlx_encoders.index.store import FORMAT, Store

ROOT = Path(__file__).parents[1]
LAUNCH = Path(sys.executable).with_name("mlx.launch")  # the venv's, whether or not it is on PATH
LAUNCH = LAUNCH if LAUNCH.exists() else shutil.which("mlx.launch") or "mlx.launch"
FILES = {
    "animals.md": "Cats purr when they are content.\n\nDogs bark at the mail carrier every morning.\n",
    "notes/code.txt": "Use argparse to read command line options.\n\nA zip file bundles many files in one.\n",
    "more.jsonl": '{"id": "fern", "text": "Ferns grow in the shade."}\n"Cacti store water."\n',
    "table.csv": "id,text\nrain,Rain falls from the clouds.\nsun,The sun rises in the east.\n",
}
IDS = ["animals.md#1", "animals.md#2", "fern", "more.jsonl:2", "notes/code.txt#1", "notes/code.txt#2", "rain", "sun"]


def st_model(folder: Path, seed: int = 0) -> Path:
    transformer = Transformer(str(make_checkpoint(folder / "bert", "bert", seed=seed)))
    SentenceTransformer(modules=[transformer, Pooling(32), Normalize()], device="cpu").save(str(folder / "st"))
    return folder / "st"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny random sentence-transformers model: it cannot rank by meaning, but a query equal to a document
    gets that document first with score 1."""
    return st_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def encoder(model) -> SentenceEncoder:
    return SentenceEncoder(model)


def write_corpus(folder: Path, files: dict[str, str] = FILES) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def stored(index: Path) -> tuple[list[tuple[str, str]], dict[str, bytes]]:
    """(document ids with their texts in corpus order, float32 vector bytes by text), read with sqlite3 alone."""
    with closing(sqlite3.connect(index / "index.sqlite")) as con:
        docs = con.execute("SELECT d.id, t.text FROM documents d JOIN texts t USING (key) ORDER BY d.position")
        vectors = dict(con.execute("SELECT text, vector FROM texts"))
        return docs.fetchall(), vectors


def text_rows(index: Path) -> list[str]:
    """The texts in row order: search breaks ties by row."""
    with closing(sqlite3.connect(index / "index.sqlite")) as con:
        return [text for (text,) in con.execute("SELECT text FROM texts ORDER BY row")]


def assert_same_index(a: Path, b: Path, model: Path, rows: bool = False) -> None:
    """The same documents and texts (with `rows`, in the same rows: two builds of one corpus from empty), and each
    text's vector up to float32 rounding of `model`'s sums."""
    (docs_a, vectors_a), (docs_b, vectors_b) = stored(a), stored(b)
    assert docs_a == docs_b and vectors_a.keys() == vectors_b.keys()
    assert not rows or text_rows(a) == text_rows(b)
    terms = encoder_terms(model, list(vectors_a))
    for text, vector in vectors_a.items():  # chunks of other texts pad batches differently: rounding only
        assert_float32_close(np.frombuffer(vector, "<f4"), np.frombuffer(vectors_b[text], "<f4"), terms)


def unit_vectors(count: int, dimension: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((count, dimension)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_build_and_search_match_sentence_transformers(tmp_path, model, encoder):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    counts = build(corpus, index, encoder, quiet=True)
    assert counts == {"documents": 8, "texts": 8, "added": 8, "dropped": 0}
    docs, vectors = stored(index)
    assert [doc_id for doc_id, _ in docs] == IDS

    oracle = SentenceTransformer(str(model), device="cpu")
    texts = [text for _, text in docs]
    expected = oracle.encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(np.stack([np.frombuffer(vectors[t], "<f4") for t in texts]), expected, atol=1e-5)

    query = "a question about files"
    q = oracle.encode(query, normalize_embeddings=True)
    order = np.argsort(-(expected @ q), kind="stable")[:3]
    hits = search(index, query, k=3, model=encoder)
    assert [h.id for h in hits] == [IDS[i] for i in order]
    np.testing.assert_allclose([h.score for h in hits], (expected @ q)[order], atol=1e-5)
    assert [h.text for h in hits] == [texts[i] for i in order]
    top = search(index, "Ferns grow in the shade.", k=1, model=encoder)[0]
    assert top.id == "fern" and abs(top.score - 1) < 1e-5


def test_incremental_rebuild_embeds_only_changes(tmp_path, encoder, monkeypatch):
    encoded = []
    real_encode = SentenceEncoder.encode

    def counting_encode(self, texts, *args, **kwargs):
        encoded.extend([texts] if isinstance(texts, str) else texts)
        return real_encode(self, texts, *args, **kwargs)

    monkeypatch.setattr(SentenceEncoder, "encode", counting_encode)
    corpus, index, clean = tmp_path / "corpus", tmp_path / "index", tmp_path / "clean"
    build(write_corpus(corpus), index, encoder, quiet=True)
    assert sorted(encoded) == sorted(text for _, text in read_corpus(corpus))

    changed = {**FILES, "animals.md": "Cats purr when they are content.\n\nDogs bark at the postman.\n"}
    del changed["table.csv"]
    changed["plants.txt"] = "Cacti store water.\n\nMoss likes damp stones.\n"  # one repeated text, one new
    encoded.clear()
    counts = build(write_corpus(corpus, changed), index, encoder, quiet=True)
    assert sorted(encoded) == ["Dogs bark at the postman.", "Moss likes damp stones."]
    assert counts == {"documents": 8, "texts": 7, "added": 2, "dropped": 3}
    encoded.clear()
    assert build(corpus, index, encoder, quiet=True)["added"] == 0 and encoded == []

    build(corpus, clean, encoder, quiet=True)
    assert_same_index(index, clean, encoder.path)
    assert [h.id for h in search(index, "Cacti store water.", k=2, model=encoder)] == ["more.jsonl:2", "plants.txt#1"]


# Builds with 2-text chunks and SIGKILLs itself right after the 3rd chunk is committed; every text sent to encode
# is appended to a log first.
KILLED_BUILD = """
import os, signal, sys
from mlx_encoders import SentenceEncoder
from mlx_encoders.index import build
from mlx_encoders.index.build import open_shard
from mlx_encoders.index.store import FORMAT, Store
corpus, index, model, log = sys.argv[1:]
encode, stage, commits = SentenceEncoder.encode, Store.stage, []
def logged_encode(self, texts, *args, **kwargs):
    with open(log, "a") as f:
        f.writelines(t + "\\n" for t in texts)
    return encode(self, texts, *args, **kwargs)
def stage_then_die(self, *args):
    stage(self, *args)
    commits.append(1)
    if len(commits) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
SentenceEncoder.encode, Store.stage = logged_encode, stage_then_die
build(corpus, index, model, chunk=2, quiet=True)
"""


def test_killed_build_resumes_without_repeating_or_losing_texts(tmp_path, model, encoder, monkeypatch):
    corpus, index, clean = write_corpus(tmp_path / "corpus"), tmp_path / "index", tmp_path / "clean"
    build(corpus, index, encoder, quiet=True)
    previous = stored(index)
    texts = [f"Paragraph number {i} of a longer file." for i in range(12)]
    (corpus / "long.txt").write_text("\n\n".join(texts))
    log = tmp_path / "encoded.txt"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_BUILD, str(corpus), str(index), str(model), str(log)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = log.read_text().splitlines()
    assert len(first) == 6 and set(first) <= set(texts)
    assert stored(index) == previous  # the 3 committed chunks are staged: searches still see the previous index
    assert sorted(h.id for h in search(index, texts[0], k=20, model=encoder)) == IDS

    resumed = []
    real_encode = SentenceEncoder.encode
    monkeypatch.setattr(
        SentenceEncoder, "encode", lambda self, t, *a, **k: resumed.extend(t) or real_encode(self, t, *a, **k)
    )
    assert build(corpus, index, encoder, quiet=True)["added"] == 12
    assert not set(first) & set(resumed) and sorted(first + resumed) == sorted(texts)
    monkeypatch.undo()
    build(corpus, clean, encoder, quiet=True)
    assert_same_index(index, clean, encoder.path)


def free_ports(count: int) -> int:
    """A first port of `count` consecutive free ones on 127.0.0.1 (mlx.launch's ring takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            sockets = [socket.create_server(("127.0.0.1", first + i)) for i in range(count)]
        except OSError:
            continue
        for s in sockets:
            s.close()
        return first
    raise RuntimeError("no free consecutive ports on 127.0.0.1")


RANK_BUILD = """
import json, os, signal, sys
import mlx.core as mx
from mlx_encoders import SentenceEncoder
from mlx_encoders.index import build
corpus, index, model, status = sys.argv[1:]
rank = mx.distributed.init().rank()
if os.environ.get("FAIL_RANK") == str(rank):
    SentenceEncoder.encode = lambda *args, **kwargs: 1 / 0
if os.environ.get("KILL_RANK") == str(rank):  # SIGKILLed right after its first commit
    from mlx_encoders.index.store import Store
    stage = Store.stage
    Store.stage = lambda *args: stage(*args) or os.kill(os.getpid(), signal.SIGKILL)
try:
    counts = build(corpus, index, model, chunk=3, quiet=True)
    result = {"rank": rank, "size": mx.distributed.init().size(), "ok": True, "counts": counts}
except Exception as e:
    result = {"rank": rank, "ok": False, "error": repr(e)}
open(f"{status}.{rank}.part", "w").write(json.dumps(result))
os.replace(f"{status}.{rank}.part", f"{status}.{rank}")  # whole or absent: mlx.launch may kill this rank meanwhile
"""


def launch_two_ranks(tmp_path: Path, corpus: Path, index: Path, model: Path, **env) -> list[dict]:
    """Each rank's status ({"rank", "ok", ...}) of a 2-rank `mlx.launch` build on 127.0.0.1."""
    script = tmp_path / "rank_build.py"
    script.write_text(RANK_BUILD)
    launched = subprocess.run(
        [LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)), sys.executable,
         str(script), str(corpus), str(index), str(model), str(tmp_path / "status")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=180,
    )  # fmt: skip
    files = [tmp_path / f"status.{rank}" for rank in range(2)]
    statuses = [json.loads(file.read_text()) for file in files if file.exists()]
    for file in files:
        file.unlink(missing_ok=True)
    assert len(statuses) == 2 or "KILL_RANK" in env, launched.stdout + launched.stderr  # it may exit 0 all the same
    return statuses


def test_two_ranks_build_equals_one_process(tmp_path, model, encoder, monkeypatch):
    files = {**FILES, "long.txt": "\n\n".join(f"Sentence {i} about topic {i % 5}." for i in range(20))}
    corpus, index, single = write_corpus(tmp_path / "corpus", files), tmp_path / "index", tmp_path / "single"
    statuses = launch_two_ranks(tmp_path, corpus, index, model)
    assert all(s["ok"] and s["size"] == 2 for s in statuses), statuses
    assert statuses[0]["counts"] == {"documents": 28, "texts": 28, "added": 28, "dropped": 0}
    assert not list((index / "shards").glob("*.sqlite"))  # merged and removed

    build(corpus, single, encoder, chunk=3, quiet=True)
    assert_same_index(index, single, model, rows=True)  # tied hits rank alike

    (corpus / "new.txt").write_text("\n\n".join(f"New sentence {i}." for i in range(10)))  # 4 chunks
    statuses = launch_two_ranks(tmp_path, corpus, index, model, FAIL_RANK="1")
    assert statuses[1] == {"rank": 1, "ok": False, "error": "ZeroDivisionError('division by zero')"}
    failed = "RanksFailed('index build: embedding failed on rank(s) [1]; see their messages')"
    assert statuses[0] == {"rank": 0, "ok": False, "error": failed}
    assert_same_index(index, single, model)  # the previous index
    shard = index / "shards" / "rank-0.sqlite"
    with closing(sqlite3.connect(shard)) as con:  # rank 0 committed its 2 chunks before rank 1 failed
        done = {text for (text,) in con.execute("SELECT text FROM staged")}
    assert len(done) == 6

    encoded = []  # resumed by one process: the shard's texts count as done and are merged
    real_encode = SentenceEncoder.encode
    monkeypatch.setattr(
        SentenceEncoder, "encode", lambda self, t, *a, **k: encoded.extend(t) or real_encode(self, t, *a, **k)
    )
    assert build(corpus, index, encoder, chunk=3, quiet=True)["added"] == 10
    assert len(encoded) == 4 and not done & set(encoded) and not shard.exists()
    monkeypatch.undo()
    build(corpus, single, encoder, chunk=3, quiet=True)
    assert_same_index(index, single, model)


def test_a_killed_rank_stops_the_run_and_the_build_resumes(tmp_path, model, encoder, monkeypatch):
    files = {"long.txt": "\n\n".join(f"Sentence {i} about topic {i % 5}." for i in range(24))}
    corpus, index, clean = write_corpus(tmp_path / "corpus", files), tmp_path / "index", tmp_path / "clean"
    build(write_corpus(tmp_path / "first", FILES), index, encoder, chunk=3, quiet=True)
    previous = stored(index)
    statuses = launch_two_ranks(tmp_path, corpus, index, model, KILL_RANK="1")
    assert not any(s.get("ok") for s in statuses), statuses  # mlx.launch ends rank 0 when rank 1 dies
    assert stored(index) == previous
    done = set()
    for shard in (index / "shards").glob("rank-*.sqlite"):
        with closing(sqlite3.connect(shard)) as con:
            done |= {text for (text,) in con.execute("SELECT text FROM staged")}
    assert len(done) >= 3  # rank 1's first chunk at least

    encoded = []
    real_encode = SentenceEncoder.encode
    monkeypatch.setattr(
        SentenceEncoder, "encode", lambda self, t, *a, **k: encoded.extend(t) or real_encode(self, t, *a, **k)
    )
    build(corpus, index, encoder, chunk=3, quiet=True)
    assert not done & set(encoded) and len(done) + len(encoded) == 24
    monkeypatch.undo()
    build(corpus, clean, encoder, chunk=3, quiet=True)
    assert_same_index(index, clean, model)


def test_a_shard_is_created_whole(tmp_path, encoder):
    """A rank killed while creating its shard leaves only `rank-<r>.sqlite.new`: never read, removed next build."""
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    (index / "shards").mkdir(parents=True)
    (index / "shards" / "rank-1.sqlite.new").write_bytes(b"SQLite format 3\x00 cut short")
    (index / "shards" / "rank-1.sqlite.new-wal").write_bytes(b"")
    build(corpus, index, encoder, chunk=3, quiet=True)
    assert not (index / "shards").exists()  # emptied, then removed

    meta = {"model_fingerprint": "f", "model": "m"}
    (index / "shards").mkdir()
    (index / "shards" / "rank-0.sqlite.new").write_bytes(b"not a database")
    with open_shard(index / "shards" / "rank-0.sqlite", meta) as shard:
        assert shard.meta["format"] == FORMAT and shard.meta["model_fingerprint"] == "f" and not shard.keys()
    assert sorted(p.name for p in (index / "shards").iterdir()) == ["rank-0.sqlite"]


def test_corrupted_ann_file_is_rebuilt_and_stale_one_replaced(tmp_path, encoder, capsys):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, ann=True, quiet=True)
    graph = index / "ann-float32.usearch"
    exact = [(h.id, h.score) for h in Index(index, encoder, ann=False).search("Rain falls from the clouds.", 8)]
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    hits = Index(index, encoder, ann=True).search("Rain falls from the clouds.", 8)
    assert "rebuilding" in capsys.readouterr().err
    assert [(h.id, h.score) for h in hits] == exact  # 8 vectors: every one is a candidate, re-scored exactly

    graph.write_bytes(graph.read_bytes()[:100])
    Index(index, encoder, ann=True)
    assert "damaged: its bytes do not match" in capsys.readouterr().err

    (corpus / "new.txt").write_text("Snow is frozen water.")
    build(corpus, index, encoder, ann=False, quiet=True)
    hits = Index(index, encoder, ann=True).search("Snow is frozen water.", 1)
    assert "stale" in capsys.readouterr().err and hits[0].id == "new.txt#1"
    Index(index, encoder, ann=True)
    assert capsys.readouterr().err == ""  # the rebuilt graph is reused


def test_a_graph_of_a_deleted_store_is_not_taken_for_the_new_one(tmp_path, encoder, capsys):
    """The store deleted and another corpus of as many texts built into the folder: generation 1 and the same row
    count again, but another store (its id), so the graph left beside it is rebuilt, never searched."""
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, ann=True, quiet=True)
    pairs = [(f"other-{i}", f"{text} (elsewhere)") for i, (_, text) in enumerate(stored(index)[0])]
    for path in index.glob("index.sqlite*"):
        path.unlink()
    build(pairs, index, encoder, ann=False, quiet=True)
    capsys.readouterr()
    hits = Index(index, encoder, ann=True).search(pairs[3][1], 8)
    assert "stale" in capsys.readouterr().err
    exact = Index(index, encoder, ann=False).search(pairs[3][1], 8)
    assert [(h.id, h.score) for h in hits] == [(h.id, h.score) for h in exact] and hits[0].id == "other-3"


def test_corrupted_store_is_a_clear_error_and_left_as_it_was(tmp_path, encoder):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    store = index / "index.sqlite"
    data = bytearray(store.read_bytes())
    data[100:4096] = os.urandom(3996)  # the header's tail and the schema page
    store.write_bytes(bytes(data))
    for attempt in (lambda: build(corpus, index, encoder, quiet=True), lambda: search(index, "x", model=encoder)):
        with pytest.raises(StoreError, match=f"The index store {store} is damaged or not an index") as e:
            attempt()
        assert "restore it from a copy, or delete its folder and build again" in str(e.value)
        assert store.read_bytes() == bytes(data)


def test_damaged_shard_is_named_and_the_index_kept(tmp_path, encoder):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    previous = stored(index)
    (index / "shards").mkdir()
    shard = index / "shards" / "rank-1.sqlite"
    shard.write_bytes(os.urandom(8192))
    (corpus / "new.txt").write_text("Snow is frozen water.")
    message = rf"shard of a distributed build is unusable: .* {shard} is damaged.*Delete {shard} to re-embed"
    with pytest.raises(StoreError, match=message):
        build(corpus, index, encoder, quiet=True)
    assert stored(index) == previous
    shard.unlink()
    assert build(corpus, index, encoder, quiet=True)["added"] == 1


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), sqlite3.OperationalError("disk is full")])
def test_full_disk_rolls_back_and_keeps_the_index(tmp_path, encoder, monkeypatch, failure):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    previous = stored(index)

    class FullDisk(sqlite3.Connection):
        def executemany(self, sql, rows):
            if sql.startswith("INSERT INTO documents"):  # the last transaction, after the old documents went
                raise failure
            return super().executemany(sql, rows)

    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *args, **kwargs: connect(*args, factory=FullDisk, **kwargs))
    (corpus / "new.txt").write_text("Snow is frozen water.")
    with pytest.raises(StoreError, match=f"Could not write to the index store {index / 'index.sqlite'}: .*full|space"):
        build(corpus, index, encoder, quiet=True)
    monkeypatch.undo()
    assert stored(index) == previous
    assert build(corpus, index, encoder, quiet=True)["added"] == 1


def test_another_model_is_an_error(tmp_path, encoder):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    other = st_model(tmp_path / "other", seed=1)
    with pytest.raises(StoreError, match=f"built with the model .*; '{other}' gives model_fingerprint"):
        build(corpus, index, other, quiet=True)
    for given in (other, SentenceEncoder(other)):
        with pytest.raises(StoreError, match=f"'{other}' is another model"):
            search(index, "x", model=given)


def test_bad_corpus_lines_are_named(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'"fine"\n\n{"text": "unterminated\n')
    with pytest.raises(CorpusError, match=f"^{jsonl}:3: not a JSON value"):
        read_corpus(jsonl)
    jsonl.write_bytes(b'"fine"\n"caf\xe9"\n')  # latin-1, not UTF-8
    with pytest.raises(CorpusError, match=f"^{jsonl}:2: not UTF-8"):
        read_corpus(jsonl)
    jsonl.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(CorpusError, match="the id 'a' appears twice"):
        read_corpus(jsonl)
    # pairs from Python: a lone surrogate (text decoded with errors="surrogateescape") named before any embedding
    for pairs, what in (([("a", "fine"), ("b", "bad \udcff")], "text"), ([("bad\udcff", "fine")], "id")):
        with pytest.raises(CorpusError, match=f"of the given documents: its {what} is not valid Unicode"):
            read_corpus(pairs)
    table = tmp_path / "t.csv"
    table.write_text("id,body\n1,x\n")
    with pytest.raises(CorpusError, match=f"^{table}: no 'text' column"):
        read_corpus(table)
    text = tmp_path / "notes.txt"
    text.write_bytes(b"one\n\ntwo \xff\n")
    with pytest.raises(CorpusError, match=f"^{text}:3: not UTF-8"):
        read_corpus(text)
    # pairs from Python follow a file's rules: a text, and an id that is a string or an integer
    for pairs, message in (
        ([("a", "fine"), ("b", "")], "the given documents: item 2: the text is empty"),
        ([(None, "x")], "the given documents: item 1: the id is missing"),
        ([(1.5, "y")], "the given documents: item 1: the id is float 1.5"),
        ([("a", "x", "extra")], "item 1: expected an \\(id, text\\) pair"),
    ):
        with pytest.raises(CorpusError, match=message):
            read_corpus(pairs)
    assert read_corpus([(np.int64(7), "x"), (8, "y")]) == [("7", "x"), ("8", "y")]
    rows = np.array([["d1", "a text"], ["d2", "another"]], dtype=object)  # a DataFrame's to_numpy()
    assert read_corpus(rows) == [("d1", "a text"), ("d2", "another")]
    (tmp_path / "upper").mkdir()  # extensions in any case, as training reads them
    (tmp_path / "upper" / "B.TXT").write_text("Beta about dogs.\n")
    (tmp_path / "upper" / "c.JSONL").write_text('{"id": "c1", "text": "Gamma about birds."}\n')
    assert read_corpus(tmp_path / "upper") == [("B.TXT#1", "Beta about dogs."), ("c1", "Gamma about birds.")]
    assert read_corpus(tmp_path / "upper" / "B.TXT") == [("B.TXT#1", "Beta about dogs.")]
    with pytest.raises(CorpusError, match="no such file or folder: .*nope.txt"):
        read_corpus(tmp_path / "nope.txt")


def test_build_options_are_checked_before_anything_is_written(tmp_path, model):
    for options, message in (
        ({"precision": "int4"}, "precision must be one of float32, int8, binary, got 'int4'"),
        ({"ann": True, "recall": 7.0}, "recall must be a number in \\(0, 1\\], got 7.0"),
        ({"chunk": 0}, "chunk must be an integer of 1 or more, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer of 1 or more, got 2.5"),
    ):
        with pytest.raises(ValueError, match=message):
            build([("a", "x")], tmp_path / "index", model, quiet=True, **options)
        assert not (tmp_path / "index").exists()
    (tmp_path / "notes.txt").write_text("mine")  # a file where the folder would be, or above it
    with pytest.raises(ValueError, match=r"index .*notes.txt cannot be a folder: .*notes.txt is a file"):
        build([("a", "x")], tmp_path / "notes.txt", model, quiet=True)
    with pytest.raises(ValueError, match=r"index .*notes.txt/index \(in .*notes.txt, a file\) cannot be a folder"):
        build([("a", "x")], tmp_path / "notes.txt" / "index", model, quiet=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def write_parquet(file: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), file, row_group_size=2)
    return file


@pytest.fixture
def small_batches(monkeypatch):
    """Two rows per record batch, so the reader streams several and counts rows across them."""
    monkeypatch.setattr(records, "PARQUET_BATCH", 2)


ROWS = [("rain", "Rain falls from the clouds."), ("sun", "The sun rises in the east."), ("fern", "Ferns grow.")]
ROWS += [("moss", "Moss likes damp stones."), ("cactus", "Cacti store water.")]


def test_parquet_corpus_equals_the_same_rows_as_jsonl(tmp_path, encoder, small_batches):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in ROWS))
    table = write_parquet(tmp_path / "rows.parquet", {"id": [i for i, _ in ROWS], "text": [t for _, t in ROWS]})
    assert read_corpus(table) == read_corpus(jsonl)
    build(table, tmp_path / "from-parquet", encoder, quiet=True)
    build(jsonl, tmp_path / "from-jsonl", encoder, quiet=True)
    assert_same_index(tmp_path / "from-parquet", tmp_path / "from-jsonl", encoder.path)

    # without an id column a row is `name:row`; an integer id reads as the jsonl reader reads it, as its string
    folder = tmp_path / "folder"
    folder.mkdir()
    write_parquet(folder / "plain.parquet", {"text": [t for _, t in ROWS], "other": list(range(5))})
    assert read_corpus(folder) == [(f"plain.parquet:{n}", t) for n, (_, t) in enumerate(ROWS, 1)]
    write_parquet(table, {"id": [10, 20, 30], "text": ["a", "b", "c"]})
    jsonl.write_text('{"id": 10, "text": "a"}\n{"id": 20, "text": "b"}\n{"id": 30, "text": "c"}\n')
    assert read_corpus(table) == read_corpus(jsonl)


def test_bad_parquet_rows_are_named(tmp_path, model, monkeypatch, capsys, small_batches):
    table = tmp_path / "t.parquet"
    write_parquet(table, {"id": ["a"], "body": ["x"]})
    with pytest.raises(CorpusError, match=rf"^{table}: no 'text' column in the columns \['id', 'body'\]"):
        read_corpus(table)
    write_parquet(table, {"text": ["x", "y", None]})  # row 3 is in the second record batch
    with pytest.raises(CorpusError, match=f"^{table}: row 3: the text is null, not a string"):
        read_corpus(table)
    write_parquet(table, {"text": [1, 2]})
    with pytest.raises(CorpusError, match=f"^{table}: row 1: the text is int, not a string"):
        read_corpus(table)
    write_parquet(table, {"id": ["a", "b", "c", "a"], "text": ["w", "x", "y", "z"]})
    with pytest.raises(CorpusError, match=rf"^{table}: row 4: the id 'a' appears twice \(first at row 1\)"):
        read_corpus(table)
    table.write_text("id,text\na,x\n")
    with pytest.raises(CorpusError, match=f"^{table}: not a readable Parquet file"):
        read_corpus(table)

    write_parquet(table, {"text": ["x"]})
    for module in ("pyarrow", "pyarrow.parquet"):  # as if the parquet extra were not installed
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=f"^{table}: a .parquet file needs pyarrow: pip install pyarrow$"):
        read_corpus(tmp_path)
    assert cli(["index", "build", "--corpus", str(table), "--index", str(tmp_path / "i"), "--model", str(model)]) == 1
    expected = f"mlx-encoders index: error: {table}: a .parquet file needs pyarrow: pip install pyarrow"
    assert expected in capsys.readouterr().err


def write_vectors(index: Path, vectors: np.ndarray) -> None:
    """An index of `vectors` without a model: documents "0", "1", ..."""
    index.mkdir()
    with Store(index / "index.sqlite", create=True) as store:
        store.set_meta({"model": "random", "model_fingerprint": "-", "dimension": str(vectors.shape[1])})
        keys = [str(i) for i in range(len(vectors))]
        store.stage(keys, keys, vectors)
        store.commit_index(list(zip(keys, keys, strict=True)))


def test_ties_go_by_row_at_the_cut_too():
    """A smaller k's answer is the start of a larger one's, whatever ties the cut falls among."""
    from mlx_encoders.index.search import best

    scores = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5, 2.0])
    assert best(scores, 3).tolist() == [1, 3, 2]
    assert all(best(scores, k).tolist() == best(scores, 8).tolist()[:k] for k in range(1, 9))


def test_a_graph_record_of_another_shape_is_rebuilt(tmp_path, capsys):
    from mlx_encoders.index import ann

    vectors = unit_vectors(300, 16, seed=0)
    write_vectors(tmp_path / "i", vectors)
    Index(tmp_path / "i", ann=True)  # builds and records the graph
    ann.paths(tmp_path / "i", "float32")[1].write_text("[1, 2]")
    index = Index(tmp_path / "i", ann=True)
    assert "rebuilding" in (err := capsys.readouterr().err) and "its record is not a graph's" in err
    assert index.search(vectors[5], 1)[0].id == "5"
    with pytest.raises(ValueError, match=r"a query vector of shape \(15,\), but the index .* holds vectors of 16 "):
        index.search(vectors[5][:15], 1)


def test_non_finite_vectors_are_refused_in_queries_and_in_the_store(tmp_path):
    """A NaN query found nothing (every comparison fails) and an infinite one scored inf; a NaN text vector (a
    half-precision overflow) made every int8 search of its index find nothing."""
    vectors = unit_vectors(300, 16, seed=0)
    write_vectors(tmp_path / "i", vectors)
    for precision, ann in (("float32", False), ("int8", False), ("binary", False), ("float32", True)):
        index = Index(tmp_path / "i", ann=ann, precision=precision)
        for bad in (np.nan, np.inf):
            query = vectors[3].copy()
            query[5] = bad
            with pytest.raises(ValueError, match="a query vector with NaN or infinite values"):
                index.search(query, 3)
    with Store(tmp_path / "i" / "index.sqlite") as store:
        before = store.keys()
        rows = unit_vectors(3, 16, seed=1)
        rows[1, 0] = np.nan
        with pytest.raises(ValueError, match="text 'b' was embedded as NaN or infinite values.*nothing of its chunk"):
            store.stage(["ka", "kb", "kc"], ["a", "b", "c"], rows)
        assert store.keys() == before
    for rescore in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"rescore must be an integer of 1 or more, got {rescore!r}"):
            Index(tmp_path / "i", rescore=rescore)


def test_threads_that_open_an_index_at_once_each_get_its_graph(tmp_path, capsys):
    """Each thread building the missing graph writes under a name of its own (one per process was renamed from
    under the others: FileNotFoundError), and the graph, its floats and its record left are one build's."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx_encoders.index import ann

    file, both = tmp_path / "ann-int8.usearch", threading.Barrier(2)

    def named(_) -> Path:
        both.wait(timeout=30)  # two threads, each its own name
        return ann.temporary_for(file)

    with ThreadPoolExecutor(2) as pool:
        assert len(set(pool.map(named, range(2)))) == 2
    vectors = unit_vectors(2_000, 32, seed=0)
    write_vectors(tmp_path / "i", vectors)
    for precision in ("float32", "int8"):
        with ThreadPoolExecutor(4) as pool:
            opened = [pool.submit(Index, tmp_path / "i", ann=True, precision=precision) for _ in range(4)]
            assert all(future.result().search(vectors[7], 1)[0].id == "7" for future in opened)
        capsys.readouterr()
        Index(tmp_path / "i", ann=True, precision=precision)
        assert "rebuilding" not in capsys.readouterr().err
    assert not list((tmp_path / "i").glob(".*.tmp"))


def recall_at_10(index: Index, vectors: np.ndarray, queries: np.ndarray) -> float:
    found = 0
    for q in queries:
        exact = set(np.argsort(-(vectors @ q), kind="stable")[:10].astype(str))
        found += len(exact & {h.id for h in index.search(q, 10)})
    return found / (10 * len(queries))


def test_ann_and_quantized_recall_against_exact_search(tmp_path):
    """recall@10 against exact float32 search on random unit vectors, the hardest case for both (no clusters)."""
    recalls, queries = {}, {d: unit_vectors(30, d, seed=1) for d in (32, 128)}
    for name, count, dimension, ann, precision, rescore in [
        ("hnsw float32 10k x 32", 10_000, 32, True, "float32", 100),
        ("exact int8 10k x 128", 10_000, 128, False, "int8", 100),
        ("exact binary 10k x 128", 10_000, 128, False, "binary", 100),
        ("hnsw int8 2k x 32", 2_000, 32, True, "int8", 100),
        ("hnsw binary 2k x 32", 2_000, 32, True, "binary", 100),
    ]:
        folder, vectors = tmp_path / f"{count}-{dimension}", unit_vectors(count, dimension, seed=0)
        if not folder.exists():
            write_vectors(folder, vectors)
        index = Index(folder, ann=ann, precision=precision, rescore=rescore)
        recalls[name] = recall_at_10(index, vectors, queries[dimension])
    print("\nrecall@10 against exact search:", json.dumps(recalls, indent=1))
    assert min(recalls.values()) >= 0.4, recalls
    assert recalls["hnsw float32 10k x 32"] >= 0.95 and recalls["exact int8 10k x 128"] >= 0.95
    assert recalls["hnsw int8 2k x 32"] >= 0.95 and recalls["exact binary 10k x 128"] == 1.0
    hit = Index(tmp_path / "2000-32", precision="binary").search(unit_vectors(2_000, 32, seed=0)[123], 1)[0]
    assert hit.id == "123" and abs(hit.score - 1) <= float32_tolerance(32, 1.0)  # re-scored: a float32 sum of 32


def test_int8_codes_rank_embeddings_that_share_a_direction(tmp_path):
    """Trained embedders' vectors share a mean direction (pairwise cosines near 0.8): per-dimension int8 codes
    offset by -128 must still pick candidates by inner product (the codes' own product lost a fifth of the top 10)."""
    mean = np.random.default_rng(99).standard_normal(64)
    vectors, queries = (unit_vectors(n, 64, seed) * 4 + mean for n, seed in ((4_000, 0), (30, 1)))
    vectors, queries = (np.float32(x / np.linalg.norm(x, axis=1, keepdims=True)) for x in (vectors, queries))
    assert 0.7 < float((vectors[:500] @ vectors[:500].T).mean()) < 0.9
    write_vectors(tmp_path / "shared", vectors)
    index = Index(tmp_path / "shared", ann=False, precision="int8", rescore=100)
    assert index.way["method"] == "exact" and recall_at_10(index, vectors, queries) >= 0.99


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_build_shows_one_progress_bar_of_texts_on_a_terminal(tmp_path, encoder, monkeypatch):
    """One bar of texts over all the chunks (not the encoder's bar of batches, one a chunk at 8 batches), none
    when quiet or when stderr is not a terminal."""
    corpus = [(str(i), f"Sentence {i} of the corpus.") for i in range(20)]
    for stderr, quiet, index in ((Terminal(), False, "a"), (Terminal(), True, "b"), (io.StringIO(), False, "c")):
        monkeypatch.setattr(sys, "stderr", stderr)
        build(corpus, tmp_path / index, encoder, batch_size=1, chunk=8, quiet=quiet)
        frames = stderr.getvalue().replace("\r", "\n").splitlines()
        bars = [frame for frame in frames if "|" in frame]
        if quiet or index == "c":
            assert bars == [] and ("embedded 20 texts" in stderr.getvalue()) is not quiet
        else:
            assert bars and all(frame.startswith("embedding:") and "/20 [" in frame for frame in bars)


def test_a_model_folder_given_relative_is_found_from_any_directory(tmp_path, model, monkeypatch):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    monkeypatch.chdir(model.parent)
    build(corpus, index, model.name, quiet=True)  # a path relative to here
    with Store(index / "index.sqlite") as store:
        assert store.meta["model"] == str(model.resolve())
    monkeypatch.chdir(tmp_path)
    assert search(index, "Cats purr when they are content.", k=1)[0].id == "animals.md#1"

    with Store(index / "index.sqlite") as store:  # as an index built before this recorded its folder whole
        store.set_meta({"model": model.name})
    with pytest.raises(FileNotFoundError, match=f"records its model as {model.name!r}, as given when it was built"):
        search(index, "Cats purr when they are content.", k=1)
    assert search(index, "Cats purr when they are content.", k=1, model=model)[0].id == "animals.md#1"


def test_command_line_build_and_search(tmp_path, model, capsys, monkeypatch):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    assert cli(["index", "build", "--corpus", str(corpus), "--index", str(index), "--model", str(model)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{index}: 8 documents, 8 texts (8 added, 0 dropped)\n" and "8 to embed over 1 rank(s)" in err
    assert cli(["index", "search", "--index", str(index), "Cats purr when they are content.", "-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["> Cats purr when they are content.", " 1. 1.000  animals.md#1",
                         "    Cats purr when they are content."]  # fmt: skip
    assert len(lines) == 5
    queries = ["Rain falls from the clouds.", "Cacti store water."]
    assert cli(["index", "search", "--index", str(index), *queries, "-k", "1", "--json"]) == 0
    out = capsys.readouterr().out
    rain, cacti = json.loads(out)
    assert len(out.splitlines()) == 4  # "[", one line per query, "]": as every command's --json
    assert rain["query"] == "Rain falls from the clouds." and rain["hits"][0]["id"] == "rain"
    assert abs(rain["hits"][0]["score"] - 1) < 1e-5 and rain["hits"][0]["text"] == "Rain falls from the clouds."
    assert cacti["hits"][0]["id"] == "more.jsonl:2"
    assert cli(["index", "search", "--index", str(index), *queries, "-k", "1", "--json", "--indent", "2"]) == 0
    indented = capsys.readouterr().out
    assert json.loads(indented) == json.loads(out) and '\n  {\n    "query": "Rain' in indented
    monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeff" + "\r\n".join(queries) + "\n\n"))  # as every command
    assert cli(["index", "search", "--index", str(index), "-k", "1", "--json"]) == 0
    assert capsys.readouterr().out == out

    (corpus / "bad.jsonl").write_text("{oops\n")
    assert cli(["index", "build", "--corpus", str(corpus), "--index", str(index), "--model", str(model)]) == 1
    assert f"mlx-encoders index: error: {corpus / 'bad.jsonl'}:1: not a JSON value" in capsys.readouterr().err


def rebuild(index: Path, texts: dict[str, np.ndarray]) -> None:
    """A new build of a `write_vectors` index: documents `texts` (id = text -> vector)."""
    with Store(index / "index.sqlite") as store:
        store.stage(list(texts), list(texts), np.array(list(texts.values())))
        store.commit_index([(key, key) for key in texts])


def test_an_index_opened_before_a_rebuild_refuses_to_mix_the_two_builds(tmp_path):
    """Dropping the text of the highest row, then adding one, reuses that row number in SQLite: an `Index` opened
    before would map the dropped text's vector to the new text. Each search finds the rebuild and raises instead;
    so does a folder deleted and built again (generation 1 again)."""
    folder, vectors = tmp_path / "index", unit_vectors(7, 8, seed=0)
    write_vectors(folder, vectors[:6])
    opened = Index(folder)
    assert opened.search(vectors[5], 1)[0].id == "5"
    rebuild(folder, {str(i): vectors[i] for i in range(5)})
    rebuild(folder, {**{str(i): vectors[i] for i in range(5)}, "new": vectors[6]})
    with pytest.raises(StaleIndex, match=f"^The index {re.escape(str(folder))} was rebuilt .*open the index again"):
        opened.search(vectors[5], 1)
    shutil.rmtree(folder)
    write_vectors(folder, vectors[1:])  # generation 1 again, as when `opened` was opened
    with pytest.raises(StaleIndex):
        opened.search(vectors[5], 1)
    assert Index(folder).search(vectors[6], 1)[0].id == "5"


def test_a_rank_that_cannot_read_the_store_tells_the_others(tmp_path, encoder, monkeypatch):
    """Rank 1 of 2 on a host that does not see the index folder: its error goes through the exchange that tells
    every rank (raised before it, it would leave the others waiting), and each exchange runs under
    `distributed.collective`'s guard against a lost or stalled rank."""
    module = importlib.import_module("mlx_encoders.index.build")  # `mlx_encoders.index.build` is the function
    steps, flags = [], []

    @contextmanager
    def guarded(world, what, seconds=None):
        steps.append(what)
        yield

    def all_sum(x, **_):  # what rank 0 would add: no failure of its own
        flags.append(x.tolist())
        return x

    monkeypatch.setattr(module, "world", lambda: World(None, 2, 1))
    monkeypatch.setattr(importlib.import_module("mlx_encoders.distributed"), "collective", guarded)  # `agree`'s
    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    with pytest.raises(StoreError, match="index.sqlite does not exist"):
        build([("a", "A text.")], tmp_path / "unseen", encoder, quiet=True)
    assert steps == ["index build: opening the index", "index build: reading the shards"]
    assert flags == [[0.0, 0.0], [0.0, 1.0]]


def test_search_options_are_bounded_and_lookups_batched(tmp_path, monkeypatch):
    """k and depth are whole numbers up to MAX_K, rrf_k finite (the library, CLI and server share the check); a
    k past the index's size answers every document, and lookups run in bounded batches with the same answer."""
    from mlx_encoders.index import store as store_module
    from mlx_encoders.index.search import MAX_K

    vectors = unit_vectors(1_200, 16, seed=0)
    write_vectors(tmp_path / "v", vectors)
    index = Index(tmp_path / "v")
    for k in (0, MAX_K + 1, 1e30, 2.0, True):
        with pytest.raises(ValueError, match="k must be a whole number from 1 to 10000"):
            index.search(vectors[0], k)
    for rrf_k in (float("nan"), float("inf"), -1):
        with pytest.raises(ValueError, match="rrf_k must be finite"):
            index.check_mode("dense", 10, "rrf", rrf_k, 0.5, 100)
    everything = index.search(vectors[0], MAX_K)
    assert len(everything) == 1_200 and everything[0].id == "0"
    monkeypatch.setattr(store_module, "LOOKUP_BATCH", 7)
    assert index.search(vectors[0], MAX_K) == everything


def test_command_line_search_options_out_of_range_exit_2_without_a_traceback(tmp_path):
    write_vectors(tmp_path / "v", unit_vectors(20, 16, seed=0))
    for option in (["--rrf-k", "nan"], ["--rrf-k", "inf"], ["-k", "100000"]):
        result = subprocess.run(
            [sys.executable, "-m", "mlx_encoders", "index", "search", "--index", str(tmp_path / "v"), "--json",
             "--mode", "dense", *option, "query"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr, (option, result.stderr)
        assert result.stdout == "" and "error:" in result.stderr


def test_threads_searching_a_new_index_load_its_model_once(tmp_path, model, encoder, monkeypatch):
    """An Index opened without a model loads it on the first search that needs it: once, however many threads
    search at first (each loaded its own copy)."""
    from concurrent.futures import ThreadPoolExecutor

    build(write_corpus(tmp_path / "corpus"), tmp_path / "index", encoder, quiet=True)
    loads, start = [], threading.Barrier(4)
    module = sys.modules["mlx_encoders.index.search"]  # the package's `search` is the function
    recorded = module.recorded

    def counted(*args):
        loads.append(args[0])
        return recorded(*args)

    monkeypatch.setattr(module, "recorded", counted)
    index = Index(tmp_path / "index")

    def first_search(_):
        start.wait(timeout=30)
        return [hit.id for hit in index.search("Cats purr when they are content.", 2)]

    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(first_search, range(4)))
    assert len(loads) == 1 and all(hits == found[0] for hits in found)


def test_scores_computed_on_a_worker_thread_are_read_on_the_caller_s(model, encoder):
    """A web app computes on its thread pool and reads the result on another thread: MLX binds a lazy array to
    the stream of the thread that made it, so the encoders hand back computed arrays."""
    from concurrent.futures import ThreadPoolExecutor

    vectors = encoder.encode(["a cat", "a dog", "a car"], convert_to_tensor=True)
    with ThreadPoolExecutor(1) as pool:
        scores = pool.submit(encoder.similarity, vectors, vectors).result()
        pairwise = pool.submit(encoder.similarity_pairwise, vectors, vectors).result()
    np.testing.assert_allclose(np.array(scores), np.array(vectors) @ np.array(vectors).T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(pairwise), 1.0, rtol=1e-5)
