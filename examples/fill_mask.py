"""Fill the masked word of a prompt with a masked-language model on MLX; print rank / token / logit / probability.

    python examples/fill_mask.py "The capital of France is [MASK]." --model albert-base-v2
    python examples/fill_mask.py "Paris is the [MASK] of France." --model path/to/checkpoint --top-k 10

`--model` takes a shortcut (albert-base-v2, albert-large-v2, albert-xlarge-v2, albert-xxlarge-v2, bert-base,
modernbert-base; fetched from the Hugging Face hub on first use), any hub id, or a local checkpoint folder
(which works offline). `[MASK]` in the prompt stands for the model's own mask token (`<mask>` for RoBERTa).
"""

import argparse

import numpy as np

from mlx_encoders import pipeline

SHORTCUTS = {
    "albert-base-v2": "albert/albert-base-v2",
    "albert-large-v2": "albert/albert-large-v2",
    "albert-xlarge-v2": "albert/albert-xlarge-v2",
    "albert-xxlarge-v2": "albert/albert-xxlarge-v2",
    "bert-base": "google-bert/bert-base-uncased",
    "modernbert-base": "answerdotai/ModernBERT-base",
}


def rows(fill, prompt: str, top_k: int) -> list[list[tuple[int, str, float, float]]]:
    """Per mask in the prompt: the top_k (rank, token, logit, probability)."""
    _, _, logits = fill.mask_logits([prompt])[0]
    table = []
    for row in logits:
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        best = np.argsort(-row, kind="stable")[:top_k]
        token = fill.tokenizer.decode  # the token as text, as transformers' `token_str`
        table.append([(r, token([int(i)], False), float(row[i]), float(probs[i])) for r, i in enumerate(best, 1)])
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", default="The capital of France is [MASK].", help="text with [MASK]")
    p.add_argument("--model", default="albert-base-v2", help=f"{', '.join(SHORTCUTS)}, a hub id, or a folder")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="cast the weights")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error(f"--top-k must be 1 or more, got {args.top_k}")
    model = SHORTCUTS.get(args.model, args.model)
    try:
        fill = pipeline("fill-mask", model=model, dtype=args.dtype)
        prompt = args.prompt.replace("[MASK]", fill.tokenizer.mask_token)
        tables = rows(fill, prompt, args.top_k)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"fill_mask.py: {e}") from e
    print(f"model: {model}\nprompt: {prompt}")
    for m, table in enumerate(tables, start=1):
        print(f"\nmask {m}\n{'rank':>4}  {'token':<16}{'logit':>9}  {'probability':>11}")
        for rank, token, logit, prob in table:
            print(f"{rank:>4}  {token!r:<16}{logit:>9.3f}  {prob:>11.4f}")


if __name__ == "__main__":
    main()
