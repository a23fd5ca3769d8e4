"""Anthropic-compatible `/v1/messages`: system, thinking with budget_tokens, thinking /
text / image / tool_use / tool_result blocks, and the streaming event sequence."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.chat.images import ImageRef
from localmoe.runtime.service import ChatRequest, Service, new_id, sampling_params
from localmoe.runtime.turn import TurnResult
from localmoe.server.anthropic_schemas import EFFORT_TIER, CountTokensRequest, MessagesRequest
from localmoe.server.errors import APIError, stream_error
from localmoe.server.images import anthropic_source_bytes

router = APIRouter()
SIGNATURE = "localmoe"  # thinking blocks carry a signature field; ours only marks where they came from


def chat_messages(body: MessagesRequest, roots: tuple[Path, ...] = ()) -> list[ChatMessage]:
    """The request's messages; image blocks' sources read as data or under `roots` (server/images.py)."""
    out: list[ChatMessage] = []
    if (system := body.system_text()) is not None:
        out.append(ChatMessage("system", system))
    names: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append(ChatMessage(message.role, message.content))
            continue
        texts, reasoning, calls, images = [], [], [], []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "document":
                raise APIError(400, f"{where}: document blocks are not supported (send the text, or use "
                                    f"/v1/documents)")
            if block.type == "image":
                if message.role != "user":
                    raise APIError(400, f"{where}: image blocks belong to user messages")
                images.append(ImageRef.of(anthropic_source_bytes(block.source, roots, where),
                                          sum(len(t) for t in texts)))
            elif block.type == "text":
                texts.append(block.text)
            elif block.type == "thinking":
                if message.role != "assistant":
                    raise APIError(400, f"{where}: thinking blocks belong to assistant messages")
                reasoning.append(block.thinking)
            elif block.type == "tool_use":
                if message.role != "assistant":
                    raise APIError(400, f"{where}: tool_use blocks belong to assistant messages")
                calls.append(ToolCall(block.name, dict(block.input), block.id))
                names[block.id] = block.name
            elif block.type == "tool_result":
                if message.role != "user":
                    raise APIError(400, f"{where}: tool_result blocks belong to user messages")
                out.append(ChatMessage("tool", block.text(), tool_call_id=block.tool_use_id,
                                       name=names.get(block.tool_use_id)))
        if message.role == "assistant":
            out.append(ChatMessage("assistant", "".join(texts), reasoning="".join(reasoning) or None,
                                   tool_calls=calls))
        elif texts or images or not any(b.type == "tool_result" for b in message.content):
            out.append(ChatMessage("user", "".join(texts), images=images))
    return out


def chat_request(body: MessagesRequest, service: Service) -> ChatRequest:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []]
    choice = body.tool_choice
    mode, names = ("auto" if tools else "none"), []
    if choice is not None:
        mode = {"auto": "auto", "any": "required", "none": "none", "tool": "named"}[choice.type]
        if mode == "named":
            if not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name")
            names = [choice.name]
    reasoning_tokens = None
    if body.thinking is not None and body.thinking.type == "enabled":
        reasoning_tokens = body.thinking.budget_tokens
        if reasoning_tokens >= body.max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({reasoning_tokens}) must be less than max_tokens "
                                f"({body.max_tokens})")
    return ChatRequest(
        messages=chat_messages(body, service.config.documents_roots), max_tokens=body.max_tokens,
        params=sampling_params(body.temperature, body.top_p, body.top_k, body.min_p, body.repetition_penalty,
                               body.seed),
        tools=tools, tool_mode=mode, tool_names=names,
        reasoning_effort=EFFORT_TIER[effort] if (effort := body.output_config and body.output_config.effort) else None,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        reasoning_tokens=reasoning_tokens, stop=list(body.stop_sequences or []), seconds=body.max_time_s,
        bytes_read=body.max_bytes_read, session_id=body.session_id, output_param="output_config.format",
        output_schema=body.output_config.format.output_schema() if body.output_config and body.output_config.format
        else None)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt tokens `messages.create` with the same body would send to the model (system, tools, effort
    and session history included): what it reports as `input_tokens + cache_read_input_tokens`."""
    service: Service = request.app.state.service
    service.check_model(body.model)
    budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else 0
    full = body.model_copy(update={"max_tokens": body.max_tokens or budget + 1})
    prep, _ = await run_in_threadpool(lambda: service.prepare_chat(chat_request(full, service)))
    return {"input_tokens": len(prep.prompt)}


def stop_reason(result: TurnResult) -> str:
    if result.tool_calls and result.finish_reason in ("tool_calls", "stop"):
        return "tool_use"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if result.finish_reason == "length" else "end_turn"


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + (call.id or "")[len("call_"):] if call.id else new_id("toolu_")


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    """Messages (Anthropic schema)."""
    service: Service = request.app.state.service
    service.check_model(body.model)
    stream = await service.chat(await run_in_threadpool(chat_request, body, service))
    mid = new_id("msg_")
    if body.stream:
        return StreamingResponse(_events(stream, mid, service.model_id, request.url.path),
                                 media_type="text/event-stream")
    result = await stream.result(request.is_disconnected)
    content: list[dict] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": SIGNATURE})
    if result.content or not result.tool_calls:
        content.append({"type": "text", "text": result.content})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": call.arguments})
    return {"id": mid, "type": "message", "role": "assistant", "model": service.model_id, "content": content,
            "stop_reason": stop_reason(result), "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.prompt_tokens - result.cached_tokens,  # as Anthropic counts: uncached
                      "cache_read_input_tokens": result.cached_tokens, "output_tokens": result.completion_tokens}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(stream, mid: str, model: str, path: str):
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": len(stream_prompt(stream)), "output_tokens": 0}}})
    index, open_kind = -1, None

    def close():
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                                "signature": SIGNATURE}}))
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        open_kind = None
        return "".join(out)

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        return out + _event("content_block_start", {"index": index, "content_block": block})

    try:
        async for kind, payload in stream.events():
            if kind == "delta":
                if payload.tool_call is not None:
                    call = payload.tool_call
                    yield start("tool_use", {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                             "input": {}})
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}})
                    yield close()
                elif payload.channel == "reasoning":
                    if open_kind != "thinking":
                        yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                   "thinking": payload.text}})
                else:
                    if open_kind != "text":
                        yield start("text", {"type": "text", "text": ""})
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                   "text": payload.text}})
            else:
                if index < 0:  # an empty answer still has one (empty) text block
                    yield start("text", {"type": "text", "text": ""})
                yield close()
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason(payload),
                                                         "stop_sequence": payload.stop_sequence},
                                               "usage": {"output_tokens": payload.completion_tokens}})
                yield _event("message_stop", {})
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, never a cut connection
        yield f"event: error\ndata: {json.dumps(stream_error(e, path), ensure_ascii=False)}\n\n"


def stream_prompt(stream) -> list[int]:
    return getattr(stream, "prompt", [])
