"""One browser tab's chat: a shared `Conversation`, its approval gate and the chat pane.

`send` answers a user message and yields after every change the page should show. With
documents attached, the message is a question about them and goes to
`localmoe.documents.answer`; otherwise it goes to the Conversation, which streams the
model's turns and pauses at each tool call until the user clicks Approve or Deny.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from localmoe.ui.web.approval import ApprovalGate
from localmoe.ui.web.documents import answer_documents
from localmoe.ui.web.transcript import Transcript

from localmoe.errors import LocalMoEError

_END = object()  # marks the end of the conversation's events in the queue


class WebSession:
    """Per-tab state: conversation, approval gate, attached documents, chat pane."""

    def __init__(self, service, workdir: Path, budget: str = "high", tools_enabled: bool = True,
                 max_tokens: int | None = None, on_turn=None, upload_root: Path | None = None):
        from localmoe.ui.conversation import Conversation

        self.service = service
        self.workdir = Path(workdir)
        self.conversation = Conversation(service, tools_enabled=tools_enabled, workdir=self.workdir, budget=budget,
                                         max_tokens=max_tokens)
        self.gate = ApprovalGate()
        self.transcript = Transcript()
        self.documents: list[Path] = []
        self.upload_root = Path(upload_root) if upload_root is not None else None  # attached files must be inside
        self.busy = False
        self.stopped = False  # the user stopped the answer in progress (`stop`)
        self._task: asyncio.Task | None = None  # the conversation's task while it answers
        self._idle = asyncio.Event()  # set while no `send` runs
        self._idle.set()
        self.max_tokens = max_tokens
        self.on_turn = on_turn  # called with each finished model turn's TurnResult (the app's live figures)

    def attach(self, paths: list[Path]) -> None:
        """Documents the next questions are about ([] detaches); search_documents searches them too.

        Each must resolve inside `upload_root` when one is set (localmoe.pathguard.PathRefused otherwise;
        nothing is attached then)."""
        runner = self.conversation.runner
        if self.upload_root is not None and paths:
            from localmoe.pathguard import resolve_inside

            paths = [resolve_inside(p, [self.upload_root]) for p in paths]
        self.documents = [Path(p) for p in paths]
        runner.document_paths = list(self.documents) or [runner.workdir]
        runner.document_roots = [self.upload_root] if self.documents and self.upload_root else [runner.workdir]

    def resume(self, session_id: str) -> None:
        """Continue a stored session in this tab (the page was reloaded): its messages are shown and the next
        message goes on from them. Raises ValueError (no session store) or LocalMoEError (a bad id)."""
        self.conversation.resume(session_id)
        self.transcript.load(self.conversation.messages, self._image_file)

    def _image_file(self, ref) -> Path | None:
        """A stored image written back as a file the page may serve (in `upload_root`, named by its hash), or
        None without an upload root or for bytes that are no image."""
        if self.upload_root is None:
            return None
        import io

        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(ref.data)) as probe:
                kind = (probe.format or "").lower()
        except (UnidentifiedImageError, OSError, ValueError):
            return None
        path = self.upload_root / "stored" / f"{ref.sha256}.{kind or 'img'}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{os.getpid()}.part")
            part.write_bytes(ref.data)
            part.replace(path)
        return path

    async def new_chat(self, wait: float = 10.0) -> None:
        """Start a new conversation. An answer in progress is stopped first (kept in its own session, marked
        interrupted) and its end awaited, up to `wait` seconds, so it cannot write into the new conversation."""
        self.stop()
        if self.busy:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), wait)
        self.gate.deny_pending()
        self.conversation.new_session()
        self.transcript.clear()

    def close(self) -> None:
        self.gate.deny_pending()
        self.stop()

    def stop(self) -> None:
        """End the answer in progress (the Stop button): its model turn is cancelled where it is (what was shown
        stays, in the history and the store, marked interrupted) and no tool round follows."""
        if self._task is not None and not self._task.done():
            self.stopped = True
            self.gate.deny_pending()
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)

    def attach_images(self, paths: list[Path]) -> None:
        """Images (uploaded or pasted files, inside `upload_root` when one is set) for the next message, each checked
        against the model's vision tower and shown in the chat; LocalMoEError / PathRefused name what is wrong."""
        for path in paths:
            if self.upload_root is not None:
                from localmoe.pathguard import resolve_inside

                path = resolve_inside(path, [self.upload_root])
            self.conversation.attach_image(Path(path).read_bytes(), Path(path).name)
            self.transcript.user_image(Path(path))

    async def send(self, text: str, images: list[Path] = ()) -> AsyncIterator[None]:
        """Answer `text` (after showing `images` with it, a model with a vision tower); yields whenever `transcript`
        or `gate.call` changed."""
        if self.busy:
            self.transcript.note("Still answering the previous message; wait for it to finish.", title="Busy")
            yield
            return
        self.busy = True
        self._idle.clear()
        try:
            if images:
                try:
                    self.attach_images(list(images))
                except LocalMoEError as e:
                    self.conversation.attached = []
                    self.transcript.note(str(e), title="Image not sent")
                    yield
                    return
            self.transcript.user(text)
            yield
            if self.documents:
                async for _ in answer_documents(self.service, self.documents, text, self.conversation.budget,
                                                self.transcript, self.max_tokens):
                    yield
            else:
                async for _ in self._chat(text):
                    yield
        finally:
            self.busy = False
            self._idle.set()

    async def _chat(self, text: str) -> AsyncIterator[None]:
        # The conversation runs in its own task: while it awaits the user's approval this
        # generator must keep yielding, so the page can show the pending call and its buttons.
        events: asyncio.Queue = asyncio.Queue()

        async def approve(call) -> bool:
            await events.put("approval")
            return await self.gate.ask(call)

        async def pump() -> None:
            try:
                async for event in self.conversation.send(text, approve):
                    await events.put(event)
            except Exception as e:  # noqa: BLE001 - shown in the chat instead of breaking the page
                await events.put(e)
            finally:
                await events.put(_END)

        budget = self.conversation.budget
        self.stopped = False
        task = self._task = asyncio.ensure_future(pump())
        try:
            while (item := await events.get()) is not _END:
                if isinstance(item, Exception):
                    self.transcript.note(f"{type(item).__name__}: {item}", title="Error")
                elif item != "approval":
                    self.transcript.apply(item, budget)
                    if item.kind == "turn_done" and item.turn is not None and self.on_turn is not None:
                        self.on_turn(item.turn)
                yield
            if self.stopped:
                self.transcript.stopped()
                yield
        finally:
            self._task = None
            self.gate.deny_pending()
            if not task.done():
                task.cancel()
