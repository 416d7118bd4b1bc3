"""Pretrain a small ELECTRA from scratch by replaced-token detection, then ask the discriminator which words of a
sentence look replaced.

    python examples/train_rtd.py                          # stdlib docstrings, a few minutes on a laptop CPU
    python examples/train_rtd.py --texts 20000 --epochs 10 --output rtd-run

The corpus, held-out split and tokenizer are `train_mlm.py`'s; the discriminator has its sizes (4 layers, 128
wide) and the generator a quarter of its width. Each evaluation (every epoch's, in OUTPUT/metrics.jsonl; the last
one printed) reports the generator's accuracy on masked tokens and the discriminator's accuracy, precision and
recall on replaced ones. OUTPUT/model/discriminator is the encoder to fine-tune (`mlx-encoders train classify
--model ...`); OUTPUT/model/generator is a masked-LM.

With the defaults (3,000 docstrings of Python 3.11's standard library, 3 epochs: 444 steps at lr 5e-4, seed 42)
it ends with (the probability of "replaced" per token, [CLS] and [SEP] left out):

    generator accuracy 0.048, discriminator accuracy 0.863 (precision 0.559, recall 0.074; 13.9% of the tokens replaced)
    return:0.16  the:0.15  number:0.13  of:0.18  items:0.18  in:0.17  the:0.16  list:0.14  .:0.15
    return:0.16  the:0.15  number:0.13  of:0.18  elephants:0.84  in:0.17  the:0.16  list:0.14  .:0.15
    if:0.16  the:0.13  file:0.13  does:0.12  not:0.11  exist:0.13  ,:0.19  raise:0.12  an:0.14  error:0.11  .:0.13
    if:0.17  the:0.14  file:0.13  does:0.12  not:0.12  sing:0.92  ,:0.19  raise:0.12  an:0.14  error:0.11  .:0.14

The words that do not belong ("elephants", "sing") stand out. At `--lr 1e-3` the same run ends flagging nothing
(recall 0, every token 0.14: the base rate), and `fine_tune` warns so.
"""

import argparse
import pathlib

import mlx.core as mx
from train_mlm import default_tokenizer, write_corpus

import mlx_encoders
from mlx_encoders.train import fine_tune

SENTENCES = [
    "Return the number of items in the list.",
    "Return the number of elephants in the list.",
    "If the file does not exist, raise an error.",
    "If the file does not sing, raise an error.",
]
SIZES = dict(embedding_size=128, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
             max_position_embeddings=128)  # fmt: skip
TINY = dict(embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="docstrings to train on (default 3000)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, help="optimizer steps, instead of epochs")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4, ELECTRA-Small's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tiny", action="store_true", help="2 layers, 32 wide: a quick check that everything runs")
    p.add_argument("--output", default="rtd-run", help="output folder (default rtd-run)")
    p.add_argument("--overwrite", action="store_true", help="clear an earlier run in the output folder first")
    p.add_argument("--tokenizer", type=pathlib.Path, help="folder with tokenizer.json (default: all-MiniLM-L6-v2's)")
    args = p.parse_args()

    output = pathlib.Path(args.output)
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:  # before this script writes its data there
        p.error(f"{output} holds an earlier run; pass --overwrite to replace it, or another --output")
    train_file, eval_file = write_corpus(output / "data", args.texts)
    trained = fine_tune(
        "rtd", train_file, output, config=TINY if args.tiny else SIZES, tokenizer=args.tokenizer or default_tokenizer(),
        eval_data=eval_file, epochs=args.epochs, max_steps=args.max_steps, batch_size=32, lr=args.lr, warmup_ratio=0.05,
        weight_decay=0.01, max_length=64, seed=args.seed, overwrite=args.overwrite,
    )  # fmt: skip
    m = trained.metrics
    print(f"generator accuracy {m['eval_generator_accuracy']:.3f}, discriminator accuracy "
          f"{m['eval_discriminator_accuracy']:.3f} (precision {m['eval_precision']:.3f}, recall "
          f"{m['eval_recall']:.3f}; {m['eval_replacement_rate']:.1%} of the tokens replaced)")  # fmt: skip
    print(f"discriminator saved to {trained.path}\n")

    model, tokenizer = mlx_encoders.load(trained.path)
    for sentence in SENTENCES:
        batch = tokenizer([sentence], return_tensors="np")
        scores = mx.sigmoid(model(**{k: mx.array(v) for k, v in batch.items()}).logits)[0].tolist()
        tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
        print("  ".join(f"{t}:{s:.2f}" for t, s in zip(tokens, scores, strict=True) if t not in ("[CLS]", "[SEP]")))


if __name__ == "__main__":
    main()
