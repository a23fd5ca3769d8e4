"""Screens besides the chat: model loading (progress bar), the session list (resume, rename,
delete) and the one-line rename prompt."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Label, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option

LOAD_PHASES = ("reading the weights", "building the chat format", "starting the engine")


def rename_session(store, session_id: str, title: str) -> None:
    """Set a stored session's title (SessionStore.rename where the store has it)."""
    if hasattr(store, "rename"):
        store.rename(session_id, title)
        return
    store.info(session_id)  # raises SessionError naming an unknown session
    # SessionStore has no rename yet: the same single-statement transaction its other writes use
    store._write([("UPDATE sessions SET title = ? WHERE id = ?", (title, session_id))])


class LoadingScreen(Screen):
    """Shown while the model loads: the phase, a progress bar over the phases, elapsed seconds."""

    def __init__(self, model_name: str):
        super().__init__(id="loading")
        self.model_name = model_name
        self.started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label(f"Loading {self.model_name}", id="loading-title")
            yield Static(LOAD_PHASES[0], id="loading-phase", markup=False)
            yield ProgressBar(total=len(LOAD_PHASES), show_eta=False, id="loading-bar")
            yield Static("", id="loading-elapsed")

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        self.query_one("#loading-elapsed", Static).update(f"{time.monotonic() - self.started:.0f} s")

    def phase(self, index: int) -> None:
        """Phase `index` of LOAD_PHASES has begun (len(LOAD_PHASES): done)."""
        self.query_one("#loading-bar", ProgressBar).update(progress=index)
        if index < len(LOAD_PHASES):
            self.query_one("#loading-phase", Static).update(LOAD_PHASES[index])

    def failed(self, message: str) -> None:
        self.query_one("#loading-phase", Static).update(f"error: {message}\n(press ctrl+q to quit)")
        self.query_one("#loading-bar", ProgressBar).display = False


class RenameScreen(ModalScreen[str | None]):
    """Asks for a new session title; dismisses with the title, or None on escape."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.current = title

    def compose(self) -> ComposeResult:
        with Vertical(id="rename-box"):
            yield Label("New title (enter to save, escape to cancel):")
            yield Input(self.current, id="rename-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())


class SessionsScreen(ModalScreen[str | None]):
    """The stored sessions, newest first: enter resumes, r renames, d deletes, escape closes.
    Dismisses with the id of the session to resume (None: stay in the current one)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Close"), Binding("r", "rename", "Rename"),
                Binding("d", "delete", "Delete")]

    def __init__(self, store, current: str | None):
        super().__init__()
        self.store = store
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions-box"):
            yield Label("Sessions: enter resume, r rename, d delete, esc close", id="sessions-title")
            yield OptionList(id="sessions-list", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.reload()

    def reload(self) -> None:
        listing = self.query_one(OptionList)
        highlighted = listing.highlighted
        listing.clear_options()
        for info in self.store.list():
            mark = "*" if info.id == self.current else " "
            when = time.strftime("%m-%d %H:%M", time.localtime(info.updated))
            title = info.title or "(untitled)"
            listing.add_option(Option(f"{mark} {when}  {info.message_count:3d} msgs  {title}", id=info.id))
        if listing.option_count:
            listing.highlighted = min(highlighted or 0, listing.option_count - 1)
        listing.focus()

    def _selected(self) -> str | None:
        listing = self.query_one(OptionList)
        if listing.highlighted is None:
            return None
        return listing.get_option_at_index(listing.highlighted).id

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_rename(self) -> None:
        session_id = self._selected()
        if session_id is None:
            return

        def renamed(title: str | None) -> None:
            if title is not None:
                rename_session(self.store, session_id, title)
                self.reload()

        self.app.push_screen(RenameScreen(self.store.info(session_id).title), renamed)

    def action_delete(self) -> None:
        session_id = self._selected()
        if session_id is None:
            return
        self.store.delete(session_id)
        if session_id == self.current:
            self.current = None
        self.reload()
