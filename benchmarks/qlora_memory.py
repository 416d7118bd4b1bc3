"""Peak resident memory while training a BERT-base-shaped classifier: full fine-tuning, LoRA and QLoRA (8 and 4 bits).

A random BERT-base-shaped encoder (12 layers, width 768, vocabulary 30522) is saved once in float32 and once per
bit width quantized as convert writes it (`quantize_model`, group size 32, rounded to nearest). Each engine runs
in its own process, so that peak memory is its alone: it loads the folder with a new 2-label head, adds rank-8
LoRA adapters on the attention projections (except full fine-tuning), then takes `--steps` AdamW steps of
`--batch` sequences of `--length` tokens (`mlx_encoders.train.optim`, as `train` does). Printed: the peak
resident set (`ru_maxrss`), the bytes of the weights as held in memory, the peak after imports, and the peak
above the weights: QLoRA's memory should sit close to the quantized size, not the float one. The "checkpointing"
rows add gradient checkpointing (`TrainingConfig.gradient_checkpointing`, `--gradient-checkpointing`): each layer's
activations are recomputed in the backward pass instead of kept, which is what brings QLoRA near its weights.

    python benchmarks/qlora_memory.py
    python benchmarks/qlora_memory.py --bits 4 --batch 16 --length 256 --steps 5
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(folder: str, lora: bool, checkpointing: bool, batch: int, length: int, steps: int) -> None:
    import mlx_encoders  # noqa: F401  (first: the fast BLAS)

    # isort: split
    import warnings

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_encoders import load_model
    from mlx_encoders.train import task_loss
    from mlx_encoders.train.lora import apply_lora
    from mlx_encoders.train.optim import adamw, optimizer_step

    imported = peak_mb()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new head's warning
        model = load_model(folder, task="sequence-classification", num_labels=2)
    if lora:
        apply_lora(model, rank=8, alpha=16)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    weights_mb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 2**20
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    ids = mx.random.randint(1000, 30000, (batch, length), key=mx.random.key(0))
    labels = mx.arange(batch) % 2
    loss_and_grad = nn.value_and_grad(model, lambda: task_loss(model, model(ids), labels))
    optimizer = adamw(model, 1e-4, 0.01)
    for _ in range(steps):
        loss, grads = loss_and_grad()
        optimizer_step(model, optimizer, grads, 1.0)
    record = {"imported_mb": imported, "peak_mb": peak_mb(), "weights_mb": weights_mb, "trainable": trainable}
    print(json.dumps({**record, "loss": loss.item()}))


ENGINES = {"full fine-tuning, float32": ("float32", False, False), "LoRA, float32": ("float32", True, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", default="8,4", help="comma-separated bit widths for QLoRA (default 8,4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.lora, args.checkpointing, args.batch, args.length, args.steps)
        return
    bits = args.bits.split(",")
    engines = {**ENGINES, **{f"QLoRA, {b}-bit": (f"{b}-bit", True, False) for b in bits}}
    engines.update({f"QLoRA, {b}-bit, checkpointing": (f"{b}-bit", True, True) for b in bits})
    with tempfile.TemporaryDirectory() as tmp:
        # the models of quantized_memory.py, each step in its own process (this one imports nothing large: Linux
        # carries ru_maxrss over fork + exec)
        command = [sys.executable, str(Path(__file__).parent / "quantized_memory.py"), "--write", tmp, "--bits",
                   args.bits]  # fmt: skip
        written = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        folders = json.loads(written.strip().splitlines()[-1])
        results = {}
        for name, (folder, lora, checkpointing) in engines.items():
            command = [sys.executable, __file__, "--worker", folders[folder], "--batch", str(args.batch), "--length",
                       str(args.length), "--steps", str(args.steps)] + (["--lora"] if lora else [])  # fmt: skip
            command += ["--checkpointing"] if checkpointing else []
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{name} failed:\n{done.stderr[-2000:]}")
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"BERT-base-shaped classifier, {args.steps} AdamW steps of {args.batch} x {args.length} tokens, "
          "one process per engine")  # fmt: skip
    print(f"{'engine':<36}{'peak MB':>9}{'weights MB':>12}{'peak - weights':>16}{'after imports':>15}{'trainable':>13}")
    for name, r in results.items():
        print(f"{name:<36}{r['peak_mb']:>9.0f}{r['weights_mb']:>12.0f}{r['peak_mb'] - r['weights_mb']:>16.0f}"
              f"{r['imported_mb']:>15.0f}{r['trainable']:>13,}")  # fmt: skip


if __name__ == "__main__":
    main()
