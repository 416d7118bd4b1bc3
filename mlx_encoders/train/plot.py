"""`curves.png` in the output folder: the training loss per step and every eval metric, read from metrics.jsonl,
when matplotlib is installed (`pip install matplotlib`); without it, nothing is drawn."""

import importlib.util
import json
from pathlib import Path

METRICS_FILE, CURVES_FILE = "metrics.jsonl", "curves.png"


def plot_metrics(output_dir: Path) -> Path | None:
    """Draw `output_dir/curves.png` (written whole, then renamed into place); returns its path, or None when
    matplotlib is missing or there is nothing to draw."""
    source = Path(output_dir) / METRICS_FILE
    if importlib.util.find_spec("matplotlib") is None or not source.is_file():
        return None
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    names = sorted({k for r in evals for k in r if k.startswith("eval_") and k != "eval_loss"})
    figure, axes = plt.subplots(1, 1 + bool(names), figsize=(6 + 5 * bool(names), 4), squeeze=False)
    losses = axes[0][0]
    losses.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="training loss", linewidth=1)
    if evals:
        losses.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    losses.set(xlabel="step", ylabel="loss", title="Loss")
    losses.legend()
    if names:
        for name in names:
            points = [r for r in evals if name in r]
            axes[0][1].plot([r["step"] for r in points], [r[name] for r in points], "o-", label=name[5:])
        axes[0][1].set(xlabel="step", title="Evaluation")
        axes[0][1].legend()
    figure.tight_layout()
    target = Path(output_dir) / CURVES_FILE
    partial = target.with_name(target.name + ".partial.png")
    try:
        figure.savefig(partial, dpi=100)
        partial.replace(target)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise OSError(e.errno, f"could not write {target}: {e.strerror or e}") from e
    finally:
        plt.close(figure)
    return target
