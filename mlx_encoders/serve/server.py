"""The HTTP application (Starlette): the served models and indexes (`Server`), the routes of every protocol
(`protocols/`), the API key and the request metrics. Each model's requests go through its `Batcher`; handlers parse
and validate the request, tokenize it on the model's tokenizer thread (off the event loop, one tokenization at a
time: a tokenizer is not thread-safe) and shape the answer."""

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .batcher import Batcher, QueueFull
from .errors import ApiError
from .lazy import TAKEN, ModelsDir, NotLoaded
from .metrics import Metrics
from .models import ServedModel
from .protocols import Endpoint, error_body, routes
from .requests import ClientGone
from .search import ServedIndex

log = logging.getLogger("mlx_encoders.serve")
access = logging.getLogger("uvicorn.access")
RETRY_AFTER_S = 1
OFF_LOOP_VALUES = 4096  # an answer of more values is written as JSON on a thread: the event loop stays free
# a larger body goes to the socket a piece at a time: one write of it all copies it whole on the event loop
SEND_BYTES = 256 * 1024
# rendering on a thread lets the event loop take the interpreter's lock at least this often; each pause costs a
# sleep's system call and timer slack (tens of microseconds), too much to take at every value
PAUSE_EVERY_S = 0.001
# a request of at most this many texts of at most this many characters is tokenized on the event loop: tens of
# microseconds, less than handing it to the tokenizer thread and back
QUICK_TEXTS, QUICK_CHARS = 8, 512
ROUTES = routes()


@dataclass
class Options:
    """Limits and behaviour of a server; the command line's options of the same names."""

    max_batch_tokens: int = 8192
    max_wait_ms: float = 0.0  # an idle worker starts at once: requests that come meanwhile join the next passes
    max_queue: int = 256
    max_inputs: int = 2048
    max_request_bytes: int = 4 * 2**20
    auto_truncate: bool = True  # as TEI: an over-long input is cut, unless a request or --auto-truncate false says
    batch_size: int = 32
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    read_timeout: float = 30.0

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():  # an unset variable, not a wish to open the server
            raise ValueError("the API key is empty: give a key, or no key at all for a server without authentication")
        check_seconds("read_timeout", self.read_timeout)
        for name in ("max_batch_tokens", "max_queue", "max_inputs", "max_request_bytes", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int of at least 1, got {value!r:.40}")
        value = self.max_wait_ms
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"max_wait_ms must be a number of milliseconds of at least 0, got {value!r:.40}")
        if not isinstance(self.auto_truncate, bool):
            raise ValueError(f"auto_truncate must be True or False, got {self.auto_truncate!r:.40}")


def check_seconds(name: str, value) -> float:
    """A timeout: a finite number of seconds above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")
    return float(value)


class Server:
    """The served models, one batcher each, the served indexes, the metrics, and the options."""

    def __init__(
        self, models: list[ServedModel], options: Options, indexes: list[ServedIndex] = (),
        lazy: ModelsDir | None = None,
    ):  # fmt: skip
        names = [m.name for m in models]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"model name {duplicated[0]!r} is given twice; name each model: --model NAME=PATH")
        self.models = {}
        self.options = options
        self.metrics = Metrics()
        self.batchers, self.tokenizers, self.tokenizer_locks = {}, {}, {}
        for m in models:
            self.add(m)
        self.indexes = {i.name: i for i in indexes}
        self.lazy = lazy
        self.ready = False

    def add(self, m: ServedModel) -> None:
        """Serve `m`: its batcher (worker thread) and its tokenizer thread."""
        self.batchers[m.name] = Batcher(
            m.name, m.compute, max_batch_tokens=self.options.max_batch_tokens, max_wait_ms=self.options.max_wait_ms,
            max_queue=self.options.max_queue, on_batch=lambda n, t, name=m.name: self.metrics.batch(name, n, t),
            on_wait=lambda seconds, name=m.name: self.metrics.waited(name, seconds), passes=m.passes(),
        )  # fmt: skip
        self.metrics.queue_depth[m.name] = self.batchers[m.name].depth
        self.tokenizers[m.name] = ThreadPoolExecutor(1, thread_name_prefix=f"mlx-encoders tokenize {m.name}")
        self.tokenizer_locks[m.name] = threading.Lock()
        self.models[m.name] = m

    def remove(self, name: str) -> Callable[[], None]:
        """Stop serving model `name` (an idle one of --models-dir; new requests load it again). On the event loop;
        the function returned stops its threads, which blocks: run it off the loop."""
        self.models.pop(name)
        self.metrics.queue_depth.pop(name, None)
        tokenizer, batcher = self.tokenizers.pop(name), self.batchers.pop(name)
        self.tokenizer_locks.pop(name)

        def stop() -> None:
            tokenizer.shutdown()
            batcher.stop()

        return stop

    def warm(self) -> None:
        """One input through each model's worker, so the first request pays no start-up cost."""
        for m in self.models.values():
            items = m.tokenize(["warm"], True, ["up"]) if m.cross is not None else m.tokenize(["warm up"], True)
            self.batchers[m.name].submit(items).result()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        for batcher in self.batchers.values():
            batcher.stop()
        for tokenizer in self.tokenizers.values():
            tokenizer.shutdown()

    async def tokenize(self, model: ServedModel, function: Callable, *args, **kwargs):
        """`function(*args, **kwargs)`, a tokenization with `model`'s tokenizer, which serves one call at a time: a
        few short texts (`quick`) on the event loop when the tokenizer is free, anything else on the model's
        tokenizer thread, so that a long one leaves the loop free (/health answers)."""
        call, lock = functools.partial(function, *args, **kwargs), self.tokenizer_locks[model.name]
        if quick(args) and lock.acquire(blocking=False):
            try:
                return call()
            finally:
                lock.release()

        def locked():
            with lock:
                return call()

        return await asyncio.get_running_loop().run_in_executor(self.tokenizers[model.name], locked)

    def model(self, name, capability: str | tuple | None, route: str) -> ServedModel:
        """The model `name` (None: the only one able to serve `route`, counting a --models-dir's models not loaded
        yet that may); 404 naming the served ones, 400 naming its kind when it cannot serve `route` (`capability`,
        or one of a tuple of them; None: any model can)."""
        wanted = capability if isinstance(capability, tuple) else (capability,)
        able = [m for m in self.models.values() if None in wanted or set(wanted) & set(m.capabilities)]
        if name is None:
            unloaded = self.unloaded_able(wanted)  # read from the folder's files: only where no model is named
            if len(able) == 1 and not unloaded:
                return able[0]
            if not able and len(unloaded) == 1:  # the one model that may serve it: loaded, then asked again
                raise NotLoaded(unloaded[0])
            served = ", ".join(m.name for m in able) or "no loaded model"
            raise ApiError(400, f'"model" is required: {route} is served by {served}{self.later(unloaded)}', "model")
        if not isinstance(name, str):
            raise ApiError(400, f'"model" must be a string, got {type(name).__name__}', "model")
        if name not in self.models and self.lazy is not None and self.lazy.path(name) is not None:
            raise NotLoaded(name)
        if name not in self.models:
            more = f"; loaded on request: {', '.join(self.lazy.names()) or 'none'}" if self.lazy is not None else ""
            raise ApiError(
                404, f"model {name!r} is not served; served models: {', '.join(self.models)}{more}", "model",
                "model_not_found",
            )  # fmt: skip
        model = self.models[name]
        if model not in able:
            raise ApiError(
                400,
                f"model {name!r} is a {model.kind} model: it serves {', '.join(model.capabilities)}, not "
                f"{' or '.join(wanted)} ({route}); models that do: {', '.join(m.name for m in able) or 'none'}"
                f"{self.later(self.unloaded_able(wanted))}",
                "model", "model_not_supported",
            )  # fmt: skip
        if self.lazy is not None:
            self.lazy.take(model)
        return model

    @staticmethod
    def later(unloaded: list[str]) -> str:
        return f"; not loaded yet (loaded on request): {', '.join(unloaded)}" if unloaded else ""

    def unloaded_able(self, wanted: tuple) -> list[str]:
        """The --models-dir models not loaded yet whose files say they may serve one of `wanted` (None: any)."""
        if self.lazy is None:
            return []
        unloaded = [n for n in self.lazy.names() if n not in self.models]
        return [n for n in unloaded if None in wanted or set(wanted) & set(self.lazy.capabilities(n))]

    def count(self, inputs: list, param: str) -> list:
        """`inputs`, unless there are more than --max-inputs (413)."""
        if len(inputs) > self.options.max_inputs:
            raise ApiError(
                413, f"{len(inputs)} inputs, more than the server's --max-inputs {self.options.max_inputs}", param
            )
        return inputs

    async def run(self, model: ServedModel, items: list) -> np.ndarray:
        """The model's rows for `items`, computed with other requests' on its worker; 429 when its queue is full,
        500 when a row is not finite."""
        try:
            future = self.batchers[model.name].submit(items)
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), None, "shutting_down") from None
        try:
            out = await unless_client_gone(future)
        except ClientGone:
            raise
        except Exception as e:  # noqa: BLE001  the model failed on this request's inputs: its 500 alone
            log.exception("model %s failed", model.name)
            raise ApiError(500, f"model {model.name!r} failed on this request: {e}", None, "model_error") from None
        self.metrics.ran(model.name, sum(len(item.ids) for item in items))
        bad = np.flatnonzero(~finite_rows(out))
        if len(bad):
            raise ApiError(
                500,
                f"model {model.name!r} gave non-finite values (NaN or infinity) for input {int(bad[0])}"
                f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}; nothing is returned rather than wrong numbers",
                None, "non_finite_output",
            )  # fmt: skip
        return out

    async def rank(
        self, model: ServedModel, query: str, docs: list[str], truncate: bool, raw: bool = False,
        param: str = "documents", **tokenize,
    ) -> tuple[np.ndarray, np.ndarray, list]:  # fmt: skip
        """Every protocol's rerank: (the (query, document) pairs' scores as `CrossEncoder.predict` gives them, or
        the logits with `raw`; the documents' order, best first; the pairs' tokenized items). `tokenize`: more of
        `ServedModel.tokenize`'s options."""
        items = await self.tokenize(model, model.tokenize, [query] * len(docs), truncate, docs, param, **tokenize)
        scores = model.scores(await self.run(model, items), raw)
        return scores, np.argsort(-scores, kind="stable"), items

    def index(self, name) -> ServedIndex:
        """The index `name` (None: the only one served); 404 naming the served ones."""
        if name is None and len(self.indexes) == 1:
            return next(iter(self.indexes.values()))
        if name is None or not isinstance(name, str):
            got = "nothing" if name is None else type(name).__name__
            raise ApiError(
                400, f'"index" must name a served index ({", ".join(self.indexes) or "none"}), got {got}', "index"
            )
        if name not in self.indexes:
            raise ApiError(
                404, f"index {name!r} is not served; served indexes: {', '.join(self.indexes) or 'none'} (--index)",
                "index", "index_not_found",
            )  # fmt: skip
        return self.indexes[name]


def quick(args: tuple) -> bool:
    """Whether a tokenization's arguments hold only a few short texts (each list of them at most QUICK_TEXTS long,
    each text at most QUICK_CHARS), and at least one such list."""
    lists = [a for a in args if isinstance(a, list)]
    return bool(lists) and all(
        len(a) <= QUICK_TEXTS and all(isinstance(t, str) and len(t) <= QUICK_CHARS for t in a) for a in lists
    )


# The request being answered, for `unless_client_gone` (set by each route's `endpoint`).
REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar("mlx_encoders_serve_request", default=None)


async def unless_client_gone(future: Future):
    """The result of a batcher's `future`; `ClientGone` when the client of the request being answered closes its
    connection first, and the future is cancelled: the batcher drops what it has not run yet, so an abandoned
    request does not hold the model (and every later request) for the rest of its inputs. The request's body has
    been read whole by then, so the next message the connection gives is its end."""
    request = REQUEST.get()
    done = asyncio.wrap_future(future)
    if request is None:
        return await done

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not done.done():
        future.cancel()
        raise ClientGone
    return done.result()


def finite_rows(out: np.ndarray) -> np.ndarray:
    """(N,) whether every value of row i is finite: rows of an array, or the arrays in an object array's row."""
    if out.dtype != object:
        return np.isfinite(out).reshape(len(out), -1).all(axis=1)
    parts = [row if isinstance(row, tuple) else (row,) for row in out]
    return np.array([all(np.isfinite(np.asarray(p, np.float64)).all() for p in row) for row in parts], bool)


def error_response(path: str, error: ApiError) -> JSONResponse:
    """`error` in the body shape of the protocol that serves `path` (OpenAI's for a path no protocol serves)."""
    content = error_body(path, ROUTES)(error)
    return JSONResponse(content, error.status, headers=error.headers)


def log_gone(request: Request) -> None:
    """uvicorn's access line for a request whose client left: uvicorn logs a response it sends, and sends none to a
    closed connection."""
    scope, client = request.scope, request.client
    query = f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
    address = f"{client.host}:{client.port}" if client else ""
    access.info('%s - "%s %s HTTP/%s" %d', address, scope["method"], scope["path"] + query, scope["http_version"], 499)


def endpoint(path: str, route: Endpoint, server: Server):
    async def call(request: Request) -> Response:
        taken, current = TAKEN.set([]), REQUEST.set(request)
        try:
            return await respond(await handled(request))
        except ApiError as e:
            return error_response(path, e)
        except ClientGone:  # nothing reaches a closed connection; 499 tells the metrics and the access log why
            log_gone(request)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001  a bug answers its own request with 500; the server stays up
            log.exception("%s failed", path)
            return error_response(path, ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal"))
        finally:
            if server.lazy is not None:
                server.lazy.release(TAKEN.get())
            TAKEN.reset(taken)
            REQUEST.reset(current)

    async def handled(request: Request):
        """The handler's answer; a model of --models-dir it names is loaded first (the body is read once)."""
        while True:
            try:
                return await route.handler(request, server)
            except NotLoaded as e:
                await server.lazy.load(server, e.name)

    return call


def values(x) -> int:
    """About how many values an answer holds (lists counted by their first item): cheap on any size."""
    if isinstance(x, np.ndarray):
        return x.size
    if isinstance(x, list):
        return len(x) * values(x[0]) if x else 1
    if isinstance(x, dict):
        return sum(values(v) for v in x.values())
    return 1


def render(x) -> list[bytes]:
    """`x` (JSON values, numpy arrays among them) as JSON, as JSONResponse writes it, in pieces of about SEND_BYTES:
    one `json.dumps` of a large answer, or one join of its pieces, would hold the interpreter's lock (and so the
    event loop) until it ends, and a join would copy the whole answer once more."""
    out = Pieces()
    write(x, out)
    return out.close()


class Pieces:
    """Bytes gathered into pieces of about SEND_BYTES."""

    def __init__(self):
        self.pieces, self.parts, self.size = [], [], 0
        self.paused = time.monotonic()

    def pause(self) -> None:
        """Lets the event loop's thread take the interpreter's lock, at most every PAUSE_EVERY_S (render runs on a
        thread: without pauses the loop waits a switch interval for each of its steps)."""
        now = time.monotonic()
        if now - self.paused >= PAUSE_EVERY_S:
            time.sleep(0)
            self.paused = time.monotonic()

    def add(self, part: bytes) -> None:
        self.parts.append(part)
        self.size += len(part)
        if self.size >= SEND_BYTES:
            self.pieces.append(b"".join(self.parts))
            self.parts, self.size = [], 0

    def close(self) -> list[bytes]:
        if self.parts:
            self.pieces.append(b"".join(self.parts))
        self.parts = []
        return self.pieces


def write(x, out: Pieces) -> None:
    if isinstance(x, np.ndarray) and x.ndim > 1 and x.size >= OFF_LOOP_VALUES:
        x = list(x)
    if not isinstance(x, (list, dict)) or values(x) < OFF_LOOP_VALUES:
        out.add(small_json(x).encode())
    elif isinstance(x, list):
        out.add(b"[")
        for i, item in enumerate(x):
            if i:
                out.add(b",")
            write(item, out)
            out.pause()
        out.add(b"]")
    else:
        out.add(b"{")
        for i, (k, v) in enumerate(x.items()):
            key = dumps(str(k)).encode()
            out.add(b"," + key + b":" if i else key + b":")
            write(v, out)
            out.pause()
        out.add(b"}")


def small_json(x) -> str:
    """`x` as JSON in one piece: its float32 vectors by `float32_json`, the rest by json.dumps."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim >= 1:
        return float32_json(x) if x.ndim == 1 else "[" + ",".join(small_json(row) for row in x) + "]"
    if isinstance(x, dict) and any(isinstance(v, (dict, list, np.ndarray)) for v in x.values()):
        return "{" + ",".join(dumps(str(k)) + ":" + small_json(v) for k, v in x.items()) + "}"
    if isinstance(x, list) and x and isinstance(x[0], (dict, list, np.ndarray)):
        return "[" + ",".join(small_json(item) for item in x) + "]"
    return dumps(x)


def dumps(x) -> str:
    return json.dumps(x, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=tolist)


@functools.lru_cache(maxsize=16)  # a request's sizes are few; a client's choice of many must not grow memory
def float32_format(size: int) -> str:
    return "[" + ",".join(["%#.9g"] * size) + "]"


def float32_json(x: np.ndarray) -> str:
    """A float32 vector as a JSON array of 9 significant digits, the most a float32 needs to be read back exactly:
    faster to write and read, and about a third fewer bytes, than json.dumps' 17 digits of its float64 value. "#" keeps
    the decimal point, so that every value reads back as a float (a point with no digit after it, at 9 digits
    before it, gets a 0). Non-finite values are refused as json.dumps refuses them."""
    if not np.isfinite(x).all():
        raise ValueError("Out of range float values are not JSON compliant")
    text = float32_format(x.size) % tuple(x.tolist())
    return text.replace(".,", ".0,").replace(".]", ".0]")


def tolist(x):
    """What json.dumps cannot write itself: a numpy array or number (a handler leaves a large conversion to it)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


async def respond(result) -> Response:
    """A handler's result (JSON values and numpy arrays) as a response; a large one is converted and written on a
    thread and sent in pieces, so the event loop stays free."""
    if isinstance(result, Response):
        return result
    if values(result) < OFF_LOOP_VALUES:
        parts = render(result)
    else:
        parts = await asyncio.get_running_loop().run_in_executor(None, render, result)
    if len(parts) <= 1:
        return Response(parts[0] if parts else b"", media_type="application/json")
    headers = {"Content-Length": str(sum(len(part) for part in parts))}
    return StreamingResponse(sent(parts), media_type="application/json", headers=headers)


async def sent(parts: list[bytes]):
    """`parts` in order, each let go once the server has sent it (an answer is never held twice). Between parts
    the event loop runs, so a client gone meanwhile ends the answer rather than every part failing on its socket."""
    parts.reverse()
    while parts:
        yield parts.pop()
        await asyncio.sleep(0)


# the health checks (TEI's three) and the schema with its page (a browser sends no key), as TEI serves them
PUBLIC = {(method, path) for method in ("GET", "HEAD") for path in ("/health", "/ping", "/", "/openapi.json", "/docs")}


class Guard:
    """ASGI middleware: the API key (every route but `PUBLIC`, compared in constant time) and the request metrics."""

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server
        key = server.options.api_key
        self.expected = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        status = [500]
        start = time.perf_counter()
        self.server.metrics.started()

        async def record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            public = (scope["method"], path) in PUBLIC
            if self.expected is not None and not public and not self.authorized(scope):
                error = ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY", None,
                                 "invalid_api_key", {"WWW-Authenticate": "Bearer"})  # fmt: skip
                return await error_response(path, error)(scope, receive, record)
            return await self.app(scope, receive, record)
        finally:
            self.server.metrics.request(route, status[0], time.perf_counter() - start)

    def authorized(self, scope) -> bool:
        """`Authorization: Bearer KEY`, the scheme's name in any case and spaces before the key (RFC 7235)."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), self.expected)


def not_found(request: Request, exc) -> JSONResponse:
    status, path = getattr(exc, "status_code", 404), request.url.path
    if status == 405 and path in ROUTES:
        methods = [m for m in ROUTES[path].methods if m != "HEAD"]
        message = f"{path} takes {' or '.join(methods)}, not {request.method}"
        error = ApiError(405, message, None, "method_not_allowed", {"Allow": ", ".join(methods)})
        return error_response(path, error)
    message = f"no route {request.method} {path}; routes: {', '.join(ROUTES)}"
    return error_response(path, ApiError(status, message, None, "not_found"))


def build(server: Server) -> Starlette:
    """The ASGI app of a built `Server`; its lifespan stops the model workers (after uvicorn has finished every
    request in flight)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        sweep = asyncio.create_task(server.lazy.sweep(server)) if server.lazy is not None else None
        yield
        if sweep is not None:
            sweep.cancel()
        await asyncio.get_running_loop().run_in_executor(None, server.stop)

    routes = [Route(path, endpoint(path, route, server), methods=route.methods) for path, route in ROUTES.items()]
    middleware = []
    if server.options.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(server.options.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))  # fmt: skip
    middleware.append(Middleware(Guard, server=server))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: not_found},
                    lifespan=lifespan)  # fmt: skip
    app.state.server = server
    return app
