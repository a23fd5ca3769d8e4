"""The OpenAPI schema tells the truth: every operation declares the error statuses the server
can answer with (and their JSON bodies), FastAPI's 422 (never sent: validation errors are 400)
is removed, and streamed answers are declared as `text/event-stream`."""

from __future__ import annotations

from collections.abc import Callable

from localmoe.server.errors import is_anthropic_path

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
WHY = {400: "Malformed JSON, a field of the wrong type or out of range, text that is not valid Unicode, or a "
            "request the model cannot serve (context, max_tokens); the message names the field",
       401: "Missing or wrong API key (servers started with --api-key)",
       403: "The Host header is not an allowed name (--allowed-hosts), or a document path is outside "
            "--documents-root (or none was given)",
       404: "Unknown model, session or response id",
       413: "The body is larger than --max-body",
       500: "An internal error (a bug), reported as JSON; the server goes on serving"}
STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}


def _statuses(path: str, method: str) -> list[int]:
    statuses = [400, 403, 500]
    if path != "/health":
        statuses.append(401)
    if method in ("post", "put", "patch"):
        statuses.append(413)
    if "{" in path or method == "post" or path.startswith(("/v1/sessions", "/v1/responses")):
        statuses.append(404)
    return sorted(set(statuses))


def truthful(openapi: Callable[[], dict]) -> Callable[[], dict]:
    """Wrap FastAPI's `app.openapi` (see the module docstring); the result is built once."""
    cache: dict = {}

    def schema() -> dict:
        if cache:
            return cache
        spec = openapi()
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        components["OpenAIError"], components["AnthropicError"] = OPENAI_ERROR, ANTHROPIC_ERROR
        for path, operations in spec.get("paths", {}).items():
            body = {"$ref": "#/components/schemas/" + ("AnthropicError" if is_anthropic_path(path) else "OpenAIError")}
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status in _statuses(path, method):
                    responses.setdefault(str(status), {"description": WHY[status],
                                                       "content": {"application/json": {"schema": body}}})
                if path in STREAMED and method == "post":
                    ok = responses.setdefault("200", {"description": "Successful Response"})
                    ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": {"type": "string"}})
        spec["components"]["schemas"].pop("HTTPValidationError", None)
        spec["components"]["schemas"].pop("ValidationError", None)
        cache.update(spec)
        return cache

    return schema
