"""The Gradio web app (`localmoe web`): its parts on their own, one tab's chat over a real
Service (tool calls approved and denied, an answer stopped), and the real page in headless Chromium
(answers streamed by the page's script outside Gradio's queue, and through Gradio's own submit)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localmoe.chat.format import ToolCall

gradio = pytest.importorskip("gradio", reason="the web app needs the ui extra: pip install 'localmoe[ui]'")

from localmoe.ui.web.approval import ApprovalGate
from localmoe.ui.web.live import LiveHistory
from localmoe.ui.web.stream import STREAM_PATH, PageDiff, StreamKeys, same_origin
from localmoe.ui.web.transcript import Transcript, fenced

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 180.0
REPLY_TIMEOUT = 120_000  # ms; one thread of a shared CPU, the embedded model


# ---- parts ----

def test_fence_outgrows_backticks_inside():
    text = "a ``` b ```` c"
    block = fenced(text)
    fence = block.splitlines()[0]
    assert set(fence) == {"`"} and len(fence) == 5  # longer than the longest run (4)
    assert block.splitlines()[1] == text and block.endswith(fence)


def _event(kind, **fields):
    from localmoe.ui.conversation import ConversationEvent

    return ConversationEvent(kind, **fields)


def test_transcript_puts_reasoning_and_tool_calls_in_panels():
    from localmoe.runtime.turn import TurnResult

    t = Transcript()
    t.user("list it")
    for piece in ("let me ", "look"):
        t.apply(_event("reasoning", text=piece), "max")
    t.apply(_event("content", text="Listing."), "max")
    call = ToolCall("list_dir", {"path": "."}, id="call_1")
    t.apply(_event("turn_done", turn=TurnResult(content="Listing.", completion_tokens=10, seconds=2.0,
                                                  time_to_first_token=0.5, reasoning_tokens=4)), "max")
    t.apply(_event("tool_call", tool_call=call), "max")
    t.apply(_event("tool_result", tool_call=call, result="a.txt\nb/", approved=True), "max")
    t.apply(_event("content", text="Two entries."), "max")
    roles = [(m["role"], m.get("metadata", {}).get("title")) for m in t.messages]
    assert roles == [("user", None), ("assistant", "Reasoning"), ("assistant", None),
                     ("assistant", "Tool call list_dir: approved, ran"), ("assistant", None)]
    assert t.messages[1]["content"] == "let me look" and t.messages[1]["metadata"]["status"] == "done"
    assert '"path": "."' in t.messages[3]["content"] and "a.txt\nb/" in t.messages[3]["content"]
    assert t.messages[4]["content"] == "Two entries."  # the turn after the tool result has its own bubble
    assert "10 tokens in 2.00 s (5.0 tok/s)" in t.last_turn and "budget max" in t.last_turn


def test_a_stored_conversation_is_shown_as_it_was_streamed():
    """Transcript.load (a reloaded tab) draws the stored messages as the live events drew them."""
    from localmoe.ui.conversation import DENIED

    from localmoe.chat.format import ChatMessage
    from localmoe.chat.images import ImageRef

    ran = ToolCall("list_dir", {"path": "."}, id="call_1")
    denied = ToolCall("run_command", {"command": "rm x"}, id="call_2")
    live = Transcript()
    live.user("list it")
    for event in (_event("reasoning", text="let me look"), _event("content", text="Listing."), _event("turn_done"),
                  _event("tool_call", tool_call=ran), _event("tool_call", tool_call=denied),
                  _event("tool_result", tool_call=ran, result="a.txt", approved=True),
                  _event("tool_result", tool_call=denied, result=DENIED, approved=False),
                  _event("content", text="One file."), _event("turn_done")):
        live.apply(event, "high")
    stored = [ChatMessage("user", "list it"),
              ChatMessage("assistant", "Listing.", reasoning="let me look", tool_calls=[ran, denied]),
              ChatMessage("tool", "a.txt", name="list_dir", tool_call_id="call_1"),
              ChatMessage("tool", DENIED, name="run_command", tool_call_id="call_2"),
              ChatMessage("assistant", "One file.")]
    loaded = Transcript()
    loaded.load(stored)
    assert loaded.messages == live.messages
    cut = Transcript()  # an answer cut short before its call was answered, and a message with an image
    cut.load([ChatMessage("user", "see", images=[ImageRef("ab" * 32, b"")]), ChatMessage("assistant", "", tool_calls=[ran])])
    assert [m["content"] for m in cut.messages[:2]] == ["(an image)", "see"]
    assert cut.messages[2]["metadata"] == {"title": "Tool call list_dir: not run", "status": "done"}
    shown = Transcript()  # with a file for the stored image: drawn as the live upload was
    shown.load([ChatMessage("user", "see", images=[ImageRef("ab" * 32, b"")])], lambda ref: Path(f"/up/{ref.sha256}"))
    assert [m["content"] for m in shown.messages] == [{"path": f"/up/{'ab' * 32}"}, "see"]


def test_a_resumed_image_is_written_back_as_a_file_the_page_serves(tmp_path):
    """WebSession's files for stored images: inside the upload root, named by hash with the image's own type; no
    file for bytes that are no image, nor without an upload root."""
    import io

    from PIL import Image

    from localmoe.chat.images import ImageRef
    from localmoe.ui.web.session import WebSession

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buf, format="JPEG")
    ref = ImageRef.of(buf.getvalue())
    session = WebSession.__new__(WebSession)  # only the upload root matters here: no service, no conversation
    session.upload_root = tmp_path
    path = session._image_file(ref)
    assert path == tmp_path / "stored" / f"{ref.sha256}.jpeg" and path.read_bytes() == ref.data
    assert session._image_file(ref) == path and len(list(path.parent.iterdir())) == 1  # written once
    assert session._image_file(ImageRef.of(b"not an image")) is None
    session.upload_root = None
    assert session._image_file(ref) is None


def test_transcript_marks_a_denied_call_and_shows_no_output():
    t = Transcript()
    call = ToolCall("run_command", {"command": "rm -rf x"}, id="call_2")
    t.apply(_event("tool_call", tool_call=call), "high")
    assert t.messages[0]["metadata"] == {"title": "Tool call run_command: waiting for approval", "status": "pending"}
    t.apply(_event("tool_result", tool_call=call, result="The user denied this", approved=False), "high")
    assert t.messages[0]["metadata"] == {"title": "Tool call run_command: denied, not run", "status": "done"}
    assert "Output" not in t.messages[0]["content"]


def test_page_diff_sends_text_as_it_grows_and_the_rest_as_a_redraw():
    t = Transcript()
    gate = ApprovalGate()
    t.user("earlier")
    diff = PageDiff(t, gate)
    assert diff.ops() == []  # what the page showed before the message is not sent again
    t.user("hi")
    assert diff.ops() == [{"op": "new", "i": 1, "role": "user", "title": None, "text": "hi"}]
    t.apply(_event("reasoning", text="hm"), "high")
    t.apply(_event("reasoning", text="m"), "high")
    assert diff.ops() == [{"op": "new", "i": 2, "role": "assistant", "title": "Reasoning", "text": "hmm"}]
    t.apply(_event("content", text="Hel"), "high")  # closes the reasoning panel: nothing to redraw for that
    assert diff.ops() == [{"op": "new", "i": 3, "role": "assistant", "title": None, "text": "Hel"}]
    t.apply(_event("content", text="lo"), "high")
    assert diff.ops() == [{"op": "append", "i": 3, "text": "lo"}]
    assert diff.ops() == []
    call = ToolCall("list_dir", {"path": "."}, id="call_1")
    t.apply(_event("turn_done"), "high")
    t.apply(_event("tool_call", tool_call=call), "high")  # a card: Gradio draws it
    assert diff.ops() == [{"op": "sync"}]
    gate.call = call  # the approval card shows
    assert diff.ops() == [{"op": "sync"}]
    t.apply(_event("tool_result", tool_call=call, result="a.txt", approved=True), "high")
    t.apply(_event("content", text="Done"), "high")
    assert diff.ops() == [{"op": "new", "i": 5, "role": "assistant", "title": None, "text": "Done"}, {"op": "sync"}]
    t.note("boom", title="Error")
    assert diff.ops() == [{"op": "sync"}]
    t.clear()
    assert diff.ops() == [{"op": "sync"}]


def test_stream_keys_and_origin_check():
    keys = StreamKeys()
    first, second = keys.issue("tab-a"), keys.issue("tab-b")
    assert first != second and len(first) >= 32
    assert keys.session_hash(first) == "tab-a" and keys.session_hash("guess") is None
    assert keys.session_hash(None) is None and keys.session_hash(["x"]) is None
    keys.forget("tab-a")
    assert keys.session_hash(first) is None and keys.session_hash(second) == "tab-b"
    assert same_origin({"origin": "http://127.0.0.1:7860", "host": "127.0.0.1:7860"})
    assert not same_origin({"origin": "http://127.0.0.1:7861", "host": "127.0.0.1:7860"})  # another local app
    assert not same_origin({"origin": "null", "host": "127.0.0.1:7860"})
    assert not same_origin({"host": "127.0.0.1:7860"})  # no Origin: not a page's fetch


def test_gate_waits_for_a_decision_from_another_thread():
    async def scenario():
        gate = ApprovalGate()
        assert gate.decide(True) is False  # nothing waiting
        call = ToolCall("read_file", {"path": "x"})
        waiting = asyncio.ensure_future(gate.ask(call))
        await asyncio.sleep(0.01)
        assert gate.call is call and not waiting.done()
        threading.Thread(target=gate.decide, args=(False,)).start()
        assert await asyncio.wait_for(waiting, 5) is False
        assert gate.call is None
        second = asyncio.ensure_future(gate.ask(call))
        await asyncio.sleep(0.01)
        gate.decide(True)
        return await asyncio.wait_for(second, 5)

    assert asyncio.run(scenario()) is True


def test_live_history_samples_at_most_once_per_interval():
    now = [0.0]
    history = LiveHistory(min_interval=1.0, clock=lambda: now[0])
    calls = []

    def snapshot():
        calls.append(now[0])
        return {"tokens_per_second": 10.0 * len(calls), "window_tokens_per_second": 1.0,
                "tier_hit_rates": {"ram": 0.5, "gpu": 0.25}}

    for t in (0.0, 0.4, 1.2, 1.5, 2.3):
        now[0] = t
        history.sample(snapshot)
    assert calls == [0.0, 1.2, 2.3]
    speed = history.throughput()
    assert list(speed[speed.series == "last turn"].tokens_per_second) == [10.0, 20.0, 30.0]
    rates = history.hit_rates()
    assert len(rates) == 6 and set(rates.tier) == {"ram", "gpu"}
    assert list(rates[rates.tier == "gpu"].seconds) == [0.0, 1.2, 2.3]


# ---- one tab's chat over a real Service ----

def test_command_rejects_a_bad_port_before_loading_anything():
    from click.testing import CliRunner

    from localmoe.commands.web import command

    result = CliRunner().invoke(command, ["--port", "70000"])
    assert result.exit_code == 1 and "--port must be between 1 and 65535, not 70000" in result.output


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service

    loaded = load_model(None, EngineConfig(threads=1), progress=False)
    svc = Service(loaded, ServerConfig(sessions_path=tmp_path_factory.mktemp("web") / "sessions.db", threads=1))
    svc.start()
    yield svc
    svc.stop()


async def _send_deciding(session, text: str, decisions: list[bool]) -> list:
    """Send `text`; answer each approval request with the next decision (a call the model makes after those, on a
    turn of its own choosing, is denied); returns the gate's calls."""
    asked = []
    async for _ in session.send(text):
        if session.gate.call is not None and session.gate.call not in asked:
            asked.append(session.gate.call)
            session.gate.decide(decisions[len(asked) - 1] if len(asked) <= len(decisions) else False)
    return asked


@pytest.mark.slow
def test_approved_call_runs_and_denied_call_never_does(service, tmp_path):
    from localmoe.ui.conversation import DENIED
    from localmoe.ui.tools import ToolRunner
    from localmoe.ui.web.session import WebSession

    (tmp_path / "planted-7319.txt").write_text("x")
    session = WebSession(service, tmp_path, budget="low", max_tokens=64)
    runs = []
    run = session.conversation.runner.run
    session.conversation.runner.run = lambda call: runs.append(call) or run(call)  # records every run

    session.conversation.tool_choice = "list_dir"  # forces a call on the next model turn
    asked = asyncio.run(_send_deciding(session, "What files are here?", [True]))
    assert asked[0].name == "list_dir" and runs == asked[:1]  # only the approved (forced) call ran
    tool_messages = [m for m in session.conversation.messages if m.role == "tool"]
    assert tool_messages[0].content == ToolRunner(tmp_path).run(asked[0])  # its output went back
    card = next(m for m in session.transcript.messages if "list_dir" in m.get("metadata", {}).get("title", ""))
    assert card["metadata"]["title"].endswith("approved, ran") and "Output:" in card["content"]

    session.conversation.tool_choice = "run_command"
    asked = asyncio.run(_send_deciding(session, "Run something.", [False]))
    assert asked[0].name == "run_command"
    assert [c.name for c in runs] == ["list_dir"]  # the denied call never reached the runner
    assert any(m.role == "tool" and m.content == DENIED for m in session.conversation.messages)
    denied = [m for m in session.transcript.messages if "run_command" in m.get("metadata", {}).get("title", "")]
    assert denied[-1]["metadata"]["title"].endswith("denied, not run")
    stored = service.sessions.messages(session.conversation.session_id)
    assert any(m.role == "tool" and m.content == DENIED for m in stored)  # the model is told, durably


@pytest.mark.slow
def test_stop_ends_the_answer_and_keeps_what_was_shown(service, tmp_path):
    """Stop cancels the running turn at once: the transcript keeps its text and says "stopped", the history and the
    store keep the partial answer marked interrupted, the worker is free, and the next message is answered."""
    from localmoe.ui.web.session import WebSession

    session = WebSession(service, tmp_path, budget="low", max_tokens=2000)
    session.conversation.tools_enabled = False

    async def scenario():
        shown = 0
        async for _ in session.send("Count from 1 to 300, one number per line."):
            texts = [m["content"] for m in session.transcript.messages if m["role"] == "assistant"]
            if texts and texts[-1] and not shown:
                shown = len(texts[-1])
                threading.Thread(target=session.stop).start()  # as Gradio's Stop handler does, from a thread
        return shown

    shown = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert shown and session.transcript.last_turn == "stopped"
    answer = session.transcript.messages[-1]["content"]
    assert session.transcript.messages[-1]["role"] == "assistant" and len(answer) >= shown
    assert len(answer) < 200, "the answer ran on after Stop"
    last = session.conversation.messages[-1]
    assert last.role == "assistant" and last.interrupted and last.content == answer
    stored = service.sessions.messages(session.conversation.session_id)
    assert stored[-1].role == "assistant" and stored[-1].interrupted and stored[-1].content == answer
    deadline = time.monotonic() + 10
    while service.worker.active or service.worker.waiting:  # the sequence is closed, its cache freed
        assert time.monotonic() < deadline, "the stopped sequence still runs"
        time.sleep(0.01)
    session.max_tokens = session.conversation.max_tokens = 4
    asyncio.run(asyncio.wait_for(_send_deciding(session, "Say hi.", []), 120))
    assert re.match(r"[1-4] tokens", session.transcript.last_turn) and not session.busy  # answered, not stopped


@pytest.mark.slow
def test_new_chat_during_an_answer_stops_it_first(service, tmp_path):
    """New chat while an answer streams: the answer is stopped and kept in its own stored session (interrupted),
    and nothing of it reaches the new conversation's history or chat pane."""
    from localmoe.ui.web.session import WebSession

    session = WebSession(service, tmp_path, budget="low", max_tokens=2000)
    session.conversation.tools_enabled = False

    async def scenario():
        started = asyncio.Event()

        async def answer():
            async for _ in session.send("Count from 1 to 300, one number per line."):
                if any(m["role"] == "assistant" and m["content"] for m in session.transcript.messages):
                    started.set()

        streaming = asyncio.ensure_future(answer())
        await asyncio.wait_for(started.wait(), 120)
        old = session.conversation.session_id
        await session.new_chat()
        assert not session.busy, "New chat returned while the old answer still ran"
        await streaming
        return old

    old = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert session.transcript.messages == [] and session.conversation.messages == []
    assert session.conversation.session_id != old
    stored = service.sessions.messages(old)
    assert stored[-1].role == "assistant" and stored[-1].interrupted and 0 < len(stored[-1].content) < 200


@pytest.mark.slow
def test_stream_route_relays_an_approved_tool_round(service, tmp_path):
    """The route over a real Service: the user's message and the text as operations (replayed, they give the
    transcript's text), each tool card and the approval card as a redraw, the approved call run, then done."""
    import json

    import httpx
    from localmoe.ui.web.app import WebApp
    from localmoe.ui.web.session import WebSession
    from localmoe.ui.web.stream import mount
    from starlette.applications import Starlette

    web = WebApp(service, workdir=tmp_path)
    session = web.sessions["tab"] = WebSession(service, tmp_path, budget="low", max_tokens=24)
    session.conversation.tool_choice = "list_dir"  # forces a call on the first model turn
    key = web.keys.issue("tab")
    app = Starlette()
    mount(app, web)

    async def scenario():
        async def approve():  # every call the model makes (the first is forced; later turns may call again)
            while True:
                if session.gate.call is not None:
                    session.gate.decide(True)
                await asyncio.sleep(0.01)

        approver = asyncio.ensure_future(approve())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:7860") as client:
            response = await client.post(STREAM_PATH, json={"key": key, "text": "What files are here?"},
                                         headers={"Origin": "http://127.0.0.1:7860"}, timeout=120)
        approver.cancel()
        return response

    response = asyncio.run(asyncio.wait_for(scenario(), 180))
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    ops = [json.loads(line) for line in response.text.splitlines()]
    assert ops[0] == {"op": "new", "i": 0, "role": "user", "title": None, "text": "What files are here?"}
    assert ops[-1] == {"op": "done"} and {"op": "sync"} in ops
    card = next(i for i, m in enumerate(session.transcript.messages) if "list_dir" in m.get("metadata", {}).get("title", ""))
    assert session.transcript.messages[card]["metadata"]["title"].endswith("approved, ran")
    assert "Output:" in session.transcript.messages[card]["content"]  # it ran (its arguments are the model's)
    shown: dict[int, str] = {}  # replaying the text operations gives the transcript's text messages after the card
    for op in ops:
        if op["op"] == "new":
            shown[op["i"]] = op["text"]
        elif op["op"] == "append":
            shown[op["i"]] += op["text"]
    assert shown and all(session.transcript.messages[i]["content"] == text for i, text in shown.items())


# ---- the real page in headless Chromium ----

def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def web_server(tmp_path_factory):
    """`localmoe web` in a subprocess on a free 127.0.0.1 port."""
    yield from _web(tmp_path_factory.mktemp("web-server"))


def _web(directory: Path, *extra: str):
    """Run `localmoe web` (the embedded model unless `extra` names one); yields (url, directory)."""
    import httpx

    port = _free_port()
    log = directory / "web.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_TEMP_DIR": str(directory / "uploads"),
           "GRADIO_ANALYTICS_ENABLED": "False"}
    args = [sys.executable, "-m", "localmoe.ui.web", "--port", str(port), "--threads", "1", "--max-tokens", "16",
            "--sessions", str(directory / "sessions.db"), "--workdir", str(directory), "--no-tools", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"localmoe web exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"localmoe web did not answer within {STARTUP_TIMEOUT:.0f} s:\n"
                                   f"{log.read_text()[-4000:]}")
            time.sleep(0.25)
        yield url, directory
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (one per module: playwright's sync API runs one driver at a time)."""
    executable = _browser()
    if executable is None:
        pytest.skip("no Chromium found (install Debian's chromium package: .ci/browser.sh)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests drive Chromium with playwright")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def page(browser, web_server):
    return _tab(browser, web_server[0])


KEY_READY = "() => document.querySelector('#stream-key textarea').value !== ''"  # the tab may use the stream route
SCRIPT_IDLE = "() => !window.localmoeStream.busy && !window.localmoeStream.syncing"


def _tab(browser, url: str):
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.goto(url)
    tab.wait_for_selector("#message textarea")
    tab.wait_for_function(KEY_READY, timeout=REPLY_TIMEOUT)
    return tab


BOT = '#chat [data-testid="bot"]'


def _bot_texts(page) -> list[str]:
    """The raw markdown of each assistant message (Gradio puts it in the aria-label)."""
    return page.eval_on_selector_all(BOT, "els => els.map(e => e.getAttribute('aria-label') || '')")


def _settled(page, states: list[str], quiet: float = 0.6, limit: float = 10.0) -> list[str]:
    """`states` plus what the newest assistant message still shows after the status changed: the status
    and the last chunk of text are separate updates, and the text may be drawn a moment later."""
    last_change = time.monotonic()
    deadline = last_change + limit
    while time.monotonic() - last_change < quiet and time.monotonic() < deadline:
        text = _bot_texts(page)[-1]
        if text != states[-1]:
            states.append(text)
            last_change = time.monotonic()
        time.sleep(0.05)
    return states


# Records every text the newest assistant message shows, as the page draws it: polling could miss the steps of
# a short reply that streams in less than one poll interval.
RECORD_JS = """(sel) => {
  window.__botStates = [];
  const seen = () => {
    const els = document.querySelectorAll(sel);
    const s = window.__botStates, last = els[els.length - 1], t = last ? (last.getAttribute('aria-label') || '') : '';
    const script = !!(last && last.closest('#lm-stream'));  // drawn by the page's script, not by Gradio
    if (!s.length || s[s.length - 1][0] !== els.length || s[s.length - 1][1] !== t || s[s.length - 1][2] !== script)
      s.push([els.length, t, script]);
  };
  if (window.__botObserver) window.__botObserver.disconnect();
  window.__botObserver = new MutationObserver(seen);
  window.__botObserver.observe(document.body, {subtree: true, childList: true, characterData: true,
                                               attributes: true, attributeFilter: ['aria-label']});
}"""


def _send_and_watch(page, text: str, drawn_by: list | None = None, button: bool = False) -> list[str]:
    """Send `text` (the enter key, or the Send button); return every distinct state of the newest assistant
    message until the turn ends (as the page drew them, recorded by a MutationObserver); `drawn_by` gets, per
    state, whether the page's script drew it (True) or Gradio (False)."""
    before = len(_bot_texts(page))
    status_before = page.inner_text("#turn-status")
    page.evaluate(RECORD_JS, BOT)
    page.fill("#message textarea", text)
    if button:
        page.click("#send")
    else:
        page.press("#message textarea", "Enter")
    deadline = time.monotonic() + REPLY_TIMEOUT / 1000
    while time.monotonic() < deadline:
        texts = _bot_texts(page)
        status = page.inner_text("#turn-status")
        if status and status != status_before and len(texts) > before:
            page.wait_for_function(SCRIPT_IDLE, timeout=REPLY_TIMEOUT)
            _settled(page, [texts[-1]])
            states: list[str] = []
            for count, shown, script in page.evaluate("window.__botStates"):
                if count > before and (not states or shown != states[-1]):
                    states.append(shown)
                    if drawn_by is not None:
                        drawn_by.append(script)
            return states
        time.sleep(0.05)
    raise AssertionError(f"no finished reply to {text!r} within {REPLY_TIMEOUT / 1000:.0f} s")


@pytest.mark.slow
def test_page_streams_a_reply_that_matches_the_stored_session(page, web_server):
    from localmoe.chat.sessions import SessionStore

    page.click("#model-panel button")
    assert "llama" in page.inner_text("#model-info")  # the inspector's architecture line, from the GGUF
    drawn_by: list[bool] = []
    states = _send_and_watch(page, "Name three colours.", drawn_by)
    final = states[-1].removeprefix("bot's message: ")
    # drawn by the page's script (the stream route; token by token: test_stop_button_ends_a_streamed_answer), then
    # Gradio's chat holds the same text
    assert any(drawn_by) and not page.query_selector("#lm-stream > *"), (states, drawn_by)
    assert _bot_texts(page)[-1] == states[-1] and page.input_value("#message textarea") == ""
    store = SessionStore(web_server[1] / "sessions.db")
    try:
        (info,) = store.list()
        stored = [m for m in store.messages(info.id) if m.role == "assistant"]
    finally:
        store.close()
    assert stored and final.strip() == stored[-1].content.strip()
    status = page.inner_text("#turn-status")
    tokens = int(re.match(r"(\d+) tokens", status).group(1))
    assert 1 <= tokens <= 16 and "budget high" in status  # --max-tokens 16, the default budget


def test_page_refuses_a_foreign_host_header(web_server):
    """DNS rebinding: a page served as evil.example that resolves to 127.0.0.1 gets nothing, not the
    page, not its queue (which could send messages and approve tool calls)."""
    import httpx

    url = web_server[0]
    for path in ("", "config", "gradio_api/queue/join"):
        refused = httpx.get(url + path, headers={"Host": "evil.example"}, timeout=10)
        assert refused.status_code == 403, (path, refused.status_code)
        assert "evil.example" in refused.json()["error"]["message"] and "--allowed-hosts" in refused.text
    assert httpx.get(url, headers={"Host": f"localhost:{url.rsplit(':', 1)[1].strip('/')}"}, timeout=10).status_code == 200


def test_stream_route_answers_only_the_pages_own_tab(web_server):
    """The stream route takes a message only from a page this server served (its Origin) holding the tab's key."""
    import httpx

    url = web_server[0].rstrip("/")
    host = url.removeprefix("http://")
    body = {"key": "not-a-key", "text": "hi"}
    for headers, said in (({}, "Origin"), ({"Origin": "http://127.0.0.1:1"}, "Origin"),
                          ({"Origin": "null"}, "Origin"), ({"Origin": url}, "unknown page key")):
        refused = httpx.post(url + STREAM_PATH, json=body, headers=headers, timeout=10)
        assert refused.status_code == 403 and said in refused.json()["error"]["message"], (headers, refused.text)
    refused = httpx.post(url + STREAM_PATH, json=body, headers={"Origin": "http://evil.example", "Host": "evil.example"},
                         timeout=10)
    assert refused.status_code == 403 and "--allowed-hosts" in refused.text  # the Host check comes first
    assert httpx.post(url + STREAM_PATH, content=b"[", headers={"Origin": url, "Host": host},
                      timeout=10).status_code == 400


@pytest.mark.slow
def test_a_refused_message_is_shown_and_stays_in_the_box(browser, web_server):
    """The stream route refusing a message (here a stale key) shows why in the chat and leaves the text to resend."""
    tab = _tab(browser, web_server[0])
    tab.evaluate("() => { const t = document.querySelector('#stream-key textarea'); t.value = 'stale'; }")
    tab.fill("#message textarea", "Hello there")
    tab.press("#message textarea", "Enter")
    tab.wait_for_function("() => document.querySelector('#lm-stream') && "
                          "document.querySelector('#lm-stream').innerText.includes('unknown page key')", timeout=REPLY_TIMEOUT)
    tab.wait_for_function(SCRIPT_IDLE, timeout=REPLY_TIMEOUT)
    assert tab.input_value("#message textarea") == "Hello there"
    tab.close()


@pytest.fixture(scope="module")
def long_web(tmp_path_factory):
    """`localmoe web` on the embedded model with long answers allowed and a short context (an error to provoke)."""
    yield from _web(tmp_path_factory.mktemp("long-web"), "--max-tokens", "600", "--max-context", "1024")


LONG_PROMPT = "Write a long story about a dragon who learns to sail, in many paragraphs."
TRIES = 5  # sampled at the app's temperature, a "long" answer now and then ends at once: ask again


def _start_long_answer(tab) -> None:
    """Send LONG_PROMPT and wait until the page's script has drawn three growing states of the answer."""
    tab.evaluate(RECORD_JS, BOT)
    tab.fill("#message textarea", LONG_PROMPT)
    tab.press("#message textarea", "Enter")
    tab.wait_for_function("() => window.__botStates.filter(s => s[2] && s[1] !== \"bot's message: \").length >= 3",
                          timeout=REPLY_TIMEOUT)


def _session_ids(directory: Path) -> set[str]:
    from localmoe.chat.sessions import SessionStore

    store = SessionStore(directory / "sessions.db")
    try:
        return {info.id for info in store.list()}
    finally:
        store.close()


def _stored(directory: Path, session_id: str) -> list:
    from localmoe.chat.sessions import SessionStore

    store = SessionStore(directory / "sessions.db")
    try:
        return store.messages(session_id) if store.exists(session_id) else []
    finally:
        store.close()


@pytest.mark.slow
def test_stop_button_ends_a_streamed_answer(browser, long_web):
    """A long answer is drawn by the page's script as it grows, token by token; Stop ends it."""
    tab = _tab(browser, long_web[0])
    for _ in range(TRIES):
        status_before = tab.inner_text("#turn-status")
        _start_long_answer(tab)
        tab.click("#stop")
        tab.wait_for_function(f"() => document.querySelector('#turn-status').innerText !== {status_before!r}",
                              timeout=REPLY_TIMEOUT)
        tab.wait_for_function(SCRIPT_IDLE, timeout=REPLY_TIMEOUT)
        if "stopped" in tab.inner_text("#turn-status"):
            break  # else the answer had ended by itself before the click: again
    else:
        raise AssertionError(f"no answer was still running when Stop was clicked, {TRIES} times")
    shown = _bot_texts(tab)[-1].removeprefix("bot's message: ")
    assert shown.strip() and not tab.query_selector("#lm-stream > *")  # Gradio's chat holds the partial answer
    last = _stored(long_web[1], tab.input_value("#chat-id textarea"))[-1]
    assert last.role == "assistant" and last.interrupted and last.content.strip() == shown.strip()  # cut short
    grown = [text for _, text, script in tab.evaluate("window.__botStates") if script]
    grown = [b for a, b in itertools.pairwise([None, *grown]) if b != a]
    assert len(grown) >= 3 and all(b.startswith(a) for a, b in itertools.pairwise(grown)), grown  # grew as it came
    states = _send_and_watch(tab, "Say hi.")  # the tab answers again
    assert states and "stopped" not in tab.inner_text("#turn-status")
    tab.close()


@pytest.mark.slow
def test_a_closed_page_cancels_its_answer(browser, long_web):
    """Closing the tab mid-answer closes the stream; the server cancels the sequence (the store keeps what was
    streamed, marked interrupted) instead of generating on for nobody."""
    for _ in range(TRIES):
        before = _session_ids(long_web[1])
        tab = _tab(browser, long_web[0])
        _start_long_answer(tab)
        tab.close()
        (session_id,) = _session_ids(long_web[1]) - before  # the tab's new session (stored when it was sent)
        deadline = time.monotonic() + REPLY_TIMEOUT / 1000
        while (stored := _stored(long_web[1], session_id))[-1].role != "assistant":
            assert time.monotonic() < deadline, "the closed page's answer was never ended"
            time.sleep(0.2)
        if stored[-1].interrupted:  # cut short, not run to its end (600 tokens)
            return
    raise AssertionError(f"every answer had ended by itself before its page closed, {TRIES} times")


@pytest.mark.slow
def test_an_error_is_shown_in_the_chat(browser, long_web):
    """A message the model cannot take (longer than the context) gets an Error panel from Gradio's redraw."""
    tab = _tab(browser, long_web[0])
    tab.fill("#message textarea", "lorem ipsum dolor " * 600)
    tab.press("#message textarea", "Enter")
    tab.wait_for_function("() => [...document.querySelectorAll('#chat [data-testid=bot]')]"
                          ".some(e => e.innerText.includes('Error'))", timeout=REPLY_TIMEOUT)
    tab.wait_for_function(SCRIPT_IDLE, timeout=REPLY_TIMEOUT)
    assert not tab.query_selector("#lm-stream > *")  # drawn by Gradio, from the transcript
    assert any("context" in t for t in _bot_texts(tab)), _bot_texts(tab)
    tab.close()


@pytest.mark.slow
def test_a_reloaded_page_keeps_its_conversation(browser, web_server):
    """The tab's stored session survives a reload: the chat shows it again and the next message continues it."""
    tab = _tab(browser, web_server[0])
    _send_and_watch(tab, "Name a fruit.")
    shown = tab.inner_text("#chat .message-wrap")
    chat_id = tab.input_value("#chat-id textarea")
    sessions = _session_ids(web_server[1])
    assert chat_id in sessions
    tab.reload()
    tab.wait_for_selector("#message textarea")
    tab.wait_for_function(KEY_READY, timeout=REPLY_TIMEOUT)
    tab.wait_for_function("() => document.querySelectorAll('#chat [data-testid=bot]').length > 0", timeout=REPLY_TIMEOUT)
    assert tab.inner_text("#chat .message-wrap") == shown
    drawn_by: list[bool] = []
    _send_and_watch(tab, "And a vegetable?", drawn_by, button=True)
    assert any(drawn_by)  # the Send button goes through the stream route too
    assert _session_ids(web_server[1]) == sessions and tab.input_value("#chat-id textarea") == chat_id
    users = [m.content for m in _stored(web_server[1], chat_id) if m.role == "user"]
    assert users == ["Name a fruit.", "And a vegetable?"]  # the same session went on
    tab.close()


@pytest.mark.slow
def test_a_duplicated_tab_starts_its_own_conversation(browser, web_server):
    """A duplicated tab starts with a copy of the first tab's sessionStorage (the stored conversation's id): while
    the first tab is open the copy starts a new chat instead of writing into the first tab's conversation; once no
    open tab shows it, a tab with that id resumes it (as a reload does)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # one profile: its tabs share channels

    def opened(stored_id: str | None = None):  # with stored_id: a tab whose sessionStorage holds it, as a duplicate's
        tab = context.new_page()
        if stored_id:
            tab.add_init_script(f"sessionStorage.setItem('localmoe-chat', {stored_id!r})")
        tab.goto(web_server[0])
        tab.wait_for_selector("#message textarea")
        tab.wait_for_function(KEY_READY, timeout=REPLY_TIMEOUT)
        return tab

    first = opened()
    _send_and_watch(first, "Name a tree.")
    chat_id = first.input_value("#chat-id textarea")
    assert chat_id in _session_ids(web_server[1])
    copy = opened(chat_id)
    time.sleep(1.0)  # a resumed chat would be drawn by now
    assert _bot_texts(copy) == [] and copy.input_value("#chat-id textarea") == ""
    _send_and_watch(copy, "Name a river.")
    assert copy.input_value("#chat-id textarea") not in ("", chat_id)
    assert [m.content for m in _stored(web_server[1], chat_id) if m.role == "user"] == ["Name a tree."]
    copy.close()
    shown = first.inner_text("#chat .message-wrap")
    first.close()
    again = opened(chat_id)  # the first tab is gone: its conversation is resumed
    again.wait_for_function("() => document.querySelectorAll('#chat [data-testid=bot]').length > 0",
                            timeout=REPLY_TIMEOUT)
    assert again.inner_text("#chat .message-wrap") == shown and again.input_value("#chat-id textarea") == chat_id
    context.close()


@pytest.mark.slow
def test_budget_change_reaches_the_next_turn(page):
    page.click("#budget input")
    page.get_by_role("option", name="low", exact=True).click()
    page.wait_for_timeout(300)
    _send_and_watch(page, "Say hi.")
    assert "budget low" in page.inner_text("#turn-status")


def _upload_and_ask(page, document, shown: str, question: str) -> str:
    """Upload `document`, ask `question`, and return the Sources panel (the reply naming `shown`)."""
    page.set_input_files("#documents input[type=file]", str(document))
    page.wait_for_function(f"() => document.querySelector('#turn-status').innerText.includes({shown!r})",
                           timeout=30_000)
    before = len(_bot_texts(page))
    page.fill("#message textarea", question)
    page.press("#message textarea", "Enter")
    page.wait_for_function(f"() => document.querySelectorAll('{BOT}').length > {before} + 1 && "
                           "document.querySelector('#turn-status').innerText.includes('answered from')",
                           timeout=REPLY_TIMEOUT)
    page.wait_for_function(SCRIPT_IDLE, timeout=REPLY_TIMEOUT)  # Gradio has redrawn the chat from the finished transcript
    texts = [t.removeprefix("bot's message: ") for t in _bot_texts(page)[before:]]
    return next(t for t in texts if shown in t)  # the Sources panel names the uploaded file


@pytest.mark.slow
def test_uploaded_file_answers_a_question_and_is_cited(page, tmp_path):
    fact = "The harbour gate code is 4471-KESTREL."
    filler = [f"Line {i}: the harbour log records routine weather and tides." for i in range(1, 40)]
    document = tmp_path / "harbour-notes.txt"
    document.write_text("\n".join(filler[:20] + [fact] + filler[20:]) + "\n")
    panel = _upload_and_ask(page, document, "harbour-notes.txt", "What is the harbour gate code?")
    fact_line = len(filler[:20]) + 1  # 1-based line of the planted fact
    spans = [(int(lo), int(hi or lo)) for lo, hi in re.findall(r"harbour-notes\.txt\*\*, lines? (\d+)(?:-(\d+))?", panel)]
    assert any(lo <= fact_line <= hi for lo, hi in spans), f"no citation covers line {fact_line}: {panel}"
    assert "4471-KESTREL" in panel  # the passage quoted is the planted fact, found in the file
    page.locator("#chat").get_by_text("Sources", exact=True).click()  # open the collapsed Sources panel
    page.wait_for_function("() => document.querySelector('#chat').innerText.includes('closest to the question')",
                           timeout=10_000)
    page.wait_for_timeout(500)  # the panel's opening animation
    shot = tmp_path / "web.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("LOCALMOE_SAVE_SCREENSHOTS"):  # refresh the picture in docs/
        shutil.copy(shot, REPO / "docs" / "images" / "web.png")


@pytest.mark.slow
def test_uploaded_pdf_with_a_long_name_gets_sources_not_an_error(page, tmp_path):
    """A multi-page PDF whose name (and so its upload path) is long: the prompt is sized from real token
    counts, so the answer comes with checked citations or labelled uncited evidence, never an error."""
    sys.path.insert(0, str(REPO))
    from tests.documents import builders

    name = "minutes-of-the-procurement-and-audit-committee-" + "q" * 90 + ".pdf"
    document = builders.write_pdf(tmp_path / name, pages=6, words_per_page=80,
                                  facts={5: builders.PDF_FACTS[7]})
    panel = _upload_and_ask(page, document, "qqqq.pdf", "Who signed the cobalt procurement review?")
    assert "Error" not in panel and "page 5" in panel, panel
    assert "Uncited evidence" in panel or re.search(r"^1\. \*\*minutes", panel, re.MULTILINE), panel
    assert "Priya Ramaswamy" in panel


@pytest.fixture(scope="module")
def vision_web(tmp_path_factory):
    """`localmoe web` on the tiny Kimi K2.5 checkpoint (a MoonViT vision tower)."""
    from localmoe.testing import write_checkpoint

    directory = tmp_path_factory.mktemp("vision-web")
    model = write_checkpoint("kimi_k25", directory / "k25", "tiny", seed=0)
    yield from _web(directory, "--model", str(model), "--max-context", "512")


@pytest.mark.slow
def test_an_uploaded_image_goes_with_the_next_message(browser, vision_web, tmp_path):
    """The image box takes a file (upload; paste goes to the same box), the chat shows it, and the model's
    prompt holds it: the stored user message keeps the image's bytes by hash."""
    import hashlib
    import io

    from PIL import Image

    from localmoe.chat.sessions import SessionStore

    buf = io.BytesIO()
    Image.new("RGB", (60, 40), (20, 120, 220)).save(buf, format="PNG")
    picture = tmp_path / "blue.png"
    picture.write_bytes(buf.getvalue())
    tab = _tab(browser, vision_web[0])
    tab.set_input_files("#image input[type=file]", str(picture))
    tab.wait_for_selector("#image img", timeout=30_000)  # the preview: the upload arrived
    _send_and_watch(tab, "What colour is it?")
    tab.wait_for_selector('#chat [data-testid="user"] img', timeout=30_000)  # the image in the chat
    assert not tab.query_selector("#image img")  # the box is cleared for the next message
    tab.reload()  # the reloaded tab shows the stored image again, served from the stored bytes
    tab.wait_for_function("() => [...document.querySelectorAll('#chat [data-testid=\"user\"] img')]"
                          ".some(i => i.complete && i.naturalWidth === 60 && i.naturalHeight === 40)",
                          timeout=30_000)
    tab.close()
    store = SessionStore(vision_web[1] / "sessions.db")
    try:
        (info,) = store.list()
        (user, *_) = store.messages(info.id)
    finally:
        store.close()
    assert user.content == "What colour is it?" and len(user.images) == 1
    assert user.images[0].sha256 == hashlib.sha256(picture.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def spec_web(tmp_path_factory):
    """`localmoe web --spec prompt` on the embedded model."""
    yield from _web(tmp_path_factory.mktemp("spec-web"), "--spec", "prompt")


@pytest.mark.slow
def test_speculation_statistics_are_shown(browser, spec_web):
    """With --spec the finished turn's line and the live status show the share of drafts kept and the tokens
    per step, the same figures the stored turn's statistics give."""
    tab = _tab(browser, spec_web[0])
    _send_and_watch(tab, "Repeat exactly: one two three four. one two three four. one two three four.")
    status = tab.inner_text("#turn-status")
    found = re.search(r"speculation: (\d+)% of drafts kept, (\d+\.\d\d) tokens per step", status)
    assert found, status
    assert 1.0 <= float(found.group(2)) <= 8.0  # --spec-k 7: at most 7 drafts and the target's token a step
    tab.wait_for_function("() => /spec \\d+% x\\d+\\.\\d/.test(document.querySelector('#live-status').innerText)",
                          timeout=30_000)
    tab.close()
