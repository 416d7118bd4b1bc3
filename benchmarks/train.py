"""Training: mlx_encoders' loop (`mlx_encoders.train.fine_tune`) against torch on CPU, in one run.

Three parts, each engine run in its own subprocess (so peak memory, `ru_maxrss`, is its own; they run one after
the other, never at once), on the docstrings of the installed Python standard library (`mlx_encoders.corpus`):

- throughput: real (non-padding) training tokens per second of optimizer steps after warm-up steps, on a
  BERT-base-shaped sequence classifier (random init from a config) and on all-MiniLM-L6-v2 (real weights, a new
  head): our `fine_tune("classify", ...)` against a torch loop written out as transformers' Trainer runs it
  (AdamW with its decay groups, linear warmup schedule, clipping), the same batches in the same order. Peak
  resident memory of each, and the share of this machine's float32 sgemm rate (a 2048^3 matmul, measured in
  the same run) that each reaches, counting 6 x non-embedding parameters FLOPs per real token (the usual
  forward + backward estimate; attention scores and padding not counted). `--rounds N` runs each engine N
  times, taking turns, and compares their median rounds: this machine's speed drifts by 20% or more over
  minutes, which one round each cannot tell from a difference between the engines.
- task: all-MiniLM-L6-v2 fine-tuned to tell which top-level package a docstring comes from (`--classes`),
  split by module (every docstring of a module on one side, so test modules are unseen); held-out accuracy
  after each epoch of ours and of transformers' Trainer (the same loop written out when `accelerate`, which
  Trainer needs, is not installed), the same hyperparameters, for each seed and their mean.
- mlm: a small BERT trained from scratch (masked-LM, the all-MiniLM-L6-v2 WordPiece tokenizer) on the
  docstrings; both engines start from the same initial weights (transformers' init, saved once) and see the
  same masked batches (our `collate` and `Masker` feed the torch loop); held-out perplexity after each epoch.

    python benchmarks/train.py --blas /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python benchmarks/train.py --parts throughput --models minilm --steps 3 --warmup 1
    python benchmarks/train.py --parts throughput --steps 8 --warmup 2 --rounds 3
    python benchmarks/train.py --parts task --train-examples 2000 --test-examples 500 --max-length 128 --epochs 3
    python benchmarks/train.py --parts mlm --mlm-docs 3000 --mlm-eval-docs 300 --mlm-epochs 5 --mlm-batch-size 32
    python benchmarks/train.py --device cuda --parts throughput --batch-size 32 --max-length 128   # on a GPU

`--blas` gives MLX's float matmuls that library (any BLAS exporting `cblas_sgemm`) in every process, through
`MLX_ENCODERS_BLAS` (by default `mlx_encoders` binds pip's OpenBLAS to MLX); torch keeps its own. Timings are printed,
never asserted; run it on an otherwise idle machine. The defaults are small (a few minutes on 2 cores), the
scaled-up commands above take the task and masked-LM parts to sizes where the accuracies and perplexities settle.
`--device cuda` runs the throughput part on the GPU (MLX's CUDA backend, torch's CUDA), its peak memory the GPU
allocators' and its reference rate a float32 product on the GPU.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

from embed import mlx_blas, model_folder  # the sibling benchmark's: the BLAS in use, the real MiniLM folder
from isolated import worker_result

CLASSES = "tkinter,idlelib,distutils,asyncio,email,importlib,xml,unittest"
BERT_BASE = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
ENGINES = ("mlx_encoders", "torch")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="throughput,task,mlm", help="comma-separated subset of throughput,task,mlm")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores and threads of each engine")
    p.add_argument("--blas", help="path of a BLAS library (exporting cblas_sgemm) for MLX to use")
    p.add_argument("--max-length", type=int, default=64, help="tokens per example, all parts (default 64)")
    p.add_argument("--classes", default=CLASSES, help=f"top-level stdlib packages to classify (default {CLASSES})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="throughput part: where both run")
    g = p.add_argument_group("throughput")
    g.add_argument("--models", default="bert-base,minilm", help="comma-separated subset of bert-base,minilm")
    g.add_argument("--batch-size", type=int, default=8, help="examples per optimizer step (default 8)")
    g.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    g.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    g.add_argument("--rounds", type=int, default=1,
                   help="run the engines this many times each, taking turns (default 1); with more than one, "
                        "ratios are of the engines' median rounds and each round's ratio is printed")  # fmt: skip
    g = p.add_argument_group("task")
    g.add_argument("--train-examples", type=int, default=240, help="at most this many, drawn evenly (default 240)")
    g.add_argument("--test-examples", type=int, default=160, help="at most this many held out (default 160)")
    g.add_argument("--epochs", type=int, default=2)
    g.add_argument("--task-batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=2e-4)
    g.add_argument("--warmup-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    g = p.add_argument_group("mlm")
    g.add_argument("--mlm-docs", type=int, default=300, help="training docstrings (default 300)")
    g.add_argument("--mlm-eval-docs", type=int, default=100, help="held-out docstrings (default 100)")
    g.add_argument("--mlm-epochs", type=int, default=2)
    g.add_argument("--mlm-batch-size", type=int, default=16)
    g.add_argument("--mlm-lr", type=float, default=5e-4)
    g.add_argument("--mlm-layers", type=int, default=4)
    g.add_argument("--mlm-hidden", type=int, default=256, help="hidden size; heads = hidden / 64, FFN = 4 x hidden")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a JSON job: this process is one engine's run
    return p.parse_args()


def set_threads(threads: int, blas: str | None) -> None:
    """Thread counts must be set before the libraries start, and a BLAS loaded before MLX binds its own. Fewer
    threads than cores also hold the process to that many cores: mlx_encoders sizes its lanes by the cores it may
    use, not by thread settings."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    allowed = sorted(os.sched_getaffinity(0))
    if 0 < threads < len(allowed):
        os.sched_setaffinity(0, allowed[:threads])
    if blas:
        if not Path(blas).is_file():
            sys.exit(f"--blas {blas}: no such file (a BLAS library exporting cblas_sgemm, such as libopenblas.so.0)")
        os.environ["MLX_ENCODERS_BLAS"] = blas  # bound to MLX alone when mlx_encoders is imported; torch keeps its own


def peak_mib(device: str = "cpu") -> float:
    """The process's peak resident memory, or on a GPU its allocator's peak (MLX's and torch's: one is unused)."""
    if device == "cuda":
        import mlx.core as mx
        import torch

        return max(mx.get_peak_memory(), torch.cuda.max_memory_allocated()) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ----- data: stdlib docstrings, labelled by top-level package, split by module -----


def module_of(source_id: str, root: Path) -> str:
    """The module a docstring's source id ("email.mime.text.MIMEText.__init__") lives in ("email.mime.text")."""
    parts = source_id.split(".")
    for k in range(len(parts), 0, -1):
        path = root.joinpath(*parts[:k])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:k])
    return parts[0]


def split_by_module(documents, classes: list[str], train_n: int, test_n: int) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of {"text", "label", "module"}: per class, whole modules (in an order fixed by a
    hash of their names) go to the test side until it holds 20% of the class's docstrings, skipping a module that
    would take it past 35%; then each side is cut to its size, taking each class's docstrings evenly."""
    from mlx_encoders.corpus import stdlib_root

    root, by_module = stdlib_root(), defaultdict(list)
    for source_id, text in documents:
        label = source_id.split(".")[0]
        if label in classes:
            by_module[label, module_of(source_id, root)].append(text)
    train, test = defaultdict(list), defaultdict(list)
    for label in classes:
        modules = sorted((m for c, m in by_module if c == label), key=lambda m: zlib.crc32(m.encode()))
        total, held = sum(len(by_module[label, m]) for m in modules), 0
        for module in modules:
            rows = [{"text": t, "label": label, "module": module} for t in by_module[label, module]]
            if held < 0.2 * total and held + len(rows) <= 0.35 * total:
                test[label] += rows
                held += len(rows)
            else:
                train[label] += rows
    return evenly(train, train_n), evenly(test, test_n)


def evenly(rows: dict[str, list[dict]], n: int) -> list[dict]:
    """Up to `n` rows, every `k`-th of each class's list so that each class keeps the same share as before."""
    total = sum(len(r) for r in rows.values())
    step = max(1.0, total / n)
    return [r[int(i * step)] for r in rows.values() for i in range(int(len(r) / step))]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def mlm_split(documents, train_n: int, eval_n: int) -> tuple[list[dict], list[dict]]:
    """Docstrings of one module in ten (by a hash of the module's name) held out; the rest trains."""
    from mlx_encoders.corpus import stdlib_root

    root, train, held = stdlib_root(), [], []
    for source_id, text in documents:
        side = held if zlib.crc32(module_of(source_id, root).encode()) % 10 == 0 else train
        side.append({"text": text})
    return train[:train_n], held[:eval_n]


# ----- the torch side -----


def torch_optimizer(model, lr: float, weight_decay: float, warmup_ratio: float, total: int):
    """AdamW and the linear warmup schedule as transformers' Trainer builds them (its decay groups, its warmup
    steps: ceil(ratio x steps))."""
    import torch
    import transformers

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    warmup = math.ceil(warmup_ratio * total)
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, warmup, total)


def torch_step(model, optimizer, schedule, batch: dict, max_grad_norm: float = 1.0) -> float:
    """One Trainer step: forward, backward, clip, AdamW, schedule."""
    import torch

    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    return loss.item()


def epoch_order(n: int, seed: int, epoch: int):
    """The order `mlx_encoders.train.trainer.epoch_steps` draws for an epoch (so both engines see one order)."""
    import numpy as np

    return np.random.default_rng([seed, epoch]).permutation(n)


def classification_batches(tokenizer, rows: list[dict], label2id: dict, job: dict):
    """The trainer's batches of `rows`, epoch after epoch, tokenized and padded by transformers."""
    from transformers import DataCollatorWithPadding

    pad = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    encoded = tokenizer([r["text"] for r in rows], truncation=True, max_length=job["max_length"])
    features = [{k: encoded[k][i] for k in encoded} | {"labels": label2id[r["label"]]} for i, r in enumerate(rows)]
    size, epoch = job["batch_size"], 0
    while True:
        order = epoch_order(len(rows), job["seed"], epoch)
        for start in range(0, len(order), size):
            yield pad([features[i] for i in order[start : start + size]])
        epoch += 1


def classifier(folder: str, label2id: dict, seed: int):
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.set_seed(seed)  # the new head's init, as Trainer's examples seed before loading
    id2label = {i: label for label, i in label2id.items()}
    return AutoModelForSequenceClassification.from_pretrained(folder, label2id=label2id, id2label=id2label)


def torch_throughput(job: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    rows, label2id = read_jsonl(job["train"]), job["label2id"]
    model = classifier(job["model"], label2id, job["seed"]).to(job["device"])
    model.train()
    total = job["warmup"] + job["steps"]
    optimizer, schedule = torch_optimizer(model, job["lr"], job["weight_decay"], job["warmup_ratio"], total)
    batches = classification_batches(AutoTokenizer.from_pretrained(job["model"]), rows, label2id, job)
    times, tokens = [], []
    for _ in range(total):
        started = time.perf_counter()
        batch = next(batches).to(job["device"])
        torch_step(model, optimizer, schedule, batch)
        times.append(time.perf_counter() - started)
        tokens.append(int(batch["attention_mask"].sum()))
    embeddings = sum(p.numel() for n, p in model.named_parameters() if ".embeddings." in n)
    parameters = sum(p.numel() for p in model.parameters()) - embeddings
    return {"times": times, "tokens": tokens, "parameters": parameters, "threads": torch.get_num_threads()}


def torch_task(job: dict) -> dict:
    """transformers' Trainer when `accelerate` is installed, else its loop written out (`torch_loop_task`)."""
    try:
        import accelerate  # noqa: F401  (Trainer refuses to run without it)
    except ImportError:
        return torch_loop_task(job)
    import numpy as np
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    tokenizer, label2id = AutoTokenizer.from_pretrained(job["model"]), job["label2id"]
    model = classifier(job["model"], label2id, job["seed"])

    def dataset(path: str) -> list[dict]:
        rows = read_jsonl(path)
        encoded = tokenizer([r["text"] for r in rows], truncation=True, max_length=job["max_length"])
        return [{k: encoded[k][i] for k in encoded} | {"labels": label2id[r["label"]]} for i, r in enumerate(rows)]

    args = TrainingArguments(
        job["out"], num_train_epochs=job["epochs"], per_device_train_batch_size=job["batch_size"],
        per_device_eval_batch_size=job["batch_size"], learning_rate=job["lr"], warmup_steps=job["warmup_ratio"],
        weight_decay=job["weight_decay"], max_grad_norm=1.0, seed=job["seed"], eval_strategy="epoch",
        save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(
        model, args, train_dataset=dataset(job["train"]), eval_dataset=dataset(job["test"]),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: {"accuracy": float(np.mean(p.predictions.argmax(-1) == p.label_ids))},
    )  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    accuracy = [r["eval_accuracy"] for r in trainer.state.log_history if "eval_accuracy" in r]
    return {"accuracy": accuracy, "seconds": time.perf_counter() - started, "engine": "transformers Trainer"}


def torch_loop_task(job: dict) -> dict:
    import torch
    from transformers import AutoTokenizer, DataCollatorWithPadding

    tokenizer, label2id = AutoTokenizer.from_pretrained(job["model"]), job["label2id"]
    model = classifier(job["model"], label2id, job["seed"])
    rows = read_jsonl(job["train"])
    per_epoch = math.ceil(len(rows) / job["batch_size"])
    total = job["epochs"] * per_epoch
    optimizer, schedule = torch_optimizer(model, job["lr"], job["weight_decay"], job["warmup_ratio"], total)
    batches = classification_batches(tokenizer, rows, label2id, job)
    test = read_jsonl(job["test"])
    encoded = tokenizer([r["text"] for r in test], truncation=True, max_length=job["max_length"])
    pad = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    started, accuracy = time.perf_counter(), []
    for _ in range(job["epochs"]):
        model.train()
        for _ in range(per_epoch):
            torch_step(model, optimizer, schedule, next(batches))
        model.eval()
        right = 0
        with torch.no_grad():
            for start in range(0, len(test), job["batch_size"]):
                rows_ = range(start, min(start + job["batch_size"], len(test)))
                batch = pad([{k: encoded[k][i] for k in encoded} for i in rows_])
                found = model(**batch).logits.argmax(-1).tolist()
                right += sum(f == label2id[test[i]["label"]] for f, i in zip(found, rows_, strict=True))
        accuracy.append(right / len(test))
    return {"accuracy": accuracy, "seconds": time.perf_counter() - started, "engine": "torch loop (Trainer's recipe)"}


def torch_mlm(job: dict) -> dict:
    """The trainer's masked batches (its epoch orders, its masking generator seeded as it seeds it), fed to
    transformers' BertForMaskedLM; held-out perplexity on the masks our `evaluate` draws (default_rng(seed))."""
    import numpy as np
    import torch
    from transformers import AutoModelForMaskedLM

    from mlx_encoders import Tokenizer
    from mlx_encoders.train.data import collate, masked_lm_data
    from mlx_encoders.train.masking import Masker

    tokenizer = Tokenizer.from_pretrained(job["model"])
    data = masked_lm_data(job["train"], tokenizer, max_length=job["max_length"])
    held = masked_lm_data(job["test"], tokenizer, max_length=job["max_length"])
    masker, rng, size = Masker.from_tokenizer(tokenizer), np.random.default_rng(job["seed"]), job["batch_size"]
    model = AutoModelForMaskedLM.from_pretrained(job["model"])
    per_epoch = math.ceil(len(data) / size)
    optimizer, schedule = torch_optimizer(
        model, job["lr"], job["weight_decay"], job["warmup_ratio"], job["epochs"] * per_epoch
    )

    def tensors(batch: dict) -> dict:
        return {k: torch.from_numpy(v.astype(np.int64)) for k, v in batch.items()}

    perplexity, seconds, tokens = [], 0.0, 0
    for epoch in range(job["epochs"]):
        model.train()
        order = epoch_order(len(data), job["seed"], epoch)
        started = time.perf_counter()
        for start in range(0, len(order), size):
            batch = collate(data, order[start : start + size], tokenizer, masker, rng)
            tokens += int(batch["attention_mask"].sum())
            torch_step(model, optimizer, schedule, tensors(batch))
        seconds += time.perf_counter() - started
        model.eval()
        eval_rng, total, count = np.random.default_rng(job["seed"]), 0.0, 0
        with torch.no_grad():
            for start in range(0, len(held), size):
                batch = collate(held, range(start, min(start + size, len(held))), tokenizer, masker, eval_rng)
                n = int((batch["labels"] != -100).sum())
                total += model(**tensors(batch)).loss.item() * n
                count += n
        perplexity.append(math.exp(total / count))
    return {"perplexity": perplexity, "seconds": seconds, "tokens": tokens}


# ----- our side -----


def timed_steps():
    """Records (seconds, real tokens) of each optimizer step `train` takes, by wrapping `Loop.step` (collate,
    forward, backward, clip, AdamW); evaluation and checkpoint writing are left out, as on the torch side."""
    from mlx_encoders.train import trainer

    records, step = [], trainer.Loop.step

    def timed(loop, indices):
        started = time.perf_counter()
        record = step(loop, indices)
        tokens = sum(len(loop.examples.encodings[i].ids) for batch in indices for i in batch)
        records.append((time.perf_counter() - started, tokens))
        return record

    trainer.Loop.step = timed
    return records


def ours(task: str, job: dict, **options) -> tuple[list[dict], list[tuple[float, int]]]:
    """`fine_tune` with the job's settings: (the metrics.jsonl records, the steps' (seconds, tokens))."""
    import mlx.core as mx

    from mlx_encoders.train import fine_tune

    records = timed_steps()
    mx.random.seed(job["seed"])  # the new head's (or model's) init: fine_tune draws it before seeding
    common = dict(max_length=job["max_length"], batch_size=job["batch_size"], lr=job["lr"], seed=job["seed"])
    training = dict(warmup_ratio=job["warmup_ratio"], weight_decay=job["weight_decay"], max_grad_norm=1.0)
    fine_tune(task, job["train"], job["out"], model=job["model"], **common, **training, **options)
    metrics = [json.loads(line) for line in (Path(job["out"]) / "metrics.jsonl").read_text().splitlines()]
    return metrics, records


def mlx_throughput(job: dict) -> dict:
    _, records = ours("classify", job, max_steps=job["warmup"] + job["steps"], label2id=job["label2id"])
    return {"times": [s for s, _ in records], "tokens": [t for _, t in records]}


def mlx_task(job: dict) -> dict:
    started = time.perf_counter()
    metrics, _ = ours("classify", job, epochs=job["epochs"], eval_data=job["test"], label2id=job["label2id"])
    accuracy = [r["eval_accuracy"] for r in metrics if "eval_accuracy" in r]
    return {"accuracy": accuracy, "seconds": time.perf_counter() - started, "engine": "mlx_encoders fine_tune"}


def mlx_mlm(job: dict) -> dict:
    metrics, records = ours("mlm", job, epochs=job["epochs"], eval_data=job["test"])
    perplexity = [r["eval_perplexity"] for r in metrics if "eval_perplexity" in r]
    return {"perplexity": perplexity, "seconds": sum(s for s, _ in records), "tokens": sum(t for _, t in records)}


WORKERS = {
    ("throughput", "mlx_encoders"): mlx_throughput,
    ("throughput", "torch"): torch_throughput,
    ("task", "mlx_encoders"): mlx_task,
    ("task", "torch"): torch_task,
    ("mlm", "mlx_encoders"): mlx_mlm,
    ("mlm", "torch"): torch_mlm,
}


def worker(args: argparse.Namespace) -> None:
    """Run one job in this process and print its result (with this process's peak memory) as the last line."""
    import torch

    torch.set_num_threads(args.threads)
    job = json.loads(args.worker)
    result = WORKERS[job["part"], job["engine"]](job)
    print("RESULT " + json.dumps(result | {"peak_mib": peak_mib(job.get("device", "cpu"))}))


def run(job: dict, args: argparse.Namespace) -> dict:
    """`job` in a fresh process of this script (same threads and BLAS); its result."""
    command = [sys.executable, __file__, "--worker", json.dumps(job), "--threads", str(args.threads)]
    command += ["--blas", args.blas] if args.blas else []
    env = os.environ | {"TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return worker_result(command, f"{job['part']} / {job['engine']}", env)


# ----- the parts -----


def sgemm_gflops(device: str) -> dict[str, float]:
    """Float32 GFLOP/s of an n x n x n matmul (best of 5) in torch and in MLX (through the BLAS it has on the CPU):
    n = 2048 on the CPU, 8192 on a GPU."""
    import mlx.core as mx
    import numpy as np
    import torch

    n = 8192 if device == "cuda" else 2048
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    rates, t, m = {}, torch.from_numpy(a).to(device), mx.array(a)

    def torch_mm():
        torch.mm(t, t)
        if device == "cuda":
            torch.cuda.synchronize()

    for name, matmul in (("torch", torch_mm), ("mlx", lambda: mx.eval(m @ m))):
        matmul()
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            matmul()
            best = min(best, time.perf_counter() - started)
        rates[name] = 2 * n**3 / best / 1e9
    return rates


def throughput(args, data, workdir: Path, sgemm: float) -> None:
    import torch
    import transformers

    print(f"\n== throughput: batch {args.batch_size}, max_length {args.max_length}, {args.warmup} warm-up + "
          f"{args.steps} timed steps, lr {args.lr}, the same batches for both ==")  # fmt: skip
    rows = []
    for name in args.models.split(","):
        if name == "bert-base":
            folder = workdir / "bert-base"
            torch.manual_seed(0)
            config = transformers.BertConfig(**BERT_BASE, label2id=data["label2id"],
                                             id2label={i: c for c, i in data["label2id"].items()})  # fmt: skip
            transformers.BertForSequenceClassification(config).save_pretrained(folder)
            for file in TOKENIZER_FILES:
                shutil.copy(model_folder() / file, folder / file)
        else:
            folder = model_folder()
        job = dict(part="throughput", model=str(folder), train=str(data["train"]), label2id=data["label2id"],
                   device=args.device,
                   batch_size=args.batch_size, max_length=args.max_length, warmup=args.warmup, steps=args.steps,
                   lr=args.lr, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, seed=0)  # fmt: skip
        rounds = defaultdict(list)  # engine -> one result per round; the engines take turns
        for k in range(args.rounds):
            for engine in ENGINES:
                out = str(workdir / f"tp-{name}-{engine}-{k}")
                rounds[engine].append(run(job | dict(engine=engine, out=out), args))
        parameters = rounds["torch"][0]["parameters"]
        rates = {e: [rate_of(r, args.warmup) for r in rs] for e, rs in rounds.items()}
        for engine, results in rounds.items():
            r = results[median_index(rates[engine])]
            times, tokens = r["times"][args.warmup :], r["tokens"][args.warmup :]
            rate = rate_of(r, args.warmup)
            steps = sorted(t / s for t, s in zip(tokens, times, strict=True))
            gflops = 6 * parameters * rate / 1e9
            rows.append((name, engine, rate, steps[0], steps[-1], statistics.median(times), r["peak_mib"], gflops))
        if rounds["mlx_encoders"][0]["tokens"] != rounds["torch"][0]["tokens"]:
            print(f"  note: {name}: the engines' batches differ in real tokens (tokenizers disagree)")
        print(f"  {name}: {parameters / 1e6:.1f}M non-embedding parameters; {sum(tokens)} real tokens timed")
        if args.rounds > 1:
            each = [a / b for a, b in zip(rates["mlx_encoders"], rates["torch"], strict=True)]
            print(f"  {name}: tokens/s per round, mlx_encoders " + ", ".join(f"{r:.0f}" for r in rates["mlx_encoders"])
                  + "; torch " + ", ".join(f"{r:.0f}" for r in rates["torch"])
                  + "; ratios " + ", ".join(f"{r:.2f}" for r in each))  # fmt: skip
    print(f"\n{'model':<11}{'engine':<14}{'tokens/s':>10}{'(step min-max)':>17}{'s/step':>8}{'peak MiB':>10}"
          f"{'GFLOP/s':>9}{'% sgemm':>9}")  # fmt: skip
    for name, engine, rate, low, high, per_step, peak, gflops in rows:
        print(f"{name:<11}{engine:<14}{rate:>10.0f}{f'({low:.0f}-{high:.0f})':>17}{per_step:>8.2f}{peak:>10.0f}"
              f"{gflops:>9.1f}{100 * gflops / sgemm:>8.1f}%")  # fmt: skip
    rounds = f", each engine's median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"ratios (tokens/s of mlx_encoders / torch{rounds}; peak memory of mlx_encoders / torch)")
    for name in args.models.split(","):
        ours_, theirs = (next(r for r in rows if r[0] == name and r[1] == e) for e in ENGINES)
        print(f"  {name:<11}{ours_[2] / theirs[2]:.2f}x speed   {ours_[6] / theirs[6]:.2f}x memory")


def rate_of(result: dict, warmup: int) -> float:
    """Real tokens per second over a throughput run's timed steps."""
    return sum(result["tokens"][warmup:]) / sum(result["times"][warmup:])


def median_index(values: list[float]) -> int:
    """The index of the median value (the lower middle one for an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def task(args, data, workdir: Path) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"\n== task: all-MiniLM-L6-v2, {len(data['label2id'])} classes ({', '.join(data['label2id'])}); "
          f"{data['train_n']} train / {data['test_n']} test docstrings, test modules unseen; {args.epochs} epochs, "
          f"batch {args.task_batch_size}, lr {args.lr}, warmup {args.warmup_ratio}, weight decay "
          f"{args.weight_decay}, max_length {args.max_length}; seeds {args.seeds} ==")  # fmt: skip
    job = dict(part="task", model=str(model_folder()), train=str(data["train"]), test=str(data["test"]),
               label2id=data["label2id"], batch_size=args.task_batch_size, max_length=args.max_length,
               epochs=args.epochs, lr=args.lr, warmup_ratio=args.warmup_ratio,
               weight_decay=args.weight_decay)  # fmt: skip
    results = defaultdict(list)
    epochs = "".join(f"{f'epoch {e + 1}':>9}" for e in range(args.epochs))
    print(f"{'seed':<6}{'engine':<32}{epochs}{'seconds':>9}")
    for seed in seeds:
        for engine in ENGINES:
            r = run(job | dict(engine=engine, seed=seed, out=str(workdir / f"task-{engine}-{seed}")), args)
            results[engine].append(r["accuracy"][-1])
            accuracy = "".join(f"{100 * a:>8.2f}%" for a in r["accuracy"])
            print(f"{seed:<6}{r['engine']:<32}{accuracy}{r['seconds']:>9.1f}", flush=True)
    ours_, theirs = (statistics.mean(results[e]) for e in ENGINES)
    print(f"held-out accuracy after the last epoch, mean of {len(seeds)} seeds: mlx_encoders {100 * ours_:.2f}%, "
          f"torch {100 * theirs:.2f}% (difference {100 * (ours_ - theirs):+.2f} points)")  # fmt: skip


def mlm(args, data, workdir: Path) -> None:
    import torch
    import transformers

    hidden = args.mlm_hidden
    sizes = dict(num_hidden_layers=args.mlm_layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                 intermediate_size=4 * hidden, max_position_embeddings=512)  # fmt: skip
    folder = workdir / "small-bert"
    torch.manual_seed(0)
    transformers.BertForMaskedLM(transformers.BertConfig(**sizes)).save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(model_folder() / file, folder / file)
    print(f"\n== mlm from scratch: BERT {sizes}, vocab 30522 (all-MiniLM-L6-v2's WordPiece); "
          f"{data['mlm_train_n']} train / {data['mlm_test_n']} held-out docstrings (held-out modules unseen), "
          f"max_length {args.max_length}, batch {args.mlm_batch_size}, lr {args.mlm_lr}, warmup {args.warmup_ratio}, "
          f"weight decay {args.weight_decay}; one initial model (transformers' init), the same masked batches "
          "==")  # fmt: skip
    job = dict(part="mlm", model=str(folder), train=str(data["mlm_train"]), test=str(data["mlm_test"]),
               batch_size=args.mlm_batch_size, max_length=args.max_length, epochs=args.mlm_epochs, lr=args.mlm_lr,
               warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, seed=0)  # fmt: skip
    results = {e: run(job | dict(engine=e, out=str(workdir / f"mlm-{e}")), args) for e in ENGINES}
    print(f"{'epoch':<7}{'mlx_encoders':>14}{'torch':>12}{'ratio':>8}   (held-out perplexity)")
    pairs = zip(results["mlx_encoders"]["perplexity"], results["torch"]["perplexity"], strict=True)
    for epoch, (a, b) in enumerate(pairs, 1):
        print(f"{epoch:<7}{a:>14.2f}{b:>12.2f}{a / b:>8.3f}")
    rates = (f"{e} {r['tokens'] / r['seconds']:.0f} (peak {r['peak_mib']:.0f} MiB)" for e, r in results.items())
    print("training tokens/s (all epochs, evaluation left out): " + ", ".join(rates))


def prepare(args, parts: list[str], workdir: Path) -> dict:
    from mlx_encoders.corpus import stdlib_documents

    documents, data = stdlib_documents(), {}
    if "throughput" in parts or "task" in parts:
        classes = args.classes.split(",")
        train, test = split_by_module(documents, classes, args.train_examples, args.test_examples)
        data |= dict(train=write_jsonl(train, workdir / "train.jsonl"), test=write_jsonl(test, workdir / "test.jsonl"),
                     label2id={c: i for i, c in enumerate(classes)}, train_n=len(train), test_n=len(test))  # fmt: skip
        counts = Counter(r["label"] for r in train), Counter(r["label"] for r in test)
        modules = len({r["module"] for r in train}), len({r["module"] for r in test})
        print(f"classification data: {len(train)} train / {len(test)} test docstrings from {modules[0]} / "
              f"{modules[1]} modules; per class (train/test): "
              + ", ".join(f"{c} {counts[0][c]}/{counts[1][c]}" for c in classes))  # fmt: skip
    if "mlm" in parts:
        train, test = mlm_split(documents, args.mlm_docs, args.mlm_eval_docs)
        data |= dict(mlm_train=write_jsonl(train, workdir / "mlm-train.jsonl"), mlm_train_n=len(train),
                     mlm_test=write_jsonl(test, workdir / "mlm-test.jsonl"), mlm_test_n=len(test))  # fmt: skip
    return data


def main() -> None:
    args = parse_args()
    if args.worker and json.loads(args.worker)["engine"] == "torch":
        # torch on its own BLAS: the OpenBLAS that mlx_encoders loads for MLX (RTLD_GLOBAL) would also take torch's
        # products from the MKL torch ships, which made a BERT-base step 1.9x slower
        os.environ["MLX_ENCODERS_BLAS"] = "0"
        args.blas = None
    set_threads(args.threads, args.blas)
    import mlx_encoders  # noqa: F401  (gives MLX the system OpenBLAS, unless --blas chose one)

    if (json.loads(args.worker).get("device", "cpu") if args.worker else args.device) == "cpu":
        import mlx.core as mx

        mx.set_default_device(mx.cpu)  # MLX's default is the GPU where there is one
    if args.worker:
        worker(args)
        return
    import mlx.core as mx
    import torch
    import transformers

    parts = args.parts.split(",")
    unknown = set(parts) - {"throughput", "task", "mlm"}
    if unknown:
        sys.exit(f"unknown part(s) {', '.join(sorted(unknown))}; choose from throughput, task, mlm")
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    print(f"{args.threads} threads, {os.cpu_count()} cores; mlx {mx.__version__} on {mx.default_device()}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}; BLAS mapped: {mlx_blas()}")  # fmt: skip
    rates = sgemm_gflops(args.device)
    sgemm = max(rates.values())
    print(f"float32 sgemm on {args.device}: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in rates.items())
          + f"; the limit below is {sgemm:.1f} GFLOP/s")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = prepare(args, parts, workdir)
        started = time.perf_counter()
        if "throughput" in parts:
            throughput(args, data, workdir, sgemm)
        if "task" in parts:
            task(args, data, workdir)
        if "mlm" in parts:
            mlm(args, data, workdir)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
