"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes a `ChatRequest` like a chat completion (instructions as the system message,
input items as messages, function tools, `reasoning.effort` as the thinking tier, `text.format`
through the grammar engine). A stored response (`store`, the default, with a session store)
is a session named by the response id holding the whole conversation through that response
(instructions excluded: they do not carry over), plus the response object; the next request's
`previous_response_id` continues from its messages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from localmoe.chat import ChatFormatError, ChatMessage, messages_from_openai
from localmoe.chat.sessions import SessionError
from localmoe.runtime.service import ChatRequest, Service, new_id, sampling_params
from localmoe.server.errors import APIError, stream_error
from localmoe.server.images import url_loader
from localmoe.server.openai_routes import service_of, tool_mode
from localmoe.server.responses_output import EventBuilder, items_of, usage_of
from localmoe.server.responses_schemas import REASONING_EFFORT, ResponsesRequest, input_messages
from localmoe.server.structured import output_schema

router = APIRouter()


def _sessions(service: Service, param: str):
    if service.sessions is None:
        raise APIError(400, f"{param} needs stored responses, but this server stores none "
                            f"(start it with --sessions PATH)", param=param)
    return service.sessions


def _history(service: Service, previous: str | None) -> list[ChatMessage]:
    if previous is None:
        return []
    store = _sessions(service, "previous_response_id")
    if store.record(previous) is None:
        raise APIError(404, f"previous_response_id {previous!r} is not a stored response (it expired, was "
                            f"deleted, or was created with store: false)", param="previous_response_id",
                       code="previous_response_not_found")
    return store.messages(previous)


def _chat_request(body: ResponsesRequest, history: list[ChatMessage],
                  roots: tuple[Path, ...] = ()) -> tuple[ChatRequest, list[ChatMessage]]:
    try:
        new = messages_from_openai(input_messages(body.input), url_loader(roots))
    except ChatFormatError as e:
        raise APIError(400, str(e), param="input") from None
    called = {c.id: c.name for m in history for c in m.tool_calls if c.id}  # outputs of calls made earlier
    for m in new:
        if m.role == "tool" and m.name is None:
            m.name = called.get(m.tool_call_id or "")
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
             for t in body.tools or []]
    choice = body.tool_choice
    mode, names = tool_mode(choice if choice is None or isinstance(choice, str) else choice.name, tools)
    effort = body.reasoning.effort if body.reasoning else None
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required when type is \"json_schema\"", param="text.format.schema")
    system = [ChatMessage("system", body.instructions)] if body.instructions else []
    req = ChatRequest(
        messages=system + history + new, max_tokens=body.max_output_tokens,
        params=sampling_params(body.temperature, body.top_p, body.top_k, body.min_p, body.repetition_penalty,
                               body.seed),
        tools=tools, tool_mode=mode, tool_names=names, parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=REASONING_EFFORT[effort] if effort else None,
        reasoning_tokens=0 if effort == "none" else None,
        output_schema=output_schema(fmt.type, fmt.schema_, fmt.strict) if fmt else None,
        output_param="text.format")
    return req, history + new


def _response(body: ResponsesRequest, rid: str, created: int, model: str, items: list[dict], result=None,
              status: str = "completed") -> dict:
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    choice = body.tool_choice
    incomplete = result is not None and result.finish_reason == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else status,
        "completed_at": int(time.time()) if result is not None and not incomplete else None,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "output": items, "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": fmt}, "truncation": "disabled",
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        "tools": [{**t.model_dump(), "strict": bool(t.strict)} for t in body.tools or []],
        "usage": usage_of(result) if result is not None else None,
    }


def _store(service: Service, body: ResponsesRequest, rid: str, conversation: list[ChatMessage], result,
           response: dict) -> None:
    """Keep the conversation through this response and the response object (store: true)."""
    if not body.store or service.sessions is None or result.finish_reason == "cancelled":
        return
    answer = ChatMessage("assistant", result.content, reasoning=result.reasoning or None,
                         tool_calls=list(result.tool_calls))
    service.sessions.ensure(rid, title="response", model=service.model_id)
    service.sessions.append(rid, *conversation, answer)
    service.sessions.set_record(rid, json.dumps(response, ensure_ascii=False))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI Responses API: text or items in, output items out; streaming; stored for previous_response_id."""
    service = service_of(request)
    service.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, f"unsupported field(s) for this server: {', '.join(unsupported)}; remove them "
                            f"(see docs/api.md, Responses API)", param=unsupported[0])
    history = await run_in_threadpool(_history, service, body.previous_response_id)
    req, conversation = await run_in_threadpool(_chat_request, body, history, service.config.documents_roots)
    stream = await service.chat(req)
    rid, created = new_id("resp_"), int(time.time())
    if body.stream:
        return StreamingResponse(_events(service, body, stream, rid, created, conversation),
                                 media_type="text/event-stream")
    result = await stream.result(request.is_disconnected)
    response = _response(body, rid, created, service.model_id, items_of(result), result)
    await run_in_threadpool(_store, service, body, rid, conversation, result, response)
    return response


async def _events(service: Service, body: ResponsesRequest, stream, rid: str, created: int, conversation):
    sequence = 0

    def sse(event: dict) -> str:
        nonlocal sequence
        event["sequence_number"] = sequence
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    builder = EventBuilder()
    pending = _response(body, rid, created, service.model_id, [], status="in_progress")
    yield sse({"type": "response.created", "response": pending})
    yield sse({"type": "response.in_progress", "response": pending})
    try:
        async for kind, payload in stream.events():
            if kind == "delta":
                for event in builder.delta(payload):
                    yield sse(event)
                continue
            for event in builder.finish(payload):
                yield sse(event)
            response = _response(body, rid, created, service.model_id, builder.items, payload)
            await run_in_threadpool(_store, service, body, rid, conversation, payload, response)
            done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield sse({"type": done, "response": response})
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, never a cut connection
        error = stream_error(e, "/v1/responses")["error"]
        yield sse({"type": "error", "code": error["code"] or error["type"], "message": error["message"],
                   "param": error["param"]})


def _stored(service: Service, response_id: str) -> str:
    store = service.sessions
    body = store.record(response_id) if store is not None else None
    if body is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id")
    return body


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    """A stored response object."""
    return json.loads(await run_in_threadpool(_stored, service_of(request), response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    """Forget a stored response (and its conversation)."""
    service = service_of(request)
    await run_in_threadpool(_stored, service, response_id)
    try:
        await run_in_threadpool(service.sessions.delete, response_id)
    except SessionError as e:
        raise APIError(404, str(e), param="response_id") from None
    return {"id": response_id, "object": "response.deleted", "deleted": True}
