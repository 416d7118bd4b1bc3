"""/v1/search: a served index searched as `Index.search` does it."""

import asyncio
import functools
from typing import TYPE_CHECKING, Annotated, Literal, Required, TypedDict

import numpy as np
from starlette.requests import Request

from ...embeddings.sparse import SparseVectors
from ...index import DamagedStore
from ...index.search import FUSIONS, MAX_K, RRF_K
from ..errors import ApiError
from ..requests import number, option, read_json, required_text
from ..schema import accepts, fields

if TYPE_CHECKING:  # the server imports every protocol
    from ..server import Server


class SearchRequest(TypedDict, total=False):
    query: Required[str]
    index: Annotated[str, "the served index (default: the only one)"]
    top_k: Annotated[int, "the best documents to answer (default 10)"]
    precision: Annotated[Literal["float32", "int8", "binary"], "the vectors ranked (default float32)"]
    truncate: Annotated[bool, "cut an over-long query to the model's length (default: --auto-truncate)"]
    mode: Annotated[Literal["dense", "sparse", "hybrid"], "default: dense when the index has a dense model"]
    fusion: Annotated[Literal["rrf", "weighted"], "how a hybrid search fuses its two rankings (default rrf)"]
    rrf_k: Annotated[float, "reciprocal rank fusion's k (default 60)"]
    alpha: Annotated[float, "the dense share of a weighted fusion, in [0, 1] (default 0.5)"]
    depth: Annotated[int, "each mode's best documents fused (default 100)"]


@accepts(SearchRequest)
async def search(request: Request, server: "Server"):
    """A served index's `top_k` best documents for `query`, as `Index.search` gives them (id, score, text), in the
    request's `mode` ("dense", "sparse" or "hybrid"; default: as `Index.search` picks) with its `fusion`, `rrf_k`,
    `alpha` and `depth`. Each embedding the mode needs runs on its model's worker."""
    body = fields(await read_json(request, server), SearchRequest)
    served = server.index(body.get("index"))
    query = required_text(body, "query")
    top_k = option(body, "top_k", int, 10, 1)
    precision = option(body, "precision", str, "float32")
    truncate = option(body, "truncate", bool, server.options.auto_truncate)
    mode = option(body, "mode", str)
    if mode is not None and mode not in served.modes:
        raise ApiError(
            400, f"index {served.name!r} cannot answer a {mode!r} search; its modes: {', '.join(served.modes)}", "mode"
        )
    fusion = option(body, "fusion", str, "rrf")
    if fusion not in FUSIONS:
        raise ApiError(400, f'"fusion" must be one of {", ".join(FUSIONS)}, got {fusion!r}', "fusion")
    rrf_k, alpha = number(body, "rrf_k", RRF_K, 0), number(body, "alpha", 0.5, 0, 1)
    depth = option(body, "depth", int, 100, 1)
    for name, value in (("top_k", top_k), ("depth", depth)):
        if value > MAX_K:
            raise ApiError(400, f'"{name}" must be at most {MAX_K}, got {value}', name)
    loop = asyncio.get_running_loop()
    try:  # opening an index at a new precision reads its vectors: off the event loop, as the search itself
        index = await loop.run_in_executor(None, served.index, precision)
    except ValueError as e:
        raise ApiError(400, f"index {served.name!r}: {e}", "precision") from None
    try:  # the mode Index.search takes (None: the index's default), and its checks of the other options
        mode = index.check_mode(mode, top_k, fusion, rrf_k, alpha, depth)
    except ValueError as e:
        raise ApiError(400, f"index {served.name!r}: {e}", "mode") from None
    used = [m for m, ok in ((served.model, mode != "sparse"), (served.sparse, mode != "dense")) if ok]
    items = [await server.tokenize(m, m.tokenize, [query], truncate, param="query", task="query") for m in used]
    out = await asyncio.gather(*(server.run(m, i) for m, i in zip(used, items, strict=True)))
    vector = served.model.embeddings(out[0], None, normalize=True)[0] if mode != "sparse" else None
    sparse = None
    if mode != "dense":
        ids, weights = out[-1][0]
        width = served.sparse.sparse.get_embedding_dimension()
        sparse = SparseVectors(np.zeros(len(ids), np.int64), np.asarray(ids, np.int64), weights, (width,))
    options = {"mode": mode, "fusion": fusion, "rrf_k": rrf_k, "alpha": alpha, "depth": depth}
    try:  # an index rebuilt since it was opened is opened again; a rebuild with other models cannot be
        search = functools.partial(served.search, precision, (vector, sparse), top_k, **options)
        hits = await loop.run_in_executor(None, search)
    except DamagedStore as e:
        raise ApiError(500, f"index {served.name!r}: {e}", None, "index_damaged") from None
    except ValueError as e:
        raise ApiError(503, f"index {served.name!r}: {e}", None, "index_changed") from None
    tokens = sum(len(item.ids) for i in items for item in i)
    return {
        "object": "list",
        "index": served.name,
        "mode": mode,
        "model": used[0].name,
        **({"sparse_model": used[1].name} if len(used) == 2 else {}),
        "hits": [{"id": h.id, "score": h.score, "text": h.text} for h in hits],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


ROUTES = {"/v1/search": (search, ["POST"])}


def error(e: ApiError) -> dict:
    return e.openai()
