"""Train a tiny GPT-2 on the standard-library docstrings with the causal-LM trainer, then generate from a prompt
with each preset (greedy, sampling at a temperature, top-k, nucleus).

    python examples/generate.py                          # a few minutes on a laptop CPU
    python examples/generate.py --texts 10000 --epochs 5 --prompt "Return the number of"

No GPT-2 tokenizer or weights ship offline, so the example trains both: a byte-level BPE tokenizer (GPT-2's kind)
on the docstrings, then a 4-layer GPT-2 from scratch (`fine_tune("clm", ..., config=..., tokenizer=...)`). The
model is saved to OUTPUT/model, which `mlx_encoders.load`, the `generate` command and transformers read.
"""

import argparse
import pathlib

import mlx_encoders
from mlx_encoders.corpus import stdlib_docstrings
from mlx_encoders.generation import PRESETS
from mlx_encoders.train import fine_tune

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], folder: pathlib.Path, vocab_size: int = 2048) -> pathlib.Path:
    """A byte-level BPE tokenizer trained on `texts`, saved to `folder` (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"eos_token": EOS, "bos_token": EOS}
    mlx_encoders.Tokenizer(bpe, config, model_max_length=128, token_types=False).save(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="docstrings to train on (default 3000)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--prompt", default="Return the")
    p.add_argument("--output", default="gpt2-run", help="output folder (default gpt2-run)")
    p.add_argument("--overwrite", action="store_true", help="clear an earlier run in the output folder first")
    args = p.parse_args()

    output = pathlib.Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:  # before this script writes its data there
        p.error(f"{output} holds an earlier run; pass --overwrite to replace it, or another --output")
    texts = stdlib_docstrings(args.texts)
    tokenizer = train_tokenizer(texts, output / "tokenizer")
    sizes = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 128}
    trained = fine_tune(
        "clm", [{"text": t} for t in texts[20:]], output, config=sizes, tokenizer=tokenizer,
        eval_data=[{"text": t} for t in texts[:20]], epochs=args.epochs, batch_size=16, lr=2e-3, warmup_ratio=0.05,
        weight_decay=0.01, max_length=128,
        overwrite=args.overwrite,
    )  # fmt: skip
    print(f"held-out loss {trained.metrics['eval_loss']:.3f}, perplexity {trained.metrics['eval_perplexity']:.1f}")
    print(f"model saved to {trained.path}\n")
    for preset in PRESETS:
        seed = {"seed": 0} if PRESETS[preset].get("do_sample") else {}  # greedy decoding draws nothing
        text = mlx_encoders.generate(trained.model, trained.tokenizer, args.prompt, preset, max_new_tokens=30, **seed)
        print(f"{preset:>8}: {args.prompt}{text}")


if __name__ == "__main__":
    main()
