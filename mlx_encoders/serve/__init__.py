"""`mlx-encoders serve`: an HTTP server of embeddings (OpenAI's /v1/embeddings, TEI's /embed and /embed_sparse),
reranking (/v1/rerank, TEI's /rerank), classification (/v1/classify, TEI's /predict) and index search
(/v1/search), and the whole API of Hugging Face text-embeddings-inference; Cohere's, Ollama's and Infinity's routes
too (protocols/), batching concurrent requests per model.
Needs the `serve` extra (Starlette, uvicorn, prometheus_client):
`pip install -e ".[serve]"` in a checkout.

    app = mlx_encoders.serve.app({"minilm": "path/to/all-MiniLM-L6-v2"})   # an ASGI app, models loaded and warm
    uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from pathlib import Path

MISSING = (
    "mlx-encoders serve needs Starlette, uvicorn and prometheus_client: pip install starlette uvicorn "
    'prometheus_client (in a checkout: pip install -e ".[serve]")'
)


def require_stack() -> None:
    """An ImportError naming the extra to install when Starlette, uvicorn or prometheus_client is missing."""
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{MISSING} ({' and '.join(missing)} not installed)")


def load_models(models, dtype: str | None = None, batch_size: int = 32, indexes: dict | None = None) -> tuple:
    """(served models, served indexes). `models`: a path or hub id, a list of them (each named after its folder or
    hub id), or {name: path}; `indexes`: {name: index folder}, each searched with the served model of its model's
    folder, else with its model loaded too."""
    from .models import ServedModel, default_name
    from .search import open_index

    if isinstance(models, (str, Path)):
        models = [models]
    models = models or []
    named = models.items() if isinstance(models, dict) else [(default_name(m), m) for m in models]
    if not named and not indexes:
        raise ValueError("nothing to serve: give at least one model (path or hub id) or index")
    served = [ServedModel(name, source, dtype, batch_size) for name, source in named]
    return served, [open_index(name, folder, served, dtype, batch_size) for name, folder in (indexes or {}).items()]


def app(
    models=None, *, indexes: dict | None = None, dtype: str | None = None, models_dir: str | Path | None = None,
    model_keep_alive: float = 300.0, **options,
):  # fmt: skip
    """A Starlette (ASGI) app serving `models` and `indexes` (see `load_models`), loaded and warmed on return, and
    the sub-folders of `models_dir`, each loaded on its first request and unloaded after `model_keep_alive` idle
    seconds (negative: never). `options` are `Options` fields: max_batch_tokens, max_wait_ms, max_queue,
    max_inputs, max_request_bytes, auto_truncate, batch_size, api_key, cors_origins, read_timeout. Its lifespan
    shutdown stops the model workers."""
    require_stack()
    from .lazy import ModelsDir
    from .server import Options, Server, build

    settings = Options(**options)
    lazy = None if models_dir is None else ModelsDir(models_dir, model_keep_alive, dtype, settings.batch_size)
    served, indexed = (
        load_models(models, dtype, settings.batch_size, indexes) if models or indexes or not lazy else ([], [])
    )
    server = Server(served, settings, indexed, lazy)
    server.warm()
    return build(server)
