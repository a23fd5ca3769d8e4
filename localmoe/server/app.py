"""The FastAPI application: middleware (API key, body size), error shapes, and the small
endpoints (/health, /metrics, /v1/sessions); the model endpoints live in openai_routes.py
and anthropic_routes.py."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localmoe.chat.sessions import SESSION_ID, SessionError, message_to_dict
from localmoe.errors import CancelledError, LocalMoEError
from localmoe.runtime.service import Service
from localmoe.server import anthropic_routes, document_routes, model_routes, openai_routes, responses_routes
from localmoe.server.errors import APIError, error_response, status_and_message
from localmoe.server.openapi import truthful
from localmoe.server.security import HostCheck

OPEN_PATHS = {"/health"}  # answered without an API key


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc) or "body"
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg', '')}", None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "value_error" and where == "body":  # a whole-body check names its own field
        return message, message.split(":", 1)[0]
    return f"{where}: {message}", where


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413 (by Content-Length, or while reading)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = error_response(413, f"the request body is larger than {self.limit} bytes", scope["path"])
        if length is not None:
            try:
                if int(length) > self.limit:
                    return await too_big(scope, receive, send)
            except ValueError:
                return await error_response(400, "Content-Length is not a number", scope["path"])(scope, receive,
                                                                                                   send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await too_big(scope, receive, send)


class _TooLarge(Exception):
    pass


class AuthAndCount:
    """ASGI middleware: the API key check (all paths but OPEN_PATHS) and request counts by path and status.

    Pure ASGI rather than `@app.middleware("http")`, which would hide client disconnects
    from the handlers (they must see them to cancel generation)."""

    def __init__(self, app, service: Service, known_paths: set):
        self.app = app
        self.service = service
        self.known = known_paths

    def _key_error(self, scope) -> str | None:
        key = self.service.config.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        given = headers.get("x-api-key")
        bearer = headers.get("authorization", "")
        if given is None and bearer.lower().startswith("bearer "):
            given = bearer[7:].strip()
        if given is not None and hmac.compare_digest(given.encode(), key.encode()):
            return None
        return ("missing API key" if given is None else "wrong API key") + \
            ": send Authorization: Bearer KEY or x-api-key: KEY"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        label = path if path in self.known else "other"
        if (message := self._key_error(scope)) is not None:
            self.service.metrics.request(label, 401)
            response = error_response(401, message, path, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)

        async def counting_send(event):
            if event["type"] == "http.response.start":
                self.service.metrics.request(label, event["status"])
            await send(event)

        await self.app(scope, receive, counting_send)


# the pattern is shown in the schema; the store's check gives the clearer message
SessionId = Annotated[str, Path(json_schema_extra={"pattern": SESSION_ID.pattern})]


def create_app(service: Service) -> FastAPI:
    """The app over a started or not yet started `service` (started and stopped with the app)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="localmoe", version="0.1.0", lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible API over a localmoe model.")
    app.state.service = service
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(document_routes.router)
    app.include_router(model_routes.router)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error.status, error.message, request.url.path, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return error_response(400, message, request.url.path, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):  # 404, and 405 with its Allow header
        return error_response(error.status_code, str(error.detail), request.url.path, headers=error.headers)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, error: SessionError):
        status = 404 if str(error).startswith("no session") else 400
        return error_response(status, str(error), request.url.path, "session_id")

    @app.exception_handler(LocalMoEError)
    async def user_error(request: Request, error: LocalMoEError):  # the runtime's errors, by kind
        status, message, param, code = status_and_message(error)
        return error_response(status, message, request.url.path, param, code)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):  # still a bug: logged by the server, but JSON
        status, message, _, _ = status_and_message(error)
        return error_response(status, message, request.url.path)

    @app.exception_handler(CancelledError)
    async def cancelled(request: Request, error: CancelledError):
        return error_response(499, "the client closed the request", request.url.path)

    @app.get("/health")
    async def health():
        """Liveness: the model is loaded and the engine worker runs."""
        return {"status": "ok", "model": service.model_id, "queue_depth": service.worker.waiting,
                "active": service.worker.active}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Prometheus text: tokens/s, queue depth, time to first token, tier hit rates."""
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    def sessions():
        if service.sessions is None:
            raise APIError(404, "this server stores no sessions (start it with --sessions PATH)")
        return service.sessions

    @app.get("/v1/sessions")
    async def list_sessions():
        """Stored sessions, most recently updated first."""
        return {"object": "list", "data": [s.to_dict() for s in sessions().list()]}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: SessionId):
        """A session and every stored message (reasoning and tool calls included)."""
        store = sessions()
        store.check_id(session_id)
        return {**store.info(session_id).to_dict(),
                "messages": [message_to_dict(m) for m in store.messages(session_id)]}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: SessionId):
        store = sessions()
        store.check_id(session_id)
        store.delete(session_id)
        return {"id": session_id, "deleted": True}

    app.openapi = truthful(app.openapi)
    known = {getattr(r, "path", None) for r in (*app.routes, *openai_routes.router.routes,
                                                *anthropic_routes.router.routes, *document_routes.router.routes)}
    app.add_middleware(AuthAndCount, service=service, known_paths=known)
    app.add_middleware(BodyLimit, limit=service.config.max_body_bytes)
    app.add_middleware(HostCheck, allowed=service.config.allowed_hosts)
    return app
