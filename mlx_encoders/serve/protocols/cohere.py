"""Cohere's (and Jina's) /v1/rerank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import Request

from ..errors import ApiError
from ..models import RERANK
from ..requests import documents, option, read_json, required_text

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


async def rerank(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), RERANK, "/v1/rerank")
    query = required_text(body, "query")
    docs = server.count(documents(body.get("documents"), "documents"), "documents")
    top_n = option(body, "top_n", int, None, 1)
    keep = option(body, "return_documents", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = await server.tokenize(model, model.tokenize, [query] * len(docs), truncate, docs, "documents")
    scores = model.scores(await server.run(model, items))
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [
        {"index": int(i), "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}} if keep else {})}
        for i in order
    ]
    tokens = sum(len(item.ids) for item in items)
    return {"model": model.name, "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


ROUTES = {"/v1/rerank": (rerank, ["POST"])}


def error(e: ApiError) -> dict:
    return e.openai()
