"""Time to first token of the TUI and the web app against the API's, on the same prompt and settings.

    python benchmarks/first_token.py                  # the embedded model, 5 rounds
    python benchmarks/first_token.py --rounds 9 --max-tokens 8

One process, one model, one `Service` (with a session store, as `localmoe chat` / `localmoe web` build
it), so every front end reaches the same engine worker and differs only in what it adds:

- `api`: a real HTTP server on loopback (`server.create_app` under uvicorn), a streamed
  `/v1/chat/completions` from httpx with the UIs' settings (the built-in tools, reasoning effort
  "high", temperature 0.7, top-p 0.9): from sending to the first content or reasoning delta;
- `conversation`: `ui.conversation.Conversation.send`, the chat loop both UIs share: to its first
  content or reasoning event;
- `tui`: the Textual app under its pilot: from pressing enter to the first text drawn into the
  assistant message;
- `web`: the Gradio app on loopback driven by gradio_client (the browser's protocol): from submitting to
  the first streamed page update showing assistant text;
- `web (browser)`: the same page in headless Chromium (playwright, where installed: `--browser`), as a
  user sees it: from the enter key in the message box to the first assistant text drawn in the chat
  (both times taken in the page); the page's script sends the message to the stream route and draws
  the answer itself (ui/web/stream.py);
- `web (browser, queue)`: the same with the page's script switched off, so the message goes through
  Gradio's submit and queue and Gradio draws the answer (the path a message with an image takes).

Each round runs every front end once, in a rotated order, each on a fresh session (no history), the
worker idle in between. Printed: per front end the median and min over rounds, and each median against
the API's (the goal: at most 1.2). `--plain` also times the API without tools and at the default effort,
the request the issue compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

QUESTION = "What is the capital of France?"
TYPING = 0.5  # seconds between the TUI showing its prompt and the enter key (a user typing the question)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api(service) -> str:
    import uvicorn

    from localmoe.server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.1)


def api_first_token(url: str, max_tokens: int, plain: bool = False) -> float:
    from localmoe.ui.tools import BUILTIN_TOOLS

    body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "max_tokens": max_tokens}
    if not plain:
        body.update(tools=BUILTIN_TOOLS, reasoning_effort="high", temperature=0.7, top_p=0.9)
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content") or delta.get("reasoning_content"):
                    first = time.perf_counter() - started
    return first


async def conversation_first_token(service, max_tokens: int) -> float:
    from localmoe.ui.conversation import Conversation

    conversation = Conversation(service, max_tokens=max_tokens)

    async def approve(call) -> bool:
        return False

    started = time.perf_counter()
    first = None
    async for event in conversation.send(QUESTION, approve):
        if first is None and event.kind in ("reasoning", "content") and event.text:
            first = time.perf_counter() - started
    return first


async def tui_first_token(service, workdir: Path, max_tokens: int) -> float:
    from localmoe.ui.tui.app import ChatApp
    from localmoe.ui.tui.widgets import AssistantMessage
    from textual.widgets import Input

    app = ChatApp(service, workdir=workdir, max_tokens=max_tokens)
    app.owns_service = False
    seen: list[float] = []
    original = AssistantMessage.add

    def add(self, channel, text):
        if not seen and text:
            seen.append(time.perf_counter())
        original(self, channel, text)

    AssistantMessage.add = add
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            while app.conversation is None:
                await pilot.pause(0.01)
            await pilot.pause(TYPING)  # the main screen's first layout, as while a user types
            app.query_one("#prompt", Input).value = QUESTION
            started = time.perf_counter()
            await pilot.press("enter")
            while not seen or app.busy:
                await pilot.pause(0.005)
    finally:
        AssistantMessage.add = original
    return seen[0] - started


def web_first_token(url: str) -> float:
    from gradio_client import Client

    client = Client(url, verbose=False)  # a fresh session (no history) each round
    started = time.perf_counter()
    job = client.submit(QUESTION, None, api_name="/respond")  # no picture
    first = None
    while first is None:
        for output in job.outputs():
            chat = output[0] if isinstance(output, (list, tuple)) else []
            if any(m.get("role") == "assistant" and m.get("content") for m in chat if isinstance(m, dict)):
                first = time.perf_counter() - started
                break
        else:
            if job.done() and first is None:
                raise SystemExit("the web app answered without assistant text")
            time.sleep(0.002)
    job.result()  # the whole answer, so the next round starts with the worker idle
    return first


class Browser:
    """Headless Chromium on a thread of its own (playwright's sync API stays on the thread that started it)."""

    FIRST = """() => {
        window.__first = null; window.__sent = null;
        const chat = document.querySelector('#chat');
        const seen = () => {
            for (const bot of chat.querySelectorAll('[data-testid="bot"]'))
                if (window.__sent !== null && bot.innerText.trim()) { window.__first = performance.now(); observer.disconnect(); return; }
        };
        const observer = new MutationObserver(seen);
        observer.observe(chat, {subtree: true, childList: true, characterData: true});
        window.addEventListener('keydown', event => {  // window's capture phase: before any page handler
            if (event.key === 'Enter') window.__sent = performance.now();
        }, {capture: true, once: true});
    }"""

    def __init__(self, executable: str):
        import queue

        self.calls: queue.Queue = queue.Queue()
        self.executable = executable
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=self.executable, headless=True, args=["--no-sandbox"])
            while True:
                fn, done = self.calls.get()
                try:
                    done.append(fn(browser))
                except Exception as e:  # noqa: BLE001 - reported on the caller's thread
                    done.append(e)

    def call(self, fn):
        done: list = []
        self.calls.put((fn, done))
        while not done:
            time.sleep(0.01)
        if isinstance(done[0], Exception):
            raise done[0]
        return done[0]


def web_browser_first_token(browser: Browser, url: str, service, stream: bool = True) -> float:
    """From the enter key to the first assistant text drawn in the chat, in a fresh tab (a new session); with
    `stream` False the page's script leaves the message to Gradio's submit."""
    def run(chromium):
        page = chromium.new_page()
        try:
            page.goto(url)
            page.wait_for_selector("#message textarea")
            page.wait_for_function("document.querySelector('#stream-key textarea').value")  # the tab's key
            page.evaluate(f"window.localmoeStream.enabled = {'true' if stream else 'false'}")
            page.fill("#message textarea", QUESTION)
            time.sleep(TYPING)  # the page settles, as while a user types (the UIs warm the header meanwhile)
            page.evaluate(Browser.FIRST)
            page.press("#message textarea", "Enter")
            page.wait_for_function("window.__first !== null", timeout=120_000)
            first = page.evaluate("window.__first - window.__sent") / 1000
            while service.worker.active or service.worker.waiting:  # the whole answer: the next round starts idle
                time.sleep(0.01)
            return first
        finally:
            page.close()

    return browser.call(run)


def prompt_tokens(service) -> int:
    from localmoe.ui.tools import BUILTIN_TOOLS

    from localmoe.chat.format import ChatMessage
    from localmoe.engine.sampler import SamplingParams
    from localmoe.runtime.service import ChatRequest

    request = ChatRequest([ChatMessage("user", QUESTION)], None, SamplingParams(), tools=BUILTIN_TOOLS,
                          reasoning_effort="high")
    return len(service.prepare_chat(request)[0].prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (the UIs' max_tokens too)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="also the API without tools, default effort")
    parser.add_argument("--browser", default=None, metavar="CHROMIUM",
                        help="also the web page in this headless Chromium executable (playwright)")
    args = parser.parse_args()

    from localmoe.ui.web.app import WebApp, launch

    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service

    tmp = Path(tempfile.mkdtemp())
    loaded = load_model(None, EngineConfig(threads=args.threads), progress=False)
    service = Service(loaded, ServerConfig(sessions_path=tmp / "sessions.db", threads=args.threads,
                                           max_tokens_default=args.max_tokens))
    api = start_api(service)  # the app's lifespan starts the service (its engine worker)
    web = WebApp(service, workdir=tmp, max_tokens=args.max_tokens)
    _, web_url = launch(web, port=free_port(), block=False)
    runs = {
        "api": lambda: api_first_token(api, args.max_tokens),
        "conversation": lambda: asyncio.run(conversation_first_token(service, args.max_tokens)),
        "tui": lambda: asyncio.run(tui_first_token(service, tmp, args.max_tokens)),
        "web": lambda: web_first_token(web_url),
    }
    if args.plain:
        runs["api (no tools)"] = lambda: api_first_token(api, args.max_tokens, plain=True)
    if args.browser:
        browser = Browser(args.browser)
        runs["web (browser)"] = lambda: web_browser_first_token(browser, web_url, service)
        runs["web (browser, queue)"] = lambda: web_browser_first_token(browser, web_url, service, stream=False)
    for run in runs.values():  # warm-up: imports, kernels, the prefix cache's first entry
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(runs[name]())
    base = statistics.median(times["api"])
    print(f"first token, {args.rounds} rounds, question {QUESTION!r}, prompt {prompt_tokens(service)} tokens "
          f"with the UIs' tools")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:20s} median {median * 1000:7.1f} ms  min {min(values) * 1000:7.1f} ms  "
              f"vs api {median / base:.2f}x")
    service.stop()


if __name__ == "__main__":
    main()
