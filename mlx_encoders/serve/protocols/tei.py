"""Hugging Face text-embeddings-inference (TEI): /embed, /embed_sparse, /rerank, /predict, /tokenize, in TEI's
shapes and with TEI's error body (on /rerank too when the body is Infinity's, which infinity.py answers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import Request

from ..errors import ApiError
from ..models import CLASSIFY, EMBED, RERANK, SPARSE, TASKS, ServedModel
from ..requests import dimensions_of, documents, option, read_json, required_text, text, texts
from . import infinity

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


async def tei_embed(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), EMBED, "/embed")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    normalize = option(body, "normalize", bool, True)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    dimensions = dimensions_of(body, model)
    items = await server.tokenize(model, model.tokenize, found, truncate, param="inputs")
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
    items = await server.tokenize(
        model, model.tokenize, found, truncate, param="inputs", task=task, prompt_name=prompt_name
    )
    rows = await server.run(model, items)
    return [[{"index": int(i), "value": float(v)} for i, v in zip(*row, strict=True)] for row in rows]


async def tei_rerank(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), RERANK, "/rerank")
    query = required_text(body, "query")
    docs = server.count(documents(body.get("texts"), "texts"), "texts")
    raw = option(body, "raw_scores", bool, False)
    keep = option(body, "return_text", bool, False)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = await server.tokenize(model, model.tokenize, [query] * len(docs), truncate, docs, "texts")
    scores = model.scores(await server.run(model, items), raw)
    order = np.argsort(-scores, kind="stable")
    return [{"index": int(i), "score": float(scores[i]), **({"text": docs[i]} if keep else {})} for i in order]


async def rerank(request: Request, server: Server):
    """/rerank: TEI's body ("texts"), or Infinity's on the same path ("documents" and no "texts")."""
    body = await read_json(request, server)
    if "documents" in body and "texts" not in body:
        return await infinity.rerank(request, server)
    return await tei_rerank(request, server)


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
        firsts, seconds = ([text(x[j], f"inputs[{i}][{j}]", "inputs") for i, x in enumerate(items)] for j in (0, 1))
        encoded = await server.tokenize(model, model.tokenize, firsts, truncate, seconds, "inputs")
    else:
        encoded = await server.tokenize(model, model.tokenize, texts(items, "inputs"), truncate, param="inputs")
    labels = model.labels(await server.run(model, encoded), None, raw)
    return labels[0] if single else labels


async def tei_tokenize(request: Request, server: Server):
    body = await read_json(request, server)
    model = server.model(body.get("model"), None, "/tokenize")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    special = option(body, "add_special_tokens", bool, True)
    return await server.tokenize(model, tokens, model, found, special)


def tokens(model: ServedModel, found: list[str], special: bool) -> list[list[dict]]:
    """/tokenize's answer: per text its tokens, with offsets into the text for those not special."""
    try:
        encodings = model.tokenizer.encode_batch(found, truncation=False, add_special_tokens=special)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), "inputs") from None
    out = []
    for line, e in zip(found, encodings, strict=True):
        out.append([
            {"id": i, "text": tok if s else line[a:b], "special": bool(s), "start": None if s else a,
             "stop": None if s else b}
            for i, tok, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)
        ])  # fmt: skip
    return out


ROUTES = {
    "/embed": (tei_embed, ["POST"]),
    "/embed_sparse": (tei_embed_sparse, ["POST"]),
    "/rerank": (rerank, ["POST"]),
    "/predict": (tei_predict, ["POST"]),
    "/tokenize": (tei_tokenize, ["POST"]),
}


def error(e: ApiError) -> dict:
    return e.tei()
