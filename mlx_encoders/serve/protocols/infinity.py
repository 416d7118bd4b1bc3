"""Infinity's (infinity-emb) unprefixed routes: /classify and /models in Infinity's shapes, and its /rerank body,
which tei.py's /rerank hands here (TEI sends "texts", Infinity "documents"); its /embeddings is openai.py's alias.
`raw_scores` gives the logits. Errors in OpenAI's shape, as Infinity's."""

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Required, TypedDict

from starlette.requests import Request

from ..errors import ApiError
from ..models import CLASSIFY, EMBED, MULTI_VECTOR, RERANK, SPARSE
from ..requests import documents, option, read_json, required_text, texts, too_long_hint
from ..schema import ModelName, Truncate, accepts, fields

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server

CAPABILITIES = {EMBED: "embed", MULTI_VECTOR: "embed", SPARSE: "embed", RERANK: "rerank", CLASSIFY: "classify"}


def usage(items: list) -> dict:
    tokens = sum(len(item.ids) for item in items)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def stamp() -> dict:
    return {"id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


async def rerank(request: Request, server: "Server"):
    """Infinity's rerank: `query`, `documents` (strings), `top_n`, `return_documents`, `raw_scores` -> `results`
    best first, each `relevance_score` (`CrossEncoder.predict`'s, or the logit), `index` and `document`."""
    body = fields(await read_json(request, server), RerankRequest)
    model = server.model(body.get("model"), RERANK, "/rerank")
    query = required_text(body, "query")
    docs = server.count(documents(body.get("documents"), "documents"), "documents")
    top_n = option(body, "top_n", int, None, 1)
    keep = option(body, "return_documents", bool, False)
    raw = option(body, "raw_scores", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    scores, order, items = await server.rank(model, query, docs, truncate, raw, hint=too_long_hint(body))
    results = [{"relevance_score": float(scores[i]), "index": int(i), "document": docs[i] if keep else None}
               for i in order[:top_n]]  # fmt: skip
    return {"object": "rerank", "results": results, "model": model.name, "usage": usage(items), **stamp()}


class RerankRequest(TypedDict, total=False):
    query: Required[str]
    documents: Required[Annotated[list[str], "the documents (Infinity's body on TEI's /rerank: no \"texts\")"]]
    model: ModelName
    top_n: Annotated[int | None, "the best documents only"]
    return_documents: Annotated[bool, "each document's text with its score (default false)"]
    raw_scores: Annotated[bool, "the logits, not the scores (default false)"]
    truncate: Truncate


class ClassifyRequest(TypedDict, total=False):
    input: Required[Annotated[str | list[str], "a text or texts"]]
    model: ModelName
    raw_scores: Annotated[bool, "the logits, not the scores (default false)"]
    truncate: Truncate


@accepts(ClassifyRequest)
async def classify(request: Request, server: "Server"):
    """Infinity's classify: `input` (strings), `raw_scores` -> per input its labels best first."""
    body = fields(await read_json(request, server), ClassifyRequest)
    model = server.model(body.get("model"), CLASSIFY, "/classify")
    found = server.count(texts(body.get("input"), "input"), "input")
    raw = option(body, "raw_scores", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = await server.tokenize(model, model.tokenize, found, truncate, hint=too_long_hint(body))
    labels = model.labels(await server.run(model, items), None, raw)
    data = [[{"score": x["score"], "label": x["label"]} for x in ranked] for ranked in labels]
    return {"object": "classify", "data": data, "model": model.name, "usage": usage(items), **stamp()}


async def models(request: Request, server: "Server"):
    data = [
        {"id": m.name, "object": "model", "owned_by": "infinity", "created": 0, "backend": "mlx", "stats": {},
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
