"""The HTTP application (Starlette): OpenAI's /v1/embeddings and /v1/models, Cohere/Jina's /v1/rerank, /v1/classify,
/v1/search, TEI's /embed, /embed_sparse, /rerank, /predict and /tokenize, /health and /metrics. Each model's
requests go through its `Batcher`; handlers only parse, validate and tokenize (on the event loop's thread: the
tokenizer is not thread-safe) and shape the answer."""

import asyncio
import base64
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..index.search import FUSIONS, RRF_K
from ..sparse import SparseVectors
from .batcher import Batcher, QueueFull
from .errors import ApiError
from .metrics import Metrics
from .models import CLASSIFY, EMBED, MULTI_VECTOR, RERANK, SPARSE, TASKS, ServedModel
from .search import ServedIndex

log = logging.getLogger("mlx_encoders.serve")
TEI_ROUTES = ("/embed", "/embed_sparse", "/rerank", "/predict", "/tokenize")
RETRY_AFTER_S = 1


@dataclass
class Options:
    """Limits and behaviour of a server; the command line's options of the same names."""

    max_batch_tokens: int = 8192
    max_wait_ms: float = 2.0
    max_queue: int = 256
    max_inputs: int = 2048
    max_request_bytes: int = 4 * 2**20
    auto_truncate: bool = False
    batch_size: int = 32
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():  # an unset variable, not a wish to open the server
            raise ValueError("the API key is empty: give a key, or no key at all for a server without authentication")


class Server:
    """The served models, one batcher each, the served indexes, the metrics, and the options."""

    def __init__(self, models: list[ServedModel], options: Options, indexes: list[ServedIndex] = ()):
        names = [m.name for m in models]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"model name {duplicated[0]!r} is given twice; name each model: --model NAME=PATH")
        self.models = {m.name: m for m in models}
        self.options = options
        self.metrics = Metrics()
        self.batchers = {}
        for m in models:
            self.batchers[m.name] = Batcher(
                m.name, m.compute, max_batch_tokens=options.max_batch_tokens, max_wait_ms=options.max_wait_ms,
                max_queue=options.max_queue, on_batch=lambda n, t, name=m.name: self.metrics.batch(name, n, t),
            )  # fmt: skip
            self.metrics.queue_depth[m.name] = self.batchers[m.name].depth
        self.indexes = {i.name: i for i in indexes}
        self.ready = False

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

    def model(self, name, capability: str | tuple | None, route: str) -> ServedModel:
        """The model `name` (None: the only one able to serve `route`); 404 naming the served ones, 400 naming its
        kind when it cannot serve `route` (`capability`, or one of a tuple of them; None: any model can)."""
        wanted = capability if isinstance(capability, tuple) else (capability,)
        able = [m for m in self.models.values() if None in wanted or set(wanted) & set(m.capabilities)]
        if name is None:
            if len(able) == 1:
                return able[0]
            raise ApiError(
                400, f'"model" is required: {route} is served by {", ".join(m.name for m in able) or "no model"}',
                "model",
            )  # fmt: skip
        if not isinstance(name, str):
            raise ApiError(400, f'"model" must be a string, got {type(name).__name__}', "model")
        if name not in self.models:
            raise ApiError(
                404, f"model {name!r} is not served; served models: {', '.join(self.models)}", "model",
                "model_not_found",
            )  # fmt: skip
        model = self.models[name]
        if model not in able:
            raise ApiError(
                400,
                f"model {name!r} is a {model.kind} model: it serves {', '.join(model.capabilities)}, not "
                f"{' or '.join(wanted)} ({route}); models that do: {', '.join(m.name for m in able) or 'none'}",
                "model", "model_not_supported",
            )  # fmt: skip
        return model

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
            out = await asyncio.wrap_future(future)
        except Exception as e:  # noqa: BLE001  the model failed on this request's inputs: its 500 alone
            log.exception("model %s failed", model.name)
            raise ApiError(500, f"model {model.name!r} failed on this request: {e}", None, "model_error") from None
        bad = np.flatnonzero(~finite_rows(out))
        if len(bad):
            raise ApiError(
                500,
                f"model {model.name!r} gave non-finite values (NaN or infinity) for input {int(bad[0])}"
                f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}; nothing is returned rather than wrong numbers",
                None, "non_finite_output",
            )  # fmt: skip
        return out

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


def finite_rows(out: np.ndarray) -> np.ndarray:
    """(N,) whether every value of row i is finite: rows of an array, or the arrays in an object array's row."""
    if out.dtype != object:
        return np.isfinite(out).reshape(len(out), -1).all(axis=1)
    parts = [row if isinstance(row, tuple) else (row,) for row in out]
    return np.array([all(np.isfinite(np.asarray(p, np.float64)).all() for p in row) for row in parts], bool)


# ---- request parsing


async def read_json(request: Request, server: Server) -> dict:
    limit = server.options.max_request_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes, more than the server's --max-request-bytes {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body declares no length: count it as it comes
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body of more than the server's --max-request-bytes {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:  # ValueError: also integers longer than Python converts
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def texts_or_ids(value, param: str = "input") -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    expected = "a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ApiError(400, f'"{param}" must be {expected}, got {type(value).__name__}', param)
    if not value:
        raise ApiError(400, f'"{param}" is empty; send at least one input', param, "empty_input")
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise ApiError(400, f"{param}[{empty}] is an empty string", param, "empty_input")
        return value, None
    if all(is_int(v) for v in value):
        return None, [value]
    if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
        return None, value
    raise ApiError(400, f'"{param}" must be {expected} (non-empty, not mixed)', param)


def texts(value, param: str) -> list[str]:
    found, ids = texts_or_ids(value, param)
    if found is None:
        raise ApiError(400, f'"{param}" must be a string or a list of strings', param)
    return found


def option(body: dict, key: str, kind: type, default=None, minimum: int | None = None):
    value = body.get(key, default)
    if value is None:
        return default
    if kind is int and not is_int(value) or kind is not int and not isinstance(value, kind):
        raise ApiError(400, f'"{key}" must be {kind.__name__}, got {type(value).__name__}: {value!r:.40}', key)
    if minimum is not None and value < minimum:
        raise ApiError(400, f'"{key}" must be at least {minimum}, got {value}', key)
    return value


def number(body: dict, key: str, default: float, minimum: float, maximum: float | None = None) -> float:
    """A JSON number (int or float) within [minimum, maximum]."""
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f'"{key}" must be a number, got {type(value).__name__}: {value!r:.40}', key)
    if not math.isfinite(value) or value < minimum or maximum is not None and value > maximum:
        within = f"within [{minimum}, {maximum}]" if maximum is not None else f"at least {minimum}"
        raise ApiError(400, f'"{key}" must be {within}, got {value}', key)
    return value


def documents(value, param: str) -> list[str]:
    """Cohere's / Jina's documents: strings or {"text": ...} objects."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, f'"{param}" must be a non-empty list of strings or {{"text": ...}} objects', param)
    out = []
    for i, d in enumerate(value):
        d = d.get("text") if isinstance(d, dict) else d
        if not isinstance(d, str):
            raise ApiError(400, f'{param}[{i}] must be a string or an object with a string "text"', param)
        out.append(d)
    return out


# ---- routes


async def embeddings(request: Request, server: Server):
    """OpenAI's embeddings; for a multi-vector model each `embedding` is a list of token vectors (floats only)."""
    body = await read_json(request, server)
    model = server.model(body.get("model"), (EMBED, MULTI_VECTOR), "/v1/embeddings")
    found, ids = texts_or_ids(body.get("input"))
    server.count(found or ids, "input")
    fmt = option(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, f'"encoding_format" must be "float" or "base64", got {fmt!r}', "encoding_format")
    task = option(body, "input_type", str)
    if task is not None and task not in TASKS:
        raise ApiError(400, f'"input_type" must be "query" or "document", got {task!r}', "input_type")
    if model.multi is not None:
        multi_vector_request(model, body, fmt, ids)
    dimensions = dimensions_of(body, model) if model.multi is None else None
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    if ids is not None and task is not None:
        raise ApiError(400, '"input_type" applies to texts (its prompt); token ids are the whole input', "input_type")
    items = model.tokenize(found, truncate, task=task) if ids is None else model.token_ids(ids, truncate)
    out = await server.run(model, items)
    vectors = out if model.multi is not None else model.embeddings(out, dimensions)
    tokens = sum(len(item.ids) for item in items)

    def encoded(v: np.ndarray):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def multi_vector_request(model: ServedModel, body: dict, fmt: str, ids) -> None:
    """What a multi-vector model refuses: base64 (a client would read the flat floats as one vector), dimensions
    and token ids (its prompts and query expansion work on texts)."""
    where = f"model {model.name!r} is a multi-vector model"
    if fmt != "float":
        raise ApiError(
            400, f'{where}: each embedding is a list of token vectors, sent as floats only; send "encoding_format": '
            '"float" (the openai SDK asks for base64 unless told)', "encoding_format",
        )  # fmt: skip
    if body.get("dimensions") is not None:
        raise ApiError(400, f'{where}: "dimensions" does not apply to its token vectors', "dimensions")
    if ids is not None:
        raise ApiError(400, f"{where}: send texts, not token ids", "input")


def dimensions_of(body: dict, model: ServedModel) -> int | None:
    dimensions = option(body, "dimensions", int, None, 1)
    if dimensions is not None and dimensions > model.dimension:
        raise ApiError(
            400, f'"dimensions" is {dimensions}, more than the {model.dimension} of model {model.name!r}', "dimensions"
        )
    return dimensions


async def rerank(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), RERANK, "/v1/rerank")
    query = option(body, "query", str)
    if query is None:
        raise ApiError(400, '"query" is required: a string', "query")
    docs = server.count(documents(body.get("documents"), "documents"), "documents")
    top_n = option(body, "top_n", int, None, 1)
    keep = option(body, "return_documents", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = model.tokenize([query] * len(docs), truncate, docs, "documents")
    scores = model.scores(await server.run(model, items))
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [
        {"index": int(i), "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}} if keep else {})}
        for i in order
    ]
    tokens = sum(len(item.ids) for item in items)
    return {"model": model.name, "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def classify(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), CLASSIFY, "/v1/classify")
    found = server.count(texts(body.get("input"), "input"), "input")
    top_k = option(body, "top_k", int, None, 1)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = model.tokenize(found, truncate)
    labels = model.labels(await server.run(model, items), top_k)
    tokens = sum(len(item.ids) for item in items)
    return {
        "object": "list",
        "model": model.name,
        "data": [{"index": i, "label": ranked[0]["label"], "labels": ranked} for i, ranked in enumerate(labels)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def models(request: Request, server: Server):
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "mlx-encoders"} for name in server.models]
    return {"object": "list", "data": data}


async def tei_embed(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), EMBED, "/embed")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    normalize = option(body, "normalize", bool, True)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    dimensions = dimensions_of(body, model)
    items = model.tokenize(found, truncate, param="inputs")
    return model.embeddings(await server.run(model, items), dimensions, normalize).tolist()


async def tei_embed_sparse(request: Request, server: Server):
    """TEI's /embed_sparse: per input its non-zero weights as [{"index": token id, "value": weight}], by id.
    `prompt_name` (TEI's) prepends that prompt; `input_type` "query" / "document" encodes as `encode_query` /
    `encode_document` (their prompt, and an inference-free Router's query or document route)."""
    body = await read_json(request, server)
    model = server.model(body.get("model"), SPARSE, "/embed_sparse")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    task, prompt_name = option(body, "input_type", str), option(body, "prompt_name", str)
    if task is not None and task not in TASKS:
        raise ApiError(400, f'"input_type" must be "query" or "document", got {task!r}', "input_type")
    items = model.tokenize(found, truncate, param="inputs", task=task, prompt_name=prompt_name)
    rows = await server.run(model, items)
    return [[{"index": int(i), "value": float(v)} for i, v in zip(*row, strict=True)] for row in rows]


async def search(request: Request, server: Server):
    """A served index's `top_k` best documents for `query`, as `Index.search` gives them (id, score, text), in the
    request's `mode` ("dense", "sparse" or "hybrid"; default: as `Index.search` picks) with its `fusion`, `rrf_k`,
    `alpha` and `depth`. Each embedding the mode needs runs on its model's worker."""
    body = await read_json(request, server)
    served = server.index(body.get("index"))
    query = option(body, "query", str)
    if not query:
        raise ApiError(400, '"query" is required: a non-empty string', "query")
    top_k = option(body, "top_k", int, 10, 1)
    precision = option(body, "precision", str, "float32")
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    mode = option(body, "mode", str)
    if mode is not None and mode not in served.modes:
        raise ApiError(
            400, f"index {served.name!r} cannot answer a {mode!r} search; its modes: {', '.join(served.modes)}", "mode"
        )
    fusion = option(body, "fusion", str, "rrf")
    if fusion not in FUSIONS:
        raise ApiError(400, f'"fusion" must be one of {", ".join(FUSIONS)}, got {fusion!r}', "fusion")
    rrf_k, alpha = number(body, "rrf_k", RRF_K, 0), number(body, "alpha", 0.5, 0, 1)
    depth = option(body, "depth", int, 100, 1)
    loop = asyncio.get_running_loop()
    try:  # opening an index at a new precision reads its vectors: off the event loop, as the search itself
        index = await loop.run_in_executor(None, served.index, precision)
    except ValueError as e:
        raise ApiError(400, f"index {served.name!r}: {e}", "precision") from None
    try:  # the mode Index.search takes (None: the index's default), and its checks of the other options
        mode = index.check_mode(mode, top_k, fusion, rrf_k, alpha, depth)
    except ValueError as e:
        raise ApiError(400, f"index {served.name!r}: {e}", "mode") from None
    used = [m for m, ok in ((served.model, mode != "sparse"), (served.sparse, mode != "dense")) if ok]
    items = [m.tokenize([query], truncate, param="query", task="query") for m in used]
    out = await asyncio.gather(*(server.run(m, i) for m, i in zip(used, items, strict=True)))
    vector = served.model.embeddings(out[0], None, normalize=True)[0] if mode != "sparse" else None
    sparse = None
    if mode != "dense":
        ids, weights = out[-1][0]
        width = served.sparse.sparse.get_embedding_dimension()
        sparse = SparseVectors(np.zeros(len(ids), np.int64), np.asarray(ids, np.int64), weights, (width,))
    options = {"mode": mode, "fusion": fusion, "rrf_k": rrf_k, "alpha": alpha, "depth": depth}
    try:  # an index rebuilt since it was opened is opened again; a rebuild with other models cannot be
        search = functools.partial(served.search, precision, (vector, sparse), top_k, **options)
        hits = await loop.run_in_executor(None, search)
    except ValueError as e:
        raise ApiError(503, f"index {served.name!r}: {e}", None, "index_changed") from None
    tokens = sum(len(item.ids) for i in items for item in i)
    return {
        "object": "list",
        "index": served.name,
        "mode": mode,
        "model": used[0].name,
        **({"sparse_model": used[1].name} if len(used) == 2 else {}),
        "hits": [{"id": h.id, "score": h.score, "text": h.text} for h in hits],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def tei_rerank(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), RERANK, "/rerank")
    query = option(body, "query", str)
    if query is None:
        raise ApiError(400, '"query" is required: a string', "query")
    docs = server.count(documents(body.get("texts"), "texts"), "texts")
    raw = option(body, "raw_scores", bool, False)
    keep = option(body, "return_text", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = model.tokenize([query] * len(docs), truncate, docs, "texts")
    scores = model.scores(await server.run(model, items), raw)
    order = np.argsort(-scores, kind="stable")
    return [{"index": int(i), "score": float(scores[i]), **({"text": docs[i]} if keep else {})} for i in order]


async def tei_predict(request: Request, server: Server):
    """TEI's /predict: `inputs` a string (one answer) or a list of strings or [text, text_pair] lists."""
    body = await read_json(request, server)
    model = server.model(body.get("model"), CLASSIFY, "/predict")
    value = body.get("inputs")
    single = isinstance(value, str)
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        raise ApiError(400, '"inputs" must be a string or a non-empty list of strings or [text, pair] lists', "inputs")
    server.count(items, "inputs")
    pairs = [isinstance(x, list) and len(x) == 2 and all(isinstance(t, str) for t in x) for x in items]
    if not all(pairs) and not all(isinstance(x, str) for x in items):
        raise ApiError(400, '"inputs" must be all strings or all [text, text_pair] lists', "inputs")
    raw = option(body, "raw_scores", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    if all(pairs):
        encoded = model.tokenize([x[0] for x in items], truncate, [x[1] for x in items], "inputs")
    else:
        encoded = model.tokenize(items, truncate, param="inputs")
    labels = model.labels(await server.run(model, encoded), None, raw)
    return labels[0] if single else labels


async def tei_tokenize(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), None, "/tokenize")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    special = option(body, "add_special_tokens", bool, True)
    try:
        encodings = model.tokenizer.encode_batch(found, truncation=False, add_special_tokens=special)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), "inputs") from None
    out = []
    for text, e in zip(found, encodings, strict=True):
        out.append([
            {"id": i, "text": tok if s else text[a:b], "special": bool(s), "start": None if s else a,
             "stop": None if s else b}
            for i, tok, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)
        ])  # fmt: skip
    return out


async def health(request: Request, server: Server):
    if not server.ready:
        raise ApiError(503, "the server is starting or stopping", None, "not_ready")
    return {"status": "ok"}


async def metrics(request: Request, server: Server):
    return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


ROUTES = {
    "/v1/embeddings": (embeddings, ["POST"]), "/v1/rerank": (rerank, ["POST"]), "/v1/classify": (classify, ["POST"]),
    "/v1/models": (models, ["GET"]), "/v1/search": (search, ["POST"]), "/embed": (tei_embed, ["POST"]),
    "/embed_sparse": (tei_embed_sparse, ["POST"]), "/rerank": (tei_rerank, ["POST"]),
    "/predict": (tei_predict, ["POST"]), "/tokenize": (tei_tokenize, ["POST"]), "/health": (health, ["GET"]),
    "/metrics": (metrics, ["GET"]),
}  # fmt: skip


def error_response(path: str, error: ApiError) -> JSONResponse:
    content = error.tei() if path in TEI_ROUTES else error.openai()
    return JSONResponse(content, error.status, headers=error.headers)


def endpoint(path: str, handler: Callable[[Request, Server], Awaitable], server: Server):
    async def call(request: Request) -> Response:
        try:
            result = await handler(request, server)
        except ApiError as e:
            return error_response(path, e)
        except Exception as e:  # noqa: BLE001  a bug answers its own request with 500; the server stays up
            log.exception("%s failed", path)
            return error_response(path, ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal"))
        return result if isinstance(result, Response) else JSONResponse(result)

    return call


class Guard:
    """ASGI middleware: the API key (every route but /health, compared in constant time) and the request metrics."""

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server
        key = server.options.api_key
        self.expected = f"Bearer {key}".encode() if key else None

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
            if self.expected is not None and path != "/health" and not self.authorized(scope):
                error = ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY", None,
                                 "invalid_api_key", {"WWW-Authenticate": "Bearer"})  # fmt: skip
                return await error_response(path, error)(scope, receive, record)
            return await self.app(scope, receive, record)
        finally:
            self.server.metrics.request(route, status[0], time.perf_counter() - start)

    def authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


def not_found(request: Request, exc) -> JSONResponse:
    status = getattr(exc, "status_code", 404)
    message = f"no route {request.method} {request.url.path}; routes: {', '.join(ROUTES)}"
    return error_response(request.url.path, ApiError(status, message, None, "not_found"))


def build(server: Server) -> Starlette:
    """The ASGI app of a built `Server`; its lifespan stops the model workers (after uvicorn has finished every
    request in flight)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.stop)

    routes = [
        Route(path, endpoint(path, handler, server), methods=methods) for path, (handler, methods) in ROUTES.items()
    ]
    middleware = []
    if server.options.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(server.options.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))  # fmt: skip
    middleware.append(Middleware(Guard, server=server))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: not_found},
                    lifespan=lifespan)  # fmt: skip
    app.state.server = server
    return app
