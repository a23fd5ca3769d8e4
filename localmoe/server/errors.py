"""HTTP errors as JSON bodies in the OpenAI or the Anthropic shape.

Every error a client can cause is an `APIError` with a status (4xx), a type and a message
that names the field at fault; handlers raise it and `error_response` renders it in the
shape the endpoint's SDK expects.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

log = logging.getLogger("localmoe.server")

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def status_and_message(error: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) of any error a request can end with: an APIError as it is,
    the runtime's errors by kind (`NotFoundError` 404, any other `LocalMoEError`, the user's input, 400),
    anything else 500 naming the error."""
    from localmoe.errors import LocalMoEError, NotFoundError, RequestError

    if isinstance(error, APIError):
        return error.status, error.message, error.param, error.code
    if isinstance(error, RequestError):
        return 404 if isinstance(error, NotFoundError) else 400, str(error), error.param, error.code
    if isinstance(error, LocalMoEError):
        return 400, str(error), None, None
    return 500, f"internal error while generating ({type(error).__name__}: {error}); the server goes on serving", \
        None, None


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(status: int, message: str, path: str, param: str | None = None, code: str | None = None) -> dict:
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                           "message": message}}
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def stream_error(error: BaseException, path: str) -> dict:
    """The body of the error event that ends a started stream (logged when it is the server's fault)."""
    status, message, param, code = status_and_message(error)
    if status >= 500:
        log.error("a stream ended with an internal error", exc_info=error)
    return error_body(status, message, path, param, code)


def error_response(status: int, message: str, path: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, path, param, code), status_code=status, headers=headers)
