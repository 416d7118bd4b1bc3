"""Cohere's API (v1 and v2: the `cohere` SDK's `Client` and `ClientV2`): /v1/embed, /v2/embed, /v1/rerank (also
Jina's) and /v2/rerank, in the request and response types of the SDK, errors as Cohere's `{"id", "message"}`."""

import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal, Required, TypedDict

import numpy as np
from starlette.requests import Request

from ..embedding_types import TYPES, base64_of, typed
from ..errors import ApiError
from ..models import EMBED, RERANK, ServedModel
from ..requests import documents, option, read_json, required_text, texts, too_long_hint
from ..schema import OutputType, Truncate, accepts, fields

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server

# Cohere's input_type -> the task encode runs: encode_query, encode_document, or encode (with the model's prompt of
# that name, when it has one: nomic's "classification: ", EmbeddingGemma's "Clustering", jina's adapter)
INPUT_TYPES = {"search_query": "query", "search_document": "document", "classification": None, "clustering": None}
TRUNCATE = {"END": "right", "START": "left", "NONE": None}
MAX_TOKENS_PER_DOC = 4096  # v2 rerank's default


InputType = Literal["search_query", "search_document", "classification", "clustering"]
Documents = Annotated[list[str | dict[str, str]], 'the documents: strings or {"text": ...} objects']
Priority = Annotated[int, "Cohere's scheduling hint (it changes nothing here)"]
Unserved = Annotated[Any, "not served: refused with a 400 saying why"]
TopN = Annotated[int | None, "the best documents only"]
ReturnDocuments = Annotated[bool, "each document's text with its score (default false)"]


class EmbedRequest(TypedDict, total=False):
    texts: Required[Annotated[list[str], "the texts"]]
    model: Annotated[str, "the served model (required on v2)"]
    input_type: Annotated[
        InputType, "search_query / search_document embed as encode_query / encode_document (required on v2)"
    ]
    embedding_types: Annotated[list[Literal[OutputType, "base64"]], "the types to answer, as encode(precision=...)"]
    truncate: Annotated[Literal["END", "START", "NONE"], "cut an over-long text at its end (default), start, or not"]
    max_tokens: Annotated[int | None, "v2: the tokens a text keeps"]
    output_dimension: Annotated[int | None, "v2: keep the first dimensions (Matryoshka models)"]
    priority: Priority
    images: Unserved
    inputs: Unserved


class RerankV1Request(TypedDict, total=False):
    query: Required[str]
    documents: Required[Documents]
    model: Annotated[str, "the served reranker"]
    top_n: TopN
    return_documents: ReturnDocuments
    rank_fields: Annotated[list[Literal["text"]], '["text"] only']
    truncate: Truncate
    max_chunks_per_doc: Unserved


class RerankV2Request(TypedDict, total=False):
    query: Required[str]
    documents: Required[Documents]
    model: Required[Annotated[str, "the served reranker"]]
    top_n: TopN
    return_documents: ReturnDocuments
    max_tokens_per_doc: Annotated[int, "each document cut to this many tokens first (default 4096)"]
    priority: Priority
    relevant_spans: Unserved


def refuse(body: dict, fields: tuple[str, ...], why: str) -> None:
    """400 when the request sets one of `fields`, which this server does not do."""
    for field in fields:
        if body.get(field) not in (None, False, []):
            raise ApiError(400, f'"{field}" is not served: {why}', field)


def meta(version: str, **billed) -> dict:
    return {"api_version": {"version": version}, "billed_units": billed}


async def embed(request: Request, server: "Server", version: str):
    """Cohere's embed: `texts` with `input_type`, `embedding_types`, `truncate` (END, START or NONE; END by
    default, as Cohere), and on v2 `max_tokens` and `output_dimension`."""
    body = fields(await read_json(request, server), EmbedRequest)
    path = f"/{version}/embed"
    refuse(body, ("images", "inputs"), 'this server embeds texts only; send them as "texts"')
    if version == "v2" and body.get("model") is None:
        raise ApiError(400, '"model" is required', "model")
    model = server.model(body.get("model"), EMBED, path)
    found = server.count(texts(body.get("texts"), "texts"), "texts")
    input_type = option(body, "input_type", str)
    if input_type is None and version == "v2":
        raise ApiError(400, f'"input_type" is required: one of {", ".join(INPUT_TYPES)}', "input_type")
    if input_type is not None and input_type not in INPUT_TYPES:
        raise ApiError(400, f'"input_type" must be one of {", ".join(INPUT_TYPES)}, got {input_type!r}', "input_type")
    types = embedding_types(body) or (["float"] if version == "v2" else None)  # v2's default: floats, by type
    truncate = option(body, "truncate", str, "END").upper()
    if truncate not in TRUNCATE:
        raise ApiError(400, f'"truncate" must be one of {", ".join(TRUNCATE)}, got {truncate!r}', "truncate")
    if version == "v1":
        refuse(body, ("max_tokens", "output_dimension"), "they are Cohere v2 fields; post to /v2/embed")
    max_tokens = option(body, "max_tokens", int, None, 1)
    dimensions = output_dimension(body, model)
    items = await server.tokenize(
        model, model.tokenize, found, TRUNCATE[truncate] is not None, param="texts",
        task=INPUT_TYPES.get(input_type), max_length=max_tokens, direction=TRUNCATE[truncate] or "right",
        prompt_name=model.prompt_called(input_type) if input_type in ("classification", "clustering") else None,
        limit_field="max_tokens", hint='shorten it, or send "truncate": "END" or "START"',
    )  # fmt: skip
    vectors = model.embeddings(await server.run(model, items), dimensions)
    tokens = sum(len(item.ids) for item in items)
    answer = {"id": str(uuid.uuid4()), "texts": found, "meta": meta(version[1:], input_tokens=tokens)}
    if types is None:  # v1 without embedding_types: the floats alone
        return {"response_type": "embeddings_floats", **answer, "embeddings": vectors}
    by_type = {}
    for kind in types:
        if kind == "base64":
            by_type[kind] = [base64_of(v) for v in vectors.astype(np.float32)]
        else:
            by_type[kind] = typed(vectors, kind, "embedding_types")
    return {"response_type": "embeddings_by_type", **answer, "embeddings": by_type}


def embedding_types(body: dict) -> list[str] | None:
    """The types asked for, in order and once each; None when the request names none."""
    value = body.get("embedding_types")
    if value is None:
        return None
    known = (*TYPES, "base64")
    if not isinstance(value, list) or not value or any(t not in known for t in value):
        raise ApiError(
            400, f'"embedding_types" must be a non-empty list of {", ".join(known)}, got {value!r:.80}',
            "embedding_types",
        )  # fmt: skip
    return list(dict.fromkeys(value))


def output_dimension(body: dict, model: ServedModel) -> int | None:
    dimensions = option(body, "output_dimension", int, None, 1)
    if dimensions is not None and dimensions > model.dimension:
        raise ApiError(
            400, f'"output_dimension" is {dimensions}, more than the {model.dimension} of model {model.name!r}',
            "output_dimension",
        )  # fmt: skip
    return dimensions


@accepts(EmbedRequest)
async def embed_v1(request: Request, server: "Server"):
    """Cohere v1's embed."""
    return await embed(request, server, "v1")


@accepts(EmbedRequest)
async def embed_v2(request: Request, server: "Server"):
    """Cohere v2's embed."""
    return await embed(request, server, "v2")


@accepts(RerankV1Request)
async def rerank(request: Request, server: "Server"):
    """Cohere v1's (and Jina's) rerank: `query`, `documents` (strings or {"text": ...}), `top_n`,
    `return_documents`; over-long pairs are refused unless `truncate` (or --auto-truncate)."""
    body = fields(await read_json(request, server), RerankV1Request)
    refuse(body, ("max_chunks_per_doc",), "each document is scored whole (cut to the model's length with "
           '"truncate": true); split long documents before sending them')  # fmt: skip
    ranked_fields = body.get("rank_fields")
    if ranked_fields not in (None, ["text"]):
        raise ApiError(400, f'"rank_fields" can only be ["text"], got {ranked_fields!r:.80}', "rank_fields")
    model = server.model(body.get("model"), RERANK, "/v1/rerank")
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    answer = await ranked(server, body, model, truncate, None)
    tokens = answer.pop("tokens")
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"id": str(uuid.uuid4()), "model": model.name, **answer, "meta": meta("1", search_units=1), "usage": usage}


@accepts(RerankV2Request)
async def rerank_v2(request: Request, server: "Server"):
    """Cohere v2's rerank: `model` (required), `query`, `documents`, `top_n`, `max_tokens_per_doc` (each document
    cut to that many tokens first, 4096 by default); pairs longer than the model takes are cut, as Cohere does."""
    body = fields(await read_json(request, server), RerankV2Request)
    refuse(body, ("relevant_spans",), "this server scores whole documents")
    if body.get("model") is None:
        raise ApiError(400, '"model" is required', "model")
    model = server.model(body["model"], RERANK, "/v2/rerank")
    limit = option(body, "max_tokens_per_doc", int, MAX_TOKENS_PER_DOC, 1)
    answer = await ranked(server, body, model, True, limit)
    del answer["tokens"]
    return {"id": str(uuid.uuid4()), **answer, "meta": meta("2", search_units=1)}


async def ranked(server: "Server", body: dict, model: ServedModel, truncate: bool, limit: int | None):
    """{"results": best first, "tokens"}: `CrossEncoder.predict`'s scores of (query, document) pairs, each
    document first cut to `limit` tokens."""
    query = required_text(body, "query")
    docs = server.count(documents(body.get("documents"), "documents"), "documents")
    top_n = option(body, "top_n", int, None, 1)
    keep = option(body, "return_documents", bool, False)
    scored = docs if limit is None else await server.tokenize(model, first_tokens, model, docs, limit)
    scores, order, items = await server.rank(model, query, scored, truncate, hint=too_long_hint(body))
    results = [
        {"index": int(i), "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}} if keep else {})}
        for i in order[:top_n]
    ]
    return {"results": results, "tokens": sum(len(item.ids) for item in items)}


def first_tokens(model: ServedModel, docs: list[str], limit: int) -> list[str]:
    """Each document cut after its first `limit` tokens (special tokens aside), at that token's last character."""
    encodings = model.tokenizer.encode_batch(docs, truncation=False, add_special_tokens=False)
    return [d if len(e.ids) <= limit else d[: e.offsets[limit - 1][1]] for d, e in zip(docs, encodings, strict=True)]


def error(e: ApiError) -> dict:
    return {"id": str(uuid.uuid4()), "message": e.message}


def openai_error(e: ApiError) -> dict:
    """/v1/rerank's: OpenAI's body, which Jina's clients read, with Cohere's `message` beside it."""
    return {**e.openai(), "message": e.message}


ROUTES = {
    "/v1/rerank": (rerank, ["POST"], openai_error),
    "/v2/rerank": (rerank_v2, ["POST"]),
    "/v1/embed": (embed_v1, ["POST"]),
    "/v2/embed": (embed_v2, ["POST"]),
}
