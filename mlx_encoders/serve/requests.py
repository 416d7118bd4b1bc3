"""What every protocol's routes share: the body read within the server's limits, and the checks of its fields, each
refusal an `ApiError` naming the field."""

import asyncio
import json
import math
import sys

from starlette.requests import Request

from .errors import ApiError
from .models import ServedModel, too_long_advice

OFF_LOOP_BYTES = 64 * 1024


class ClientGone(Exception):
    """The client closed its connection before its request arrived whole: there is no one to answer."""


async def read_json(request: Request, server) -> dict:
    """The body as a JSON object: at most --max-request-bytes (413), whole within --read-timeout of the handler's
    start (408, and the connection closes); `ClientGone` when the client leaves first. Read once: a second call
    (from a route that chose its handler by the body) gets the same object."""
    if hasattr(request.state, "json"):
        return request.state.json
    limit, timeout = server.options.max_request_bytes, server.options.read_timeout
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes, more than the server's --max-request-bytes {limit}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks, size, more = [], 0, True
    while more:  # a chunked body declares no length: count it as it comes
        try:
            message = await asyncio.wait_for(request.receive(), max(deadline - loop.time(), 0))
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within the server's --read-timeout of {timeout:g} s", None,
                "read_timeout", {"Connection": "close"},
            ) from None  # fmt: skip
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body of more than the server's --max-request-bytes {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:  # a large body is parsed on a thread: the event loop stays free
        data = json.loads(body) if size < OFF_LOOP_BYTES else await loop.run_in_executor(None, json.loads, body)
    except (ValueError, UnicodeDecodeError) as e:
        if "int_max_str_digits" in str(e):  # Python's own advice would mean nothing to a client
            digits = sys.get_int_max_str_digits()
            raise ApiError(400, f"the request body holds an integer of more than {digits} digits") from None
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    request.state.json = data
    return data


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def text(value: str, where: str, param: str) -> str:
    """One text of a request (an input, a pair's half, a query, a document): every route refuses "" alike."""
    if not value:
        raise ApiError(400, f"{where} is an empty string", param, "empty_input")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # named here: the tokenizer sees a batch's texts without their names
        raise ApiError(
            400, f"{where} is not valid Unicode: it holds a lone surrogate {value[e.start]!r} at character {e.start} "
            "(a JSON \\ud800-style escape of half a UTF-16 pair); send the whole pair or replace it", param,
        ) from None  # fmt: skip
    return value


def required_text(body: dict, key: str) -> str:
    """The request's `key`, a non-empty string."""
    value = option(body, key, str)
    if value is None:
        raise ApiError(400, f'"{key}" is required: a non-empty string', key)
    return text(value, f'"{key}"', key)


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
        return [text(v, f"{param}[{i}]", param) for i, v in enumerate(value)], None
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


def too_long_hint(body: dict, inside: str | None = None) -> str:
    """How an over-long input of this request could be cut: its own "truncate" where it sent false (the server's
    --auto-truncate cannot override it), else either; `inside`: the object of the request that holds "truncate"."""
    send = f'"{inside}": {{"truncate": true}}' if inside else '"truncate": true'
    return f"shorten it, or send {send}" if body.get("truncate") is not None else too_long_advice(send)


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
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past a float's range
        finite = False
    if not finite or value < minimum or maximum is not None and value > maximum:
        within = f"within [{minimum}, {maximum}]" if maximum is not None else f"at least {minimum}"
        within = within if finite else f"a finite number {within}"
        raise ApiError(400, f'"{key}" must be {within}, got {value!r:.40}', key)
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
        out.append(text(d, f"{param}[{i}]", param))
    return out


def dimensions_of(body: dict, model: ServedModel, zero_is_all: bool = False) -> int | None:
    """The request's "dimensions" (None: all; with `zero_is_all`, 0 too, as Infinity's client sends by default)."""
    dimensions = option(body, "dimensions", int, None, 0 if zero_is_all else 1)
    if dimensions == 0:
        return None
    if dimensions is not None and dimensions > model.dimension:
        raise ApiError(
            400, f'"dimensions" is {dimensions}, more than the {model.dimension} of model {model.name!r}', "dimensions"
        )
    return dimensions
