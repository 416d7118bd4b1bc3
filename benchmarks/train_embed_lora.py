"""LoRA embedding training on the Qwen3-Embedding-0.6B shape: tokens per second of `fine_tune("embed", lora_rank=...)`
against sentence-transformers' trainer with a PEFT LoRA adapter (peft's `get_peft_model`) on torch CPU.

The model is built by transformers at Qwen3-Embedding-0.6B's published config with seeded random weights, laid out
as its sentence-transformers folder (last-token pooling, left padding, Normalize; benchmarks/embedders.py), with
all-MiniLM-L6-v2's tokenizer standing in for Qwen's (speed depends on the token counts, not on the weights or the
vocabulary). Both engines train the same LoRA (rank, alpha, targets, no dropout) over the frozen base with
MultipleNegativesRankingLoss on the same anchor/positive pairs, the same batch size, learning rate, maximum length
and NO_DUPLICATES batches, each in its own process. Every anchor and positive (the two halves of a long stdlib
docstring) fills `--max-length` tokens, so every step embeds 2 x batch x max-length tokens, none of them padding,
whatever order the sampler takes. Each engine's first `--warmup` steps are left out: tokens/s is the timed steps'
tokens over the time from the end of the last warm-up step to the end of the last step.

    python benchmarks/train_embed_lora.py                                   # 1 warm-up + 3 timed steps, batch 8
    python benchmarks/train_embed_lora.py --batch-size 16 --steps 5 --max-length 128

peft is this benchmark's oracle only (pip install peft accelerate), not a dependency of mlx_encoders. Timings are
printed, never asserted; run it on an otherwise idle machine.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = "qwen3-embedding-0.6b"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8, help="anchor/positive pairs per step (default 8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the timing, at least 1 (default 1)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules, comma-separated")
    p.add_argument("--engines", default="ours,st", help="comma-separated subset of: ours, st")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch_size < 2:  # MNRL's in-batch negatives: one pair has none
        p.error(f"--batch-size must be 2 or more (in-batch negatives), got {args.batch_size}")
    return args


def training_rows(n: int, tokenizer, max_length: int) -> list[dict]:
    """`n` pairs of the two halves of long stdlib docstrings, each half at least `max_length` tokens."""
    from mlx_encoders.corpus import stdlib_docstrings

    rows = []
    for doc in stdlib_docstrings(20 * n):
        words = doc.split()
        anchor, positive = " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])
        lengths = [
            len(ids) for ids in tokenizer([anchor, positive], truncation=True, max_length=max_length)["input_ids"]
        ]
        if min(lengths) == max_length:
            rows.append({"anchor": anchor, "positive": positive})
        if len(rows) == n:
            return rows
    sys.exit(f"only {len(rows)} stdlib docstrings give two halves of {max_length} tokens: lower --max-length")


def step_times_ours(job: dict, folder: Path, output: Path) -> list[float]:
    """fine_tune's steps, each timed at the moment the trainer logs it."""
    from mlx_encoders.train import fine_tune, trainer

    times, log = [], trainer.log_metrics

    def timed(output_dir, record):
        times.append(time.perf_counter())
        log(output_dir, record)

    trainer.log_metrics = timed  # the trainer logs once per optimizer step
    fine_tune(
        "embed", job["rows"], output, model=folder, loss="mnrl", lora_rank=job["rank"], lora_alpha=2 * job["rank"],
        lora_targets=job["targets"], batch_size=job["batch_size"], max_steps=job["total_steps"], lr=1e-4,
        warmup_ratio=0.0, max_length=job["max_length"], seed=0,
    )  # fmt: skip
    return times


def step_times_st(job: dict, folder: Path, output: Path) -> list[float]:
    """SentenceTransformerTrainer's steps with a PEFT LoRA adapter, each timed at its on_step_end."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    model = SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = job["max_length"]
    config = LoraConfig(r=job["rank"], lora_alpha=2 * job["rank"], lora_dropout=0.0, target_modules=job["targets"])
    # PEFT around the transformers model, as `add_adapter` does (which asks transformers for peft >= 0.22)
    model[0].model = get_peft_model(model[0].model, config)
    times = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    args = SentenceTransformerTrainingArguments(
        output_dir=str(output), max_steps=job["total_steps"], per_device_train_batch_size=job["batch_size"],
        learning_rate=1e-4, warmup_ratio=0.0, seed=0, use_cpu=True, batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    loss = losses.MultipleNegativesRankingLoss(model)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(job["rows"]), loss=loss, callbacks=[Clock()]
    )
    trainer.train()
    return times


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        step_times = step_times_ours if job["engine"] == "ours" else step_times_st
        times = step_times(job, Path(job["folder"]), Path(tmp) / "out")
    return {"times": times}


def main() -> None:
    args = parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return
    from embedders import sentence_folder
    from train_embed import run
    from transformers import AutoTokenizer

    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be at least 1: the timing starts at the end of a step")
    total = args.warmup + args.steps
    print(f"{SHAPE} shape, LoRA rank {args.rank} on {args.targets}, MNRL, batch {args.batch_size} pairs, max length "
          f"{args.max_length}, {args.warmup} warm-up + {args.steps} timed steps, {args.threads} threads")  # fmt: skip
    rates = {}
    with tempfile.TemporaryDirectory() as workdir:
        folder = sentence_folder(SHAPE, Path(workdir))
        tokenizer = AutoTokenizer.from_pretrained(folder.parent / "transformer")
        # exactly `total` batches of distinct rows: one epoch, every row in one step
        rows = training_rows(total * args.batch_size, tokenizer, args.max_length)
        job = dict(
            rows=rows, rank=args.rank, targets=args.targets.split(","), batch_size=args.batch_size,
            total_steps=total, max_length=args.max_length, threads=args.threads, folder=str(folder),
        )  # fmt: skip
        tokens = args.steps * args.batch_size * 2 * args.max_length
        for engine in args.engines.split(","):
            times = run({**job, "engine": engine}, __file__)["times"]
            if len(times) != total:
                sys.exit(f"{engine}: {len(times)} steps timed, expected {total}")
            rates[engine] = tokens / (times[-1] - times[args.warmup - 1])
            per_step = ", ".join(f"{b - a:.1f}" for a, b in zip(times, times[1:], strict=False))
            print(f"{engine:>5}: {rates[engine]:8.1f} tokens/s  (seconds of each step after the first: {per_step})",
                  flush=True)  # fmt: skip
    if {"ours", "st"} <= set(rates):
        print(f"ours / sentence-transformers + peft: {rates['ours'] / rates['st']:.2f}x")


if __name__ == "__main__":
    main()
