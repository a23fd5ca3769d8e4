"""One chat session over a `Service`, shared by the TUI and the web app so that neither has
its own prompt or tool logic.

`send(text, approve)` streams what happens while the model answers one user message:
reasoning and content deltas, the tool calls it makes (each one waits for `approve`), the
tool results, the end of every model turn, and "done". Approved calls run through
`localmoe.ui.tools.ToolRunner`; their output goes back to the model as a tool message
and the model takes another turn. A denied call never runs: the model is told so in the
tool message. History (reasoning and tool calls included) lives in the Service's session
store when it has one, else in `messages`. `attach_image(bytes)` queues an image (checked against
the model's vision tower at once) that the next user message shows before its text.

    conversation = Conversation(service)
    async for event in conversation.send("hello", approve=ask_user):
        if event.kind == "content":
            print(event.text, end="")
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from localmoe.ui.tools import BUILTIN_NAMES, BUILTIN_TOOLS, ToolRunner

from localmoe.chat.format import REASONING_EFFORTS, ChatMessage, ToolCall
from localmoe.chat.images import ImageRef
from localmoe.engine.sampler import SamplingParams
from localmoe.errors import LocalMoEError

DENIED = "The user denied this tool call; it did not run. Do not retry it unless the user asks."
MAX_TOOL_ROUNDS = 8  # model turns after tool results within one user message (a model looping on calls stops)

Approve = Callable[[ToolCall], Awaitable[bool]]


@dataclass
class ConversationEvent:
    """kind: "reasoning" | "content" (text) | "tool_call" (tool_call) | "tool_result" (tool_call, result,
    approved) | "turn_done" (turn: the model turn's TurnResult) | "done" (the user's message is answered)."""

    kind: str
    text: str = ""
    tool_call: ToolCall | None = None
    result: str | None = None
    approved: bool | None = None
    turn: object | None = None


class Conversation:
    """A chat session: history, thinking budget, tools on or off."""

    def __init__(self, service, session_id: str | None = None, *, tools_enabled: bool = True,
                 workdir: Path | None = None, budget: str = "high", runner: ToolRunner | None = None,
                 max_tokens: int | None = None, params: SamplingParams | None = None):
        self.service = service
        self.tools_enabled = tools_enabled
        self.budget = budget
        self.runner = runner or ToolRunner(Path.cwd() if workdir is None else workdir)
        self.max_tokens = max_tokens
        self.params = params or SamplingParams(temperature=0.7, top_p=0.9)
        self.tool_choice: str | None = None  # a built-in tool name forces that call on the next model turn
        self.session_id = session_id
        self.messages: list[ChatMessage] = []
        self.attached: list[ImageRef] = []  # images the next user message shows (attach_image)
        self.last_turn = None  # the TurnResult of the latest model turn (for ui.stats.snapshot)
        if session_id is not None:
            self.resume(session_id)
        self.warm()

    def warm(self) -> None:
        """Have the service prefill this conversation's fixed header (system message, tool definitions) while
        the user types, so the first message prefills only itself (`Service.warm`)."""
        self.service.warm(self._request([ChatMessage("user", "...")], None))

    @property
    def budget(self) -> str:
        return self._budget

    @budget.setter
    def budget(self, value: str) -> None:
        if value not in REASONING_EFFORTS:
            raise ValueError(f"budget must be one of {', '.join(REASONING_EFFORTS)}, not {value!r}")
        self._budget = value

    @property
    def stored(self) -> bool:
        """History is kept by the service's session store (else only in `messages`)."""
        return self.service.sessions is not None and self.session_id is not None

    def resume(self, session_id: str) -> None:
        """Continue a stored session: its messages become the history."""
        store = self.service.sessions
        if store is None:
            raise ValueError("this service keeps no sessions (give ServerConfig a sessions_path to resume one)")
        self.session_id = store.check_id(session_id)
        self.messages = store.messages(session_id) if store.exists(session_id) else []

    def new_session(self, title: str = "") -> str:
        """Start an empty session (stored when the service has a store); returns its id."""
        self.messages = []
        store = self.service.sessions
        self.session_id = store.create(title=title, model=self.service.model_id) if store is not None else None
        self.warm()
        return self.session_id or ""

    def attach_image(self, data: bytes, name: str = "image") -> ImageRef:
        """Queue an image (a file's bytes) for the next message, checked now against the model's vision tower;
        returns it sized (the width x height the tower sees, its placeholder tokens). Raises LocalMoEError
        (a model without a tower, not a usable image) naming `name`."""
        from localmoe.runtime.images import size_images

        ref = ImageRef.of(data)
        try:
            (message,) = size_images(self.service.loaded, [ChatMessage("user", "", images=[ref])])
        except LocalMoEError as e:
            raise LocalMoEError(f"{name}: {str(e).removeprefix('messages[0] image 1: ')}") from None
        self.attached.append(ref)
        return message.images[0]

    def _request(self, new: list[ChatMessage], forced: str | None):
        from localmoe.runtime.service import ChatRequest

        tools = BUILTIN_TOOLS if self.tools_enabled else []
        mode = "named" if forced else ("auto" if tools else "none")
        history = new if self.stored else self.messages + new
        return ChatRequest(messages=list(history), max_tokens=self.max_tokens, params=self.params, tools=tools,
                           tool_mode=mode, tool_names=[forced] if forced else [], reasoning_effort=self.budget,
                           session_id=self.session_id if self.stored else None)

    async def send(self, text: str, approve: Approve) -> AsyncIterator[ConversationEvent]:
        """Answer one user message; see the module docstring for the events."""
        if self.service.sessions is not None and self.session_id is None:
            self.new_session(title=text.strip().splitlines()[0][:60] if text.strip() else "")
        forced = self.tool_choice if self.tools_enabled else None
        if forced is not None and forced not in BUILTIN_NAMES:
            raise ValueError(f"tool_choice {forced!r} is not a built-in tool ({', '.join(BUILTIN_NAMES)})")
        self.tool_choice = None
        new = [ChatMessage("user", text, images=self.attached)]  # the attached images go before the text
        self.attached = []
        for _ in range(MAX_TOOL_ROUNDS + 1):
            stream = await self.service.chat(self._request(new, forced))
            self.messages.extend(new)
            forced = None
            turn = None
            try:
                async for kind, payload in stream.events():
                    if kind == "delta" and payload.tool_call is None and payload.text:
                        yield ConversationEvent(payload.channel, text=payload.text)
                    elif kind == "done":
                        turn = payload
            except asyncio.CancelledError:  # stopped: the history keeps what was shown, as the store does
                partial = stream.partial
                self.messages.append(ChatMessage("assistant", partial.content, reasoning=partial.reasoning or None,
                                                 tool_calls=list(partial.tool_calls), interrupted=True))
                raise
            self.messages.append(ChatMessage("assistant", turn.content, reasoning=turn.reasoning or None,
                                             tool_calls=list(turn.tool_calls)))
            self.last_turn = turn
            yield ConversationEvent("turn_done", turn=turn)
            if not turn.tool_calls or turn.finish_reason == "cancelled":
                break
            new = []
            for call in turn.tool_calls:
                yield ConversationEvent("tool_call", tool_call=call)
                approved = bool(await approve(call))
                # on a worker thread: a run_command may take up to its timeout and the UI keeps drawing
                result = await asyncio.to_thread(self.runner.run, call) if approved else DENIED
                yield ConversationEvent("tool_result", tool_call=call, result=result, approved=approved)
                new.append(ChatMessage("tool", result, name=call.name, tool_call_id=call.id))
        else:  # out of rounds with results not yet shown to the model: keep them in the history
            self.messages.extend(new)
            if self.stored:
                self.service.sessions.append(self.session_id, *new)
        yield ConversationEvent("done")
