"""torch's speed beside mlx_encoders: a library import must not slow other libraries.

Runs the same torch work in fresh processes: torch alone, `import mlx_encoders` before `import torch`, and after
it, in turns (`--rounds`), and prints each one's speed relative to torch alone (best time of each). The work: a
one-row product (1 x 768 @ 768 x 3072, the shape of a decoding step) and a BERT-base forward (transformers'
BertModel, random weights, 8 x 128 tokens; `--quick`: 2 layers, 4 x 64). Target: >= 0.95x in both orders.

    python benchmarks/torch_beside.py
    python benchmarks/torch_beside.py --rounds 5
    python benchmarks/torch_beside.py --quick --json   # a 2-layer BERT, ratios as JSON
"""

import argparse
import json
import subprocess
import sys

WORK = """
import json, time
{before}
import torch
{after}
from transformers import BertConfig, BertModel

torch.manual_seed(0)
x, w = torch.randn(1, 768), torch.randn(768, 3072)
bert = BertModel(BertConfig(num_hidden_layers={layers})).eval()
ids = torch.randint(0, 30522, ({batch}, {length}))


def best(f, n, tries=5):
    f()
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - start) / n)
    return min(times)


with torch.inference_mode():
    product, forward = best(lambda: x @ w, {products}), best(lambda: bert(ids), 2)
    print(json.dumps({{"one-row product": product, "BERT forward": forward}}))
"""
SETUPS = {
    "torch alone": dict(before="", after=""),
    "mlx_encoders imported before torch": dict(before="import mlx_encoders", after=""),
    "mlx_encoders imported after torch": dict(before="", after="import mlx_encoders"),
}


def measure(setup: dict, quick: bool) -> dict[str, float]:
    shape = (
        dict(layers=2, batch=4, length=64, products=500)
        if quick
        else dict(layers=12, batch=8, length=128, products=2000)
    )
    result = subprocess.run(
        [sys.executable, "-c", WORK.format(**setup, **shape)], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="each setup this many times, in turns")
    parser.add_argument("--quick", action="store_true", help="a 2-layer BERT on 4 x 64 tokens")
    parser.add_argument("--json", action="store_true", help="print {setup: {work: ratio to torch alone}} as JSON")
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, setup in SETUPS.items():
            for work, seconds in measure(setup, args.quick).items():
                best.setdefault(name, {})[work] = min(seconds, best.get(name, {}).get(work, float("inf")))
    alone = best["torch alone"]
    if args.json:
        print(json.dumps({name: {w: alone[w] / t for w, t in times.items()} for name, times in best.items()}))
        return
    for name, times in best.items():
        cells = ", ".join(f"{work} {times[work] * 1e3:.3f} ms ({alone[work] / times[work]:.2f}x)" for work in times)
        print(f"{name:36s} {cells}")


if __name__ == "__main__":
    main()
