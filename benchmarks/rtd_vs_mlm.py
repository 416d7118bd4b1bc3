"""Pretraining by replaced-token detection (ELECTRA) against masked-LM, judged by the encoder each one gives.

For each seed, two encoders of the same shape (`examples/train_mlm.py`'s: 4 layers, 128 wide; ELECTRA's
embeddings as wide as its hidden states, so the discriminator is BERT's shape) are pretrained from scratch on
the same standard-library docstrings, with the same tokens (texts x epochs), batch size and learning rate:
`fine_tune("mlm", ...)` and `fine_tune("rtd", ...)` (generator 1/4 as wide). Each is then fine-tuned on
`examples/train_classifier.py`'s task (which package a docstring documents, held-out modules unseen) and its
held-out accuracy reported; also each pretraining's throughput in real tokens per second of its whole
`fine_tune` call (compilation included, no evaluation).

    python benchmarks/rtd_vs_mlm.py                                  # 3 seeds at train_mlm.py's size
    python benchmarks/rtd_vs_mlm.py --tiny --texts 200 --epochs 1 --seeds 1 --task-examples 200 --task-epochs 1

Timings are printed, never asserted; run it on an otherwise idle machine.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_classifier import docstring_task  # noqa: E402
from train_mlm import default_tokenizer, write_corpus  # noqa: E402

from mlx_encoders.tokenizer import Tokenizer  # noqa: E402
from mlx_encoders.train import fine_tune  # noqa: E402
from mlx_encoders.train.data import masked_lm_data  # noqa: E402

SIZES = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
             max_position_embeddings=128)  # fmt: skip
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128)  # fmt: skip
MAX_LENGTH = 64


def pretrain(kind: str, corpus: pathlib.Path, output: pathlib.Path, sizes: dict, args, seed: int) -> tuple:
    """(the encoder's folder, real tokens per second) of one pretraining run."""
    config = {**sizes, "model_type": "bert"} if kind == "mlm" else {**sizes, "embedding_size": sizes["hidden_size"]}
    started = time.perf_counter()
    trained = fine_tune(
        kind, corpus, output, config=config, tokenizer=args.tokenizer, epochs=args.epochs, batch_size=32, lr=1e-3,
        warmup_ratio=0.05, weight_decay=0.01, max_length=MAX_LENGTH, seed=seed, overwrite=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    tokens = sum(len(e.ids) for e in masked_lm_data(corpus, args.tok, max_length=MAX_LENGTH).encodings)
    return trained.path, tokens * args.epochs / seconds


def downstream(encoder: pathlib.Path, task: tuple, output: pathlib.Path, args, seed: int) -> float:
    trained = fine_tune(
        "classify", task[0], output, model=encoder, eval_data=task[1], epochs=args.task_epochs, batch_size=16,
        lr=args.task_lr, warmup_ratio=0.1, weight_decay=0.01, max_length=128, seed=seed, overwrite=True,
    )  # fmt: skip
    return trained.metrics["eval_accuracy"]


def trimmed(file: pathlib.Path, n: int | None) -> pathlib.Path:
    """About `n` rows of a JSONL file, evenly spaced so every label stays; every row when None (a quick run)."""
    if n is None:
        return file
    rows = file.read_text().splitlines(keepends=True)
    out = file.with_name(f"{file.stem}-{n}.jsonl")
    out.write_text("".join(rows[:: max(1, len(rows) // n)]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="docstrings to pretrain on (train_mlm.py's 3000)")
    p.add_argument("--epochs", type=int, default=3, help="pretraining epochs (default 3)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 42, 43, ... (default 3)")
    p.add_argument("--task-epochs", type=int, default=3, help="fine-tuning epochs (default 3)")
    p.add_argument("--task-lr", type=float, default=5e-4, help="fine-tuning learning rate (default 5e-4)")
    p.add_argument("--task-examples", type=int, help="fine-tune on about N training rows only")
    p.add_argument("--tiny", action="store_true", help="2 layers, 32 wide: a quick check that everything runs")
    p.add_argument("--tokenizer", type=pathlib.Path, default=default_tokenizer())
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("rtd-vs-mlm"))
    args = p.parse_args()
    args.tok = Tokenizer.from_pretrained(args.tokenizer)

    corpus, _ = write_corpus(args.output / "corpus", args.texts)
    train_file, eval_file = docstring_task(args.output / "task")
    task = trimmed(train_file, args.task_examples), eval_file
    sizes = TINY if args.tiny else SIZES
    rows = []
    for seed in range(42, 42 + args.seeds):
        row = {"seed": seed}
        for kind in ("mlm", "rtd"):
            encoder, row[f"{kind}_tokens_s"] = pretrain(kind, corpus, args.output / f"{kind}-{seed}", sizes, args, seed)
            row[f"{kind}_accuracy"] = downstream(encoder, task, args.output / f"{kind}-{seed}-task", args, seed)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'':>10}  {'held-out accuracy':>22}  {'pretraining tokens/s':>20}")
    for kind in ("mlm", "rtd"):
        accuracy = [r[f"{kind}_accuracy"] for r in rows]
        spread = statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0
        speed = statistics.median(r[f"{kind}_tokens_s"] for r in rows)
        print(f"{kind:>10}  {statistics.mean(accuracy):>14.4f} ± {spread:.4f}  {speed:>20.0f}")
    (args.output / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
