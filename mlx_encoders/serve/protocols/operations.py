"""Operations: /health and Prometheus' /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from ..errors import ApiError

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


async def health(request: Request, server: Server):
    if not server.ready:
        raise ApiError(503, "the server is starting or stopping", None, "not_ready")
    return {"status": "ok"}


async def metrics(request: Request, server: Server):
    return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


ROUTES = {"/health": (health, ["GET"]), "/metrics": (metrics, ["GET"])}


def error(e: ApiError) -> dict:
    return e.openai()
