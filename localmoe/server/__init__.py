"""OpenAI- and Anthropic-compatible HTTP API over one loaded model (FastAPI + uvicorn).

    from localmoe.server import ServerConfig, Service, create_app, serve
    serve(load_model(None), ServerConfig(api_key="secret"), host="127.0.0.1", port=8000)

Layering: handlers (openai_routes.py, anthropic_routes.py, ...) -> the runtime's Service
(localmoe/runtime/service.py: render, limits, sessions) -> its one EngineWorker thread (worker.py:
scheduling, batched steps) advancing per-request turns (turn.py) over Decoders. The runtime's
errors become HTTP statuses in errors.py. docs/api.md shows the endpoints with curl and SDKs.
"""

from __future__ import annotations

from localmoe.runtime.service import ServerConfig, Service


def create_app(service: Service):
    """The FastAPI app of `service` (imported lazily: fastapi is the `server` extra)."""
    from localmoe.server.app import create_app as _create_app

    return _create_app(service)


def serve(loaded, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          chat_format=None) -> None:
    """Serve `loaded` (a LoadedModel) until interrupted."""
    from dataclasses import replace

    import uvicorn

    from localmoe.server.security import allowed_hosts_for

    config = replace(config, allowed_hosts=tuple(dict.fromkeys(config.allowed_hosts + allowed_hosts_for(host))))
    app = create_app(Service(loaded, config, chat_format))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


__all__ = ["ServerConfig", "Service", "create_app", "serve"]
