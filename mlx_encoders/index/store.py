"""The index's system of record: one SQLite file (WAL) of texts, their float32 vectors and document ids.

Tables: `meta` (model, model fingerprint, dimension, dtype, pooling, the sparse model, generation, store id, format,
row counts), `texts` (one row per distinct text: integer row, SHA-256 key, text, dense vector; empty without a dense
model), `documents` (id -> text key, in corpus order), `postings` (the sparse model's inverted index: term id, text
row, weight; clustered by term), `terms` (postings per term) and `staged` / `staged_postings` (vectors embedded by a
build that has not finished).
A build commits its vectors into the staging tables a chunk at a time, then swaps `documents`, `texts` and `postings`
in one transaction, so a reader sees the previous index or the new one.

Every row carries a checksum of its values, seeded with its row number where it has one (a text's key and text, and
its vector; a document's id, key and the number of documents of its text; a posting's term, row and weight; a
term's number of postings), and `meta` a checksum of its entries. Every read checks them, and the counts, so a
damaged byte that SQLite's own page checks miss is a `DamagedStore` error, never a wrong score, id or text.
"""

import hashlib
import os
import sqlite3
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np

DTYPE = np.dtype("<f4")  # little-endian float32 on every machine, so an index can be copied between them
LOOKUP_BATCH = 500  # rows per lookup statement
VECTORS_BATCH = 4096  # rows per batch read into the vectors array
POSTINGS_BATCH = 100_000  # postings per batch checked
FORMAT = "3"  # rows with these checksums; a store of an earlier version gets them at its next build
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS texts (row INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, text TEXT NOT NULL,
                                  vector BLOB NOT NULL, text_crc INTEGER, vector_crc INTEGER);
CREATE TABLE IF NOT EXISTS documents (position INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, key TEXT NOT NULL,
                                      shared INTEGER, crc INTEGER);
CREATE INDEX IF NOT EXISTS documents_key ON documents (key);
CREATE TABLE IF NOT EXISTS staged (key TEXT PRIMARY KEY, text TEXT NOT NULL, vector BLOB NOT NULL, text_crc INTEGER,
                                   vector_crc INTEGER);
CREATE TABLE IF NOT EXISTS postings (term INTEGER NOT NULL, row INTEGER NOT NULL, weight REAL NOT NULL, crc INTEGER,
                                     PRIMARY KEY (term, row)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS postings_row ON postings (row);
CREATE TABLE IF NOT EXISTS terms (term INTEGER PRIMARY KEY, postings INTEGER NOT NULL, crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS staged_postings (key TEXT NOT NULL, term INTEGER NOT NULL, weight REAL NOT NULL,
                                            crc INTEGER, PRIMARY KEY (key, term)) WITHOUT ROWID;
"""
# the checksum columns, which stores of earlier versions lack
CHECKSUMS = {"texts": ("text_crc", "vector_crc"), "staged": ("text_crc", "vector_crc"),
             "documents": ("shared", "crc"), "postings": ("crc",), "staged_postings": ("crc",)}  # fmt: skip
# the checksums of texts and documents as SQL over the `crc32(bytes, seed)` function each connection defines (zlib's;
# `Store.documents` computes the same in Python)
SEED = "crc32(CAST(key AS BLOB), {} & 4294967295)"
TEXT_CRC = f"crc32(CAST(text AS BLOB), {SEED.format('row')})"
STAGED_TEXT_CRC = f"crc32(CAST(text AS BLOB), {SEED.format(0)})"
DOCUMENT_CRC = "crc32(CAST(id AS BLOB), crc32(CAST(key AS BLOB), crc32(CAST(shared AS BLOB), position & 4294967295)))"
# a lookup that a damaged interior page of a b-tree sends astray finds fewer rows, without an error: each document
# says how many documents share its text, each term of the inverted index how many postings it has
SHARED = "UPDATE documents SET shared = (SELECT count(*) FROM documents d WHERE d.key = documents.key)"
TERMS = ("INSERT INTO terms SELECT term, count(*), crc32(CAST(count(*) AS BLOB), term & 4294967295) FROM postings "
         "GROUP BY term")  # fmt: skip
ROW_MIX = 2654435761  # odd: rows below 2**31 times it are distinct, and below 2**63 (SQLite's integers)
# what must match for vectors to be comparable; "" where the index has no dense or no sparse model
IDENTITY = ("model_fingerprint", "dimension", "dtype", "pooling", "sparse_model_fingerprint")
CORRUPT = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB: the file, not the disk or the statement, is at fault
# SQLite's errors that say nothing of the file's bytes (sqlite3.h's primary codes), and what to do about each.
NOT_DAMAGE = {
    3: "its folder's permissions must let this user read and write it (SQLite keeps -wal and -shm files beside it)",
    5: "another process holds it: run again once that one is done",
    6: "another process holds it: run again once that one is done",
    7: "the process ran out of memory: free some and run again",
    8: "its folder must be writable, as SQLite keeps -wal and -shm files beside the store",
    10: "the disk failed a read or write (full, removed, or failing): free space or check it, then run again",
    13: "the disk is full: free space on it and run again",
    14: "SQLite could not open it or the -wal and -shm files beside it: check the folder's permissions and space",
}


class StoreError(ValueError):
    """The store cannot be used as it is (damaged, another model); the message names the file and what to do."""


class DamagedStore(StoreError):
    """The store's file is not a readable index (cut short by a crash or a full disk, overwritten): an index kept
    as a cache of its corpus can be deleted and built again."""


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def seeded(key: bytes, number: int) -> int:
    """The seed of a row's checksums: its key's CRC-32 started from its row number (the SQL `SEED`)."""
    return zlib.crc32(key, number & 0xFFFFFFFF)


def xor_row(value: str, row: str) -> str:
    """SQL of `value` xor-ed with `row` times ROW_MIX: how a staged vector's or posting's checksum takes the row
    its text gets at commit (SQLite has no xor: (a | b) & ~(a & b))."""
    mix = f"(({row} & 2147483647) * {ROW_MIX})"
    return f"(({value} | {mix}) & ~({value} & {mix}))"


def row_mix(rows: np.ndarray) -> np.ndarray:
    return (np.asarray(rows, np.int64) & 0x7FFFFFFF) * ROW_MIX


def posting_crc(terms: np.ndarray, weights: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """One 64-bit checksum per posting, vectorised: its term and weight bits, each through an odd multiplier (a
    change of either always changes the sum), mixed by xor-shifts (uint64 arithmetic wraps); once the posting has
    a text row (`rows`), xor-ed with the row times ROW_MIX, as `xor_row` does at commit."""
    h = np.asarray(terms).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= np.asarray(weights, np.float64).view(np.uint64) * np.uint64(0x165667B19E3779F9)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
    return h.view(np.int64) if rows is None else h.view(np.int64) ^ row_mix(rows)


def vector_sum(vectors: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """One 64-bit checksum per (N, D) float32 vector, vectorised: the sum of its 32-bit words, each times an odd
    weight of its position modulo 2**32 (a change of any one word always changes the sum); once the vector has a
    text row (`rows`), xor-ed with the row times ROW_MIX, as `xor_row` does at commit."""
    words = np.ascontiguousarray(vectors, DTYPE).view(np.uint32)
    weights = (np.arange(1, words.shape[1] + 1, dtype=np.uint32) * np.uint32(0x9E3779B9)) | np.uint32(1)
    sums = (words * weights).sum(axis=1, dtype=np.uint64).view(np.int64)
    return sums if rows is None else sums ^ row_mix(rows)


def posting_columns(found: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(terms, rows, weights, checksums) of postings read from SQLite as (term, row, weight, checksum) rows."""
    columns = list(zip(*found, strict=True)) or [()] * 4
    kinds = (np.int64, np.int64, np.float64, np.int64)
    return tuple(np.array(column, kind) for column, kind in zip(columns, kinds, strict=True))


def meta_crc(items: Iterable[tuple[bytes, bytes]]) -> int:
    value = 0
    for name, entry in sorted(items):
        value = zlib.crc32(name + b"\0" + entry + b"\0", value)
    return value


class Store:
    """One SQLite file. `Store(path)` opens (creating the file when `create`); every write is a transaction, every
    read checked (`reading`)."""

    def __init__(self, path: Path, create: bool = False):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise StoreError(f"{self.path} does not exist; build the index first (mlx-encoders index build)")
        try:
            with self.reading():  # a file that is not a store fails here (its header, its schema)
                if not create and not os.access(self.path.parent, os.W_OK):
                    self.con = self.read_only()
                else:
                    self.con = sqlite3.connect(self.path, isolation_level=None, timeout=60)
                    self.con.execute("PRAGMA journal_mode = WAL")
                    self.con.execute("PRAGMA synchronous = NORMAL")  # in WAL mode: durable across a killed process
                self.con.create_function("crc32", 2, zlib.crc32, deterministic=True)
                self.con.execute("PRAGMA cell_size_check = ON")  # a damaged cell is an error, not a read past its end
                fresh = create and self.con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
                if fresh:  # a store of an earlier version is changed by `upgrade` alone, once it is checked
                    # in one transaction: a full disk or a kill part way left some tables, and a store called damaged
                    tables = [(sql, None) for sql in SCHEMA.split(";") if sql.strip()]
                    self.transaction([*tables, ("INSERT INTO meta VALUES (?, ?)", [("format", FORMAT)])])
            self.meta = self.read_meta()
        except BaseException:
            self.close()
            raise

    def read_only(self) -> sqlite3.Connection:
        """A connection that reads the store of a folder that cannot be written (a read-only mount, another user's
        files), where SQLite cannot make the shared-memory file its WAL mode reads through: the file alone, as
        immutable, when no change waits in its -wal file (nothing can write there meanwhile)."""
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise StoreError(
                f"The index store {self.path} is in a folder that cannot be written, and changes of its last build "
                f"wait in {wal.name} beside it, which only a writable folder can merge: open the index once where "
                "its folder can be written (or copy the folder), then it reads anywhere."
            )
        return sqlite3.connect(f"{self.path.resolve().as_uri()}?immutable=1", uri=True, isolation_level=None)

    def damaged(self, e: object) -> DamagedStore:
        return DamagedStore(
            f"The index store {self.path} is damaged or not an index ({e}). It was left as it is: restore it from a "
            "copy, or delete its folder and build again."
        )

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Any failure to read the file as an index is the `damaged` error: SQLite's own (a malformed page), bytes
        that are not UTF-8, a value of another type, size or range where a damaged cell was read."""
        try:
            yield
        except StoreError:
            raise
        except sqlite3.DatabaseError as e:
            why = NOT_DAMAGE.get(getattr(e, "sqlite_errorcode", 0) & 0xFF)
            if why is None:
                raise self.damaged(e) from None
            raise StoreError(f"Could not read the index store {self.path}: {e}. It was left as it is; {why}") from None
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, OverflowError) as e:
            raise self.damaged(e) from None

    def close(self) -> None:
        if getattr(self, "con", None) is not None:
            self.con.close()
            self.con = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_meta(self) -> dict[str, str]:
        """The meta entries, checked against their checksum (stores of earlier versions have none)."""
        with self.reading():
            entries = dict(self.con.execute("SELECT CAST(name AS BLOB), CAST(value AS BLOB) FROM meta"))
            stored = entries.pop(b"checksum", None)
            if None in entries or None in entries.values():
                raise self.damaged("a meta entry is empty")
            if (stored is not None or b"format" in entries) and stored != str(meta_crc(entries.items())).encode():
                raise self.damaged("its meta entries do not match their checksum")
            return {name.decode(): value.decode() for name, value in entries.items()}

    def begin_read(self) -> dict[str, str]:
        """Start a read transaction (every read until it ends sees one build) and return that build's meta."""
        with self.reading():
            self.con.execute("BEGIN")
        self.meta = self.read_meta()
        return self.meta

    def require_checksums(self) -> None:
        """A store of an earlier version (rows without checksums) is an error saying how to add them."""
        if self.meta.get("format") != FORMAT:
            raise StoreError(
                f"{self.path} was written by an earlier version of mlx-encoders (store format "
                f"{self.meta.get('format', '1')}; this version reads {FORMAT}), without this version's checksums of "
                "its rows: run the same `mlx-encoders index build` (corpus and model) on it once to add them "
                "(nothing is embedded again), or delete the folder and build again."
            )

    def check(self) -> None:
        """Full integrity check of the file (O(size)): SQLite's pages, then every row against its checksum and the
        row counts; raises `DamagedStore` naming the file and the first bad row."""
        with self.reading():
            size = int(self.meta.get("dimension", 0)) * DTYPE.itemsize
            result = self.con.execute("PRAGMA quick_check").fetchone()[0]
            if result != "ok":
                raise self.damaged(result)
            for what, sql in (
                ("text row", f"SELECT row FROM texts WHERE text_crc IS NOT {TEXT_CRC} OR length(vector) != {size}"),
                ("staged text", f"SELECT key FROM staged WHERE text_crc IS NOT {STAGED_TEXT_CRC} OR length(vector) "
                                f"!= {size}"),
                ("document at position", f"SELECT position FROM documents WHERE crc IS NOT {DOCUMENT_CRC} OR shared "
                                         "!= (SELECT count(*) FROM documents d WHERE d.key = documents.key)"),
            ):  # fmt: skip
                if bad := self.con.execute(f"{sql} LIMIT 1").fetchone():
                    raise self.damaged(f"the {what} {bad[0]} does not match its checksum")
            for sql, rows in (("SELECT row, vector, vector_crc FROM texts", True),
                              ("SELECT 0, vector, vector_crc FROM staged", False)):  # fmt: skip
                self.check_vectors(self.con.execute(sql), int(self.meta.get("dimension", 0)), rows)
            postings = self.check_postings("SELECT term, row, weight, crc FROM postings", rows=True)
            self.check_postings("SELECT term, 0, weight, crc FROM staged_postings", rows=False)
            counted = dict(self.con.execute("SELECT term, count(*) FROM postings GROUP BY term"))
            if self.term_counts(self.con.execute("SELECT term, postings, crc FROM terms")) != counted:
                raise self.damaged("the postings per term are not those the last build counted")
            documents = self.con.execute("SELECT count(*) FROM documents").fetchone()[0]
        self.check_counts(texts=self.count(), documents=documents, postings=postings)

    def check_vectors(self, found: sqlite3.Cursor, dimension: int, rows: bool, into=None) -> int:
        """How many (row, vector, checksum) rows `found` holds, read and checked a batch at a time; with `into`,
        (rows (N,), vectors (N, D)) arrays, copied into them in order (never a second copy of every vector)."""
        read = 0
        while batch := found.fetchmany(VECTORS_BATCH):
            numbers, blobs, stored = zip(*batch, strict=True)
            if into is not None and read + len(batch) > len(into[0]):
                raise self.damaged(f"more text rows than the {len(into[0])} counted")
            vectors = np.frombuffer(b"".join(blobs), DTYPE).reshape(len(batch), dimension)
            bad = vector_sum(vectors, numbers if rows else None) != np.array(stored, np.int64)
            if bad.any():
                raise self.damaged(f"the vector of text row {numbers[int(bad.argmax())]} does not match its checksum")
            if into is not None:
                into[0][read : read + len(batch)], into[1][read : read + len(batch)] = numbers, vectors
            read += len(batch)
        return read

    def check_postings(self, sql: str, rows: bool) -> int:
        """How many (term, row, weight, checksum) postings `sql` reads, each checked in batches."""
        count, cursor = 0, self.con.execute(sql)
        while batch := cursor.fetchmany(POSTINGS_BATCH):
            terms, numbers, weights, sums = posting_columns(batch)
            if np.any(posting_crc(terms, weights, numbers if rows else None) != sums):
                raise self.damaged("a posting of the inverted index does not match its checksum")
            count += len(batch)
        return count

    def term_counts(self, rows: Iterable[tuple[int, int, int]]) -> dict[int, int]:
        """Term -> its number of postings, of (term, postings, checksum) rows of `terms`, each checked."""
        counts = {}
        for term, postings, stored in rows:
            if stored != zlib.crc32(str(postings).encode(), term & 0xFFFFFFFF):
                raise self.damaged(f"the count of postings of term {term} does not match its checksum")
            counts[term] = postings
        return counts

    def check_counts(self, **found: int) -> None:
        """Rows lost to a damaged page that SQLite read without complaint show as counts below the build's."""
        for name, count in found.items():
            if name in self.meta and int(self.meta[name]) != count:
                raise self.damaged(f"{count} rows of {name} where the last build wrote {self.meta[name]}")

    def upgrade(self) -> None:
        """Give a store of an earlier version its checksums, after SQLite's page check and a check of every text
        (UTF-8) and vector (size, finite values): a damaged store is the `damaged` error and stays as it was."""
        if self.meta.get("format") == FORMAT:
            return
        with self.reading():
            result = self.con.execute("PRAGMA quick_check").fetchone()[0]
            if result != "ok":
                raise self.damaged(result)
            dimension, sums = int(self.meta.get("dimension", 0)), {}
            for table, handle in (("texts", "row"), ("staged", "key")):
                sums[table] = []
                for number, key, text, vector in self.con.execute(
                    f"SELECT {handle}, key, CAST(text AS BLOB), vector FROM {table}"
                ):
                    text.decode()
                    values = np.frombuffer(vector, DTYPE) if len(vector) == dimension * DTYPE.itemsize else None
                    if values is None or not np.isfinite(values).all():
                        raise self.damaged(f"the vector of {key!r} in {table} is not {dimension} finite float32s")
                    rows = np.array([number]) if table == "texts" else None
                    sums[table].append((int(vector_sum(values[None], rows)[0]), number))
            terms, rows, weights, _ = posting_columns(self.con.execute("SELECT term, row, weight, 0 FROM postings"))
            postings = zip(posting_crc(terms, weights, rows).tolist(), terms.tolist(), rows.tolist(), strict=True)
            staged = self.con.execute("SELECT key, term, weight FROM staged_postings").fetchall()
            staged = [(int(posting_crc([t], [w])[0]), key, t) for key, t, w in staged]
            present = {table: {c[1] for c in self.con.execute(f"PRAGMA table_info({table})")} for table in CHECKSUMS}
        self.transaction([
            *((statement, [()]) for statement in SCHEMA.split(";") if statement.strip()),  # the tables it lacks
            *((f"ALTER TABLE {table} ADD COLUMN {column} INTEGER", [()])
              for table, columns in CHECKSUMS.items() for column in columns if column not in present[table]),
            ("UPDATE texts SET vector_crc = ? WHERE row = ?", sums["texts"]),
            ("UPDATE staged SET vector_crc = ? WHERE key = ?", sums["staged"]),
            (f"UPDATE texts SET text_crc = {TEXT_CRC}", [()]),
            (f"UPDATE staged SET text_crc = {STAGED_TEXT_CRC}", [()]),
            ("UPDATE postings SET crc = ? WHERE term = ? AND row = ?", postings),
            ("UPDATE staged_postings SET crc = ? WHERE key = ? AND term = ?", staged),
            *SUMMARIES,
            ("INSERT OR REPLACE INTO meta VALUES ('format', ?)", [(FORMAT,)]),
        ])  # fmt: skip

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

    def transaction(self, statements: Iterable[tuple[str, Iterable]], check: Callable[[], None] | None = None) -> None:
        """Run (sql, rows) pairs with executemany (rows None: sql once) in one transaction, then `check` (which raises
        to roll it back) and the meta's checksum: all of them or none."""
        try:
            self.con.execute("BEGIN IMMEDIATE")
            try:
                for sql, rows in statements:
                    self.con.execute(sql) if rows is None else self.con.executemany(sql, rows)
                if check is not None:
                    check()
                entries = self.con.execute("SELECT CAST(name AS BLOB), CAST(value AS BLOB) FROM meta WHERE name != ?",
                                           ("checksum",))  # fmt: skip
                self.con.execute("INSERT OR REPLACE INTO meta VALUES ('checksum', ?)", (str(meta_crc(entries)),))
                self.con.execute("COMMIT")
            except BaseException:
                if self.con.in_transaction:  # SQLite rolls back by itself on some errors (a full disk)
                    self.con.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as e:
            if getattr(e, "sqlite_errorcode", 0) & 0xFF in CORRUPT:
                raise self.damaged(e) from None
            raise self.unwritable(e) from None
        except (sqlite3.Error, OSError) as e:
            raise self.unwritable(e) from None
        self.meta = self.read_meta()

    def unwritable(self, e: Exception) -> StoreError:
        return StoreError(
            f"Could not write to the index store {self.path}: {e}. This step was rolled back: the index is as "
            "it was. Free disk space if it is full and run again."
        )

    def set_meta(self, meta: dict[str, str]) -> None:
        self.transaction([("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(meta.items()))])

    def stage(self, keys: list[str], texts: list[str], vectors: np.ndarray, sparse: list | None = None) -> None:
        """Stage texts with their dense vectors ((N, 0) without a dense model) and sparse (term ids, weights), in
        one transaction: a text is staged with all its vectors or not at all."""
        vectors = np.ascontiguousarray(vectors, DTYPE)
        finite = np.isfinite(vectors).all(axis=1)
        if sparse is not None:
            finite &= [np.isfinite(np.asarray(weights, np.float64)).all() for _, weights in sparse]
        if not finite.all():  # a NaN row made every int8 search of the index find nothing
            bad = int(np.flatnonzero(~finite)[0])
            raise ValueError(
                f"text {texts[bad]!r:.80} was embedded as NaN or infinite values (an overflow in the model, in half "
                "precision most often); nothing of its chunk was written: load the model in float32, or leave the "
                "text out"
            )
        rows = [
            (key, text, vector.tobytes(), zlib.crc32(text.encode(), seeded(key.encode(), 0)), vector_sum)
            for key, text, vector, vector_sum in zip(keys, texts, vectors, vector_sum(vectors).tolist(), strict=True)
        ]
        postings = [
            (key, term, weight, crc)
            for key, (terms, weights) in zip(keys, sparse or [], strict=sparse is not None)
            for term, weight, crc in zip(np.asarray(terms, np.int64).tolist(), np.asarray(weights, np.float64).tolist(),
                                         posting_crc(terms, weights).tolist(), strict=True)
        ]  # fmt: skip
        self.transaction([
            ("INSERT OR IGNORE INTO staged VALUES (?, ?, ?, ?, ?)", rows),
            ("INSERT OR IGNORE INTO staged_postings VALUES (?, ?, ?, ?)", postings),
        ])  # fmt: skip

    def keys(self, staged: bool = True) -> set[str]:
        """Keys of every text this store holds a vector for: indexed, and staged unless `staged` is False."""
        sql = "SELECT key FROM texts UNION SELECT key FROM staged" if staged else "SELECT key FROM texts"
        with self.reading():
            return {key for (key,) in self.con.execute(sql)}

    def merge(self, shard: Path) -> None:
        """Stage the vectors of a shard written by another rank (one transaction; merging twice is harmless)."""
        try:
            self.con.execute("ATTACH DATABASE ? AS shard", (str(shard),))
        except sqlite3.Error as e:
            raise StoreError(f"Could not read the shard {shard}: {e}; delete it to re-embed its texts") from None
        columns = "key, text, vector, text_crc, vector_crc"
        try:
            self.transaction([
                (f"INSERT OR IGNORE INTO staged ({columns}) SELECT {columns} FROM shard.staged", [()]),
                ("INSERT OR IGNORE INTO staged_postings SELECT key, term, weight, crc FROM shard.staged_postings",
                 [()]),
            ])  # fmt: skip
        finally:
            self.con.execute("DETACH DATABASE shard")

    def commit_index(self, docs: list[tuple[str, str]]) -> None:
        """The new index in one transaction: `docs` (id, key) replace the documents, the staged texts join the
        texts and their postings the inverted index, texts no document uses go with their postings, and the
        generation moves on (with the store's random id, set once, it tells every build apart). Rolled back,
        with an error, when a document's text has no vector: another process changed the staging tables."""
        generation = str(int(self.meta.get("generation", "0")) + 1)
        documents = [(position, doc_id, key) for position, (doc_id, key) in enumerate(docs, 1)]
        self.transaction([
            ("DELETE FROM staged_postings WHERE key IN (SELECT key FROM texts)", [()]),  # a shard merged again
            ("DELETE FROM documents", [()]),
            ("INSERT INTO documents (position, id, key) VALUES (?, ?, ?)", documents),
            # new texts take rows in the order of their first document, whichever rank staged them (ties are
            # broken by row: a sharded build ranks as one process's does)
            ("INSERT OR IGNORE INTO texts (key, text, vector, vector_crc) SELECT key, text, vector, vector_crc FROM "
             "staged s ORDER BY (SELECT MIN(position) FROM documents d WHERE d.key = s.key), s.key", [()]),
            (f"UPDATE texts SET text_crc = {TEXT_CRC}, vector_crc = {xor_row('vector_crc', 'row')} WHERE text_crc IS "
             "NULL", [()]),  # the texts just added: their checksums take their rows
            (f"INSERT INTO postings SELECT s.term, t.row, s.weight, {xor_row('s.crc', 't.row')} FROM staged_postings s "
             "JOIN texts t USING (key)", [()]),
            ("DELETE FROM staged", [()]),
            ("DELETE FROM staged_postings", [()]),
            ("DELETE FROM postings WHERE row IN (SELECT row FROM texts WHERE key NOT IN (SELECT key FROM documents))",
             [()]),
            ("DELETE FROM texts WHERE key NOT IN (SELECT key FROM documents)", [()]),
            *SUMMARIES,
            ("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("generation", generation)]),
            ("INSERT OR IGNORE INTO meta VALUES ('store_id', ?)", [(uuid.uuid4().hex,)]),
        ], check=self.every_document_has_its_vector)  # fmt: skip

    def every_document_has_its_vector(self) -> None:
        missing = self.con.execute(
            "SELECT count(*), min(d.id) FROM documents d LEFT JOIN texts t ON t.key = d.key WHERE t.row IS NULL"
        ).fetchone()
        if missing[0]:
            raise StoreError(
                f"{missing[0]} documents of this build (such as {missing[1]!r}) have no vector in {self.path}: "
                "another process changed the store during the build. Nothing was committed (the index is as it "
                "was): run the build again, one build at a time."
            )

    def count(self) -> int:
        with self.reading():
            return self.con.execute("SELECT count(*) FROM texts").fetchone()[0]

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows (N,) int64, vectors (N, D) float32) of the indexed texts, in row order, each vector checked
        against its checksum, and the row counts against the build's."""
        with self.reading():
            dimension, count = int(self.meta["dimension"]), self.count()
            rows, vectors = np.empty(count, np.int64), np.empty((count, dimension), DTYPE)
            texts = self.con.execute("SELECT row, vector, vector_crc FROM texts ORDER BY row")
            read = self.check_vectors(texts, dimension, rows=True, into=(rows, vectors))
            documents = self.con.execute("SELECT count(*) FROM documents").fetchone()[0]
        if read != count or np.any(np.diff(rows) <= 0):
            raise self.damaged(f"the text rows read are not the {count} rows counted, in order")
        self.check_counts(texts=count, documents=documents)
        return rows, vectors

    def postings(self, terms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(terms, rows, weights) of every posting of the given term ids, read through the term index and checked
        against their checksums."""
        marks, asked = ",".join("?" * len(terms)), [int(t) for t in terms]
        with self.reading():
            found = self.con.execute(f"SELECT term, row, weight, crc FROM postings WHERE term IN ({marks})", asked)
            terms, rows, weights, sums = posting_columns(found.fetchall())
            counted = self.con.execute(f"SELECT term, postings, crc FROM terms WHERE term IN ({marks})", asked)
            counts = self.term_counts(counted)
        if np.any(posting_crc(terms, weights, rows) != sums):
            raise self.damaged("a posting of the inverted index does not match its checksum")
        if dict(zip(*np.unique(terms, return_counts=True), strict=True)) != counts:
            raise self.damaged("the postings found are not as many as the last build counted for their terms")
        self.check_posted_once(terms, rows)
        return terms, rows, weights

    DOCUMENT_COLUMNS = (
        "t.row, CAST(t.key AS BLOB), CAST(t.text AS BLOB), t.text_crc, d.position, CAST(d.id AS BLOB), "
        "CAST(d.key AS BLOB), d.shared, d.crc FROM texts t JOIN documents d ON d.key = t.key"
    )

    def checked_document(self, row, key, text, text_sum, position, doc_id, doc_key, shared, doc_sum) -> tuple:
        """(position, row, id, text, documents sharing the text) of a row of DOCUMENT_COLUMNS, once its text and
        document match their checksums (seeded with the row and position, so a row found is the row asked for)."""
        seed = zlib.crc32(str(shared).encode(), position & 0xFFFFFFFF)
        if (
            text_sum != zlib.crc32(text, seeded(key, row))
            or doc_sum != zlib.crc32(doc_id, zlib.crc32(doc_key, seed))
            or doc_key != key
        ):
            raise self.damaged(f"text row {row} or its document {position} does not match its checksum")
        return position, row, doc_id.decode(), text.decode(), shared

    def documents(self, rows: list[int]) -> dict[int, list[tuple[str, str]]]:
        """For each text row its (document id, text) pairs, in corpus order (a shared text has several); read in
        batches of LOOKUP_BATCH rows, so that no statement grows with the request. Each text and document is
        checked against its checksum; a row with fewer documents than the build wrote for it is the `damaged`
        error."""
        out: dict[int, list[tuple[str, str]]] = {row: [] for row in rows}
        found = []
        with self.reading():
            for start in range(0, len(rows), LOOKUP_BATCH):
                batch = [int(r) for r in rows[start : start + LOOKUP_BATCH]]
                marks = ",".join("?" * len(batch))
                for values in self.con.execute(f"SELECT {self.DOCUMENT_COLUMNS} WHERE t.row IN ({marks})", batch):
                    found.append(self.checked_document(*values))
        for _, row, doc_id, text, _ in sorted(found):
            out[row].append((doc_id, text))
        shared = {row: count for _, row, _, _, count in found}
        if short := [row for row, pairs in out.items() if len(pairs) != shared.get(row)]:
            raise self.damaged(f"text row {short[0]} has not the documents the last build wrote for it")
        return out

    def all_documents(self, size: int) -> Iterator[list[tuple[str, int, str]]]:
        """Every document in corpus order, `size` at a time: (id, text row, text), each checked as `documents`
        checks them; after the last, the number read and the documents of each text against the build's counts
        (a damaged page that SQLite reads without complaint loses rows)."""
        read, shared, last = {}, {}, 0
        with self.reading():
            cursor = self.con.execute(f"SELECT {self.DOCUMENT_COLUMNS} ORDER BY d.position")
            while batch := cursor.fetchmany(size):
                out = []
                for values in batch:
                    position, row, doc_id, text, count = self.checked_document(*values)
                    if position <= last:
                        raise self.damaged(f"the document at position {position} is out of corpus order")
                    last, read[row], shared[row] = position, read.get(row, 0) + 1, count
                    out.append((doc_id, row, text))
                yield out
        if read != shared:
            raise self.damaged("the documents read are not those the last build wrote for their texts")
        self.check_counts(documents=sum(read.values()), texts=len(read))

    def postings_of(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(terms, rows, weights) of every posting of the given text rows, ordered by row then term, read through
        the row index in batches of LOOKUP_BATCH rows and checked against their checksums. Whether none was lost
        shows only against the build's count of all postings: read every row once, then `check_counts(postings=)`."""
        found = []
        with self.reading():
            for start in range(0, len(rows), LOOKUP_BATCH):
                batch = [int(r) for r in rows[start : start + LOOKUP_BATCH]]
                marks = ",".join("?" * len(batch))
                found += self.con.execute(f"SELECT term, row, weight, crc FROM postings WHERE row IN ({marks})", batch)
            terms, numbers, weights, sums = posting_columns(found)
        if np.any(posting_crc(terms, weights, numbers) != sums):
            raise self.damaged("a posting of the inverted index does not match its checksum")
        order = np.lexsort((terms, numbers))
        terms, numbers, weights = terms[order], numbers[order], weights[order]
        self.check_posted_once(terms, numbers)
        return terms, numbers, weights

    def check_posted_once(self, terms: np.ndarray, rows: np.ndarray) -> None:
        """No (term, row) posting read twice: a damaged index can list one twice and lose another, which leaves the
        counts the build wrote even."""
        order = np.lexsort((rows, terms))
        terms, rows = terms[order], rows[order]
        if np.any((terms[1:] == terms[:-1]) & (rows[1:] == rows[:-1])):
            raise self.damaged("a text's term is posted twice in the inverted index")


# what a build writes with each commit, after the texts and postings: the checksums of the documents, the counts of
# documents per text and postings per term, and the row counts
SUMMARIES = [
    (SHARED, [()]),
    (f"UPDATE documents SET crc = {DOCUMENT_CRC}", [()]),
    ("DELETE FROM terms", [()]),
    (TERMS, [()]),
    ("INSERT OR REPLACE INTO meta VALUES ('texts', (SELECT count(*) FROM texts))", [()]),
    ("INSERT OR REPLACE INTO meta VALUES ('documents', (SELECT count(*) FROM documents))", [()]),
    ("INSERT OR REPLACE INTO meta VALUES ('postings', (SELECT count(*) FROM postings))", [()]),
]


def shard_keys(path: Path, identity: dict[str, str], model: str) -> set[str]:
    """The keys a shard written by one rank holds, checked first: a damaged shard, one of another model or of an
    earlier version, is an error naming the file."""
    try:
        with closing(Store(path)) as shard:
            shard.require_checksums()
            shard.check()
            shard.check_identity(identity, model)
            return shard.keys()
    except StoreError as e:
        raise StoreError(
            f"A shard of a distributed build is unusable: {e} Delete {path} to re-embed its texts; the index itself "
            "is unchanged."
        ) from None
