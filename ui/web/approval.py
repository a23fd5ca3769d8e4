"""Tool-call approval across two browser events: the chat stream waits, a button click answers.

The Conversation awaits `approve(call)` while its turn is paused; in the web app the answer
comes from another Gradio event (the Approve or Deny button), handled on the same event
loop, so the waiting side holds a Future that the click resolves.
"""

from __future__ import annotations

import asyncio


class ApprovalGate:
    """At most one tool call waits here for the user's decision."""

    def __init__(self):
        self.call = None  # the ToolCall waiting for a decision, or None
        self._answer: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def ask(self, call) -> bool:
        """Wait until `decide` is called; True means run the call."""
        if self._answer is not None:
            raise RuntimeError("a tool call is already waiting for approval")
        self._loop = asyncio.get_running_loop()
        self._answer = self._loop.create_future()
        self.call = call
        try:
            return await self._answer
        finally:
            self.call = None
            self._answer = None

    def decide(self, approved: bool) -> bool:
        """Answer the waiting call (from any thread); False when nothing was waiting."""
        answer, loop = self._answer, self._loop
        if answer is None or loop is None:
            return False

        def settle() -> None:
            if not answer.done():
                answer.set_result(bool(approved))

        loop.call_soon_threadsafe(settle)
        return True

    def deny_pending(self) -> None:
        """Deny whatever is waiting (the page closed, a new chat began)."""
        self.decide(False)
