"""Operations: /health, Prometheus' /metrics, the OpenAPI schema (/openapi.json) and its page (/docs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse

from ... import __version__
from ..errors import ApiError
from ..schema import DOCS_PAGE, openapi

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


async def health(request: Request, server: Server):
    """Health: 200 once every model is loaded and warm, 503 while starting or stopping."""
    if not server.ready:
        raise ApiError(503, "the server is starting or stopping", None, "not_ready")
    return {"status": "ok"}


async def metrics(request: Request, server: Server):
    """Prometheus metrics: requests, queues, batches and tokens by route and model, and the process's."""
    return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


async def schema(request: Request, server: Server):
    """This document: every route, and the fields of each request body."""
    from ..server import ROUTES  # the server imports every protocol

    return openapi(ROUTES, "mlx-encoders serve", __version__)


async def docs(request: Request, server: Server):
    """The routes and their fields, read from /openapi.json, as a page for the browser."""
    return HTMLResponse(DOCS_PAGE)


ROUTES = {
    "/health": (health, ["GET"]),
    "/metrics": (metrics, ["GET"]),
    "/openapi.json": (schema, ["GET"]),
    "/docs": (docs, ["GET"]),
}


def error(e: ApiError) -> dict:
    return e.openai()
