"""The Textual chat app (`localmoe chat`): streaming replies, reasoning panels, tool-call
approval cards, a thinking-budget selector, a session list and a live status bar.

Everything about prompts, tools and history is `localmoe.ui.conversation.Conversation`'s;
this module only draws it. Keys (also in the footer): ctrl+b / F2 budget, ctrl+t / F3
tools on/off, ctrl+r / F4 open or close the last reasoning panel, ctrl+o / F5 sessions,
ctrl+n new session, y / n on a tool card, ctrl+q quit. A message starting with
`/tool NAME` makes the model call that built-in tool first; `/image PATH` attaches an image
file (a model with a vision tower) that the next message shows the model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from localmoe.ui.conversation import DENIED, Conversation
from localmoe.ui.stats import snapshot, status_line
from localmoe.ui.tools import BUILTIN_NAMES
from localmoe.ui.tui.images import AttachedImage
from localmoe.ui.tui.screens import LOAD_PHASES, LoadingScreen, SessionsScreen
from localmoe.ui.tui.widgets import AssistantMessage, BudgetSelector, StatusBar, ToolCard, UserMessage
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Input, Static

from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.errors import LocalMoEError

Loader = Callable[[Callable[[int], None]], object]  # (phase callback) -> a started Service


def load_service(model: str | None, engine_config, server_config) -> Loader:
    """A loader for ChatApp: load the model, build the Service, start its engine worker."""

    def load(phase: Callable[[int], None]):
        from localmoe.load import load_model
        from localmoe.runtime.service import Service

        phase(0)
        loaded = load_model(model, engine_config, progress=False)  # tqdm would draw over the TUI
        phase(1)
        service = Service(loaded, server_config)
        phase(2)
        service.start()
        phase(len(LOAD_PHASES))
        return service

    return load


def parse_tool_prefix(text: str) -> tuple[str | None, str]:
    """"/tool NAME rest" -> (NAME, rest); anything else -> (None, text). Raises ValueError for an unknown NAME."""
    if not text.startswith("/tool "):
        return None, text
    _, name, *rest = text.split(maxsplit=2)
    if name not in BUILTIN_NAMES:
        raise ValueError(f"/tool {name}: not a built-in tool; use one of {', '.join(BUILTIN_NAMES)}")
    return name, rest[0] if rest else f"Use {name}."


IMAGE_COMMAND = "/image "
MAX_IMAGE_BYTES = 20 << 20


def read_image_file(path: Path) -> bytes:
    """The bytes of an image file the user names; ValueError saying what is wrong."""
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_IMAGE_BYTES >> 20} MiB; scale it down first")
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None


class ChatApp(App):
    """Chat with a Service; give `service` (started) or `loader` (see load_service)."""

    CSS_PATH = "chat.tcss"
    TITLE = "localmoe chat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+b,f2", "cycle_budget", "Budget", priority=True),
        Binding("ctrl+t,f3", "toggle_tools", "Tools", priority=True),
        Binding("ctrl+r,f4", "toggle_reasoning", "Reasoning", priority=True),
        Binding("ctrl+o,f5", "sessions", "Sessions", priority=True),
        Binding("ctrl+n", "new_session", "New", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, service=None, *, loader: Loader | None = None, model_name: str = "model",
                 workdir: Path | None = None, budget: str = "high", tools_enabled: bool = True,
                 session_id: str | None = None, max_tokens: int | None = None, runner=None,
                 params=None, stats: Callable[[], str] | None = None, stats_interval: float = 1.0):
        super().__init__()
        if (service is None) == (loader is None):
            raise ValueError("ChatApp needs exactly one of service (started) or loader")
        self.service = service
        self.loader = loader
        self.owns_service = service is None  # a service it loaded, it stops on exit
        self.model_name = model_name
        self.options = {"workdir": workdir, "budget": budget, "tools_enabled": tools_enabled, "max_tokens": max_tokens,
                        "runner": runner, "params": params}  # params: SamplingParams (None: the conversation's)
        self.initial_session = session_id
        self.stats = stats
        self.stats_interval = stats_interval
        self.conversation: Conversation | None = None
        self.busy = False
        self.cards: dict[str, ToolCard] = {}

    def compose(self) -> ComposeResult:
        # kept as attributes: the main screen's widgets, reachable while another screen is on top
        self.title_bar = Static("", id="title", markup=False)
        self.tools_state = Static("", id="tools-state")
        self.budget_selector = BudgetSelector(self.options["budget"], id="budget")
        self.chat = VerticalScroll(id="chat")
        self.prompt = Input(placeholder="Message (enter sends; /tool NAME ... forces a tool call)", id="prompt")
        self.status_bar = StatusBar("loading", id="status", markup=False)
        with Horizontal(id="topbar"):
            yield self.title_bar
            yield self.tools_state
            yield self.budget_selector
        yield self.chat
        yield self.prompt
        yield self.status_bar
        yield Footer()

    def on_mount(self) -> None:
        if self.service is not None:
            self._start_chat(self.service)
            return
        self.push_screen(LoadingScreen(self.model_name))
        self.run_worker(self._load, thread=True, exclusive=True, group="load")

    def _load(self) -> None:
        screen = self.screen

        def phase(index: int) -> None:
            self.call_from_thread(screen.phase, index)

        try:
            service = self.loader(phase)
        except Exception as e:  # noqa: BLE001 - shown on the loading screen instead of a traceback
            self.call_from_thread(screen.failed, str(e))
            return
        self.call_from_thread(self._loaded, service)

    def _loaded(self, service) -> None:
        self.pop_screen()
        self._start_chat(service)

    def _start_chat(self, service) -> None:
        self.service = service
        self.conversation = Conversation(service, self.initial_session, **self.options)
        self.model_name = service.model_id
        self._render_history()
        self._refresh_bars()
        self.set_interval(self.stats_interval, self.refresh_status)
        self.prompt.focus()

    def on_unmount(self) -> None:
        if self.owns_service and self.service is not None:
            self.service.stop()

    # ---- drawing ----

    def _refresh_bars(self) -> None:
        conv = self.conversation
        title = self.model_name
        if conv is not None and conv.stored and self.service.sessions.exists(conv.session_id):
            title += " | " + (self.service.sessions.info(conv.session_id).title or "(untitled)")
        self.title_bar.update(title)
        tools = conv is not None and conv.tools_enabled
        self.tools_state.update("tools: [b]on[/]" if tools else "tools: off")
        self.refresh_status()

    def refresh_status(self) -> None:
        if self.service is None:
            return
        line = self.stats() if self.stats is not None else status_line(snapshot(self.service,
                                                                                self.conversation.last_turn))
        self.status_bar.update(("generating | " if self.busy else "") + line)

    def _render_history(self) -> None:
        """Draw the conversation's stored messages (after resuming a session)."""
        chat = self.chat
        chat.remove_children()
        self.cards.clear()
        results = {m.tool_call_id: m.content for m in self.conversation.messages if m.role == "tool"}
        widgets = []
        for m in self.conversation.messages:
            if m.role == "user":
                widgets.extend(AttachedImage(f"image {k + 1}", ref) for k, ref in enumerate(m.images))
                widgets.append(UserMessage(m.content))
            elif m.role == "assistant":
                if m.content or m.reasoning or not m.tool_calls:
                    widgets.append(AssistantMessage(m.content, m.reasoning or ""))
                widgets.extend(self._stored_card(call, results.get(call.id)) for call in m.tool_calls)
        chat.mount_all(widgets)
        chat.scroll_end(animate=False)

    @staticmethod
    def _stored_card(call: ToolCall, result: str | None) -> ToolCard:
        return ToolCard(call, decided=result is not None and result != DENIED, result=result or "")

    def _assistant_messages(self) -> list[AssistantMessage]:
        return list(self.chat.query(AssistantMessage))

    # ---- sending ----

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.conversation is None:
            return
        if self.busy:
            self.notify("the model is still answering; wait for it to finish", severity="warning")
            return
        if text.startswith(IMAGE_COMMAND):
            self._attach_image(text[len(IMAGE_COMMAND):].strip())
            event.input.value = ""
            return
        try:
            forced, text = parse_tool_prefix(text)
        except ValueError as e:
            self.notify(str(e), severity="error")
            return
        event.input.value = ""
        self.conversation.tool_choice = forced
        self.busy = True
        self.run_worker(self._send(text), exclusive=True, group="send")

    def _attach_image(self, given: str) -> None:
        """`/image PATH` (relative paths from the working directory): shown in the chat, sent with the next message."""
        path = Path(given).expanduser()
        if not path.is_absolute():
            path = self.conversation.runner.workdir / path
        try:
            ref = self.conversation.attach_image(read_image_file(path), path.name)
        except (ValueError, LocalMoEError) as e:
            self.notify(str(e), severity="error")
            return
        self.chat.mount(AttachedImage(path.name, ref))
        self.chat.scroll_end(animate=False)

    async def _send(self, text: str) -> None:
        chat = self.chat
        await chat.mount(UserMessage(text))
        current: AssistantMessage | None = None
        try:
            async for event in self.conversation.send(text, self._approve):
                if event.kind in ("reasoning", "content"):
                    if current is None:
                        current = AssistantMessage()
                        await chat.mount(current)
                    current.add(event.kind, event.text)
                    chat.scroll_end(animate=False)
                elif event.kind == "turn_done":
                    if current is None and not event.turn.tool_calls:
                        current = AssistantMessage()
                        await chat.mount(current)
                    if current is not None:
                        current.finish(event.turn)
                    current = None
                elif event.kind == "tool_result":
                    self.cards[event.tool_call.id].show_result(event.approved, event.result)
                    chat.scroll_end(animate=False)
        except Exception as e:  # noqa: BLE001 - a failed request is shown in the chat, the app goes on
            await chat.mount(Static(f"error: {e}", markup=False, classes="error"))
        finally:
            self.busy = False
            self._refresh_bars()
            self.prompt.focus()

    async def _approve(self, call: ToolCall) -> bool:
        """Show a card for `call` and wait for the user's y / n."""
        card = ToolCard(call)
        self.cards[call.id] = card
        chat = self.chat
        await chat.mount(card)
        chat.scroll_end(animate=False)
        return await card.wait()

    # ---- actions ----

    def on_budget_selector_changed(self, event: BudgetSelector.Changed) -> None:
        if self.conversation is not None:
            self.conversation.budget = event.budget

    def action_cycle_budget(self) -> None:
        self.budget_selector.cycle()

    def action_toggle_tools(self) -> None:
        if self.conversation is not None:
            self.conversation.tools_enabled = not self.conversation.tools_enabled
            self._refresh_bars()

    def action_toggle_reasoning(self) -> None:
        with_reasoning = [m for m in self._assistant_messages() if m.reasoning_text]
        if not with_reasoning:
            self.notify("no reasoning to show yet")
            return
        panel = with_reasoning[-1].reasoning_panel
        panel.collapsed = not panel.collapsed

    def action_sessions(self) -> None:
        if self.service is None or self.service.sessions is None:
            self.notify("this chat stores no sessions", severity="warning")
            return
        if self.busy:
            self.notify("wait for the answer before switching sessions", severity="warning")
            return
        self.push_screen(SessionsScreen(self.service.sessions, self.conversation.session_id), self._session_chosen)

    def _session_chosen(self, session_id: str | None) -> None:
        conv = self.conversation
        if session_id is not None and session_id != conv.session_id:
            conv.resume(session_id)
        elif conv.session_id is not None and not self.service.sessions.exists(conv.session_id):
            conv.session_id, conv.messages = None, []  # the current session was deleted
        self._render_history()
        self._refresh_bars()

    def action_new_session(self) -> None:
        if self.busy or self.conversation is None:
            return
        self.conversation.session_id = None
        self.conversation.messages = []
        self.conversation.last_turn = None
        self._render_history()
        self._refresh_bars()

    def history(self) -> list[ChatMessage]:
        """The conversation's messages (for tests and callers)."""
        return list(self.conversation.messages) if self.conversation else []
