"""What a conversion tells: the report printed, the model card written beside the weights, the hub upload."""

import re
from pathlib import Path

from ..errors import CommandError
from ..quantization.fidelity import PROBE_TEXTS, describe_perplexity


def describe_quantization(
    quantization: dict | None, method: str = "round to nearest", applied: dict | None = None
) -> str:
    """The settings `applied` ({(bits, mode, group size): modules}, from `applied_settings`) and the modules left
    float: what was done, which config.json's default alone does not say (a recipe may override it everywhere)."""
    if not quantization:
        return "none (float)"
    applied = applied or {(quantization["bits"], quantization["mode"], quantization["group_size"]): None}
    if len(applied) == 1:
        (bits, mode, group_size), _ = next(iter(applied.items()))
        text = f"{bits}-bit {mode}, group size {group_size} ({method})"
    else:
        parts = [f"{b}-bit {m} (g{g}) for {n} modules" for (b, m, g), n in sorted(applied.items(), key=lambda i: -i[1])]
        text = f"mixed: {', '.join(parts)} ({method})"
    floats = [k for k, v in quantization.items() if v is False]
    if floats:
        text += f"; {len(floats)} modules left float (input width not divisible by the group size, or by recipe): "
        text += ", ".join(floats)
    return text


def model_card(source: str, folder_name: str, report: dict, repo: str | None, tokenizer: bool = True) -> str:
    """The converted folder's README: what it is, its figures, and code that loads it (from the hub repo it is
    uploaded to, else from its folder; the model alone for a folder without a tokenizer)."""
    hub_source = not Path(str(source)).expanduser().exists() and str(source).count("/") == 1
    front = ["---", "library_name: mlx", "tags:", "- mlx", "- mlx-encoders", f"- {report['model_type']}"]
    if hub_source:
        front.append(f"base_model: {source}")
    front.append("---")
    fid = report["fidelity"]
    perplexity_lines = []
    if "perplexity" in report:  # a causal LM's
        perplexity_lines = [f"- Perplexity on the probe texts, source -> here: {describe_perplexity(report)}"]
    return "\n".join(
        [
            *front,
            f"\n# {folder_name}\n",
            f"MLX weights of `{source}` converted with the `convert` command of mlx-encoders.\n",
            f"- Architecture: {report['model_type']} ({report['architecture']}), {report['parameters']:,} parameters",
            f"- Quantization: {describe_quantization(report['quantization'], report['method'], report['applied'])}",
            f"- Weights on disk: {report['bytes_before'] / 1e6:.1f} MB in the source, "
            f"{report['bytes_after'] / 1e6:.1f} MB here ({report['bits_per_weight']:.2f} bits per weight)",
            f"- Fidelity vs the source on {len(PROBE_TEXTS)} built-in probe texts ({report['output']}): "
            f"cosine mean {fid['cosine_mean']:.6f}, min {fid['cosine_min']:.6f}; "
            f"max abs difference {fid['max_abs_diff']:.4g}",
            *perplexity_lines,
            "\n## Use\n",
            *use(repo or folder_name, tokenizer),
            "",
        ]
    )


def use(name: str, tokenizer: bool) -> list[str]:
    """The card's code: load the folder (or repo) and run it, on a tokenized text, or on token ids when the folder
    has no tokenizer."""
    if tokenizer:
        load = [f'model, tokenizer = {LOAD}("{name}")', 'batch = tokenizer(["Hello world"], padding=True)']
        run = ['out = model(batch["input_ids"], attention_mask=batch["attention_mask"])']
        note, imports = [], []
    else:
        load, run = [f'model = {LOAD}_model("{name}")'], ["out = model(mx.array([[1, 2, 3]]))"]
        note = ["The source has no tokenizer (tokenizer.json), so neither has this folder: the model takes token "
                "ids.\n"]  # fmt: skip
        imports = ["import mlx.core as mx"]
    return [*note, "```python", *imports, "import mlx_encoders", "", *load, *run, "```"]


LOAD = "mlx_encoders.load"
CARD_LOAD = re.compile(r'mlx_encoders\.load(_model)?\("[^"\n]*"\)')


def upload(folder: Path, repo: str) -> str:
    """Publish `folder` as the model repo `repo` (needs a write token: `hf auth login` or HF_TOKEN)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    # the card's code loads the repo, whatever name the folder had when it was converted (a reused conversion)
    card = CARD_LOAD.sub(lambda m: f'{LOAD}{m[1] or ""}("{repo}")', (folder / "README.md").read_text())
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != "README.md")
    operations = [CommitOperationAdd(p.relative_to(folder).as_posix(), str(p)) for p in files]
    operations.append(CommitOperationAdd("README.md", card.encode()))
    try:
        api = HfApi()
        api.create_repo(repo_id=repo, repo_type="model", exist_ok=True)
        api.create_commit(
            repo_id=repo, repo_type="model", operations=operations, commit_message="Upload with mlx-encoders"
        )
    except Exception as e:  # noqa: BLE001  the hub's errors (HTTP, network, auth) have no common base
        raise CommandError(
            f"{folder} was written, but uploading it to {repo} failed: {type(e).__name__}: {e}. Check the network "
            f"and the token (hf auth login, or HF_TOKEN), then upload the folder: hf upload {repo} {folder}"
        ) from e
    return f"https://huggingface.co/{repo}"


def print_report(source: str, target: Path, report: dict) -> None:
    fid = report["fidelity"]
    ratio = report["bytes_after"] / report["bytes_before"]
    rows = [
        ("architecture", f"{report['model_type']} ({report['architecture']})"),
        ("parameters", f"{report['parameters']:,}"),
        ("quantization", describe_quantization(report["quantization"], report["method"], report["applied"])),
        (
            "size on disk",
            f"{report['bytes_before'] / 1e6:.2f} MB -> {report['bytes_after'] / 1e6:.2f} MB ({ratio:.3f}x)",
        ),
        ("bits/weight", f"{report['bits_per_weight']:.2f}"),
        (
            "fidelity",
            f"{report['output']} on {len(PROBE_TEXTS)} probe texts: cosine mean {fid['cosine_mean']:.6f}, "
            f"min {fid['cosine_min']:.6f}; max abs diff {fid['max_abs_diff']:.4g}",
        ),
        *([("perplexity", f"{describe_perplexity(report)} on the probe texts")] if "perplexity" in report else []),
        ("time", f"{report['seconds']:.1f} s"),
    ]
    print(f"Converted {source} -> {target}")
    for name, value in rows:
        print(f"  {name:<13} {value}")
