"""Speed of SparseEncoder.encode (SPLADE) on the CPU: mlx_encoders against sentence-transformers' SparseEncoder.

Both encode the same standard-library docstrings with the same checkpoint: a DistilBERT masked-LM of
distilbert-base's shape (`--size base`; `--size tiny` for a quick check) seeded by transformers
(`torch.manual_seed(0)`) with all-MiniLM-L6-v2's WordPiece tokenizer, saved by sentence-transformers as a SPLADE
folder (max pooling) once, to a temporary folder. A warm-up pass each, then timed passes taken round-robin; prints
texts per second (median and range), the largest weight difference from sentence-transformers, and the ratio.
sentence-transformers runs in a process of its own (`isolated.py`), torch on its own BLAS.

    python benchmarks/sparse.py --texts 200 --repeats 3
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from embed import model_folder
from isolated import Isolated

SIZES = {
    "base": dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072),
    "tiny": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=48),
}


def write_splade(folder: str, size: str):
    """The SPLADE folder, written by transformers and sentence-transformers (in the isolated process, so that torch
    is untouched by the BLAS mlx_encoders loads); returns a no-op, as Isolated needs a callable."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(0)
    model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=30522, **SIZES[size]))
    model.save_pretrained(f"{folder}/mlm")
    AutoTokenizer.from_pretrained(str(model_folder())).save_pretrained(f"{folder}/mlm")
    transformer = Transformer(f"{folder}/mlm", transformer_task="fill-mask", max_seq_length=256)
    SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu").save(f"{folder}/splade")
    return lambda: None


def sentence_transformers_model(folder: str, batch_size: int, threads: int):
    import torch
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(threads)
    model = SparseEncoder(folder, device="cpu")

    def encode(texts):
        return model.encode(texts, batch_size=batch_size, convert_to_sparse_tensor=False).numpy()

    return encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=200, help="number of docstrings (default 200)")
    p.add_argument("--size", choices=sorted(SIZES), default="base", help="model shape (default base)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    args = p.parse_args()

    import mlx_encoders
    from mlx_encoders.corpus import stdlib_docstrings

    texts = stdlib_docstrings(args.texts)
    with tempfile.TemporaryDirectory() as folder:
        Isolated(write_splade, folder, args.size)
        ours = mlx_encoders.SparseEncoder(f"{folder}/splade")
        engines = {
            "mlx_encoders": lambda x: ours.encode(x, batch_size=args.batch_size, convert_to_sparse_tensor=False),
            "sentence-transformers": Isolated(
                sentence_transformers_model, f"{folder}/splade", args.batch_size, args.threads
            ),
        }
        vectors, times = {}, {name: [] for name in engines}
        for name, encode in engines.items():
            start = time.perf_counter()
            vectors[name] = encode(texts)
            print(f"warm-up {name}: {time.perf_counter() - start:.2f} s", flush=True)
        for _ in range(args.repeats):
            for name, encode in engines.items():
                start = time.perf_counter()
                encode(texts)
                times[name].append(time.perf_counter() - start)
    n = len(texts)
    print(f"\n{n} texts, {args.size} model, batch size {args.batch_size}, {args.repeats} timed passes; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'engine':<24}{'texts/s':>10}{'(min-max)':>18}{'max |weight - theirs|':>23}")
    for name, t in times.items():
        difference = float(np.abs(vectors[name] - vectors["sentence-transformers"]).max())
        spread = f"({n / max(t):.1f}-{n / min(t):.1f})"
        print(f"{name:<24}{n / statistics.median(t):>10.1f}{spread:>18}{difference:>23.2e}")
    ratio = statistics.median(times["sentence-transformers"]) / statistics.median(times["mlx_encoders"])
    print(f"\nmlx_encoders (median texts/s): {ratio:.2f}x sentence-transformers")


if __name__ == "__main__":
    main()
