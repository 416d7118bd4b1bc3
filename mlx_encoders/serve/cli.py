"""`mlx-encoders serve --model [NAME=]PATH ... [--index NAME=DIR ...]`: load and warm the models, open the indexes,
print one line per model and index and the URL, serve until SIGINT or SIGTERM, then finish the requests in flight
(those still arriving get --shutdown-timeout seconds) and exit 0."""

import argparse
import os
import signal
import socket
import sys

from ..pipelines.base import check_count

API_KEY_ENV = "MLX_ENCODERS_API_KEY"
# --option: (default seconds, its environment variable, help)
TIMEOUTS = {
    "--read-timeout": (30.0, "MLX_ENCODERS_READ_TIMEOUT", "a request's headers must arrive within SECONDS of its "
                       "first byte, its body within SECONDS of its headers, else 408"),
    "--keep-alive-timeout": (5.0, "MLX_ENCODERS_KEEP_ALIVE_TIMEOUT", "close a connection idle for SECONDS"),
    "--shutdown-timeout": (5.0, "MLX_ENCODERS_SHUTDOWN_TIMEOUT", "on SIGTERM, requests still arriving get SECONDS "
                           "more, then their connections close; requests that arrived are answered"),
}  # fmt: skip


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve", help="HTTP server: OpenAI embeddings, rerank, classify, search (and TEI's, Cohere's, Ollama's and "
        "Infinity's routes)",
        description="Serve embeddings (/v1/embeddings, /embed, /embed_sparse), reranking (/v1/rerank, /rerank), "
        "classification (/v1/classify, /predict) and index search (/v1/search) over HTTP, batching concurrent "
        "requests; also Cohere's (/v2/embed, /v2/rerank), Ollama's (/api/embed) and Infinity's routes. Needs: pip "
        "install \"mlx-encoders[serve]\"",
    )  # fmt: skip
    p.add_argument("--model", "-m", action="append", default=[], metavar="[NAME=]PATH",
                   help="folder or hub id to serve, as NAME= (default: its folder or hub id); repeatable")  # fmt: skip
    p.add_argument("--models-dir", metavar="DIR",
                   help="serve each sub-folder of DIR under its name, loaded on its first request and unloaded "
                   "when idle (Ollama-style); --model models stay loaded")  # fmt: skip
    p.add_argument("--model-keep-alive", type=float, default=300.0, metavar="SECONDS",
                   help="unload a --models-dir model idle for SECONDS (default 300; negative: never; an Ollama "
                   "request's keep_alive sets it for its model)")  # fmt: skip
    p.add_argument("--index", action="append", default=[], metavar="NAME=DIR",
                   help="index folder (mlx-encoders index build) to search on /v1/search; repeatable")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="cast the weights (default: as stored)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per batch a model runs (default 8192)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="wait for a batch to fill, in ms (default 2)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting per model before 429 (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per forward pass within a batch (default 32)")
    p.add_argument("--max-inputs", type=int, default=2048, help="inputs per request (default 2048)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="request body size (default 4 MiB)")
    p.add_argument("--auto-truncate", action="store_true", help="cut over-long inputs instead of answering 400")
    p.add_argument("--api-key", help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV} when set)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; default: no CORS)")  # fmt: skip
    for flag, (default, env, text) in TIMEOUTS.items():
        p.add_argument(flag, type=float, metavar="SECONDS", help=f"{text} (default: ${env} when set, else {default:g})")
    p.set_defaults(run=run)


def model_specs(values: list[str]) -> dict[str, str]:
    from .models import default_name

    specs = {}
    for value in values:
        # NAME=PATH splits at the first "=": a path may hold one (runs/lr=1e-4/model), a served name may not
        name, _, path = value.partition("=") if "=" in value and not os.path.exists(value) else ("", "", value)
        name = name or default_name(path)
        if name in specs:
            raise ValueError(f"model name {name!r} is given twice; name each model: --model NAME=PATH")
        specs[name] = path
    return specs


def index_specs(values: list[str]) -> dict[str, str]:
    specs = {}
    for value in values:
        name, _, folder = value.partition("=")
        if not name or not folder:
            raise ValueError(f"--index takes NAME=DIR, got {value!r}")
        if name in specs:
            raise ValueError(f"index name {name!r} is given twice; name each index: --index NAME=DIR")
        specs[name] = folder
    return specs


def api_key(given: str | None) -> str | None:
    """--api-key, else the variable when set; given but empty (`--api-key "$UNSET"`) is refused, never open."""
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = "--api-key" if given is not None else f"${API_KEY_ENV}"
        raise ValueError(f"{source} is empty: give a key, or leave it out to serve without authentication")
    return key


def timeout(args: argparse.Namespace, flag: str) -> float:
    """The option's seconds, else its environment variable's, else the default; a finite number above 0."""
    from .server import check_seconds

    default, env, _ = TIMEOUTS[flag]
    given = getattr(args, flag[2:].replace("-", "_"))
    if given is not None:
        return check_seconds(flag, given)
    if env not in os.environ:
        return default
    try:
        return check_seconds(f"${env}", float(os.environ[env]))
    except ValueError:
        raise ValueError(f"${env} must be a number of seconds above 0, got {os.environ[env]!r}") from None


def run(args: argparse.Namespace) -> int:
    from . import require_stack

    require_stack()  # an ImportError naming what to install: the command prints it (errors.run_command)
    import uvicorn

    from . import load_models
    from .connections import protocol
    from .lazy import ModelsDir
    from .server import Options, Server, build

    for name in ("max_batch_tokens", "max_queue", "batch_size", "max_inputs", "max_request_bytes"):
        check_count(f"--{name.replace('_', '-')}", getattr(args, name), 1)
    if args.max_wait_ms < 0:
        raise ValueError(f"--max-wait-ms must be 0 or more, got {args.max_wait_ms}")
    read, idle, shutdown = (timeout(args, flag) for flag in TIMEOUTS)
    options = Options(
        max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
        max_inputs=args.max_inputs, max_request_bytes=args.max_request_bytes, auto_truncate=args.auto_truncate,
        batch_size=args.batch_size, api_key=api_key(args.api_key),
        cors_origins=tuple(args.cors_origin), read_timeout=read,
    )  # fmt: skip
    if not args.model and not args.index and not args.models_dir:
        raise ValueError("mlx-encoders serve needs --model PATH, --models-dir DIR or --index NAME=DIR")
    lazy = None if not args.models_dir else ModelsDir(args.models_dir, args.model_keep_alive, args.dtype,
                                                     args.batch_size)  # fmt: skip
    models, indexes = [], []
    if args.model or args.index:
        models, indexes = load_models(model_specs(args.model), args.dtype, args.batch_size, index_specs(args.index))
    server = Server(models, options, indexes, lazy)
    server.warm()
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on such sockets' connections (40 ms per answer else)
    sock = socket.socket(
        socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    for model in server.models.values():
        print(f"mlx-encoders serve: model {model.describe()}")
    for index in server.indexes.values():
        print(f"mlx-encoders serve: index {index.describe()}")
    if lazy is not None:
        print(
            f"mlx-encoders serve: models loaded on request from {args.models_dir}: {', '.join(lazy.names()) or 'none'}"
        )
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"mlx-encoders serve: listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    # no graceful-shutdown timeout: a request that arrived whole is finished; the protocol ends the others in time
    config = uvicorn.Config(
        build(server), http=protocol(read, shutdown), log_level="warning", access_log=False,
        timeout_keep_alive=idle, timeout_graceful_shutdown=None,
    )  # fmt: skip
    # uvicorn re-raises the stopping signal once it has shut down; these handlers take it, so the exit status is 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])
    print("mlx-encoders serve: stopped", file=sys.stderr)
    return 0
