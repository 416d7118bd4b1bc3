"""Speed of the search example's index (examples/search.py) at 100k documents, without a model.

Fills a fresh index with `--documents` random unit vectors of dimension `--dimension` through the example's
own `write_index` (one transaction), opens it with `read_index` (every row read and checked, as each run of
the example does), then times `--queries` random unit queries, each scored against all vectors by one numpy
matrix product and cut to the top `--top-k` with the example's `best`. Embedding the query with the model
is not included (see benchmarks/embed.py for the model's speed).

    python benchmarks/search.py                                # 100k x 384, 200 queries, top 5
    python benchmarks/search.py --documents 1000000 --index /tmp/big-index
"""

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).parents[1] / "examples" / "search.py"


def load_example():
    spec = importlib.util.spec_from_file_location("search_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unit_vectors(rng: np.random.Generator, n: int, dimension: int) -> np.ndarray:
    vectors = rng.standard_normal((n, dimension), dtype=np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=100_000)
    p.add_argument("--dimension", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--index", type=Path, help="index folder (default: a temporary one); must not hold an index")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="search-bench-") as temporary:
        run(args, args.index or Path(temporary))


def run(args: argparse.Namespace, folder: Path) -> None:
    search, rng = load_example(), np.random.default_rng(0)
    file = folder / "index.sqlite"
    if file.exists():
        raise SystemExit(f"{file} already exists; pass an empty --index folder")

    vectors = unit_vectors(rng, args.documents, args.dimension)
    keys = [search.text_key(f"document {i}") for i in range(args.documents)]
    meta = {"model": "random", "model_fingerprint": "random", "dimension": str(args.dimension), "dtype": "<f4"}
    start = time.perf_counter()
    search.write_index(file, meta, dict(zip(keys, vectors, strict=True)), set())
    written = time.perf_counter() - start

    start = time.perf_counter()
    _, loaded = search.read_index(file, "random", args.dimension)
    opened = time.perf_counter() - start

    seconds = []
    for query in unit_vectors(rng, args.queries, args.dimension):
        start = time.perf_counter()
        search.best(loaded @ query, args.top_k)
        seconds.append(time.perf_counter() - start)
    ms = sorted(1000 * s for s in seconds)
    print(f"index: {args.documents} x {args.dimension} float32, {file.stat().st_size / 1e6:.0f} MB")
    print(f"write (one transaction): {written:.2f} s; open (read and check every row): {opened:.2f} s")
    print(
        f"query (matrix product + top-{args.top_k}), {args.queries} queries: median {statistics.median(ms):.1f} ms, "
        f"p95 {ms[int(0.95 * (len(ms) - 1))]:.1f} ms, max {ms[-1]:.1f} ms"
    )


if __name__ == "__main__":
    main()
