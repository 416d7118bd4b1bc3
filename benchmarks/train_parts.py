"""Which parts of a training step cost more in MLX than in torch: all-MiniLM-L6-v2 as a sequence classifier (8
labels, a new head), one optimizer step (forward, backward, AdamW) on a fixed batch of random token ids in training
mode (dropout on), on one thread in each library; the whole step, then the step with one part taken out at a time:
GELU (the identity instead), attention (each layer's values pass through), the layers' dropout (off), the optimizer
update (the gradients only). Both clip the gradients' norm to 1 and update with AdamW, as transformers' Trainer and
`fine_tune` do; MLX's step is `fine_tune`'s (compiled, its fused AdamW, dropout drawn from the step's key, freed
buffers kept for reuse). Each worker process is pinned to one core, so neither library uses a second.

Each library and variant runs in its own process; a time is the median of `--steps` steps after 4 of warm-up. A
part's cost is the whole step's time less the step's without it: parts share memory traffic and kernels, so the
costs do not add up to the step.

    python benchmarks/train_parts.py
    python benchmarks/train_parts.py --batch-size 16 --max-length 64 --steps 15
    TMPDIR=<MLX kernel cache> python benchmarks/train_parts.py --libraries mlx
"""

import argparse
import json
import os
import sys

from embed import model_folder  # the sibling benchmark's: the real MiniLM folder
from isolated import worker_result
from train_step import LABELS, timed  # the sibling benchmark's: its classifier's labels, its step timing

VARIANTS = ("whole", "no GELU", "no attention", "no dropout", "no optimizer")


def torch_step(variant: str, ids, labels):
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_folder(), num_labels=LABELS, attn_implementation="eager"
    ).train()
    for layer in model.bert.encoder.layer:
        if variant == "no GELU":
            layer.intermediate.intermediate_act_fn = torch.nn.Identity()
        if variant == "no attention":
            attention = layer.attention.self
            attention.forward = lambda hidden, *_, attention=attention, **__: (attention.value(hidden), None)
        if variant == "no dropout":
            for module in layer.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)  # Trainer's and fine_tune's default
    x, y = torch.tensor(ids), torch.tensor(labels)
    zeros = {p: torch.zeros_like(p) for p in model.parameters()}

    def step():
        model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss.backward()
        if variant != "no optimizer":
            for p, zero in zeros.items():
                if p.grad is None:  # unused (no attention: queries and keys), updated as MLX updates them
                    p.grad = zero
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        optimizer.zero_grad()

    return step


def mlx_step(variant: str, ids, labels):
    import warnings

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    import mlx_encoders
    from mlx_encoders.engine.ops import drawing_from
    from mlx_encoders.engine.runtime import cache_working_set
    from mlx_encoders.models import base
    from mlx_encoders.train.compiling import compiled_value_and_grad
    from mlx_encoders.train.optim import adamw, optimizer_step

    if variant == "no attention":
        base.attention = lambda q, k, v, mask, dropout: v
    warnings.simplefilter("ignore")  # the new head's "newly initialized" warning
    model, _ = mlx_encoders.load(model_folder(), task="sequence-classification", num_labels=LABELS)
    for layer in model.bert.encoder.layer:
        if variant == "no GELU":
            layer.intermediate.act = lambda x: x
        if variant == "no dropout":
            for module in layer.modules():
                if isinstance(module, nn.Dropout):
                    module._p_1 = 1.0  # nn.Dropout keeps 1 - p
    model.train()
    optimizer = adamw(model, 2e-5)
    batch = {"input_ids": ids.astype(np.int32), "attention_mask": np.ones_like(ids, np.int32),
             "labels": labels.astype(np.int32)}  # fmt: skip
    random = [mx.random.key(0)]  # the key dropout draws from, advanced by each step
    loss_and_grad = compiled_value_and_grad(model, random)

    def step():
        with drawing_from(random):
            loss, gradients = loss_and_grad(batch)
        mx.eval(loss, gradients)
        if variant != "no optimizer":
            optimizer_step(model, optimizer, gradients, 1.0)
        cache_working_set()

    return step


def worker(library: str, variant: str, batch: int, length: int, steps: int) -> float:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, before either library starts its threads
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (batch, length))
    labels = rng.integers(0, LABELS, (batch,))
    if library == "torch":
        return timed(torch_step(variant, ids, labels), steps, warmup=4)["wall"]
    from mlx_encoders.engine.runtime import keep_freed_memory, one_blas_thread

    step = mlx_step(variant, ids, labels)
    with one_blas_thread(), keep_freed_memory():
        return timed(step, steps, warmup=4)["wall"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--libraries", default="mlx,torch", help="which to run, comma-separated (default both)")
    p.add_argument("--worker", nargs=2, metavar=("LIBRARY", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.batch_size, args.max_length, args.steps)))
        return
    print(f"all-MiniLM-L6-v2 classifier, batch {args.batch_size} x {args.max_length} tokens, training mode, one "
          f"thread, median of {args.steps} steps")  # fmt: skip
    libraries = args.libraries.split(",")
    names = {"mlx": "MLX", "torch": "torch"}
    print(f"{'variant':<14}" + "".join(f"{names[lib] + ' s':>9}" for lib in libraries)
          + "".join(f"{names[lib] + ' part s':>14}" for lib in libraries))  # fmt: skip
    env = os.environ | {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    whole = {}
    for variant in VARIANTS:
        times = {}
        for library in libraries:
            sizes = ["--batch-size", str(args.batch_size), "--max-length", str(args.max_length)]
            command = [sys.executable, __file__, "--worker", library, variant, *sizes, "--steps", str(args.steps)]
            times[library] = worker_result(command, f"{library}, {variant}", env)
        whole = whole or times
        parts = "" if variant == "whole" else "".join(f"{whole[lib] - times[lib]:>14.3f}" for lib in libraries)
        print(f"{variant:<14}" + "".join(f"{times[lib]:>9.3f}" for lib in libraries) + parts, flush=True)


if __name__ == "__main__":
    main()
