"""Infinity's (infinity-emb) unprefixed routes: /classify and /models in Infinity's shapes, and its /rerank body,
which tei.py's /rerank hands here (TEI sends "texts", Infinity "documents"); its /embeddings is openai.py's alias.
`raw_scores` gives the logits. Errors in OpenAI's shape, as Infinity's."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from starlette.requests import Request

from ..errors import ApiError
from ..models import CLASSIFY, EMBED, MULTI_VECTOR, RERANK, SPARSE
from ..requests import documents, option, read_json, required_text, texts

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server

CAPABILITIES = {EMBED: "embed", MULTI_VECTOR: "embed", SPARSE: "embed", RERANK: "rerank", CLASSIFY: "classify"}


def usage(items: list) -> dict:
    tokens = sum(len(item.ids) for item in items)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def stamp() -> dict:
    return {"id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


async def rerank(request: Request, server: Server):
    """Infinity's rerank: `query`, `documents` (strings), `top_n`, `return_documents`, `raw_scores` -> `results`
    best first, each `relevance_score` (`CrossEncoder.predict`'s, or the logit), `index` and `document`."""
    body = await read_json(request, server)
    model = server.model(body.get("model"), RERANK, "/rerank")
    query = required_text(body, "query")
    docs = server.count(documents(body.get("documents"), "documents"), "documents")
    top_n = option(body, "top_n", int, None, 1)
    keep = option(body, "return_documents", bool, False)
    raw = option(body, "raw_scores", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    scores, order, items = await server.rank(model, query, docs, truncate, raw)
    results = [{"relevance_score": float(scores[i]), "index": int(i), "document": docs[i] if keep else None}
               for i in order[:top_n]]  # fmt: skip
    return {"object": "rerank", "results": results, "model": model.name, "usage": usage(items), **stamp()}


async def classify(request: Request, server: Server):
    """Infinity's classify: `input` (strings), `raw_scores` -> per input its labels best first."""
    body = await read_json(request, server)
    model = server.model(body.get("model"), CLASSIFY, "/classify")
    found = server.count(texts(body.get("input"), "input"), "input")
    raw = option(body, "raw_scores", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = await server.tokenize(model, model.tokenize, found, truncate)
    labels = model.labels(await server.run(model, items), None, raw)
    data = [[{"score": x["score"], "label": x["label"]} for x in ranked] for ranked in labels]
    return {"object": "classify", "data": data, "model": model.name, "usage": usage(items), **stamp()}


async def models(request: Request, server: Server):
    data = [
        {"id": m.name, "object": "model", "owned_by": "mlx-encoders", "created": 0, "backend": "mlx",
         "capabilities": sorted({CAPABILITIES[c] for c in m.capabilities})}
        for m in server.models.values()
    ]  # fmt: skip
    return {"object": "list", "data": data}


ROUTES = {
    "/classify": (classify, ["POST"]),
    "/models": (models, ["GET"]),
}


def error(e: ApiError) -> dict:
    return e.openai()
