"""mlx_encoders.index under concurrent builds and damaged files: one build per folder (the second is refused, a lock
left by a killed build is taken over), commits that refuse documents without vectors, and checksums that turn any
damaged byte into the `DamagedStore` error, never a wrong score, id or text (a property-based campaign)."""

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing, contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_index import FILES, ROOT, assert_same_index, st_model, stored, unit_vectors, write_corpus

from mlx_encoders import SentenceEncoder
from mlx_encoders.__main__ import main as cli
from mlx_encoders.distributed import World
from mlx_encoders.embeddings.sparse import SparseVectors
from mlx_encoders.index import DamagedStore, Index, StoreError, build
from mlx_encoders.index.lock import LOCK_NAME, BuildLock, IndexBusy
from mlx_encoders.index.store import CHECKSUMS, Store, text_key

CAMPAIGN_CASES = 300  # damaged copies of one index, each searched four ways


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return st_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def encoder(model) -> SentenceEncoder:
    return SentenceEncoder(model)


# Builds with 2-text chunks and, after each committed chunk, says so (the file `ready`) and waits for `go`.
PAUSED_BUILD = """
import sys, time
from pathlib import Path
from mlx_encoders.index import build
from mlx_encoders.index.store import Store
corpus, index, model, ready, go = sys.argv[1:]
stage = Store.stage
def stage_then_wait(self, *args):
    stage(self, *args)
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.02)
Store.stage = stage_then_wait
build(corpus, index, model, chunk=2, quiet=True)
"""


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_a_second_build_is_refused_while_one_runs_and_nothing_is_lost(tmp_path, model, encoder, capsys):
    """Two builds into one folder (3,000 and 1,500 texts in the report) each committed the other's staged rows and
    dropped the texts its own documents did not use. Now the second is refused at once, naming the first, which
    finishes as if alone."""
    first = {"long.txt": "\n\n".join(f"First corpus, paragraph {i}." for i in range(8))}
    corpus, other = write_corpus(tmp_path / "corpus", first), write_corpus(tmp_path / "other", FILES)
    index, ready, go = tmp_path / "index", tmp_path / "ready", tmp_path / "go"
    running = subprocess.Popen(
        [sys.executable, "-c", PAUSED_BUILD, str(corpus), str(index), str(model), str(ready), str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        wait_for(ready, running)  # its first chunk is committed: it holds the lock
        holder = rf"pid {running.pid} on host {re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\d \d\d:\d\d"
        with pytest.raises(IndexBusy, match=rf"^Another build is writing the index {re.escape(str(index))}: {holder}"):
            build(other, index, encoder, quiet=True)
        command = ["index", "build", "--corpus", str(other), "--index", str(index), "--model", str(model)]
        assert cli(command) == 1
        err = capsys.readouterr().err
        assert f"mlx-encoders index: error: Another build is writing the index {index}: pid {running.pid}" in err
        assert "wait for that build to end (or stop it), then run this one again" in err
    finally:
        go.touch()
        out, err = running.communicate(timeout=120)
    assert running.returncode == 0, err
    build(corpus, tmp_path / "clean", encoder, chunk=2, quiet=True)
    assert_same_index(index, tmp_path / "clean", encoder.path)  # the refused builds changed nothing
    assert not (index / LOCK_NAME).exists()  # released


# Takes the lock of the folder, then SIGKILLs itself: the OS releases the lock, its record stays.
KILLED_HOLDER = """
import os, signal, sys
from mlx_encoders.index.lock import BuildLock
BuildLock(sys.argv[1]).__enter__()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_lock_of_a_killed_build_is_taken_over(tmp_path, encoder, capsys):
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    index.mkdir()
    killed = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, str(index)], stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert killed.wait(120) == -signal.SIGKILL, killed.stderr.read()
    assert f'"pid": {killed.pid}' in (index / LOCK_NAME).read_text()
    build(corpus, index, encoder)
    err = capsys.readouterr().err
    assert (
        f"taking over the lock of {index}, left by a build that stopped without releasing it (pid {killed.pid}" in err
    )
    build(corpus, tmp_path / "clean", encoder, quiet=True)
    assert_same_index(index, tmp_path / "clean", encoder.path)
    assert not (index / LOCK_NAME).exists()
    build(corpus, index, encoder)  # a clean release leaves nothing to take over
    assert "taking over" not in capsys.readouterr().err


def test_a_distributed_build_is_locked_by_rank_0_alone(tmp_path, encoder, monkeypatch):
    """Rank 0 takes the lock and, refused, tells the other ranks through the first exchange; the other ranks never
    touch it (on one host they would be refused by rank 0's own lock)."""
    module = sys.modules["mlx_encoders.index.build"]
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    steps, flags = [], []

    @contextmanager
    def guarded(world, what, seconds=None):
        steps.append(what)
        yield

    def all_sum(x, **_):  # what the other rank would add: no failure of its own
        flags.append(x.tolist())
        return x

    monkeypatch.setattr(sys.modules["mlx_encoders.distributed"], "collective", guarded)  # `agree`'s exchange
    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    with BuildLock(index):  # another build holds the folder
        monkeypatch.setattr(module, "world", lambda: World(None, 2, 0))
        with pytest.raises(IndexBusy, match=f"Another build is writing the index {index}: pid {os.getpid()}"):
            build(corpus, index, encoder, quiet=True)
        assert steps == ["index build: opening the index"] and flags == [[1.0, 0.0]]
        monkeypatch.setattr(module, "world", lambda: World(None, 2, 1))
        assert build(corpus, index, encoder, quiet=True) == {}  # rank 1: every step, without the lock
        assert steps[1:] == [f"index build: {step}" for step in ("opening the index", "reading the shards",
                                                                  "embedding", "merging")]  # fmt: skip


def test_a_commit_whose_documents_lack_vectors_is_rolled_back(tmp_path):
    """The race the lock prevents, at the store: build B commits while build A has staged its texts; B's commit
    moves A's staged rows and drops them (no document of B uses them). A's commit then finds documents without
    vectors and rolls back with an error instead of committing them."""
    vectors = unit_vectors(6, 8, seed=0)
    path = tmp_path / "index.sqlite"
    with Store(path, create=True) as a, Store(path) as b:
        a.set_meta({"model": "random", "model_fingerprint": "-", "dimension": "8"})
        b.meta = a.meta
        a.stage(["a1", "a2", "a3"], ["A one", "A two", "A three"], vectors[:3])
        b.stage(["b1", "b2"], ["B one", "B two"], vectors[3:5])
        b.commit_index([("b-1", "b1"), ("b-2", "b2")])
        before = stored(tmp_path)
        with pytest.raises(StoreError, match=rf"^3 documents of this build \(such as 'a-1'\) have no vector in {path}"):
            a.commit_index([("a-1", "a1"), ("a-2", "a2"), ("a-3", "a3")])
    assert stored(tmp_path) == before == ([("b-1", "B one"), ("b-2", "B two")], before[1])
    assert Index(tmp_path).search(vectors[3], 5)[0].id == "b-1"


def write_index(folder: Path, texts: list[str], vectors: np.ndarray, sparse: list, shared: int = 0) -> None:
    """An index of `texts` (keyed as a build keys them) with dense and sparse vectors and no model: documents
    "doc-0", ...; the last `shared` documents repeat the first texts."""
    folder.mkdir()
    ids = [f"doc-{i}" for i in range(len(texts) + shared)]
    keys = [text_key(text) for text in texts]
    with Store(folder / "index.sqlite", create=True) as store:
        store.set_meta({"model": "random", "model_fingerprint": "-", "dimension": str(vectors.shape[1]),
                        "sparse_model": "random", "sparse_model_fingerprint": "-"})  # fmt: skip
        store.stage(keys, texts, vectors, sparse)
        store.commit_index(list(zip(ids, keys + keys[:shared], strict=True)))


def sparse_rows(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (np.sort(rng.choice(60, 5, replace=False)), rng.uniform(0.1, 3, 5).astype(np.float32)) for _ in range(count)
    ]


def sparse_query(terms, weights) -> SparseVectors:
    return SparseVectors(np.zeros(len(terms), np.int64), np.asarray(terms, np.int64), np.asarray(weights), (60,))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, np.ndarray, list]:
    """(folder, vectors, sparse rows) of an index of 300 texts (dense 16-d, sparse) and 310 documents."""
    folder = tmp_path_factory.mktemp("clean") / "index"
    texts = [f"Text number {i} of the damage campaign, with a few more words." for i in range(300)]
    vectors, sparse = unit_vectors(300, 16, seed=3), sparse_rows(300, seed=4)
    write_index(folder, texts, vectors, sparse, shared=10)
    with closing(sqlite3.connect(folder / "index.sqlite")) as con:
        con.execute("VACUUM")  # no free pages holding copies of the staged rows: each value is in the file once
    assert not (folder / "index.sqlite-wal").exists()  # every page is in the file the campaign damages
    return folder, vectors, sparse


def answers(index: Index, vectors: np.ndarray, sparse: list) -> list:
    """Every search a damaged index must answer exactly as the clean one, or refuse: the best 3 and every
    document, dense, sparse and hybrid."""
    query = sparse_query(*sparse[7])
    found = [index.search(vectors[5], 3), index.search(vectors[5], 400), index.search(query, 400, mode="sparse"),
             index.search((vectors[7], query), 400, mode="hybrid")]  # fmt: skip
    return [[(hit.id, hit.score, hit.text) for hit in hits] for hits in found]


def test_an_index_in_a_folder_that_cannot_be_written_is_searched_or_refused_saying_why(tmp_path, encoder,
                                                                                        monkeypatch):  # fmt: skip
    """A read-only folder (a read-only mount, another user's files): searched through the store file alone, unless
    changes wait in its -wal file; errors that say nothing of the file's bytes (it cannot be opened) are no
    `DamagedStore` and never advise deleting the index."""
    from mlx_encoders.index import store

    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    expected = [(h.id, h.score) for h in Index(index, encoder, write=False).search("Rain falls.", 3)]
    writable = os.access
    monkeypatch.setattr(store.os, "access", lambda path, mode: mode != os.W_OK and writable(path, mode))
    assert [(h.id, h.score) for h in Index(index, encoder, write=False).search("Rain falls.", 3)] == expected
    assert not (index / "index.sqlite-shm").exists()  # nothing written beside it
    (index / "index.sqlite-wal").write_bytes(b"\0" * 32)
    with pytest.raises(StoreError, match=r"cannot be written, and changes of its last build wait in index.sqlite-wal"):
        Index(index, encoder, write=False)
    monkeypatch.undo()
    (index / "index.sqlite-wal").unlink()

    folder = tmp_path / "not-a-file"
    (folder / "index.sqlite").mkdir(parents=True)  # SQLite cannot open it: not damage
    with pytest.raises(StoreError, match=r"Could not read the index store .* It was left as it is; SQLite could not "
                       r"open it") as raised:  # fmt: skip
        Index(folder, encoder)
    assert not isinstance(raised.value, DamagedStore) and "delete" not in str(raised.value)


def test_a_graph_that_cannot_be_saved_leaves_no_file_and_says_to_search_exactly(tmp_path, encoder, monkeypatch):
    from mlx_encoders.index import ann

    graph = ann.usearch_index()

    class Unsaved(graph):
        def save(self, path, *args, **kwargs):  # usearch's failure on a full disk, after part of the file
            Path(path).write_bytes(b"\0" * 100)
            raise RuntimeError("Failed to serialize into stream")

    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    build(corpus, index, encoder, quiet=True)
    monkeypatch.setattr(ann, "usearch_index", lambda: Unsaved)
    with pytest.raises(OSError, match=r"could not write .*ann-float32.usearch.[0-9-]+.tmp.*search exactly \(--exact\)"):
        Index(index, encoder, ann=True)
    assert not list(index.glob("ann-*")), list(index.iterdir())


def test_a_failed_write_reports_its_own_error_when_sqlite_has_rolled_back_already(tmp_path):
    """SQLite ends the transaction itself on some errors (a full disk): the rollback that follows must not replace
    the error with "cannot rollback - no transaction is active"."""
    with Store(tmp_path / "index.sqlite", create=True) as s:

        def rolled_back_then_failed():
            s.con.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")

        with pytest.raises(StoreError, match=r"Could not write to the index store .*: database or disk is full\."):
            s.transaction([("INSERT INTO meta VALUES (?, ?)", [("a", "b")])], rolled_back_then_failed)


def test_a_store_whose_creation_failed_part_way_is_created_whole_next_time(tmp_path, monkeypatch):
    """The tables and the format entry are made in one transaction: a full disk or a kill part way left some
    tables, and every later build called the store damaged."""
    from mlx_encoders.index import store

    path = tmp_path / "index.sqlite"
    monkeypatch.setattr(store, "SCHEMA", store.SCHEMA + "CREATE TABLE failing (;")  # fails after the others
    with pytest.raises(StoreError, match="Could not write to the index store"):
        Store(path, create=True)
    monkeypatch.undo()
    with Store(path, create=True) as s:
        assert s.meta["format"] == store.FORMAT
        s.require_checksums()
        s.set_meta({"model": "m"})
    with Store(path) as s:
        assert s.meta["model"] == "m"


def test_damage_at_random_offsets_gives_the_right_answer_or_the_damaged_error(clean, tmp_path):
    """Bytes xor-ed at random offsets of the store (1 to 64 of them, or a whole page of random bytes), before the
    index is opened or after: each search answers as the clean index did or raises `DamagedStore`; never a wrong
    score, id or text, and no other exception."""
    folder, vectors, sparse = clean
    original = (folder / "index.sqlite").read_bytes()
    expected = answers(Index(folder), vectors, sparse)
    assert len(expected[1]) == 310 and len(expected[2]) > 10
    page = struct.unpack(">H", original[16:18])[0]  # the page size, in the file's header
    damaged, outcomes = tmp_path / "damaged", Counter()
    damaged.mkdir()

    @settings(max_examples=CAMPAIGN_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(
        offset=st.integers(0, len(original) - 1),
        mask=st.binary(min_size=1, max_size=64).filter(any) | st.integers(0, 2**32),
        opened=st.booleans(),
    )
    def case(offset: int, mask, opened: bool) -> None:
        data = bytearray(original)
        if isinstance(mask, int):  # a whole page of random bytes
            offset -= offset % page
            data[offset : offset + page] = np.random.default_rng(mask).bytes(page)
        else:
            for i, byte in enumerate(mask[: len(data) - offset]):
                data[offset + i] ^= byte
        store = damaged / "index.sqlite"
        store.write_bytes(original if opened else data)
        try:
            index = Index(damaged)
            if opened:  # the vectors were read from the clean file; the lookups meet the damage
                store.write_bytes(data)
            found = answers(index, vectors, sparse)
        except DamagedStore:
            outcomes["damaged error" + (" after open" if opened else "")] += 1
        else:
            assert found == expected
            outcomes["right answer" + (" after open" if opened else "")] += 1

    case()
    print(f"\nindex damage campaign: {sum(outcomes.values())} cases, {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) == CAMPAIGN_CASES
    assert outcomes["damaged error"] and outcomes["damaged error after open"] and outcomes["right answer"]


def flip(store: Path, found: bytes, at: int, value: int | None = None) -> None:
    """Change the byte `at` of the only occurrence of `found` in the file (xor 0x20, or set it to `value`)."""
    data = bytearray(store.read_bytes())
    assert data.count(found) == 1, found
    where = data.find(found) + at
    data[where] = data[where] ^ 0x20 if value is None else value
    store.write_bytes(bytes(data))


def quick_check(store: Path) -> str:
    with closing(sqlite3.connect(store)) as con:
        return con.execute("PRAGMA quick_check").fetchone()[0]


def test_a_flipped_byte_in_a_vector_a_text_an_id_or_a_weight_is_the_damaged_error(clean, tmp_path):
    """One changed byte that SQLite's own check passes: in a vector (the index refuses to open), a text (made
    another letter, or not UTF-8), a document id or a sparse weight (the searches that reach it refuse; others
    answer as before). The build's full check finds each of them."""
    folder, vectors, sparse = clean
    text = "Text number 42 of the damage campaign, with a few more words."
    row, document = "text row 43 or its document 43 does not match", "the document at position 43 does not match"
    cases = [  # (what, the bytes it is found by, which byte, its new value, the message of a search, of `check`)
        ("vector", vectors[42].astype("<f4").tobytes(), 5, None, "the vector of text row 43 does not match",
         "the vector of text row 43 does not match"),
        ("text, another letter", text.encode(), 0, None, row, "the text row 43 does not match"),
        ("text, not UTF-8", text.encode(), 3, 0xFF, row, "the text row 43 does not match"),
        ("document id", b"doc-42" + text_key(text)[:8].encode(), 4, None, row, document),  # the row, not its index
        ("sparse weight", struct.pack(">d", float(sparse[42][1][2])), 6, None, "a posting of the inverted index",
         "a posting of the inverted index"),
    ]  # fmt: skip
    reached = sparse_query(*sparse[42])
    for name, found, at, value, message, checked in cases:
        index = tmp_path / name
        shutil.copytree(folder, index)
        store = index / "index.sqlite"
        flip(store, found, at, value)
        assert quick_check(store) == "ok", name
        with pytest.raises(DamagedStore, match=f"^The index store {store} is damaged .*{message}"):
            if name == "vector":
                Index(index)
            elif name == "sparse weight":
                assert Index(index).search(vectors[5], 3)[0].id == "doc-5"
                Index(index).search(reached, 3, mode="sparse")
            else:
                assert [h.id for h in Index(index).search(vectors[5], 3)][0] == "doc-5"  # row 43 not reached
                Index(index).search(vectors[42], 1)
        with Store(store) as opened, pytest.raises(DamagedStore, match=checked):
            opened.check()


def test_rows_a_lookup_misses_are_the_damaged_error(clean, tmp_path):
    """A damaged interior page of a b-tree can send a lookup astray: it finds fewer rows, without any error. Rows
    removed with SQL after the index was opened stand for it here: a posting of a query term, and one of the two
    documents of a shared text (doc-5 and doc-305)."""
    folder, vectors, sparse = clean
    term = int(sparse[42][0][2])
    cases = [
        ("posting", f"DELETE FROM postings WHERE term = {term} AND row = 43",
         lambda index: index.search(sparse_query(*sparse[42]), 3, mode="sparse"),
         "the postings found are not as many as the last build counted for their terms"),
        ("document", "DELETE FROM documents WHERE id = 'doc-305'", lambda index: index.search(vectors[5], 1),
         "text row 6 has not the documents the last build wrote for it"),
    ]  # fmt: skip
    for name, sql, search, message in cases:
        shutil.copytree(folder, tmp_path / name)
        index = Index(tmp_path / name)
        with closing(sqlite3.connect(tmp_path / name / "index.sqlite", isolation_level=None)) as con:
            con.execute(sql)
        with pytest.raises(DamagedStore, match=message):
            search(index)
        with Store(tmp_path / name / "index.sqlite") as store, pytest.raises(DamagedStore):
            store.check()


def downgrade(store: Path) -> None:
    """The store as the previous version wrote it: no checksum columns, no format, checksum or counts in meta."""
    with closing(sqlite3.connect(store, isolation_level=None)) as con:
        for table, columns in CHECKSUMS.items():
            for column in columns:
                con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        con.execute("DROP TABLE terms")
        con.execute("DELETE FROM meta WHERE name IN ('format', 'checksum', 'texts', 'documents', 'postings')")


def test_an_index_without_checksums_is_refused_until_its_next_build_adds_them(tmp_path, encoder, monkeypatch):
    corpus, index, clean = write_corpus(tmp_path / "corpus"), tmp_path / "index", tmp_path / "clean"
    build(corpus, index, encoder, quiet=True)
    build(corpus, clean, encoder, quiet=True)
    downgrade(index / "index.sqlite")
    with pytest.raises(StoreError, match=r"written by an earlier version of mlx-encoders \(store format 1; .*\), "
                                         r"without this version's checksums of its rows: run the same `mlx-encoders "
                                         r"index build` .* once to add them"):  # fmt: skip
        Index(index)

    broken = tmp_path / "broken"
    shutil.copytree(index, broken)
    with closing(sqlite3.connect(broken / "index.sqlite", isolation_level=None)) as con:
        con.execute("UPDATE texts SET vector = ? WHERE row = 2", (np.full(32, np.nan, "<f4").tobytes(),))
    before = (broken / "index.sqlite").read_bytes()
    with pytest.raises(DamagedStore, match=r"is not 32 finite float32s"):
        build(corpus, broken, encoder, quiet=True)
    assert (broken / "index.sqlite").read_bytes() == before

    monkeypatch.setattr(SentenceEncoder, "encode", lambda *args, **kwargs: pytest.fail("nothing is embedded again"))
    assert build(corpus, index, encoder, quiet=True)["added"] == 0
    monkeypatch.undo()
    assert_same_index(index, clean, encoder.path)
    query = Index(clean).vectors[3]
    assert Index(index).search(query, 8) == Index(clean).search(query, 8)


def test_a_lock_file_removed_as_it_is_locked_is_locked_again(tmp_path, monkeypatch):
    """A build that ends removes the lock file while it holds it: a build that opened the file just before locks
    a file no longer in the folder, so it locks the one there now (else two builds could each hold "the" lock)."""
    flock, locked = fcntl.flock, []

    def racing(fd, operation):
        flock(fd, operation)
        if not locked:  # the holder ended between this build's open and its lock
            (tmp_path / LOCK_NAME).unlink()
        locked.append(fd)

    monkeypatch.setattr(fcntl, "flock", racing)
    with BuildLock(tmp_path):
        assert len(locked) == 2 and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_graph_files_are_written_under_this_thread_s_own_temporary_name(tmp_path):
    """Searchers opening a new index at once each build its graph: a shared temporary name was renamed from under
    the others (FileNotFoundError); one a killed process left is removed by the next writer."""
    import os
    import subprocess
    import sys
    import threading

    from mlx_encoders.index.ann import temporary_for

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f".ann-int8.usearch.{int(ended.stdout)}{thread}.tmp" for thread in ("", "-1234")]
    live = tmp_path / f".ann-int8.usearch.{os.getppid()}-1234.tmp"  # a process that still runs
    for file in (*stale, live):
        file.write_bytes(b"left by a killed build")
    own = tmp_path / f".ann-int8.usearch.{os.getpid()}-{threading.get_ident()}.tmp"  # this thread's
    assert temporary_for(tmp_path / "ann-int8.usearch") == own
    assert not any(file.exists() for file in stale) and live.exists()


def test_a_malformed_collective_timeout_is_refused_before_any_file_is_made(tmp_path, encoder, monkeypatch):
    from mlx_encoders import distributed

    corpus = write_corpus(tmp_path / "corpus")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "abc")
    with pytest.raises(ValueError, match=f"{distributed.TIMEOUT_ENV}='abc' is not a number of seconds"):
        build(corpus, tmp_path / "index", encoder, quiet=True)
    assert not (tmp_path / "index").exists()
