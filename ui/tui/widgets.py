"""The chat screen's pieces: messages, the reasoning panel, tool-call cards, the budget
selector and the status bar. Each is one row high where it can be, for 80x24 terminals."""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Collapsible, Static

from localmoe.chat.format import REASONING_EFFORTS, ToolCall

RESULT_PREVIEW_LINES = 12  # a tool result longer than this shows its first lines only


class UserMessage(Static):
    """What the user typed."""

    def __init__(self, text: str):
        super().__init__(text, markup=False, classes="user")


class AssistantMessage(Vertical):
    """One model turn: a collapsible reasoning panel (shown once reasoning arrives) and the answer,
    both filled while the reply streams."""

    def __init__(self, content: str = "", reasoning: str = ""):
        super().__init__(classes="assistant")
        self.content_text = content
        self.reasoning_text = reasoning
        self.reasoning_panel = Collapsible(Static(reasoning, markup=False, classes="reasoning-text"),
                                           title="Reasoning", collapsed=True, classes="reasoning")
        self.reasoning_panel.display = bool(reasoning)
        self.answer = Static(content, markup=False, classes="answer")
        self.answer.display = bool(content) or not reasoning

    def compose(self) -> ComposeResult:
        yield self.reasoning_panel
        yield self.answer

    def add(self, channel: str, text: str) -> None:
        if channel == "reasoning":
            self.reasoning_text += text
            self.reasoning_panel.display = True
            self.reasoning_panel.query_one(".reasoning-text", Static).update(self.reasoning_text)
            self.reasoning_panel.title = f"Reasoning ({len(self.reasoning_text)} chars)"
        else:
            self.content_text += text
            self.answer.display = True
            self.answer.update(self.content_text)

    def finish(self, turn) -> None:
        """The turn is over: note why it stopped when that is worth knowing."""
        if turn.reasoning_closed_by:
            self.reasoning_panel.title = f"Reasoning ({turn.reasoning_tokens} tokens, budget reached)"
        elif self.reasoning_text:
            self.reasoning_panel.title = f"Reasoning ({turn.reasoning_tokens} tokens)"
        if not self.content_text.strip() and not turn.tool_calls:
            self.answer.display = True
            self.answer.update(f"(no answer: finish reason {turn.finish_reason})")


def call_summary(call: ToolCall) -> str:
    arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments,
                                                                                    ensure_ascii=False)
    return f"{call.name}({arguments})"


class ToolCard(Vertical, can_focus=True):
    """A tool call waiting for the user: Approve (y) or Deny (n); afterwards it shows the result."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("y", "decide(True)", "Approve"), Binding("n", "decide(False)", "Deny")]

    class Decided(Message):
        def __init__(self, card: ToolCard, approved: bool):
            super().__init__()
            self.card = card
            self.approved = approved

    def __init__(self, call: ToolCall, decided: bool | None = None, result: str | None = None):
        super().__init__(classes="tool-card")
        self.call = call
        # resolved by the user's y / n; a card for a stored call (decided given) asks nothing
        self.decision: asyncio.Future[bool] | None = None if decided is not None else \
            asyncio.get_running_loop().create_future()
        self.approved = decided
        self.result_text = result
        self.border_title = f"tool call: {call.name}"

    def compose(self) -> ComposeResult:
        yield Static(call_summary(self.call), markup=False, classes="tool-args")
        with Horizontal(classes="tool-buttons"):
            yield Button("Approve (y)", classes="approve", variant="success", compact=True)
            yield Button("Deny (n)", classes="deny", variant="error", compact=True)
        yield Static("", markup=False, classes="tool-result")

    def on_mount(self) -> None:
        if self.approved is not None:
            self.show_result(self.approved, self.result_text or "")

    async def wait(self) -> bool:
        """Focus the card and wait for the user's decision."""
        self.focus()
        return await self.decision

    def action_decide(self, approved: bool) -> None:
        if self.decision is not None and not self.decision.done():
            self.decision.set_result(approved)
            self.approved = approved
            self.query_one(".tool-buttons").display = False
            self.border_subtitle = "approved: running" if approved else "denied"
            self.post_message(self.Decided(self, approved))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_decide(event.button.has_class("approve"))

    def show_result(self, approved: bool, result: str) -> None:
        self.approved = approved
        self.result_text = result
        self.query_one(".tool-buttons").display = False
        self.border_subtitle = "approved" if approved else "denied: not run"
        lines = result.splitlines()
        preview = "\n".join(lines[:RESULT_PREVIEW_LINES])
        if len(lines) > RESULT_PREVIEW_LINES:
            preview += f"\n[... {len(lines) - RESULT_PREVIEW_LINES} more lines]"
        self.query_one(".tool-result", Static).update(preview if approved else "The call did not run.")
        self.set_class(not approved, "denied")


class BudgetSelector(Static):
    """The thinking budget: low / high / max, the active one highlighted; click or ctrl+b cycles."""

    class Changed(Message):
        def __init__(self, budget: str):
            super().__init__()
            self.budget = budget

    def __init__(self, budget: str, **kwargs):
        super().__init__("", **kwargs)
        self.budget = budget

    def on_mount(self) -> None:
        self.refresh_label()

    def budget_markup(self) -> str:
        return "budget: " + " ".join(f"[reverse]{t}[/]" if t == self.budget else t for t in REASONING_EFFORTS)

    def refresh_label(self) -> None:
        self.update(self.budget_markup())

    def select(self, budget: str) -> None:
        if budget not in REASONING_EFFORTS:
            raise ValueError(f"budget must be one of {', '.join(REASONING_EFFORTS)}, not {budget!r}")
        self.budget = budget
        self.refresh_label()
        self.post_message(self.Changed(budget))

    def cycle(self) -> None:
        self.select(REASONING_EFFORTS[(REASONING_EFFORTS.index(self.budget) + 1) % len(REASONING_EFFORTS)])

    def on_click(self) -> None:
        self.cycle()


class StatusBar(Static):
    """tokens/s, time to first token, tier hit rates, RAM/VRAM: one line, refreshed by the app."""
