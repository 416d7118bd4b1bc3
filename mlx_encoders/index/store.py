"""The index's system of record: one SQLite file (WAL) of texts, their float32 vectors and document ids.

Tables: `meta` (model, model fingerprint, dimension, dtype, pooling, generation), `texts` (one row per distinct
text: integer row, SHA-256 key, text, vector), `documents` (id -> text key, in corpus order) and `staged`
(vectors embedded by a build that has not finished). A build commits its vectors into `staged` a chunk at a time,
then swaps `documents` and `texts` in one transaction, so a reader sees the previous index or the new one.
"""

import hashlib
import sqlite3
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path

import numpy as np

DTYPE = np.dtype("<f4")  # little-endian float32 on every machine, so an index can be copied between them
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS texts (row INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, text TEXT NOT NULL,
                                  vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS documents (position INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS documents_key ON documents (key);
CREATE TABLE IF NOT EXISTS staged (key TEXT PRIMARY KEY, text TEXT NOT NULL, vector BLOB NOT NULL);
"""
IDENTITY = ("model_fingerprint", "dimension", "dtype", "pooling")  # what must match for vectors to be comparable


class StoreError(ValueError):
    """The store cannot be used as it is (damaged, another model); the message names the file and what to do."""


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

    def damaged(self, e: Exception) -> StoreError:
        return StoreError(
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
        for name in IDENTITY:
            if name in self.meta and self.meta[name] != identity[name]:
                raise StoreError(
                    f"{self.path} was built with the model {self.meta.get('model')!r} ({name} "
                    f"{self.meta[name]!r}); {model!r} gives {name} {identity[name]!r}. Use the index's model "
                    "(--model), or build into a new --index folder."
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

    def stage(self, keys: list[str], texts: list[str], vectors: np.ndarray) -> None:
        rows = [(k, t, v.astype(DTYPE).tobytes()) for k, t, v in zip(keys, texts, vectors, strict=True)]
        self.transaction([("INSERT OR IGNORE INTO staged VALUES (?, ?, ?)", rows)])

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
            self.transaction([("INSERT OR IGNORE INTO staged SELECT key, text, vector FROM shard.staged", [()])])
        finally:
            self.con.execute("DETACH DATABASE shard")

    def commit_index(self, docs: list[tuple[str, str]]) -> None:
        """The new index in one transaction: `docs` (id, key) replace the documents, the staged texts join the
        texts, texts no document uses go, and the generation moves on."""
        generation = str(int(self.meta.get("generation", "0")) + 1)
        self.transaction([
            ("INSERT OR IGNORE INTO texts (key, text, vector) SELECT key, text, vector FROM staged", [()]),
            ("DELETE FROM staged", [()]),
            ("DELETE FROM documents", [()]),
            ("INSERT INTO documents (id, key) VALUES (?, ?)", docs),
            ("DELETE FROM texts WHERE key NOT IN (SELECT key FROM documents)", [()]),
            ("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("generation", generation)]),
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

    def documents(self, rows: list[int]) -> dict[int, list[tuple[str, str]]]:
        """For each text row its (document id, text) pairs, in corpus order (a shared text has several)."""
        out: dict[int, list[tuple[str, str]]] = {row: [] for row in rows}
        marks = ",".join("?" * len(rows))
        found = self.con.execute(
            f"SELECT t.row, d.id, t.text FROM texts t JOIN documents d ON d.key = t.key WHERE t.row IN ({marks}) "
            "ORDER BY d.position",
            [int(r) for r in rows],
        )
        for row, doc_id, text in found:
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
