"""Hugging Face text-embeddings-inference (TEI): the routes of its router (router/src/http/server.rs) in its
request and answer shapes, with its status codes (422 a request it cannot take, 424 a model that cannot answer it
or failed, 400 an empty input, 413 too large, 429 overloaded) and its error body `{"error", "error_type"}`. `/`
answers by the model's kind, as TEI's does. TEI serves one model; here a request names its model with "model" or
`?model=NAME` in the URL (for clients that post to a URL as given, as `InferenceClient(model=URL)`), else it goes
to the only model that can answer it. A field the route does not declare is refused, never ignored. /rerank also
takes Infinity's body ("documents" and no "texts"), which infinity.py answers, with TEI's statuses and error body."""

import itertools
from functools import wraps
from typing import TYPE_CHECKING, Annotated, Literal, Required, TypedDict

from starlette.requests import Request

from ... import __version__
from ...pipelines.text_classification import FUNCTIONS
from ..errors import ApiError
from ..models import CLASSIFY, EMBED, RERANK, SPARSE, TASKS, ServedModel
from ..requests import (
    dimensions_of,
    is_int,
    option,
    read_json,
    required_text,
    text,
    texts,
    texts_or_ids,
    too_long_hint,
)
from ..schema import Truncate, accepts, fields
from . import infinity
from .operations import health

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server

DIRECTIONS = {"right": "right", "Right": "right", "left": "left", "Left": "left"}
MODEL_FAILED = {"model_error", "non_finite_output", "model_not_supported"}  # TEI's "Backend" errors: 424

Model = Annotated[str, "the served model (or ?model=NAME in the URL); default: the only one able to answer"]
Direction = Annotated[Literal["right", "left", "Right", "Left"], "the end an over-long input is cut at (right)"]
PromptName = Annotated[
    str | None, "prepend this prompt of the model's prompts (default: the prompt `encode` prepends, if any)"
]
Texts = Annotated[str | list[str], "a text or a list of texts"]


class EmbedRequest(TypedDict, total=False):
    inputs: Required[Annotated[str | list[str] | list[int] | list[list[int]], "texts, or token ids"]]
    model: Model
    normalize: Annotated[bool, "L2-normalise each vector (default true)"]
    prompt_name: PromptName
    truncate: Truncate
    truncation_direction: Direction
    dimensions: Annotated[int | None, "keep the first dimensions (Matryoshka models)"]
    encoding_format: Annotated[Literal["float"], "floats (the only format of /embed)"]


class EmbedAllRequest(TypedDict, total=False):
    inputs: Required[Texts]
    model: Model
    prompt_name: PromptName
    truncate: Truncate
    truncation_direction: Direction


class EmbedSparseRequest(TypedDict, total=False):
    inputs: Required[Texts]
    model: Model
    prompt_name: PromptName
    input_type: Annotated[Literal["query", "document"], "encode as `encode_query` / `encode_document`"]
    truncate: Truncate
    truncation_direction: Annotated[Literal["right", "Right"], "the end an over-long input is cut at (right)"]


class PredictParameters(TypedDict, total=False):
    function_to_apply: Annotated[Literal["softmax", "sigmoid", "none"], "of the logits (default: the model's)"]
    top_k: Annotated[int | None, "the best labels only"]


class PredictRequest(TypedDict, total=False):
    inputs: Required[
        Annotated[
            str | list[str] | list[list[str]],
            "a text, a [text, text_pair] pair, or a list of [text] and [text, text_pair] lists",
        ]
    ]
    model: Model
    raw_scores: Annotated[bool, "the logits, not the scores (default false)"]
    truncate: Truncate
    truncation_direction: Direction
    parameters: Annotated[
        PredictParameters | None, "the Inference API's text-classification form: a single text's answer is nested"
    ]


class RerankRequest(TypedDict, total=False):
    query: Required[str]
    texts: Required[Annotated[list[str], "the documents"]]
    model: Model
    raw_scores: Annotated[bool, "the logits, not the scores (default false)"]
    return_text: Annotated[bool, "each document's text with its score (default false)"]
    truncate: Truncate
    truncation_direction: Direction


class SimilarityInputs(TypedDict):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(TypedDict, total=False):
    prompt_name: PromptName
    truncate: Truncate
    truncation_direction: Direction


class SimilarityRequest(TypedDict, total=False):
    inputs: Required[SimilarityInputs]
    model: Model
    parameters: SimilarityParameters | None


class TokenizeRequest(TypedDict, total=False):
    inputs: Required[Texts]
    model: Model
    add_special_tokens: Annotated[bool, "the model's special tokens around each text (default true)"]
    prompt_name: Annotated[str | None, "prepend this prompt of the model's prompts (default: its default prompt)"]


class DecodeRequest(TypedDict, total=False):
    ids: Required[Annotated[list[int] | list[list[int]], "token ids, or a list of such lists"]]
    model: Model
    skip_special_tokens: Annotated[bool, "leave special tokens out (default true)"]


def tei_errors(handler):
    """TEI's status for each refusal: 422 for what it cannot take (400 only for an empty input), 424 when the
    model cannot answer the route or failed."""

    @wraps(handler)
    async def answer(request: Request, server: "Server"):
        try:
            return await handler(request, server)
        except ApiError as e:
            status = e.status
            if status == 400:
                status = 424 if e.code in MODEL_FAILED else 400 if e.code == "empty_input" else 422
            elif status == 500 and e.code in MODEL_FAILED:
                status = 424
            if status == e.status:
                raise
            raise ApiError(status, e.message, e.param, e.code, e.headers) from None

    return answer


async def body_of(request: Request, server: "Server", model: type) -> dict:
    return fields(await read_json(request, server), model)


def served(request: Request, server: "Server", body: dict, capability, route: str) -> ServedModel:
    """The model named by the body's "model", else by `?model=`, else the only one able to serve `route` (424, as
    TEI's, when none can)."""
    name = body.get("model", request.query_params.get("model"))
    if (
        name is None
        and capability is not None
        and not any(capability in m.capabilities for m in server.models.values())
        and not server.unloaded_able((capability,))
    ):
        raise ApiError(
            424, f"no served model serves {route} ({capability}); served: "
            f"{', '.join(f'{m.name} ({m.kind})' for m in server.models.values())}", None, "model_not_supported",
        )  # fmt: skip
    return server.model(name, capability, route)


def truncation(body: dict, server: "Server") -> tuple[bool, str]:
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    direction = option(body, "truncation_direction", str, "right")
    if direction not in DIRECTIONS:
        raise ApiError(
            400, f'"truncation_direction" must be "right" or "left", got {direction!r}', "truncation_direction"
        )
    return truncate, DIRECTIONS[direction]


async def tokenized(
    server: "Server", model: ServedModel, body: dict, found: list[str], inside: str | None = None, **kwargs
) -> list:
    """The encodings of `found` under the request's options `body` (the object named `inside`, else its top)."""
    truncate, direction = truncation(body, server)
    prompt_name = option(body, "prompt_name", str)
    return await server.tokenize(
        model, model.tokenize, found, truncate, param="inputs", prompt_name=prompt_name, direction=direction,
        hint=too_long_hint(body, inside), **kwargs,
    )  # fmt: skip


async def embed_answer(request: Request, server: "Server", body: dict, model: ServedModel) -> list:
    found, ids = texts_or_ids(body.get("inputs"), "inputs")
    server.count(found or ids, "inputs")
    normalize = option(body, "normalize", bool, True)
    dimensions = dimensions_of(body, model)
    if option(body, "encoding_format", str, "float") != "float":
        raise ApiError(400, '"encoding_format" of /embed is "float" only', "encoding_format")
    if ids is None:
        items = await tokenized(server, model, body, found)
    elif body.get("prompt_name") is not None:
        raise ApiError(400, '"prompt_name" applies to texts; token ids are the whole input', "prompt_name")
    else:
        truncate, direction = truncation(body, server)
        if direction != "right":
            raise ApiError(400, '"truncation_direction" applies to texts; send "right" with token ids', "inputs")
        items = await server.tokenize(model, model.token_ids, ids, truncate, too_long_hint(body))
    if not normalize:  # the vectors as pooled (and projected), as TEI gives them
        items = model.unnormalized(items)
    return model.embeddings(await server.run(model, items), dimensions, normalize, raw=not normalize)


@tei_errors
@accepts(EmbedRequest)
async def embed(request: Request, server: "Server"):
    """Embeddings: per input its vector, as `encode` (normalised unless "normalize" is false)."""
    body = await body_of(request, server, EmbedRequest)
    return await embed_answer(request, server, body, served(request, server, body, EMBED, "/embed"))


@tei_errors
@accepts(EmbedAllRequest)
async def embed_all(request: Request, server: "Server"):
    """Token embeddings: per input the model's last hidden state, a vector per token (special tokens included)."""
    body = await body_of(request, server, EmbedAllRequest)
    model = served(request, server, body, EMBED, "/embed_all")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    items = await tokenized(server, model, body, found, token_vectors=True)
    await server.run(model, items)
    return [item.tokens for item in items]


async def embed_sparse_answer(request: Request, server: "Server", body: dict, model: ServedModel) -> list:
    """Per input its non-zero weights as [{"index": token id, "value": weight}], by id."""
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    task = option(body, "input_type", str)
    if task is not None and task not in TASKS:
        raise ApiError(400, f'"input_type" must be "query" or "document", got {task!r}', "input_type")
    items = await tokenized(server, model, body, found, task=task)
    rows = await server.run(model, items)
    return [[{"index": int(i), "value": float(v)} for i, v in zip(*row, strict=True)] for row in rows]


@tei_errors
@accepts(EmbedSparseRequest)
async def embed_sparse(request: Request, server: "Server"):
    """Sparse embeddings (SPLADE): per input its non-zero weights as {"index": token id, "value"}, by id.
    `input_type` "query" / "document" encodes as `encode_query` / `encode_document`."""
    body = await body_of(request, server, EmbedSparseRequest)
    return await embed_sparse_answer(request, server, body, served(request, server, body, SPARSE, "/embed_sparse"))


def predict_inputs(value) -> tuple[list[list[str]], bool]:
    """TEI's `inputs`: a text or a [text] / [text, pair] list (one input), or a list of such lists; and whether
    it was one input."""
    expected = "a string, a [text, text_pair] pair, or a list of [text] and [text, text_pair] lists"
    if isinstance(value, str):
        return [[text(value, '"inputs"', "inputs")]], True
    if not isinstance(value, list):
        raise ApiError(400, f'"inputs" must be {expected}, got {type(value).__name__}', "inputs")
    if not value:
        raise ApiError(400, '"inputs" is empty; send at least one input', "inputs", "empty_input")
    single = isinstance(value[0], str)
    items = [value] if single else value
    for i, item in enumerate(items):
        if not isinstance(item, list) or not 1 <= len(item) <= 2 or not all(isinstance(t, str) for t in item):
            where = '"inputs"' if single else f"inputs[{i}]"
            raise ApiError(400, f"{where} must be a [text] or [text, text_pair] list of strings", "inputs")
        for j, t in enumerate(item):
            text(t, f"inputs[{i}][{j}]" if not single else f"inputs[{j}]", "inputs")
    return items, single


async def predict_answer(request: Request, server: "Server", body: dict, model: ServedModel):
    items, single = predict_inputs(body.get("inputs"))
    server.count(items, "inputs")
    parameters = option(body, "parameters", dict, {})
    fields(parameters, PredictParameters)
    function = option(parameters, "function_to_apply", str)
    if function is not None and function not in FUNCTIONS:
        raise ApiError(
            400, f'"function_to_apply" must be one of {", ".join(FUNCTIONS)}, got {function!r}', "parameters"
        )
    raw = option(body, "raw_scores", bool, False)
    if raw and function not in (None, "none"):
        raise ApiError(
            400, '"raw_scores" gives the logits: leave "function_to_apply" out, or send "none"', "raw_scores"
        )
    top_k = option(parameters, "top_k", int, None, 1)
    groups = {}  # texts alone, and pairs: tokenized apart, run together in the inputs' order
    for i, item in enumerate(items):
        groups.setdefault(len(item), []).append(i)
    encoded = [None] * len(items)
    for size, rows in groups.items():
        firsts = [items[i][0] for i in rows]
        pairs = [items[i][1] for i in rows] if size == 2 else None
        for i, e in zip(rows, await tokenized(server, model, body, firsts, pairs=pairs), strict=True):
            encoded[i] = e
    labels = model.labels(await server.run(model, encoded), top_k, raw, function)
    # the Inference API nests a single text's labels (InferenceClient reads them so); TEI does not
    return ([labels[0]] if "parameters" in body else labels[0]) if single else labels


@tei_errors
@accepts(PredictRequest)
async def predict(request: Request, server: "Server"):
    """Classification: per input its labels and scores, best first, as the text-classification pipeline gives
    them (`raw_scores`: the logits)."""
    body = await body_of(request, server, PredictRequest)
    return await predict_answer(request, server, body, served(request, server, body, CLASSIFY, "/predict"))


async def rerank_answer(request: Request, server: "Server", body: dict, model: ServedModel) -> list:
    query = required_text(body, "query")
    value = body.get("texts")
    if isinstance(value, list) and not value:
        raise ApiError(400, '"texts" is empty; send at least one text', "texts", "empty_input")
    docs = server.count(texts(value, "texts"), "texts")
    raw = option(body, "raw_scores", bool, False)
    keep = option(body, "return_text", bool, False)
    truncate, direction = truncation(body, server)
    prompt_name = option(body, "prompt_name", str)
    scores, order, _ = await server.rank(
        model, query, docs, truncate, raw, "texts", prompt_name=prompt_name, direction=direction,
        hint=too_long_hint(body),
    )  # fmt: skip
    return [{"index": int(i), "score": float(scores[i]), **({"text": docs[i]} if keep else {})} for i in order]


@tei_errors
@accepts(RerankRequest | infinity.RerankRequest)
async def rerank(request: Request, server: "Server"):
    """Reranking: the texts by the cross-encoder's score for (query, text), best first, as `CrossEncoder.predict`
    (`raw_scores`: the logits). A body with "documents" and no "texts" is Infinity's, which infinity.py answers
    (told apart before the check of TEI's fields, which would refuse "documents"), with TEI's statuses and body."""
    body = await read_json(request, server)
    if "documents" in body and "texts" not in body:
        return await infinity.rerank(request, server)
    body = fields(body, RerankRequest)
    return await rerank_answer(request, server, body, served(request, server, body, RERANK, "/rerank"))


async def similarity_answer(request: Request, server: "Server", body: dict, model: ServedModel) -> list:
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        raise ApiError(400, '"inputs" must be {"source_sentence": text, "sentences": [texts]}', "inputs")
    fields(inputs, SimilarityInputs)
    source = required_text(inputs, "source_sentence")
    value = inputs.get("sentences")
    if isinstance(value, list) and not value:
        raise ApiError(400, '"sentences" is empty; send at least one sentence', "inputs", "empty_input")
    sentences = server.count(texts(value, "sentences"), "inputs")
    parameters = fields(option(body, "parameters", dict, {}), SimilarityParameters)
    names = lambda i: f"inputs.sentences[{i - 1}]" if i else "inputs.source_sentence"  # noqa: E731
    items = await tokenized(server, model, parameters, [source, *sentences], "parameters", names=names)
    vectors = model.embeddings(await server.run(model, items), None, normalize=True)
    return vectors[1:] @ vectors[0]


@tei_errors
@accepts(SimilarityRequest)
async def similarity(request: Request, server: "Server"):
    """Sentence similarity: the cosine similarity of the source sentence's embedding with each sentence's."""
    body = await body_of(request, server, SimilarityRequest)
    return await similarity_answer(request, server, body, served(request, server, body, EMBED, "/similarity"))


@tei_errors
@accepts(TokenizeRequest)
async def tokenize(request: Request, server: "Server"):
    """Tokens: per input its tokens (id, text, special, and the character span of a token not special)."""
    body = await body_of(request, server, TokenizeRequest)
    model = served(request, server, body, None, "/tokenize")
    found = server.count(texts(body.get("inputs"), "inputs"), "inputs")
    special = option(body, "add_special_tokens", bool, True)
    prompt_name = option(body, "prompt_name", str)
    prompt = model.prompt(None) if prompt_name is None else model.named_prompt(prompt_name)  # as /embed's
    found = [prompt + t for t in found] if prompt else found
    return await server.tokenize(model, tokens, model, found, special)


def tokens(model: ServedModel, found: list[str], special: bool) -> list[list[dict]]:
    """/tokenize's answer: per text its tokens, with the UTF-8 byte span in the text of those not special (TEI's
    offsets are Rust's byte offsets; Python's tokenizers give characters)."""
    try:
        encodings = model.tokenizer.encode_batch(found, truncation=False, add_special_tokens=special)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), "inputs") from None
    out = []
    for line, e in zip(found, encodings, strict=True):
        at = [0, *itertools.accumulate(len(c.encode()) for c in line)]  # character index -> byte offset
        out.append([
            {"id": i, "text": tok if s else line[a:b], "special": bool(s), "start": None if s else at[a],
             "stop": None if s else at[b]}
            for i, tok, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)
        ])  # fmt: skip
    return out


@tei_errors
@accepts(DecodeRequest)
async def decode(request: Request, server: "Server"):
    """Decoding: per list of token ids its text."""
    body = await body_of(request, server, DecodeRequest)
    model = served(request, server, body, None, "/decode")
    value = body.get("ids")
    lists = [value] if isinstance(value, list) and value and all(is_int(t) for t in value) else value
    if (
        not isinstance(lists, list)
        or not lists
        or not all(isinstance(x, list) and all(is_int(t) for t in x) for x in lists)
    ):
        raise ApiError(400, '"ids" must be a non-empty list of token ids, or a list of such lists', "ids")
    server.count(lists, "ids")
    skip = option(body, "skip_special_tokens", bool, True)
    largest = model.tokenizer.max_id

    def decoded() -> list[str]:  # on the tokenizer's thread: the event loop answers /health meanwhile
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t <= largest), None)
            if bad is not None:
                raise ApiError(
                    400, f"ids[{i}] holds {bad}, outside model {model.name!r}'s token ids 0..{largest}", "ids"
                )
        return model.tokenizer.decode_batch(lists, skip)

    return await server.tokenize(model, decoded)


def model_type(model: ServedModel) -> dict:
    """TEI's `model_type`: {"embedding": {"pooling"}}, or {"classifier" | "reranker": {"id2label", "label2id"}}."""
    if model.cross is not None:
        # a LogitScore reranker (Qwen3-Reranker) has no classification head: one score, transformers' default label
        names = model.classifier.id2label if model.classifier is not None else {0: "LABEL_0"}
        id2label = {str(i): names[i] for i in range(model.cross.num_labels)}
        kind = "reranker" if RERANK in model.capabilities else "classifier"
        return {kind: {"id2label": id2label, "label2id": {label: int(i) for i, label in id2label.items()}}}
    if model.sparse is not None:
        return {"embedding": {"pooling": "splade"}}
    pooling = model.encoder.pooling if model.encoder is not None else ("multi-vector",)
    return {"embedding": {"pooling": "+".join(pooling)}}


@tei_errors
async def info(request: Request, server: "Server"):
    """The model's description, as TEI's /info (`?model=NAME` when the server holds several)."""
    return info_answer(server, served(request, server, {}, None, "/info"))


def info_answer(server: "Server", model: ServedModel) -> dict:
    options = server.options
    return {
        "model_id": model.source,
        "model_sha": None,
        "model_dtype": model.weights.dtype,
        "served_model_name": model.name,
        "model_type": model_type(model),
        "max_concurrent_requests": options.max_queue,
        "max_input_length": model.max_length,
        "max_batch_tokens": options.max_batch_tokens,
        "max_batch_requests": None,
        "max_client_batch_size": options.max_inputs,
        "auto_truncate": options.auto_truncate,
        "tokenization_workers": 1,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


def is_served(server: "Server", name: str) -> bool:
    """Whether `name` is a served model, loaded or (--models-dir) loaded on request."""
    return name in server.models or server.lazy is not None and server.lazy.path(name) is not None


def root_capability(body: dict):
    """What a body posted to `/` asks for, by its shape: similarity, reranking, or (None) the model's kind."""
    if isinstance(body.get("inputs"), dict):
        return EMBED
    return RERANK if "query" in body or "texts" in body else None


@tei_errors
@accepts(EmbedRequest | SimilarityRequest | EmbedSparseRequest | PredictRequest | RerankRequest)
async def root(request: Request, server: "Server"):
    """GET: health. POST: the route of the model's kind, as TEI's `/`: an embedding model's /embed (its
    /similarity for {"inputs": {"source_sentence", "sentences"}}), a sparse model's /embed_sparse, a
    cross-encoder's /rerank (its /predict for "inputs"), a classifier's /predict."""
    if request.method in ("GET", "HEAD"):  # Starlette routes HEAD to a GET route; Ollama's heartbeat sends it
        name = request.query_params.get("model")
        if name is not None and not is_served(server, name):
            # huggingface_hub's InferenceClient appends /info or /health to a URL that ends in "?model=NAME"
            base, _, route = name.rpartition("/")
            if route not in ("info", "health") or not is_served(server, base):
                server.model(name, None, "/")  # a 404 naming the served models
            if route == "info":
                return info_answer(server, server.model(base, None, "/info"))
        return await health(request, server)
    body = await read_json(request, server)
    capability = root_capability(body)
    model = served(request, server, body, capability, "/")
    if capability == EMBED:
        return await similarity_answer(request, server, fields(body, SimilarityRequest), model)
    if capability == RERANK:
        return await rerank_answer(request, server, fields(body, RerankRequest), model)
    if CLASSIFY in model.capabilities:
        return await predict_answer(request, server, fields(body, PredictRequest), model)
    if SPARSE in model.capabilities:
        return await embed_sparse_answer(request, server, fields(body, EmbedSparseRequest), model)
    if EMBED in model.capabilities:
        return await embed_answer(request, server, fields(body, EmbedRequest), model)
    if RERANK in model.capabilities:  # a reranker asked for something but a ranking
        use = 'post {"query": ..., "texts": [...]} to / or /rerank'
    else:  # a multi-vector model
        use = "use /v1/embeddings"
    raise ApiError(
        424, f"model {model.name!r} is a {model.kind} model, which this TEI route does not serve; {use}",
        "model", "model_not_supported",
    )  # fmt: skip


ROUTES = {
    "/": (root, ["GET", "POST"]),
    "/invocations": (root, ["POST"]),
    "/ping": (health, ["GET"]),
    "/info": (info, ["GET"]),
    "/embed": (embed, ["POST"]),
    "/embed_all": (embed_all, ["POST"]),
    "/embed_sparse": (embed_sparse, ["POST"]),
    "/predict": (predict, ["POST"]),
    "/rerank": (rerank, ["POST"]),
    "/similarity": (similarity, ["POST"]),
    "/tokenize": (tokenize, ["POST"]),
    "/decode": (decode, ["POST"]),
}


def error(e: ApiError) -> dict:
    return e.tei()
