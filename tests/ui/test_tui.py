"""The Textual chat app driven by its `run_test` pilot at 80x24.

Models: the embedded SmolLM2 for the streamed reply and the tool cards (there a `/tool NAME`
message forces the call through the server's JSON-constrained tool_choice, so a call happens
for sure while the model still writes its arguments); a tiny random Kimi K3 (thinking
format) for the reasoning panel and the budget. The snapshot test draws a stored session with
fixed status figures, so the screen is the same on every run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from localmoe.ui.conversation import DENIED
from localmoe.ui.stats import status_line
from localmoe.ui.tui import ChatApp
from localmoe.ui.tui.images import AttachedImage
from localmoe.ui.tui.screens import LOAD_PHASES, LoadingScreen, SessionsScreen
from localmoe.ui.tui.widgets import AssistantMessage, ToolCard, UserMessage
from textual.widgets import Input, OptionList

from localmoe.chat.format import ChatMessage, ToolCall

from .conftest import K3_BUDGETS, K3_SAMPLING, click_until, run_async, wait_until

SIZE = (80, 24)
SNAPSHOT = Path(__file__).parent / "snapshots" / "main_screen.svg"
FIXED_FIGURES = {"tokens_per_second": 21.5, "time_to_first_token": 0.42, "tier_hit_rates": {"gpu": 0.61, "ram": 0.97},
                 "ram_used_bytes": 5 << 30, "vram_used_bytes": 3 << 30}


async def _type(pilot, text: str) -> None:
    pilot.app.query_one("#prompt", Input).value = text
    await pilot.press("enter")


async def _answered(pilot, turns_before: int = 0) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: not app.busy and app.conversation.last_turn is not None, what="the reply")


def test_loading_screen_then_streamed_reply(smol, make_service, workdir):
    """The app loads through a loader (progress over LOAD_PHASES), then a message streams a reply."""
    service = make_service(smol, max_tokens_default=12)
    phases_seen = []

    def loader(phase):
        for index in range(len(LOAD_PHASES) + 1):
            phase(index)
            phases_seen.append(index)
        return service

    async def scenario():
        app = ChatApp(loader=loader, workdir=workdir, max_tokens=12, tools_enabled=False)
        app.owns_service = False  # the fixture stops it
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.conversation is not None, what="the model to load")
            assert not isinstance(app.screen, LoadingScreen)
            updates = []
            original = AssistantMessage.add

            def counting_add(self, channel, text):
                updates.append(text)
                original(self, channel, text)

            AssistantMessage.add = counting_add
            try:
                await _type(pilot, "Say hello.")
                await _answered(pilot)
            finally:
                AssistantMessage.add = original
            (message,) = app.query(AssistantMessage)
            stored = service.sessions.messages(app.conversation.session_id)
            assert stored[-1].role == "assistant" and message.content_text == stored[-1].content
            assert len(updates) > 1 and "".join(updates) == stored[-1].content
            assert [w.content for w in app.query(UserMessage)] == ["Say hello."]
            assert str(message.answer.render()) == stored[-1].content  # what the widget draws
            assert message.answer.region.height > 0 and app.screen.region.contains_region(message.answer.region)
        assert phases_seen == list(range(len(LOAD_PHASES) + 1))

    run_async(scenario())


def test_a_failed_load_is_shown_on_the_loading_screen(workdir):
    def loader(phase):
        phase(0)
        raise FileNotFoundError("model.gguf: no such file")

    async def scenario():
        app = ChatApp(loader=loader, workdir=workdir)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.5)
            assert isinstance(app.screen, LoadingScreen)
            assert "model.gguf: no such file" in str(app.screen.query_one("#loading-phase").render())

    run_async(scenario())


def test_reasoning_panel_opens_and_closes(k3, make_service, workdir):
    service = make_service(k3, budgets=K3_BUDGETS)

    async def scenario():
        app = ChatApp(service, workdir=workdir, budget="low", max_tokens=10, tools_enabled=False, params=K3_SAMPLING)
        async with app.run_test(size=SIZE) as pilot:
            await _type(pilot, "Think.")
            await _answered(pilot)
            (message,) = app.query(AssistantMessage)
            turn = app.conversation.last_turn
            assert message.reasoning_text == turn.reasoning and turn.reasoning_tokens == K3_BUDGETS["low"]
            panel = message.reasoning_panel
            assert panel.display and panel.collapsed
            await pilot.press("ctrl+r")
            await pilot.pause()
            assert not panel.collapsed
            body = panel.query_one(".reasoning-text")
            assert body.region.height > 0 and str(body.render()) == turn.reasoning
            await pilot.press("ctrl+r")
            await pilot.pause()
            assert panel.collapsed and body.region.height == 0

    run_async(scenario())


def test_budget_key_and_click_change_the_next_turn(k3, make_service, workdir):
    service = make_service(k3, budgets=K3_BUDGETS)

    async def scenario():
        app = ChatApp(service, workdir=workdir, budget="high", max_tokens=16, tools_enabled=False, params=K3_SAMPLING)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+b")
            assert app.conversation.budget == "max"
            await pilot.click("#budget")
            assert app.conversation.budget == "low"
            assert "[reverse]low[/]" in app.query_one("#budget").budget_markup()
            await _type(pilot, "Think.")
            await _answered(pilot)
            assert app.conversation.last_turn.reasoning_tokens == K3_BUDGETS["low"]
            await pilot.press("f2")  # low -> high
            await _type(pilot, "Again.")
            await wait_until(pilot, lambda: not app.busy and len(app.query(AssistantMessage)) == 2, what="turn 2")
            assert app.conversation.last_turn.reasoning_tokens == K3_BUDGETS["high"]

    run_async(scenario())


def test_approve_one_tool_call_and_deny_another(smol, make_service, recording_runner):
    service = make_service(smol)

    async def scenario():
        app = ChatApp(service, runner=recording_runner, max_tokens=12)
        async with app.run_test(size=SIZE) as pilot:
            await _type(pilot, "/tool list_dir What is here?")
            await wait_until(pilot, lambda: len(app.query(ToolCard)) == 1 and app.query_one(ToolCard).has_focus,
                             what="the first tool card")
            card = app.query_one(ToolCard)
            assert card.call.name == "list_dir" and recording_runner.ran == []  # waits for the user
            await pilot.press("y")
            await wait_until(pilot, lambda: card.result_text is not None and not app.busy, what="the approved call")
            assert recording_runner.ran == [card.call]
            assert card.result_text == recording_runner.run(card.call)

            await _type(pilot, "/tool run_command Clean up.")
            await wait_until(pilot, lambda: len(app.query(ToolCard)) == 2 and list(app.query(ToolCard))[1].has_focus,
                             what="the second tool card")
            second = list(app.query(ToolCard))[1]
            assert second.call.name == "run_command"
            await click_until(pilot, second.query_one(".deny"), lambda: second.approved is not None)
            assert second.approved is False
            await wait_until(pilot, lambda: second.result_text is not None and not app.busy, what="the denial")
            assert [c.name for c in recording_runner.ran] == ["list_dir", "list_dir"]  # run_command never ran
            assert second.has_class("denied") and second.result_text == DENIED
            stored = service.sessions.messages(app.conversation.session_id)
            tool_messages = [m for m in stored if m.role == "tool"]
            assert [m.tool_call_id for m in tool_messages] == [card.call.id, second.call.id]
            assert tool_messages[1].content == DENIED

    run_async(scenario())


def _store_sessions(service):
    store = service.sessions
    older = store.create(title="older talk")
    store.append(older, ChatMessage("user", "first question"), ChatMessage("assistant", "first answer"))
    newer = store.create(title="pick me")
    call = ToolCall("list_dir", {"path": "."}, id="call_stored")
    store.append(newer, ChatMessage("user", "what files are there?"),
                 ChatMessage("assistant", "", reasoning="I should list the folder.", tool_calls=[call]),
                 ChatMessage("tool", "notes.txt\ndocs/", name="list_dir", tool_call_id="call_stored"),
                 ChatMessage("assistant", "There are notes.txt and a docs folder."))
    return older, newer


def test_resume_rename_and_delete_sessions(smol, make_service, workdir):
    service = make_service(smol)
    older, newer = _store_sessions(service)

    async def scenario():
        app = ChatApp(service, workdir=workdir)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+o")
            assert isinstance(app.screen, SessionsScreen)
            listing = app.screen.query_one(OptionList)
            assert [listing.get_option_at_index(i).id for i in range(listing.option_count)] == [newer, older]
            await pilot.press("enter")  # the newest is highlighted
            await pilot.pause()
            assert app.conversation.session_id == newer
            assert app.conversation.messages == service.sessions.messages(newer)
            assert [w.content for w in app.query(UserMessage)] == ["what files are there?"]
            (card,) = app.query(ToolCard)
            assert card.approved and card.result_text == "notes.txt\ndocs/"
            answers = [m.content_text for m in app.query(AssistantMessage)]
            assert answers == ["", "There are notes.txt and a docs folder."]

            await pilot.press("ctrl+o", "down", "r")
            rename = app.screen.query_one("#rename-input", Input)
            rename.value = "renamed talk"
            await pilot.press("enter")
            await pilot.pause()
            assert service.sessions.info(older).title == "renamed talk"
            await pilot.press("d")  # deletes the highlighted (older) session
            await pilot.pause()
            assert not service.sessions.exists(older) and service.sessions.exists(newer)
            await pilot.press("escape")
            assert app.conversation.session_id == newer

    run_async(scenario())


def _normalised(svg: str) -> str:
    """The SVG without what changes from run to run: Rich's per-export class hash."""
    return re.sub(r"terminal-\d+", "terminal", svg)


def test_main_screen_snapshot(smol, make_service, workdir):
    """The main screen at 80x24 with a resumed session; LOCALMOE_UPDATE_SNAPSHOTS=1 rewrites the file."""
    service = make_service(smol)
    _, newer = _store_sessions(service)

    async def scenario():
        app = ChatApp(service, workdir=workdir, session_id=newer, stats=lambda: status_line(FIXED_FIGURES))
        async with app.run_test(size=SIZE) as pilot:
            app.query_one("#prompt", Input).cursor_blink = False
            await pilot.press("ctrl+r")  # open the reasoning panel of the last answer with reasoning
            await pilot.pause()
            return app.export_screenshot(title="localmoe chat")

    svg = _normalised(run_async(scenario()))
    if os.environ.get("LOCALMOE_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(svg)
    assert SNAPSHOT.exists(), f"{SNAPSHOT} is missing; write it with LOCALMOE_UPDATE_SNAPSHOTS=1"
    assert svg == SNAPSHOT.read_text(), "the main screen changed; look at it and rerun with LOCALMOE_UPDATE_SNAPSHOTS=1"


def test_image_command_attaches_an_image_to_the_next_message(make_service, workdir, tmp_path, monkeypatch):
    """`/image PATH` shows the attached image in the chat (the size and tokens the tower gives it) and the next
    message carries it to the model; a bad file or a text-only model is refused and nothing is attached. The
    resumed session shows the stored image again: its size, a half-block preview on a click, the file on `o`."""
    import io

    from PIL import Image

    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    k25 = load_model(write_checkpoint("kimi_k25", tmp_path / "k25", "tiny", seed=0), EngineConfig(threads=1),
                     progress=False)
    buf = io.BytesIO()
    Image.new("RGB", (60, 40), (200, 30, 30)).save(buf, format="PNG")
    (workdir / "red.png").write_bytes(buf.getvalue())
    service = make_service(k25)

    async def scenario():
        app = ChatApp(service, workdir=workdir, max_tokens=4, tools_enabled=False)
        async with app.run_test(size=SIZE) as pilot:
            await _type(pilot, "/image notes.txt")  # not an image: refused, nothing attached
            await _type(pilot, "/image red.png")
            await wait_until(pilot, lambda: len(app.query(AttachedImage)) == 1, what="the attached image")
            (shown,) = app.query(AttachedImage)
            assert "red.png (60x40 px, 6 image tokens)" in str(shown.header.render())
            assert len(app.conversation.attached) == 1
            await _type(pilot, "What colour is it?")
            await _answered(pilot)
            first = app.conversation.messages[0]
            assert first.content == "What colour is it?" and len(first.images) == 1
            assert first.images[0].data == (workdir / "red.png").read_bytes() and app.conversation.attached == []
            assert app.conversation.last_turn.prompt_tokens > 6
            stored = service.sessions.messages(app.conversation.session_id)
            assert stored[0].images[0].sha256 == first.images[0].sha256
            return app.conversation.session_id

    session = run_async(scenario())
    monkeypatch.setenv("LOCALMOE_CACHE", str(tmp_path / "cache"))
    opened = []

    async def resumed():
        app = ChatApp(service, workdir=workdir, session_id=session, tools_enabled=False)
        monkeypatch.setattr(app, "open_url", lambda url, **kw: opened.append(url))
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: len(app.query(AttachedImage)) == 1, what="the stored image")
            (shown,) = app.query(AttachedImage)
            assert "image 1 (60x40 px PNG, 0.1 KB)" in str(shown.header.render())
            assert not shown.preview.display
            shown.scroll_visible(animate=False)
            await pilot.pause()
            await pilot.click(AttachedImage)
            await wait_until(pilot, lambda: shown.preview.display, what="the preview", timeout=10)
            drawn = shown.preview.render()
            assert str(drawn).count("▀") == 36 * 12  # 60x40 px scaled into 48x24: 36x24 px, two a cell
            assert drawn.spans and all(repr(span.style).count("Color(200, 30, 30)") == 2 for span in drawn.spans)
            await pilot.press("v")  # the key closes it again; `o` opens the file
            assert not shown.preview.display
            await pilot.press("o")
            await wait_until(pilot, lambda: opened, what="the viewer")
            path = Path(opened[0].removeprefix("file://"))
            assert path.read_bytes() == (workdir / "red.png").read_bytes() and path.suffix == ".png"

    run_async(resumed())


def test_image_command_on_a_text_model_says_so(smol, make_service, workdir):
    (workdir / "a.png").write_bytes(b"\x89PNG not really")
    service = make_service(smol)

    async def scenario():
        app = ChatApp(service, workdir=workdir, max_tokens=4, tools_enabled=False)
        async with app.run_test(size=SIZE) as pilot:
            await _type(pilot, "/image a.png")
            await pilot.pause()
            assert not app.query(AttachedImage) and app.conversation.attached == []
            assert any("no vision tower" in n.message for n in app._notifications)

    run_async(scenario())


def test_status_bar_shows_speculation(smol, make_service, workdir):
    """With --spec the status bar ends with the last turn's share of drafts kept and tokens per step."""
    service = make_service(smol, spec="prompt", max_tokens_default=12)

    async def scenario():
        app = ChatApp(service, workdir=workdir, max_tokens=12, tools_enabled=False)
        async with app.run_test(size=SIZE) as pilot:
            await _type(pilot, "Repeat exactly: one two three. one two three. one two three.")
            await _answered(pilot)
            spec = app.conversation.last_turn.spec
            assert spec is not None and spec.steps > 0
            want = f"spec {spec.acceptance:.0%} x{spec.tokens_per_step:.1f}"
            await wait_until(pilot, lambda: str(app.status_bar.render()).endswith(want), what="the status bar")

    run_async(scenario())
