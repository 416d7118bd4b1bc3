"""`mlx-encoders serve`: an HTTP server of embeddings (OpenAI's /v1/embeddings, TEI's /embed), reranking
(/v1/rerank, TEI's /rerank) and classification (/v1/classify, TEI's /predict), batching concurrent requests
per model. Needs the `serve` extra (Starlette, uvicorn): `pip install "mlx-encoders[serve]"`.

    app = mlx_encoders.serve.app({"minilm": "path/to/all-MiniLM-L6-v2"})   # an ASGI app, models loaded and warm
    uvicorn.run(app, host="127.0.0.1", port=8080)
"""

from pathlib import Path

MISSING = 'mlx-encoders serve needs Starlette and uvicorn: pip install "mlx-encoders[serve]"'


def require_stack() -> None:
    """An ImportError naming the extra to install when Starlette or uvicorn is missing."""
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{MISSING} ({' and '.join(missing)} not installed)")


def load_models(models, dtype: str | None = None, batch_size: int = 32) -> list:
    """`models`: a path or hub id, a list of them (each named after its folder or hub id), or {name: path}."""
    from .models import ServedModel, default_name

    if isinstance(models, (str, Path)):
        models = [models]
    named = models.items() if isinstance(models, dict) else [(default_name(m), m) for m in models]
    if not named:
        raise ValueError("no model to serve: give at least one path or hub id")
    return [ServedModel(name, source, dtype, batch_size) for name, source in named]


def app(models, *, dtype: str | None = None, **options):
    """A Starlette (ASGI) app serving `models` (see `load_models`), loaded and warmed on return. `options` are
    `Options` fields: max_batch_tokens, max_wait_ms, max_queue, max_inputs, max_request_bytes, auto_truncate,
    batch_size, api_key, cors_origins. Its lifespan shutdown stops the model workers."""
    require_stack()
    from .app import Options, Server, build

    settings = Options(**options)
    server = Server(load_models(models, dtype, settings.batch_size), settings)
    server.warm()
    return build(server)
