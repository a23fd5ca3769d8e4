"""The chat pane's contents: Conversation events turned into Gradio chatbot messages.

Gradio's chatbot takes a list of {"role", "content", "metadata"} dicts; a message whose
metadata has a "title" is drawn as a collapsible panel. Reasoning goes in such a panel
(the reasoning accordion), and so does each tool call (its arguments, then its output or
the denial), so the answer itself stays a plain assistant bubble.
"""

from __future__ import annotations

import json
import re

REASONING_TITLE = "Reasoning"
IMAGE_SHOWN = "(an image)"  # a stored user image that cannot be shown again (no file for it: see `load`)
TOOL_OUTPUT_SHOWN = 4000  # characters of a tool's output drawn in its card (the model gets all of it)


def fenced(text: str, language: str = "") -> str:
    """`text` as a markdown code block whose fence is longer than any backtick run inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"


def call_arguments(call) -> str:
    if call.raw_arguments is not None:
        return call.raw_arguments
    return json.dumps(call.arguments, ensure_ascii=False, indent=2)


def turn_summary(turn, budget: str) -> str:
    """One line about a finished model turn: tokens, speed, time to first token, budget, finish, and where it
    speculated the share of drafts kept and the tokens per step."""
    rate = turn.completion_tokens / turn.seconds if turn.seconds > 0 else 0.0
    parts = [f"{turn.completion_tokens} tokens in {turn.seconds:.2f} s ({rate:.1f} tok/s)",
             f"first token {turn.time_to_first_token:.2f} s", f"budget {budget}", f"finish {turn.finish_reason}"]
    if turn.reasoning_tokens:
        parts.insert(1, f"{turn.reasoning_tokens} reasoning")
    if turn.reasoning_closed_by:
        parts.append(f"reasoning closed by the {turn.reasoning_closed_by} budget")
    spec = getattr(turn, "spec", None)
    if spec is not None and spec.steps:
        parts.append(f"speculation: {spec.acceptance:.0%} of drafts kept, {spec.tokens_per_step:.2f} tokens per step")
    return " · ".join(parts)


class Transcript:
    """The chatbot message list, updated in place from ConversationEvents."""

    def __init__(self):
        self.messages: list[dict] = []
        self.last_turn: str = ""  # turn_summary of the latest finished model turn
        self._reasoning: int | None = None  # index of the open reasoning panel of the current turn
        self._content: int | None = None  # index of the current turn's answer bubble
        self._cards: dict[object, int] = {}  # tool call key -> index of its card

    def clear(self) -> None:
        self.__init__()

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def user_image(self, path) -> None:
        """An image the user sent (a file the page may serve: Gradio's upload folder)."""
        self.messages.append({"role": "user", "content": {"path": str(path)}})

    def note(self, text: str, title: str | None = None, pending: bool = False) -> int:
        """An assistant message outside the model's turns (errors, document progress); returns its index."""
        message: dict = {"role": "assistant", "content": text}
        if title is not None:
            message["metadata"] = {"title": title, "status": "pending" if pending else "done"}
        self.messages.append(message)
        return len(self.messages) - 1

    def apply(self, event, budget: str) -> None:
        """Fold one ConversationEvent into the messages."""
        kind = event.kind
        if kind == "reasoning":
            if self._reasoning is None:
                self._reasoning = self.note("", title=REASONING_TITLE, pending=True)
            self.messages[self._reasoning]["content"] += event.text
        elif kind == "content":
            self._close_reasoning()
            if self._content is None:
                self._content = self.note("")
            self.messages[self._content]["content"] += event.text
        elif kind == "tool_call":
            self._close_reasoning()
            call = event.tool_call
            index = self.note(fenced(call_arguments(call), "json"), title=f"Tool call {call.name}: waiting for approval",
                              pending=True)
            self._cards[self._key(call)] = index
        elif kind == "tool_result":
            self._tool_result(event)
        elif kind == "turn_done":
            self._close_reasoning()
            if event.turn is not None:
                self.last_turn = turn_summary(event.turn, budget)
            self._reasoning = self._content = None  # a tool round starts a new turn: new panels and bubble

    def load(self, messages, image_file=None) -> None:
        """Show a stored conversation (ChatMessages of a resumed session) as it looked when it was answered.
        `image_file(ref)` gives a file the page may serve for a stored image (ImageRef), or None: then the
        image is shown as IMAGE_SHOWN."""
        from localmoe.ui.conversation import DENIED, ConversationEvent

        from localmoe.chat.format import ToolCall

        self.clear()
        calls: dict = {}
        for message in messages:
            if message.role == "user":
                for ref in message.images:
                    path = image_file(ref) if image_file is not None else None
                    if path is not None:
                        self.user_image(path)
                    else:
                        self.user(IMAGE_SHOWN)
                self.user(message.content)
            elif message.role == "assistant":
                if message.reasoning:
                    self.apply(ConversationEvent("reasoning", text=message.reasoning), "")
                if message.content:
                    self.apply(ConversationEvent("content", text=message.content), "")
                self.apply(ConversationEvent("turn_done"), "")
                for call in message.tool_calls:
                    calls[call.id] = call
                    self.apply(ConversationEvent("tool_call", tool_call=call), "")
            elif message.role == "tool":
                call = calls.get(message.tool_call_id) or ToolCall(message.name or "tool", {}, id=message.tool_call_id)
                self.apply(ConversationEvent("tool_result", tool_call=call, result=message.content,
                                             approved=message.content != DENIED), "")
        for index in self._cards.values():  # a call the session never answered (its answer was cut short)
            card = self.messages[index]
            if card["metadata"]["status"] == "pending":
                card["metadata"].update(title=card["metadata"]["title"].replace("waiting for approval", "not run"),
                                        status="done")

    def stopped(self) -> None:
        """The user stopped the answer: its panels are closed and the turn line says so."""
        self._close_reasoning()
        for index in self._cards.values():
            self.messages[index]["metadata"]["status"] = "done"
        self.last_turn = "stopped"
        self._reasoning = self._content = None

    def _tool_result(self, event) -> None:
        call = event.tool_call
        index = self._cards.get(self._key(call))
        if index is None:  # a result whose call was never shown: give it its own card
            index = self.note(fenced(call_arguments(call), "json"), title=f"Tool call {call.name}")
        card = self.messages[index]
        if event.approved:
            output = event.result or ""
            shown = output[:TOOL_OUTPUT_SHOWN] + (f"\n… ({len(output) - TOOL_OUTPUT_SHOWN} more characters)"
                                                  if len(output) > TOOL_OUTPUT_SHOWN else "")
            card["metadata"]["title"] = f"Tool call {call.name}: approved, ran"
            card["content"] += "\n\nOutput:\n" + fenced(shown)
        else:
            card["metadata"]["title"] = f"Tool call {call.name}: denied, not run"
        card["metadata"]["status"] = "done"

    def _close_reasoning(self) -> None:
        if self._reasoning is not None:
            self.messages[self._reasoning]["metadata"]["status"] = "done"

    @staticmethod
    def _key(call) -> object:
        return call.id or id(call)
