"""Ollama's embedding API, as the `ollama` client and the apps built on it call it: /api/embed, /api/embeddings (the
legacy one), /api/tags, /api/show, /api/ps and /api/version; errors as Ollama's `{"error": message}`. A model is
named as served or with Ollama's tag, `NAME:latest`."""

import datetime
import hashlib
import math
import re
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Required, TypedDict

from starlette.requests import Request

from ... import __version__
from ..errors import ApiError
from ..models import EMBED, ServedModel
from ..requests import dimensions_of, option, read_json, texts
from ..schema import accepts, fields

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server

TAG = ":latest"
# Ollama's options that cannot change an embedding (hardware, threads, sampling): taken and left alone
NO_EFFECT = {
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
    "use_mlock", "embedding_only", "num_thread", "num_keep", "seed", "num_predict", "top_k", "top_p", "min_p",
    "tfs_z", "typical_p", "repeat_last_n", "temperature", "repeat_penalty", "presence_penalty", "frequency_penalty",
    "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline", "stop",
}  # fmt: skip
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", re.ASCII)
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
WEIGHT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # Ollama's quantization_level names
FOREVER = "2262-04-11T23:47:16Z"  # what Ollama shows for a model kept loaded (keep_alive -1)
FOREVER_S = datetime.datetime.fromisoformat(FOREVER).timestamp()


Name = Annotated[str, 'a served model, as served or tagged (":latest")']
KeepAlive = Annotated[int | float | str, 'how long a --models-dir model stays loaded when idle ("5m", seconds)']
Options = Annotated[dict[str, Any], "Ollama's options: num_ctx is the tokens an input keeps; the others change nothing"]


class EmbedRequest(TypedDict, total=False):
    model: Required[Name]
    input: Annotated[str | list[str], "a text or texts (none: only load the model)"]
    truncate: Annotated[bool, "cut an over-long input to the model's length (default true)"]
    dimensions: Annotated[int | None, "keep the first dimensions (Matryoshka models), re-normalised"]
    keep_alive: KeepAlive
    options: Options


class EmbeddingsRequest(TypedDict, total=False):
    model: Required[Name]
    prompt: Annotated[str, "the text (none: only load the model)"]
    keep_alive: KeepAlive
    options: Options


class ShowRequest(TypedDict, total=False):
    model: Required[Name]
    name: Annotated[str, 'the model (Ollama\'s older spelling of "model")']
    verbose: Annotated[bool, "Ollama's fuller answer (the same answer here)"]


def served(server: "Server", body: dict, capability: str | None, route: str) -> ServedModel:
    """The request's `model` (required, as Ollama's), as served or tagged `:latest`."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, '"model" is required: a served model\'s name, e.g. ' + repr(next(iter(server.models), "")))
    if name not in server.models and name.endswith(TAG):
        name = name[: -len(TAG)]
    return server.model(name, capability, route)


def keep_alive(body: dict) -> float | None:
    """Ollama's `keep_alive` in seconds (a number, or a duration such as "5m" or "1h30m"; negative: forever)."""
    value = body.get("keep_alive")
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) < 2**53 else math.inf if value > 0 else -math.inf  # as good as forever
    if value is None or isinstance(value, float) and not math.isnan(value):
        return value
    if isinstance(value, str):
        sign, rest = (-1, value[1:]) if value.startswith("-") else (1, value)
        if rest.isascii() and rest.isdigit():
            return sign * float(rest)
        parts = DURATION.findall(rest)
        if parts and "".join(n + u for n, u in parts) == rest:
            return sign * sum(float(n) * UNITS[u] for n, u in parts)
    raise ApiError(400, f'"keep_alive" must be seconds or a duration such as "5m", got {value!r:.40}', "keep_alive")


def context(body: dict) -> int | None:
    """`options.num_ctx` (the tokens an input may have), refusing options this server does not know."""
    options = body.get("options")
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ApiError(400, f'"options" must be an object, got {type(options).__name__}', "options")
    unknown = sorted(k for k, v in options.items() if v is not None and k != "num_ctx" and k not in NO_EFFECT)
    if unknown:
        raise ApiError(400, f'"options" {", ".join(map(repr, unknown))} not known to this server', "options")
    return option(options, "num_ctx", int, None, 1)


def kept(server: "Server", model: ServedModel, body: dict) -> None:
    """The request's `keep_alive`, for a model of --models-dir: how long it stays loaded once idle."""
    seconds = keep_alive(body)
    if seconds is not None and server.lazy is not None:
        server.lazy.set_keep_alive(model.name, seconds)


async def embeddings_of(server: "Server", model: ServedModel, found: list[str], body: dict, normalize: bool):
    """(vectors, tokens) of `found`, cut to the model's length (or num_ctx) unless `truncate` is false."""
    truncate = option(body, "truncate", bool, True)
    limit = context(body)
    dimensions = dimensions_of(body, model)
    items = await server.tokenize(
        model, model.tokenize, found, truncate, max_length=limit, limit_field="options.num_ctx",
        hint='shorten it, or send "truncate": true',  # Ollama cuts by default: only the request's false is left
    )  # fmt: skip
    if not normalize:  # the legacy route's vectors as pooled, as Ollama's, whatever the model's folder holds
        items = model.unnormalized(items)
    vectors = model.embeddings(await server.run(model, items), dimensions, normalize, raw=not normalize)
    return vectors, sum(len(item.ids) for item in items)


@accepts(EmbedRequest)
async def embed(request: Request, server: "Server"):
    """/api/embed: `input` a string or a list; L2-normalised vectors, as Ollama's. No input (or "") loads nothing
    and answers no embeddings, as Ollama answers a request that only loads its model."""
    start = time.perf_counter_ns()
    body = fields(await read_json(request, server), EmbedRequest)
    model = served(server, body, EMBED, "/api/embed")
    kept(server, model, body)
    value = body.get("input")
    found = [] if value in (None, "", []) else server.count(texts(value, "input"), "input")
    vectors, tokens = await embeddings_of(server, model, found, body, True) if found else ([], 0)
    return {
        "model": body["model"],
        "embeddings": list(vectors),
        "total_duration": time.perf_counter_ns() - start,
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


@accepts(EmbeddingsRequest)
async def embeddings(request: Request, server: "Server"):
    """/api/embeddings (legacy): `prompt` -> `embedding`, not normalised (as Ollama's); no prompt: empty."""
    body = fields(await read_json(request, server), EmbeddingsRequest)
    model = served(server, body, EMBED, "/api/embeddings")
    kept(server, model, body)
    prompt = option(body, "prompt", str, "")
    if not prompt:
        return {"embedding": []}
    vectors, _ = await embeddings_of(server, model, [prompt], body, False)
    return {"embedding": vectors[0]}


def facts(model: ServedModel) -> dict:
    """What Ollama's model lists say of a model: its size in bytes, parameters, family, weight type, digest
    (worked out once per loaded model; an unloaded one's go with it)."""
    if model not in FACTS:
        FACTS[model] = facts_of(model)
    return FACTS[model]


def facts_of(model: ServedModel) -> dict:
    weights = model.weights
    args = getattr(model.model, "args", None)
    source = Path(model.source)
    modified = source.stat().st_mtime if source.exists() else 0
    return {
        "size": weights.bytes,
        "parameters": weights.parameters,
        "family": getattr(args, "model_type", model.kind),
        "dtype": quantization_level(weights),
        "digest": hashlib.sha256(f"{model.name}\0{model.source}".encode()).hexdigest(),
        "modified_at": datetime.datetime.fromtimestamp(modified, datetime.timezone.utc).isoformat(),
    }


def quantization_level(weights) -> str:
    """Ollama's name for how the weights are stored: F32, F16, BF16; Q8_0, Q4_0 ... for affine integers (GGUF's
    nearest names), MXFP4, NVFP4, MXFP8 for the floating-point modes (as Ollama names gpt-oss's MXFP4)."""
    if weights.bits is None:
        return WEIGHT_TYPES.get(weights.dtype, "")
    return f"Q{weights.bits}_0" if weights.mode == "affine" else str(weights.mode).upper()


def details(model: ServedModel) -> dict:
    f = facts(model)
    size = f"{f['parameters'] / 1e6:.1f}M" if f["parameters"] < 1e9 else f"{f['parameters'] / 1e9:.1f}B"
    return {"parent_model": "", "format": "safetensors", "family": f["family"], "families": [f["family"]],
            "parameter_size": size, "quantization_level": f["dtype"]}  # fmt: skip


def tagged(name: str) -> str:
    return name if ":" in name else name + TAG


async def tags(request: Request, server: "Server"):
    """The served models and, unloaded, the other models of --models-dir (as Ollama lists what it has pulled)."""
    models = []
    for model in server.models.values():
        f = facts(model)
        models.append({"name": tagged(model.name), "model": tagged(model.name), "modified_at": f["modified_at"],
                       "size": f["size"], "digest": f["digest"], "details": details(model)})  # fmt: skip
    for name in server.lazy.names() if server.lazy is not None else []:
        if name not in server.models:
            models.append(folder_entry(name, server.lazy.folder / name))
    return {"models": models}


def folder_entry(name: str, folder: Path) -> dict:
    """/api/tags' entry of a model not loaded: what its folder says (its weight files' size, its model_type)."""
    from ...checkpoint import read_json_object

    try:
        family = str(read_json_object(folder / "config.json").get("model_type", ""))
    except (OSError, ValueError):  # a damaged folder is listed, and loading it says what is wrong
        family = ""
    size = sum(p.stat().st_size for p in folder.rglob("*.safetensors") if p.is_file())  # not a dangling link
    modified = datetime.datetime.fromtimestamp(folder.stat().st_mtime, datetime.timezone.utc).isoformat()
    digest = hashlib.sha256(f"{name}\0{folder}".encode()).hexdigest()
    return {"name": tagged(name), "model": tagged(name), "modified_at": modified, "size": size, "digest": digest,
            "details": {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
                        "parameter_size": "", "quantization_level": ""}}  # fmt: skip


@accepts(ShowRequest)
async def show(request: Request, server: "Server"):
    """A model's details, as Ollama's."""
    body = fields(await read_json(request, server), ShowRequest)
    if body.get("model") is None and body.get("name") is not None:  # Ollama's deprecated spelling, which it takes
        body = {**body, "model": body["name"]}
    model = served(server, body, None, "/api/show")
    family = facts(model)["family"]
    info = {"general.architecture": family, "general.parameter_count": facts(model)["parameters"],
            f"{family}.context_length": model.max_length}  # fmt: skip
    if EMBED in model.capabilities:
        info[f"{family}.embedding_length"] = model.dimension
    return {
        "modelfile": "", "parameters": "", "template": "", "details": details(model), "model_info": info,
        "capabilities": ["embedding"] if EMBED in model.capabilities else [],
        "modified_at": facts(model)["modified_at"],
    }  # fmt: skip


async def ps(request: Request, server: "Server"):
    models = []
    for model in server.models.values():
        f = facts(model)
        models.append({
            "name": tagged(model.name), "model": tagged(model.name), "size": f["size"], "digest": f["digest"],
            "details": details(model), "expires_at": expires_at(server, model.name), "size_vram": 0,
            "context_length": model.max_length,
        })  # fmt: skip
    return {"models": models}


def expires_at(server: "Server", name: str) -> str:
    """When the model unloads: a --models-dir model's expiry, or Ollama's far date for one kept loaded."""
    expiry = server.lazy.expiry(name) if server.lazy is not None else None
    if expiry is None or expiry >= FOREVER_S:  # a keep_alive past Ollama's far date (or a datetime's range) too
        return FOREVER
    return datetime.datetime.fromtimestamp(expiry, datetime.timezone.utc).isoformat()


async def version(request: Request, server: "Server"):
    return {"version": __version__}


ROUTES = {
    "/api/embed": (embed, ["POST"]),
    "/api/embeddings": (embeddings, ["POST"]),
    "/api/tags": (tags, ["GET"]),
    "/api/show": (show, ["POST"]),
    "/api/ps": (ps, ["GET"]),
    "/api/version": (version, ["GET"]),
}


def error(e: ApiError) -> dict:
    return {"error": e.message}
