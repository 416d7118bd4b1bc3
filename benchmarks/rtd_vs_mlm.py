"""Pretraining by replaced-token detection (ELECTRA) against masked-LM, judged by the encoders each one gives along
the way.

For each seed, two encoders of the same shape (`examples/train_mlm.py`'s: 4 layers, 128 wide) are pretrained from
scratch on the same texts, in the same order, for the same tokens (texts x epochs), batch size, learning rate and
schedule: `fine_tune("mlm", ...)` and `fine_tune("rtd", ...)` (a generator `--generator-size` as wide sharing the
discriminator's embeddings, the discriminator's loss weighted `--discriminator-weight`). Each saves `--curve`
checkpoints spread over its run; every checkpoint's encoder is fine-tuned on two downstream tasks, held-out
accuracy reported:

- docstrings: which standard-library package a docstring documents (`examples/train_classifier.py`'s task,
  held-out modules unseen);
- debian: which archive section a Debian package is in, from its description (held-out packages, none of them in
  the pretraining corpus). Needs the package lists of an apt-based system (`apt-cache dumpavail`); skipped
  elsewhere, with a message.

The pretraining corpus is `--texts` standard-library docstrings plus `--debian` package descriptions (packages not
used by the debian task). Wall time and tokens per second of each pretraining are printed beside the accuracies:
at equal tokens ELECTRA also runs its generator, so its compute per token is higher. A table of mean ± sd per
task, kind and checkpoint, and a plot of the curves (`curves.png`, with matplotlib) are written to `--output`.

    python benchmarks/rtd_vs_mlm.py                                   # 3 seeds, 4 checkpoints, both tasks
    python benchmarks/rtd_vs_mlm.py --generator-size 0.5 --discriminator-weight 20 --output /tmp/ablation
    python benchmarks/rtd_vs_mlm.py --kinds rtd --no-share-embeddings --output /tmp/untied   # the paper's ablations
    python benchmarks/rtd_vs_mlm.py --kinds rtd --generator-size 1.0 --save-every 422   # at the default run's steps
    python benchmarks/rtd_vs_mlm.py --compare rtd-vs-mlm /tmp/ablation /tmp/untied   # their tables side by side
    python benchmarks/rtd_vs_mlm.py --tiny --texts 200 --debian 200 --epochs 1 --seeds 1 --curve 2 \
        --task-examples 100 --task-epochs 1                          # a quick check that everything runs

Timings are printed, never asserted; run it on an otherwise idle machine.
"""

import argparse
import collections
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_classifier import docstring_task  # noqa: E402
from train_mlm import default_tokenizer  # noqa: E402

from mlx_encoders.corpus import stdlib_docstrings  # noqa: E402
from mlx_encoders.tokenizer import Tokenizer  # noqa: E402
from mlx_encoders.train import fine_tune  # noqa: E402
from mlx_encoders.train.data import masked_lm_data  # noqa: E402

SIZES = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
             max_position_embeddings=128)  # fmt: skip
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128)  # fmt: skip
MAX_LENGTH, BATCH = 64, 32
SECTIONS = ("admin", "devel", "games", "graphics", "net", "science", "sound", "text", "web", "math")
PER_SECTION = 400  # packages per section in the debian task (a quarter held out)


def debian_packages() -> list[dict]:
    """(package, section, description) of every package apt knows, or [] where there is no apt."""
    try:
        out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    packages = []
    for stanza in out.split("\n\n"):
        fields, last = {}, None
        for line in stanza.splitlines():
            if line.startswith(" ") and last == "Description":
                fields[last] += " " + ("" if line.strip() == "." else line.strip())
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if {"Package", "Section", "Description"} <= fields.keys():
            section = fields["Section"].split("/")[-1]
            packages.append({"package": fields["Package"], "section": section, "text": fields["Description"]})
    return packages


def debian_task(folder: pathlib.Path, packages: list[dict]) -> tuple[tuple[pathlib.Path, pathlib.Path], set[str]]:
    """train.jsonl / eval.jsonl of (description, section) rows, a quarter of each section's packages held out (by a
    hash of the name), and the packages the task uses."""
    folder.mkdir(parents=True, exist_ok=True)
    chosen = collections.defaultdict(list)
    for p in sorted(packages, key=lambda p: zlib.crc32(p["package"].encode())):
        if p["section"] in SECTIONS and len(chosen[p["section"]]) < PER_SECTION:
            chosen[p["section"]].append(p)
    parts = {"train": [], "eval": []}
    for section, rows in chosen.items():
        for i, p in enumerate(rows):
            parts["eval" if i % 4 == 1 else "train"].append({"text": p["text"][:500], "label": section})
    files = folder / "train.jsonl", folder / "eval.jsonl"
    for file, part in zip(files, parts.values(), strict=True):
        file.write_text("".join(json.dumps(r) + "\n" for r in part))
    return files, {p["package"] for rows in chosen.values() for p in rows}


def write_corpus(file: pathlib.Path, docstrings: int, descriptions: list[str]) -> pathlib.Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    texts = stdlib_docstrings(docstrings) + descriptions
    file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return file


def trimmed(file: pathlib.Path, n: int | None) -> pathlib.Path:
    """About `n` rows of a JSONL file, evenly spaced so every label stays; every row when None."""
    if n is None:
        return file
    rows = file.read_text().splitlines(keepends=True)
    out = file.with_name(f"{file.stem}-{n}.jsonl")
    out.write_text("".join(rows[:: max(1, len(rows) // n)]))
    return out


def pretrain(kind: str, corpus: pathlib.Path, output: pathlib.Path, args, seed: int) -> tuple[list, float, float]:
    """([(step, encoder folder)] of the run's checkpoints, real tokens per second, seconds) of one pretraining."""
    sizes = TINY if args.tiny else SIZES
    config = {**sizes, "model_type": "bert"} if kind == "mlm" else {**sizes, "embedding_size": sizes["hidden_size"]}
    rtd = {"generator_size": args.generator_size, "discriminator_weight": args.discriminator_weight,
           "share_embeddings": not args.no_share_embeddings}  # fmt: skip
    rows = sum(1 for _ in corpus.open())
    steps = math.ceil(rows / BATCH) * args.epochs
    started = time.perf_counter()
    fine_tune(
        kind, corpus, output, config=config, tokenizer=args.tokenizer, epochs=args.epochs, batch_size=BATCH,
        lr=args.lr, warmup_ratio=args.warmup_ratio, weight_decay=0.01, max_length=MAX_LENGTH, seed=seed,
        save_every=args.save_every or max(1, steps // args.curve), keep_last=None, overwrite=True,
        **(rtd if kind == "rtd" else {}),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    tokens = sum(len(e.ids) for e in masked_lm_data(corpus, args.tok, max_length=MAX_LENGTH).encodings)
    found = []
    for folder in sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        encoder = folder / "discriminator" if kind == "rtd" else folder
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            if (folder / name).exists() and not (encoder / name).exists():
                shutil.copy(folder / name, encoder / name)
        found.append((int(folder.name.split("-")[1]), encoder))
    return found, tokens * args.epochs / seconds, seconds


def downstream(encoder: pathlib.Path, task: tuple, output: pathlib.Path, args, seed: int) -> float:
    trained = fine_tune(
        "classify", task[0], output, model=encoder, eval_data=task[1], epochs=args.task_epochs, batch_size=16,
        lr=args.task_lr, warmup_ratio=0.1, weight_decay=0.01, max_length=128, seed=seed, overwrite=True,
        final_checkpoint=False,
    )  # fmt: skip
    shutil.rmtree(output / "model", ignore_errors=True)
    return trained.metrics["eval_accuracy"]


def summary(results: list[dict]) -> dict:
    """(task, kind, step) -> (mean, sd, n) of the accuracies over seeds."""
    groups = collections.defaultdict(list)
    for r in results:
        groups[r["task"], r["kind"], r["step"]].append(r["accuracy"])
    return {key: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for key, v in groups.items()}


def plot(table: dict, file: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    tasks = sorted({t for t, _, _ in table})
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for kind, label in (("mlm", "masked-LM"), ("rtd", "replaced-token detection")):
            points = sorted((s, m, sd) for (t, k, s), (m, sd, _) in table.items() if t == task and k == kind)
            if points:
                steps, means, sds = zip(*points, strict=True)
                ax.errorbar(steps, means, yerr=sds, marker="o", capsize=3, label=label)
        ax.set(title=f"{task}: held-out accuracy", xlabel="pretraining step", ylabel="accuracy")
        ax.legend()
    figure.tight_layout()
    figure.savefig(file, dpi=120)
    print(f"curves: {file}")


def compare(folders: list[pathlib.Path]) -> None:
    """A markdown table of the runs in `folders` (their results.json), one column per run and kind, mean ± sd over
    seeds at the steps all of them saved: masked-LM, the default run and its ablations side by side."""
    columns = {}
    names = [f.name for f in folders]  # a folder's name, or its path where two runs share one
    for folder in folders:
        if not (folder / "results.json").is_file():
            raise SystemExit(f"{folder} holds no results.json: give the --output folders of finished runs")
        results = json.loads((folder / "results.json").read_text())["results"]
        for kind in dict.fromkeys(r["kind"] for r in results):
            name = folder.name if names.count(folder.name) == 1 else str(folder)
            columns[f"{name} {kind}"] = summary([r for r in results if r["kind"] == kind])
    steps = sorted(set.intersection(*({s for _, _, s in table} for table in columns.values())))
    tasks = sorted({t for table in columns.values() for t, _, _ in table})
    print("| task | step | " + " | ".join(columns) + " |\n|---|---:|" + "---:|" * len(columns))
    for task in tasks:
        for step in steps:
            cells = [
                next((v for (t, _, s), v in table.items() if (t, s) == (task, step)), None)
                for table in columns.values()
            ]
            text = [f"{c[0]:.3f} ± {c[1]:.3f}" if c else "-" for c in cells]
            print(f"| {task} | {step} | " + " | ".join(text) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="standard-library docstrings to pretrain on (3000)")
    p.add_argument("--debian", type=int, default=6000, help="Debian package descriptions to pretrain on (6000)")
    p.add_argument("--epochs", type=int, default=3, help="pretraining epochs (default 3)")
    p.add_argument("--lr", type=float, default=5e-4, help="pretraining learning rate (ELECTRA-Small's 5e-4)")
    p.add_argument("--warmup-ratio", type=float, default=0.05, help="pretraining warmup share (default 0.05)")
    p.add_argument("--generator-size", type=float, default=0.25, help="generator width / discriminator's (0.25)")
    p.add_argument("--discriminator-weight", type=float, default=50.0, help="ELECTRA's lambda (default 50)")
    p.add_argument("--no-share-embeddings", action="store_true", help="the generator keeps its own embeddings")
    p.add_argument("--kinds", default="mlm,rtd", help="pretrainings to run (an ablation: rtd alone)")
    p.add_argument("--curve", type=int, default=4, help="checkpoints per pretraining run (default 4)")
    p.add_argument("--save-every", type=int, help="a checkpoint every N steps instead (to match another run's steps)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 42, 43, ... (default 3)")
    p.add_argument("--task-epochs", type=int, default=3, help="fine-tuning epochs (default 3)")
    p.add_argument("--task-lr", type=float, default=5e-4, help="fine-tuning learning rate (default 5e-4)")
    p.add_argument("--task-examples", type=int, help="fine-tune on about N training rows only")
    p.add_argument("--tiny", action="store_true", help="2 layers, 32 wide: a quick check that everything runs")
    p.add_argument("--tokenizer", type=pathlib.Path, default=default_tokenizer())
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("rtd-vs-mlm"))
    p.add_argument("--compare", type=pathlib.Path, nargs="+", metavar="OUTPUT",
                   help="print earlier runs' results side by side (their --output folders), and stop")  # fmt: skip
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    args.tok = Tokenizer.from_pretrained(args.tokenizer)

    tasks = {"docstrings": docstring_task(args.output / "task-docstrings")}
    packages = debian_packages()
    if packages:
        files, used = debian_task(args.output / "task-debian", packages)
        tasks["debian"] = files
        descriptions = [p["text"] for p in packages if p["package"] not in used][: args.debian]
    else:
        print("no apt package lists here (apt-cache dumpavail): the debian task and descriptions are skipped")
        descriptions = []
    tasks = {name: (trimmed(train, args.task_examples), held_out) for name, (train, held_out) in tasks.items()}
    corpus = write_corpus(args.output / "corpus.jsonl", args.texts, descriptions)
    print(f"pretraining corpus: {args.texts} docstrings + {len(descriptions)} package descriptions; tasks: "
          f"{', '.join(tasks)}", flush=True)  # fmt: skip

    results, speeds = [], []
    for seed in range(42, 42 + args.seeds):
        for kind in args.kinds.split(","):
            found, rate, seconds = pretrain(kind, corpus, args.output / f"{kind}-{seed}", args, seed)
            speeds.append({"seed": seed, "kind": kind, "tokens_s": rate, "seconds": seconds})
            for step, encoder in found:
                for task, files in tasks.items():
                    accuracy = downstream(encoder, files, args.output / f"{kind}-{seed}-{step}-{task}", args, seed)
                    results.append({"seed": seed, "kind": kind, "step": step, "task": task, "accuracy": accuracy})
                    print(json.dumps(results[-1]), flush=True)

    (args.output / "results.json").write_text(json.dumps({"results": results, "speeds": speeds}, indent=2) + "\n")
    table = summary(results)
    print(f"\n{'task':<12}{'step':>6}  {'masked-LM':>17}  {'replaced-token det.':>19}")
    for task, step in sorted({(t, s) for t, _, s in table}):
        cells = [table.get((task, kind, step)) for kind in ("mlm", "rtd")]
        text = [f"{c[0]:.3f} ± {c[1]:.3f}" if c else "-" for c in cells]
        print(f"{task:<12}{step:>6}  {text[0]:>17}  {text[1]:>19}")
    for kind in args.kinds.split(","):
        rows = [s for s in speeds if s["kind"] == kind]
        print(f"{kind}: pretraining {statistics.median(r['tokens_s'] for r in rows):.0f} tokens/s, "
              f"{statistics.median(r['seconds'] for r in rows):.0f} s (median over seeds)")  # fmt: skip
    plot(table, args.output / "curves.png")


if __name__ == "__main__":
    main()
