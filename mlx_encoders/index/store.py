"""The index's system of record: one SQLite file (WAL) of texts, their float32 vectors and document ids.

Tables: `meta` (model, model fingerprint, dimension, dtype, pooling, the sparse model, generation, store id),
`texts` (one row per distinct text: integer row, SHA-256 key, text, dense vector; empty without a dense model),
`documents` (id -> text key, in corpus order), `postings` (the sparse model's inverted index: term id, text row,
weight; clustered by term) and `staged` / `staged_postings` (vectors embedded by a build that has not finished). A
build commits its vectors into the staging tables a chunk at a time, then swaps `documents`, `texts` and `postings` in
one transaction, so a reader sees the previous index or the new one.
"""

import hashlib
import sqlite3
import uuid
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path

import numpy as np

DTYPE = np.dtype("<f4")  # little-endian float32 on every machine, so an index can be copied between them
LOOKUP_BATCH = 500  # rows per lookup statement
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS texts (row INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, text TEXT NOT NULL,
                                  vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS documents (position INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS documents_key ON documents (key);
CREATE TABLE IF NOT EXISTS staged (key TEXT PRIMARY KEY, text TEXT NOT NULL, vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS postings (term INTEGER NOT NULL, row INTEGER NOT NULL, weight REAL NOT NULL,
                                     PRIMARY KEY (term, row)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS postings_row ON postings (row);
CREATE TABLE IF NOT EXISTS staged_postings (key TEXT NOT NULL, term INTEGER NOT NULL, weight REAL NOT NULL,
                                            PRIMARY KEY (key, term)) WITHOUT ROWID;
"""
# what must match for vectors to be comparable; "" where the index has no dense or no sparse model
IDENTITY = ("model_fingerprint", "dimension", "dtype", "pooling", "sparse_model_fingerprint")


class StoreError(ValueError):
    """The store cannot be used as it is (damaged, another model); the message names the file and what to do."""


class DamagedStore(StoreError):
    """The store's file is not a readable index (cut short by a crash or a full disk, overwritten): an index kept
    as a cache of its corpus can be deleted and built again."""


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Store:
    """One SQLite file. `Store(path)` opens (creating the file when `create`); every write is a transaction."""

    def __init__(self, path: Path, create: bool = False):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise StoreError(f"{self.path} does not exist; build the index first (mlx-encoders index build)")
        try:
            self.con = sqlite3.connect(self.path, isolation_level=None, timeout=60)
            self.con.execute("PRAGMA journal_mode = WAL")
            self.con.execute("PRAGMA synchronous = NORMAL")  # in WAL mode: durable across a killed process
            if create:
                self.con.executescript(SCHEMA)
            self.meta = dict(self.con.execute("SELECT name, value FROM meta"))
        except sqlite3.DatabaseError as e:
            self.close()
            raise self.damaged(e) from None

    def damaged(self, e: Exception) -> DamagedStore:
        return DamagedStore(
            f"The index store {self.path} is damaged or not an index ({e}). It was left as it is: restore it from a "
            "copy, or delete its folder and build again."
        )

    def close(self) -> None:
        if getattr(self, "con", None) is not None:
            self.con.close()
            self.con = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Full integrity check of the file (O(size)): raises StoreError naming the file when damaged."""
        try:
            result = self.con.execute("PRAGMA quick_check").fetchone()[0]
            dimension = int(self.meta.get("dimension", 0))
            size = (dimension * 4,) * 2
            bad = self.con.execute(
                "SELECT (SELECT count(*) FROM texts WHERE length(vector) != ?) "
                "+ (SELECT count(*) FROM staged WHERE length(vector) != ?)",
                size,
            ).fetchone()
        except (sqlite3.DatabaseError, ValueError) as e:
            raise self.damaged(e) from None
        if result != "ok":
            raise self.damaged(result)
        if bad[0]:
            raise self.damaged(f"{bad[0]} vectors are not {dimension} float32 values")

    def check_identity(self, identity: dict[str, str], model: str) -> None:
        """A store of another model (or pooling, dimension) is an error naming both."""
        if "model_fingerprint" not in self.meta:  # a new store: any models
            return
        for name in IDENTITY:
            if self.meta.get(name, "") != identity[name]:
                built = " and ".join(
                    f"the {kind}model {self.meta[m]!r}" for m, kind in (("model", ""), ("sparse_model", "sparse "))
                    if self.meta.get(m)
                )  # fmt: skip
                raise StoreError(
                    f"{self.path} was built with {built} ({name} {self.meta.get(name, '')!r}); "
                    f"{model!r} gives {name} {identity[name]!r}. Use the index's models (--model, --sparse-model), "
                    "or build into a new --index folder."
                )

    def transaction(self, statements: Iterable[tuple[str, Iterable]]) -> None:
        """Run (sql, rows) pairs with executemany in one transaction: all of them or none."""
        try:
            self.con.execute("BEGIN IMMEDIATE")
            try:
                for sql, rows in statements:
                    self.con.executemany(sql, rows)
                self.con.execute("COMMIT")
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as e:
            raise StoreError(
                f"Could not write to the index store {self.path}: {e}. This step was rolled back: the index is as "
                "it was. Free disk space if it is full and run again."
            ) from None
        self.meta = dict(self.con.execute("SELECT name, value FROM meta"))

    def set_meta(self, meta: dict[str, str]) -> None:
        self.transaction([("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(meta.items()))])

    def stage(self, keys: list[str], texts: list[str], vectors: np.ndarray, sparse: list | None = None) -> None:
        """Stage texts with their dense vectors ((N, 0) without a dense model) and sparse (term ids, weights), in
        one transaction: a text is staged with all its vectors or not at all."""
        rows = [(k, t, v.astype(DTYPE).tobytes()) for k, t, v in zip(keys, texts, vectors, strict=True)]
        postings = [
            (key, int(term), float(weight))
            for key, (terms, weights) in zip(keys, sparse or [], strict=sparse is not None)
            for term, weight in zip(terms, weights, strict=True)
        ]
        self.transaction([
            ("INSERT OR IGNORE INTO staged VALUES (?, ?, ?)", rows),
            ("INSERT OR IGNORE INTO staged_postings VALUES (?, ?, ?)", postings),
        ])  # fmt: skip

    def keys(self) -> set[str]:
        """Keys of every text this store holds a vector for, indexed or staged."""
        rows = self.con.execute("SELECT key FROM texts UNION SELECT key FROM staged")
        return {key for (key,) in rows}

    def merge(self, shard: Path) -> None:
        """Stage the vectors of a shard written by another rank (one transaction; merging twice is harmless)."""
        try:
            self.con.execute("ATTACH DATABASE ? AS shard", (str(shard),))
        except sqlite3.Error as e:
            raise StoreError(f"Could not read the shard {shard}: {e}; delete it to re-embed its texts") from None
        try:
            self.transaction([
                ("INSERT OR IGNORE INTO staged SELECT key, text, vector FROM shard.staged", [()]),
                ("INSERT OR IGNORE INTO staged_postings SELECT key, term, weight FROM shard.staged_postings", [()]),
            ])  # fmt: skip
        finally:
            self.con.execute("DETACH DATABASE shard")

    def commit_index(self, docs: list[tuple[str, str]]) -> None:
        """The new index in one transaction: `docs` (id, key) replace the documents, the staged texts join the
        texts and their postings the inverted index, texts no document uses go with their postings, and the
        generation moves on (with the store's random id, set once, it tells every build apart)."""
        generation = str(int(self.meta.get("generation", "0")) + 1)
        self.transaction([
            ("DELETE FROM staged_postings WHERE key IN (SELECT key FROM texts)", [()]),  # a shard merged again
            ("INSERT OR IGNORE INTO texts (key, text, vector) SELECT key, text, vector FROM staged", [()]),
            ("INSERT INTO postings SELECT s.term, t.row, s.weight FROM staged_postings s JOIN texts t USING (key)",
             [()]),
            ("DELETE FROM staged", [()]),
            ("DELETE FROM staged_postings", [()]),
            ("DELETE FROM documents", [()]),
            ("INSERT INTO documents (id, key) VALUES (?, ?)", docs),
            ("DELETE FROM postings WHERE row IN (SELECT row FROM texts WHERE key NOT IN (SELECT key FROM documents))",
             [()]),
            ("DELETE FROM texts WHERE key NOT IN (SELECT key FROM documents)", [()]),
            ("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("generation", generation)]),
            ("INSERT OR IGNORE INTO meta VALUES ('store_id', ?)", [(uuid.uuid4().hex,)]),
        ])  # fmt: skip

    def count(self) -> int:
        return self.con.execute("SELECT count(*) FROM texts").fetchone()[0]

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows (N,) int64, vectors (N, D) float32) of the indexed texts, in row order."""
        dimension, count = int(self.meta["dimension"]), self.count()
        rows, vectors = np.empty(count, np.int64), np.empty((count, dimension), DTYPE)
        try:  # row by row into one array: no second copy of every vector
            for i, (row, vector) in enumerate(self.con.execute("SELECT row, vector FROM texts ORDER BY row")):
                if len(vector) != dimension * DTYPE.itemsize:
                    raise self.damaged(f"the vector of text row {row} is not {dimension} float32 values")
                rows[i], vectors[i] = row, np.frombuffer(vector, DTYPE)
        except sqlite3.DatabaseError as e:
            raise self.damaged(e) from None
        return rows, vectors

    def postings(self, terms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(terms, rows, weights) of every posting of the given term ids, read through the term index."""
        marks = ",".join("?" * len(terms))
        try:
            found = self.con.execute(
                f"SELECT term, row, weight FROM postings WHERE term IN ({marks})", [int(t) for t in terms]
            ).fetchall()
        except sqlite3.DatabaseError as e:
            raise self.damaged(e) from None
        columns = np.array(found, np.float64).reshape(-1, 3)
        return columns[:, 0].astype(np.int64), columns[:, 1].astype(np.int64), columns[:, 2]

    def documents(self, rows: list[int]) -> dict[int, list[tuple[str, str]]]:
        """For each text row its (document id, text) pairs, in corpus order (a shared text has several); read in
        batches of LOOKUP_BATCH rows, so that no statement grows with the request."""
        out: dict[int, list[tuple[str, str]]] = {row: [] for row in rows}
        found = []
        try:
            for start in range(0, len(rows), LOOKUP_BATCH):
                batch = [int(r) for r in rows[start : start + LOOKUP_BATCH]]
                found += self.con.execute(
                    f"SELECT t.row, d.id, t.text, d.position FROM texts t JOIN documents d ON d.key = t.key "
                    f"WHERE t.row IN ({','.join('?' * len(batch))})",
                    batch,
                ).fetchall()
        except sqlite3.DatabaseError as e:
            raise self.damaged(e) from None
        for row, doc_id, text, _ in sorted(found, key=lambda f: f[3]):
            out[row].append((doc_id, text))
        return out


def shard_keys(path: Path, identity: dict[str, str], model: str) -> set[str]:
    """The keys a shard written by one rank holds, checked first: a damaged shard, or one of another model, is an
    error naming the file."""
    try:
        with closing(Store(path)) as shard:
            shard.check()
            shard.check_identity(identity, model)
            return shard.keys()
    except StoreError as e:
        raise StoreError(
            f"A shard of a distributed build is unusable: {e} Delete {path} to re-embed its texts; the index itself "
            "is unchanged."
        ) from None
