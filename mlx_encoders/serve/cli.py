"""`mlx-encoders serve --model [NAME=]PATH ... [--index NAME=DIR ...]`: load and warm the models, open the indexes,
print one line per model and index and the URL, serve until SIGINT or SIGTERM, then finish the requests in flight
(those still arriving get --shutdown-timeout seconds) and exit 0."""

import argparse
import gc
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DEBUG_ENV

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def switch(text: str) -> bool:
    """A yes/no value as a flag's argument or a variable's: true/false, 1/0, yes/no, on/off."""
    value = text.strip().lower()
    if value not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ValueError("must be true or false")
    return value in ("true", "1", "yes", "on")


def number(text: str, convert: Callable, ok: Callable, what: str):
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"must be {what}")
    return value


def count(text: str) -> int:
    return number(text, int, lambda v: v >= 1, "an int >= 1")


def port(text: str) -> int:
    return number(text, int, lambda v: 0 <= v < 65536, "a port, 0 to 65535")


def milliseconds(text: str) -> float:
    return number(text, float, lambda v: 0 <= v < math.inf, "a number of milliseconds, 0 or more")


def seconds(text: str) -> float:
    return number(text, float, lambda v: 0 < v < math.inf, "a number of seconds above 0")


def keep_alive(text: str) -> float:
    return number(text, float, lambda v: not math.isnan(v), "a number of seconds (negative: never)")


@dataclass(frozen=True)
class Flag:
    """One option of `serve`: its default, its help, how its text is read (`kind`, a ValueError saying what it
    must be), and whether it repeats (its variable then holds the values separated by commas)."""

    default: object
    help: str
    kind: Callable = str
    metavar: str | None = None
    choices: tuple | None = None
    repeat: bool = False
    short: str | None = None


# Every option of `serve`, each also read from its variable (`variable(flag)`) when the command line lacks it
FLAGS = {
    "--model": Flag([], "folder or hub id to serve, as NAME= (default: its folder or hub id); repeatable",
                    metavar="[NAME=]PATH", repeat=True, short="-m"),
    "--models-dir": Flag(None, "serve each sub-folder of DIR under its name, loaded on its first request and "
                         "unloaded when idle (Ollama-style); --model models stay loaded", metavar="DIR"),
    "--model-keep-alive": Flag(300.0, "unload a --models-dir model idle for SECONDS (negative: never; an Ollama "
                               "request's keep_alive sets it for its model)", keep_alive, "SECONDS"),
    "--index": Flag([], "index folder (mlx-encoders index build) to search on /v1/search; repeatable",
                    metavar="NAME=DIR", repeat=True),
    "--host": Flag("127.0.0.1", "address to bind (127.0.0.1: this machine only)"),
    "--port": Flag(8080, "port (0: any free port, printed)", port),
    "--dtype": Flag(None, "cast the weights", choices=("float16", "bfloat16", "float32")),
    "--max-batch-tokens": Flag(8192, "tokens per batch a model runs", count),
    "--max-wait-ms": Flag(0.0, "how long an idle worker waits for a batch to fill, in ms (0: starts at once)",
                          milliseconds),
    "--max-queue": Flag(256, "requests waiting per model before 429", count),
    "--batch-size": Flag(32, "inputs per forward pass within a batch", count),
    "--max-inputs": Flag(2048, "inputs per request", count),
    "--max-request-bytes": Flag(4 * 2**20, "request body size in bytes", count),
    "--auto-truncate": Flag(True, "cut over-long inputs to the model's length (false: answer 400, or TEI's 422); "
                            "a request's own \"truncate\" wins", switch, metavar="true|false"),
    "--api-key": Flag(None, "require Authorization: Bearer KEY on every route but the health checks"),
    "--cors-origin": Flag([], "allow browser requests from ORIGIN (repeatable)", metavar="ORIGIN",
                          repeat=True),
    "--read-timeout": Flag(30.0, "a request's headers must arrive within SECONDS of its first byte, its body within "
                           "SECONDS of its headers, else 408", seconds, "SECONDS"),
    "--keep-alive-timeout": Flag(5.0, "close a connection idle for SECONDS", seconds, "SECONDS"),
    "--shutdown-timeout": Flag(5.0, "on SIGTERM or SIGINT, requests still arriving get SECONDS more, then their "
                               "connections close; requests that arrived are answered", seconds, "SECONDS"),
    "--log-level": Flag("warning", "the server's log: errors and warnings, or also each request (info)",
                        choices=LOG_LEVELS),
}  # fmt: skip


def bound(host: str, port: int) -> socket.socket:
    """The server's socket, bound to `host`:`port` and listening (connections wait in the backlog until the models
    are loaded and uvicorn accepts them: a socket bound but not listening leaves the port to a second server); an
    error naming them (and their options) when the address is taken or not this machine's."""
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on such sockets' connections (40 ms per answer else)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} (--host and --port, or {variable('--host')} and {variable('--port')}): "
            f"{e.strerror or e}; choose another port (--port 0 takes a free one), or an address of this machine"
        ) from None
    return sock


def variable(flag: str) -> str:
    """The environment variable of a flag: --max-queue -> MLX_ENCODERS_MAX_QUEUE (--debug: MLX_ENCODERS_DEBUG)."""
    return DEBUG_ENV if flag == "--debug" else "MLX_ENCODERS_" + flag[2:].upper().replace("-", "_")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve", help="HTTP server: OpenAI embeddings, rerank, classify, search, and TEI's API (and Cohere's, "
        "Ollama's and Infinity's routes)",
        description="Serve embeddings (/v1/embeddings, /embed, /embed_sparse), reranking (/v1/rerank, /rerank), "
        "classification (/v1/classify, /predict) and index search (/v1/search) over HTTP, batching concurrent "
        "requests; also Cohere's (/v2/embed, /v2/rerank), Ollama's (/api/embed) and Infinity's routes; the schema at "
        "/openapi.json. Each option may come from its environment variable instead, MLX_ENCODERS_ and the option's "
        "name (--max-queue: MLX_ENCODERS_MAX_QUEUE). Needs: pip install starlette uvicorn prometheus_client "
        '(in a checkout: pip install -e ".[serve]")',
    )  # fmt: skip
    for flag, spec in FLAGS.items():
        names = [spec.short, flag] if spec.short else [flag]
        shown = {"--dtype": "as stored", "--cors-origin": "no CORS"}.get(flag) or str(spec.default).lower()
        help = f"{spec.help} (default: ${variable(flag)} when set, else {shown})"
        options = {"metavar": spec.metavar, "choices": spec.choices, "help": help}
        if spec.kind is switch:  # --auto-truncate alone means true, as TEI's
            options.update(nargs="?", const=True)
        p.add_argument(*names, action="append" if spec.repeat else "store", type=typed(flag, spec.kind), **options)
    p.set_defaults(run=run)


def typed(flag: str, kind: Callable) -> Callable:
    """`kind` for argparse: its ValueError becomes argparse's message naming the flag."""

    def read(text: str):
        try:
            return kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}, got {text!r}") from None

    return read


def setting(args: argparse.Namespace, flag: str):
    """A flag's value: from the command line, else from its variable, else its default; a variable that does not
    read as the flag's kind is a ValueError naming it."""
    spec = FLAGS[flag]
    given = getattr(args, flag[2:].replace("-", "_"), None)
    if given is not None:
        return given
    name = variable(flag)
    if name not in os.environ:
        return spec.default
    text = os.environ[name]
    values = [v.strip() for v in text.split(",") if v.strip()] if spec.repeat else [text]
    try:
        read = [spec.kind(v) for v in values]
    except ValueError as e:
        raise ValueError(f"${name} {e}, got {text!r}") from None
    if spec.choices and read[0] not in spec.choices:
        raise ValueError(f"${name} must be one of {', '.join(spec.choices)}, got {text!r}")
    return read if spec.repeat else read[0]


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


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else its variable when set; given but empty (`--api-key "$UNSET"`) is refused, never open."""
    key = setting(args, "--api-key")
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else f"${variable('--api-key')}"
        raise ValueError(f"{source} is empty: give a key, or leave it out to serve without authentication")
    return key


def run(args: argparse.Namespace) -> int:
    from . import require_stack

    require_stack()  # an ImportError naming what to install: the command prints it (errors.run_command)
    import uvicorn

    from . import load_models
    from .connections import protocol
    from .lazy import ModelsDir
    from .server import Options, Server, build

    given = {flag[2:].replace("-", "_"): setting(args, flag) for flag in FLAGS}
    level = given["log_level"]
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("mlx-encoders serve: %(levelname)s: %(message)s"))
    logging.getLogger("mlx_encoders").addHandler(handler)
    logging.getLogger("mlx_encoders").setLevel(level.upper())
    options = Options(
        **{name: given[name] for name in ("max_batch_tokens", "max_wait_ms", "max_queue", "max_inputs",
                                          "max_request_bytes", "auto_truncate", "batch_size", "read_timeout")},
        api_key=api_key(args), cors_origins=tuple(given["cors_origin"]),
    )  # fmt: skip
    if not given["model"] and not given["index"] and not given["models_dir"]:
        raise ValueError("mlx-encoders serve needs --model PATH, --models-dir DIR or --index NAME=DIR")
    sock = bound(given["host"], given["port"])  # before the models load: a taken port fails at once
    lazy = None
    if given["models_dir"]:
        lazy = ModelsDir(given["models_dir"], given["model_keep_alive"], given["dtype"], given["batch_size"])
    models, indexes = [], []
    if given["model"] or given["index"]:
        models, indexes = load_models(
            model_specs(given["model"]), given["dtype"], given["batch_size"], index_specs(given["index"])
        )
    server = Server(models, options, indexes, lazy)
    server.warm()
    # what start-up built lives as long as the server: a full collection walking it would hold the event loop
    gc.freeze()
    host = given["host"]
    for model in server.models.values():
        print(f"mlx-encoders serve: model {model.describe()}")
    for index in server.indexes.values():
        print(f"mlx-encoders serve: index {index.describe()}")
    if lazy is not None:
        print(
            f"mlx-encoders serve: models loaded on request from {given['models_dir']}: "
            f"{', '.join(lazy.names()) or 'none'}"
        )
    # no graceful-shutdown timeout: a request that arrived whole is finished; the protocol ends the others in time
    config = uvicorn.Config(
        build(server), http=protocol(given["read_timeout"], given["shutdown_timeout"]), log_level=level,
        access_log=level in ("info", "debug"), timeout_keep_alive=given["keep_alive_timeout"],
        timeout_graceful_shutdown=None,
    )  # fmt: skip
    runner = uvicorn.Server(config)
    # Before uvicorn takes the stopping signals, one stops it as soon as it has started; after, uvicorn re-raises the
    # signal once it has shut down and this handler takes it, so the exit status is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(runner, "should_exit", True))
    shown = f"[{host}]" if ":" in host else host
    print(f"mlx-encoders serve: listening on http://{shown}:{sock.getsockname()[1]}", flush=True)
    runner.run(sockets=[sock])
    print("mlx-encoders serve: stopped", file=sys.stderr)
    return 0
