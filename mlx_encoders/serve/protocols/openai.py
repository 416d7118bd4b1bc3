"""OpenAI's routes: /v1/embeddings and /v1/models; /v1/classify in the same shapes."""

from typing import TYPE_CHECKING, Annotated, Literal, Required, TypedDict

import numpy as np
from starlette.requests import Request

from ..embedding_types import TYPES, base64_of, typed
from ..errors import ApiError
from ..models import CLASSIFY, EMBED, MULTI_VECTOR, TASKS, ServedModel
from ..requests import dimensions_of, option, read_json, texts, texts_or_ids, too_long_hint
from ..schema import ModelName, OutputType, Truncate, accepts, fields

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


User = Annotated[str, "the end user's id (OpenAI's; it changes nothing)"]


class EmbeddingsRequest(TypedDict, total=False):
    input: Required[
        Annotated[
            str | list[str] | list[int] | list[list[int]],
            "a text, texts, or token ids (the model's own, special tokens included)",
        ]
    ]
    model: ModelName
    encoding_format: Annotated[Literal["float", "base64"], "floats (default), or base64 of float32"]
    dimensions: Annotated[int | None, "keep the first dimensions (Matryoshka models)"]
    input_type: Annotated[Literal["query", "document"] | None, "embed as encode_query / encode_document do"]
    output_dtype: Annotated[OutputType, "quantized embeddings (Voyage's), as encode(precision=...)"]
    truncate: Truncate
    user: User
    modality: Annotated[Literal["text"], "Infinity's: texts only"]


class ClassifyRequest(TypedDict, total=False):
    input: Required[Annotated[str | list[str], "a text or texts"]]
    model: ModelName
    top_k: Annotated[int | None, "labels per text, best first (default: all)"]
    truncate: Truncate
    user: User


@accepts(EmbeddingsRequest)
async def embeddings(request: Request, server: "Server"):
    """OpenAI's embeddings; for a multi-vector model each `embedding` is a list of token vectors (floats only)."""
    body = fields(await read_json(request, server), EmbeddingsRequest)
    if body.get("modality", "text") != "text":
        raise ApiError(400, f'"modality" {body["modality"]!r:.40} is not served: this server embeds texts', "modality")
    model = server.model(body.get("model"), (EMBED, MULTI_VECTOR), "/v1/embeddings")
    found, ids = texts_or_ids(body.get("input"))
    server.count(found or ids, "input")
    fmt = option(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, f'"encoding_format" must be "float" or "base64", got {fmt!r}', "encoding_format")
    task = option(body, "input_type", str)
    if task is not None and task not in TASKS:
        raise ApiError(400, f'"input_type" must be "query" or "document", got {task!r}', "input_type")
    dtype = output_dtype(body, fmt)
    if model.multi is not None:
        multi_vector_request(model, body, fmt, ids)
    infinity = request.url.path == "/embeddings"  # its client sends "dimensions": 0 for all of them
    dimensions = dimensions_of(body, model, zero_is_all=infinity) if model.multi is None else None
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    if ids is not None and task is not None:
        raise ApiError(400, '"input_type" applies to texts (its prompt); token ids are the whole input', "input_type")
    if ids is None:
        items = await server.tokenize(model, model.tokenize, found, truncate, task=task, hint=too_long_hint(body))
    else:
        items = await server.tokenize(model, model.token_ids, ids, truncate, too_long_hint(body))
    out = await server.run(model, items)
    vectors = out if model.multi is not None else model.embeddings(out, dimensions)
    if dtype != "float":
        vectors = typed(vectors, dtype, "output_dtype")
    tokens = sum(len(item.ids) for item in items)

    def encoded(v: np.ndarray):
        # floats stay an array: the response writes them off the event loop
        return base64_of(v) if fmt == "base64" else v

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def output_dtype(body: dict, fmt: str) -> str:
    """Voyage's `output_dtype`: float (default), int8, uint8, binary or ubinary, as `encode(precision=...)`;
    integers are sent as lists (base64 would decode as float32 in OpenAI clients)."""
    dtype = option(body, "output_dtype", str, "float")
    if dtype not in TYPES:
        raise ApiError(400, f'"output_dtype" must be one of {", ".join(TYPES)}, got {dtype!r:.40}', "output_dtype")
    if dtype != "float" and fmt != "float":
        raise ApiError(
            400, f'"output_dtype" {dtype} is sent as lists of integers: send "encoding_format": "float" (an OpenAI '
            "client decodes base64 as float32, and the openai SDK asks for base64 unless told)", "encoding_format",
        )  # fmt: skip
    return dtype


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
    if body.get("output_dtype", "float") != "float":
        raise ApiError(400, f"{where}: its token vectors are sent as floats only", "output_dtype")
    if ids is not None:
        raise ApiError(400, f"{where}: send texts, not token ids", "input")


@accepts(ClassifyRequest)
async def classify(request: Request, server: "Server"):
    """Per text its labels, best first, in OpenAI's list shape."""
    body = fields(await read_json(request, server), ClassifyRequest)
    model = server.model(body.get("model"), CLASSIFY, "/v1/classify")
    found = server.count(texts(body.get("input"), "input"), "input")
    top_k = option(body, "top_k", int, None, 1)
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    items = await server.tokenize(model, model.tokenize, found, truncate, hint=too_long_hint(body))
    labels = model.labels(await server.run(model, items), top_k)
    tokens = sum(len(item.ids) for item in items)
    return {
        "object": "list",
        "model": model.name,
        "data": [{"index": i, "label": ranked[0]["label"], "labels": ranked} for i, ranked in enumerate(labels)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def model_names(server: "Server") -> list[str]:
    """The served models, then the other models of --models-dir (loaded by their first request)."""
    names = list(server.models)
    return names + ([n for n in server.lazy.names() if n not in server.models] if server.lazy is not None else [])


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mlx-encoders"}


async def models(request: Request, server: "Server"):
    return {"object": "list", "data": [model_object(name) for name in model_names(server)]}


async def model(request: Request, server: "Server"):
    """OpenAI's retrieve-model route: the model's object as /v1/models lists it."""
    name, names = request.path_params["model"], model_names(server)
    if name not in names:
        known = ", ".join(repr(n) for n in names)
        raise ApiError(404, f"The model {name!r} does not exist; the models: {known}", "model", "model_not_found")
    return model_object(name)


ROUTES = {
    "/v1/embeddings": (embeddings, ["POST"]),
    "/embeddings": (embeddings, ["POST"]),  # TEI's (and Infinity's) unprefixed alias
    "/v1/classify": (classify, ["POST"]),
    "/v1/models": (models, ["GET"]),
    "/v1/models/{model:path}": (model, ["GET"]),  # a hub id's slash is part of the name
}


def error(e: ApiError) -> dict:
    return e.openai()
