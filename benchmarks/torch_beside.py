"""torch's speed beside mlx_encoders: a library import must not slow other libraries.

Runs the same torch work in fresh processes: torch alone, `import mlx_encoders` before `import torch`, and after
it, in turns (`--rounds`), and prints each one's speed relative to torch alone (best time of each). The work: a
one-row product (1 x 768 @ 768 x 3072, the shape of a decoding step) and a BERT-base forward (transformers'
BertModel, random weights, 8 x 128 tokens). Target: >= 0.95x in both orders.

    python benchmarks/torch_beside.py
    python benchmarks/torch_beside.py --rounds 5
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
bert = BertModel(BertConfig()).eval()
ids = torch.randint(0, 30522, (8, 128))


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
    print(json.dumps({{"one-row product": best(lambda: x @ w, 2000), "BERT-base forward": best(lambda: bert(ids), 2)}}))
"""
SETUPS = {
    "torch alone": dict(before="", after=""),
    "mlx_encoders imported before torch": dict(before="import mlx_encoders", after=""),
    "mlx_encoders imported after torch": dict(before="", after="import mlx_encoders"),
}


def measure(setup: dict) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", WORK.format(**setup)], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="each setup this many times, in turns")
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, setup in SETUPS.items():
            for work, seconds in measure(setup).items():
                best.setdefault(name, {})[work] = min(seconds, best.get(name, {}).get(work, float("inf")))
    alone = best["torch alone"]
    for name, times in best.items():
        cells = ", ".join(f"{work} {times[work] * 1e3:.3f} ms ({alone[work] / times[work]:.2f}x)" for work in times)
        print(f"{name:36s} {cells}")


if __name__ == "__main__":
    main()
