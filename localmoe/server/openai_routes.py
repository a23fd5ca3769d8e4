"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from localmoe.chat import ChatFormatError, messages_from_openai
from localmoe.runtime.service import ChatRequest, Service, new_id, sampling_params, tool_call_dict
from localmoe.runtime.turn import TurnResult
from localmoe.server.errors import APIError, stream_error
from localmoe.server.images import url_loader
from localmoe.server.schemas import EFFORT_TIER, ChatCompletionRequest, CompletionRequest
from localmoe.server.structured import chat_output_schema

router = APIRouter()


def service_of(request: Request) -> Service:
    return request.app.state.service


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(result: TurnResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens}}


def finish_reason(result: TurnResult) -> str:
    return result.finish_reason if result.finish_reason in ("stop", "length", "tool_calls") else "stop"


def tool_mode(choice: str | None, tools: list) -> tuple[str, list[str]]:
    """OpenAI `tool_choice` ("none" / "auto" / "required", a function's name, or absent) -> (mode, names)."""
    if choice is None:
        return ("auto" if tools else "none"), []
    if choice in ("none", "auto", "required"):
        return choice, []
    return "named", [choice]


def chat_request(body: ChatCompletionRequest, service: Service) -> ChatRequest:
    try:
        messages = messages_from_openai([m.model_dump(exclude_none=True) for m in body.messages],
                                        url_loader(service.config.documents_roots))
    except ChatFormatError as e:
        raise APIError(400, str(e), param="messages") from None
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    mode, names = tool_mode(choice if choice is None or isinstance(choice, str) else choice.function.name, tools)
    try:
        schema = chat_output_schema(body.response_format)
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from None
    return ChatRequest(
        output_schema=schema, messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
        params=sampling_params(body.temperature, body.top_p, body.top_k, body.min_p, body.repetition_penalty,
                               body.seed),
        tools=tools, tool_mode=mode, tool_names=names, parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=EFFORT_TIER[body.reasoning_effort] if body.reasoning_effort else None,
        reasoning_tokens=body.max_reasoning_tokens, stop=body.stops(), seconds=body.max_time_s,
        bytes_read=body.max_bytes_read, session_id=body.session_id, spec=body.spec)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Chat completion (OpenAI schema): streaming, tools, reasoning_effort, reasoning_content."""
    service = service_of(request)
    service.check_model(body.model)
    stream = await service.chat(await run_in_threadpool(chat_request, body, service))
    rid, created = new_id("chatcmpl-"), int(time.time())
    head = {"id": rid, "created": created, "model": service.model_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_events(stream, head, include_usage, request.url.path),
                                 media_type="text/event-stream")
    result = await stream.result(request.is_disconnected)
    message: dict = {"role": "assistant", "content": result.content if result.content or not result.tool_calls
                     else None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [tool_call_dict(c) for c in result.tool_calls]
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result), "logprobs": None}],
            "usage": usage(result)}


async def _chat_events(stream, head: dict, include_usage: bool, path: str):
    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for kind, payload in stream.events():
            if kind == "delta":
                if payload.tool_call is not None:
                    call = tool_call_dict(payload.tool_call)
                    yield chunk({"tool_calls": [{"index": calls, **call}]})
                    calls += 1
                elif payload.channel == "reasoning":
                    yield chunk({"reasoning_content": payload.text})
                else:
                    yield chunk({"content": payload.text})
            else:
                yield chunk({}, finish_reason(payload))
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(payload)})
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error chunk, never a cut connection
        yield sse(stream_error(e, path))
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """Plain text completion (OpenAI legacy schema)."""
    service = service_of(request)
    service.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    params = sampling_params(body.temperature, body.top_p, body.top_k, body.min_p, body.repetition_penalty, body.seed)
    stream = service.completion_stream(prompt, body.max_tokens, params, body.stops(), body.spec)
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": service.model_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_completion_events(stream, head, include_usage, request.url.path),
                                 media_type="text/event-stream")
    result = await stream.result(request.is_disconnected)
    return {**head, "choices": [{"index": 0, "text": result.content, "finish_reason": finish_reason(result),
                                 "logprobs": None}],
            "usage": {k: v for k, v in usage(result).items() if k != "completion_tokens_details"}}


async def _completion_events(stream, head: dict, include_usage: bool, path: str):
    try:
        async for kind, payload in stream.events():
            if kind == "delta":
                yield sse({**head, "choices": [{"index": 0, "text": payload.text, "finish_reason": None,
                                                "logprobs": None}]})
            else:
                yield sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": finish_reason(payload),
                                                "logprobs": None}]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(payload)})
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error chunk, never a cut connection
        yield sse(stream_error(e, path))
    yield sse("[DONE]")
