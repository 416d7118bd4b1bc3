"""One module per protocol: its routes (`ROUTES`: path -> (handler, methods), or (handler, methods, error) for a
route whose error body is not the module's) and its error body (`error`). A handler takes (request, server) and
returns a JSON-able value or a Response; it refuses with `ApiError`."""

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import ApiError
from . import cohere, infinity, ollama, openai, operations, search, tei

PROTOCOLS = (openai, cohere, tei, ollama, infinity, search, operations)


class Endpoint(NamedTuple):
    handler: Callable[..., Awaitable]
    methods: list[str]
    error: Callable[[ApiError], dict]


def error_body(path: str, table: dict[str, Endpoint]) -> Callable[[ApiError], dict]:
    """The error body of `path`'s protocol: its route's, else by prefix for a path no route serves (Ollama's under
    /api/, Cohere's under /v2/), else OpenAI's."""
    if path in table:
        return table[path].error
    if path.startswith("/api/"):
        return ollama.error
    return cohere.error if path.startswith("/v2/") else openai.error


def routes() -> dict[str, Endpoint]:
    """Every protocol's routes; a path claimed twice is a bug named at start-up."""
    table: dict[str, Endpoint] = {}
    for protocol in PROTOCOLS:
        for path, (handler, methods, *error) in protocol.ROUTES.items():
            if path in table:
                raise RuntimeError(f"route {path} is declared by two protocols (one is {protocol.__name__})")
            table[path] = Endpoint(handler, methods, error[0] if error else protocol.error)
    return table
