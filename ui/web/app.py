"""The Gradio Blocks app: chat with a reasoning accordion, budget dropdown, tools toggle with
Approve/Deny for a pending call, an image for the next message (upload or paste), document upload,
live plots and a model-info panel.

Each browser tab gets a `WebSession` (keyed by Gradio's session hash); every tab shares the
one `Service`, so all prompt, tool and session logic is the Conversation's, not the page's.
A typed message is answered through the stream route (stream.py, stream.js: the page draws the
answer as it comes, outside Gradio's queue); a message with an image goes through Gradio's submit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gradio as gr
from localmoe.ui.web.live import LiveHistory
from localmoe.ui.web.model_info import model_markdown
from localmoe.ui.web.session import WebSession
from localmoe.ui.web.stream import StreamKeys, mount
from localmoe.ui.web.transcript import call_arguments, fenced
from starlette.middleware import Middleware

from localmoe.chat.format import REASONING_EFFORTS
from localmoe.errors import LocalMoEError
from localmoe.pathguard import PathRefused
from localmoe.server.security import HostCheck, allowed_hosts_for

DOCUMENT_TYPES = [".txt", ".md", ".rst", ".csv", ".json", ".html", ".htm", ".pdf", ".docx", ".xlsx", ".pptx", ".py"]
CSS = """
#approval { border: 2px solid var(--color-accent); }
#turn-status, #live-status { font-size: var(--text-sm); color: var(--body-text-color-subdued); }
#lm-stream { display: flex; flex-direction: column; gap: var(--spacing-xxl); padding: var(--spacing-xxl) 0; }
#lm-stream .lm-row { max-width: 85%; padding: var(--spacing-xl); border-radius: var(--radius-xl);
                     white-space: pre-wrap; overflow-wrap: anywhere; }
#lm-stream .lm-user { align-self: flex-end; background: var(--color-accent-soft); }
#lm-stream .lm-assistant { align-self: flex-start; background: var(--background-fill-secondary); }
#chat .bubble-wrap:has(#lm-stream > *) .placeholder-content { display: none; }
"""
STREAM_JS = Path(__file__).with_name("stream.js")
TAB_JS = Path(__file__).with_name("tab.js")
# after Gradio redrew the chat for the page's script: tell it how many messages Gradio shows now
SYNCED_JS = "(chat) => { window.localmoeStream && window.localmoeStream.synced(chat.length); return []; }"
# the tab's stored conversation survives a reload, not a duplication of the tab (tab.js)
RECALL_JS = "() => window.localmoeTab.recall()"
REMEMBER_JS = "(id) => { window.localmoeTab.remember(id); return []; }"


class WebApp:
    """The page and the per-tab sessions behind it."""

    def __init__(self, service, workdir: Path | None = None, budget: str = "high", tools_enabled: bool = True,
                 max_tokens: int | None = None):
        if budget not in REASONING_EFFORTS:
            raise ValueError(f"budget must be one of {', '.join(REASONING_EFFORTS)}, not {budget!r}")
        self.service = service
        self.workdir = Path.cwd() if workdir is None else Path(workdir)
        self.budget = budget
        self.tools_enabled = tools_enabled
        self.max_tokens = max_tokens  # per model turn; None: the service's default
        self.sessions: dict[str, WebSession] = {}
        self.keys = StreamKeys()  # the stream route's per-tab keys
        self.history = LiveHistory()
        self.last_turn = None  # the latest finished model turn of any tab: the status line's speed and TTFT

    def session(self, request) -> WebSession:
        key = getattr(request, "session_hash", None) or "default"
        if key not in self.sessions:
            self.sessions[key] = WebSession(self.service, self.workdir, self.budget, self.tools_enabled,
                                            self.max_tokens, on_turn=self._turn_finished,
                                            upload_root=Path(gr.utils.get_upload_folder()))
        return self.sessions[key]

    def session_for_key(self, key) -> WebSession | None:
        """The tab whose page holds `key` (the stream route's check), or None."""
        session_hash = self.keys.session_hash(key)
        return self.sessions.get(session_hash) if session_hash is not None else None

    def _turn_finished(self, turn) -> None:
        self.last_turn = turn

    def forget(self, request: gr.Request) -> None:
        key = getattr(request, "session_hash", None) or "default"
        self.keys.forget(key)
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close()

    # ---- the page ----

    def build(self) -> gr.Blocks:
        with gr.Blocks(title=f"localmoe · {self.service.model_id}") as demo:
            gr.Markdown(f"## localmoe · {self.service.model_id}")
            with gr.Row():
                with gr.Column(scale=3):
                    chat = gr.Chatbot(elem_id="chat", label="Chat", height=480, buttons=["copy"],
                                      feedback_options=None, placeholder="Ask something. Reasoning and tool calls "
                                      "appear as collapsible panels above each answer.")
                    with gr.Group(visible=False, elem_id="approval") as approval:
                        approval_text = gr.Markdown(elem_id="approval-text")
                        with gr.Row():
                            approve = gr.Button("Approve and run", variant="primary", elem_id="approve")
                            deny = gr.Button("Deny", variant="stop", elem_id="deny")
                    with gr.Row():
                        message = gr.Textbox(elem_id="message", show_label=False, scale=8, autofocus=True,
                                             placeholder="Message (Enter sends)")
                        send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                        stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
                    stream_key = gr.Textbox(visible="hidden", elem_id="stream-key")  # the stream route's key
                    sync = gr.Button(visible="hidden", elem_id="stream-sync")  # the page's script: redraw the chat
                    chat_id = gr.Textbox(visible="hidden", elem_id="chat-id")  # the stored session this tab shows
                    image = gr.Image(type="filepath", sources=["upload", "clipboard"], elem_id="image", height=140,
                                     label="Image for the next message (upload or paste; a model with a vision tower)")
                    turn_status = gr.Markdown(elem_id="turn-status")
                with gr.Column(scale=2):
                    with gr.Row():
                        budget = gr.Dropdown(list(REASONING_EFFORTS), value=self.budget, label="Thinking budget",
                                             elem_id="budget", interactive=True)
                        tools = gr.Checkbox(value=self.tools_enabled, label="Tools (each call asks first)",
                                            elem_id="tools")
                    new_chat = gr.Button("New chat", size="sm", elem_id="new-chat")
                    documents = gr.File(file_count="multiple", file_types=DOCUMENT_TYPES, elem_id="documents",
                                        label="Documents: while attached, messages are questions about them")
                    live_status = gr.Markdown(elem_id="live-status")
                    speed = gr.LinePlot(x="seconds", y="tokens_per_second", color="series", title="tokens/s",
                                        height=180, x_title="seconds", y_title="tokens/s", elem_id="plot-speed")
                    tiers = gr.LinePlot(x="seconds", y="hit_rate", color="tier", title="expert tier hit rate",
                                        height=180, y_lim=[0, 1], x_title="seconds", y_title="hit rate",
                                        elem_id="plot-tiers")
                    with gr.Accordion("Model", open=False, elem_id="model-panel"):
                        gr.Markdown(model_markdown(self.service), elem_id="model-info")
            timer = gr.Timer(1.0)

            async def respond(text: str, picture: str | None, request: gr.Request):
                session = self.session(request)
                if not text.strip():
                    yield self._view(session) + (text, picture)
                    return
                async for _ in session.send(text, [Path(picture)] if picture else []):
                    yield self._view(session) + ("", None)

            outputs = [chat, approval, approval_text, turn_status, chat_id, message, image]
            for trigger in (message.submit, send.click):
                trigger(respond, [message, image], outputs, concurrency_limit=None, show_progress="hidden")

            def decide(approved: bool):
                def handler(request: gr.Request):
                    self.session(request).gate.decide(approved)
                    return gr.update(visible=False)
                return handler

            def open_tab(stored_id: str, request: gr.Request):
                """A new tab, or a reloaded one: the stream route's key, and the tab's stored conversation if it
                had one."""
                session = self.session(request)
                if stored_id:
                    try:
                        session.resume(stored_id)
                    except (ValueError, LocalMoEError):  # no store, or an id that is not one: a new chat
                        pass
                return (self.keys.issue(getattr(request, "session_hash", None) or "default"),) + self._view(session)

            def redraw(request: gr.Request):
                return self._view(self.session(request))

            def stop_answer(request: gr.Request) -> None:
                self.session(request).stop()

            demo.load(open_tab, [chat_id], [stream_key] + outputs[:5], js=RECALL_JS, show_progress="hidden")
            chat_id.change(None, [chat_id], None, js=REMEMBER_JS)
            sync.click(redraw, None, outputs[:5], concurrency_limit=None, show_progress="hidden").then(
                None, [chat], None, js=SYNCED_JS, show_progress="hidden")
            stop.click(stop_answer, None, None, concurrency_limit=None, show_progress="hidden")
            approve.click(decide(True), None, [approval], concurrency_limit=None)
            deny.click(decide(False), None, [approval], concurrency_limit=None)

            def set_budget(value: str, request: gr.Request):
                self.session(request).conversation.budget = value

            def set_tools(value: bool, request: gr.Request):
                self.session(request).conversation.tools_enabled = bool(value)

            def set_documents(files, request: gr.Request):
                session = self.session(request)
                try:
                    session.attach([Path(f) for f in (files or [])])
                except PathRefused as e:
                    return f"Not attached: {e}"
                names = ", ".join(p.name for p in session.documents)
                return f"Questions now go to {names}." if names else ""

            async def start_over(request: gr.Request):
                session = self.session(request)
                await session.new_chat()
                return [], gr.update(visible=False), "", session.conversation.session_id or ""

            budget.change(set_budget, [budget], None)
            tools.change(set_tools, [tools], None)
            documents.change(set_documents, [documents], [turn_status])
            new_chat.click(start_over, None, [chat, approval, turn_status, chat_id])
            chat.clear(start_over, None, [chat, approval, turn_status, chat_id])
            timer.tick(self._live, None, [live_status, speed, tiers], show_progress="hidden")
            demo.unload(self.forget)
        return demo

    def _view(self, session: WebSession) -> tuple:
        """Chat messages, approval card (shown while a call waits), the last turn's line, the stored session's id."""
        call = session.gate.call
        card = ""
        if call is not None:
            card = f"**The model wants to run `{call.name}`**\n\n" + fenced(call_arguments(call), "json")
        return (copy.deepcopy(session.transcript.messages), gr.update(visible=call is not None), card,
                session.transcript.last_turn, session.conversation.session_id or "")

    def _live(self):
        from localmoe.ui.stats import snapshot, status_line

        def figures_now() -> dict:
            figures = snapshot(self.service, self.last_turn)
            figures["window_tokens_per_second"] = self.service.metrics.tokens_per_second()
            return figures

        figures = self.history.sample(figures_now)
        return status_line(figures), self.history.throughput(), self.history.hit_rates()


def theme():
    """Gradio's default look with the system fonts: nothing is fetched from outside the machine."""
    return gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def launch(app: WebApp, host: str = "127.0.0.1", port: int = 7860, block: bool = True,
           allowed_hosts: tuple[str, ...] = ()):
    """Serve the page; with block=False return (demo, url) and keep serving in the background.

    Like the API server, the page answers only requests whose Host header is a loopback name, the
    bound address or one of `allowed_hosts` (the DNS-rebinding defence: a page elsewhere must not
    drive the chat or approve its tool calls)."""
    demo = app.build()
    demo.queue(default_concurrency_limit=None)
    host_check = Middleware(HostCheck, allowed=allowed_hosts_for(host, allowed_hosts))
    _, url, _ = demo.launch(server_name=host, server_port=port, share=False, inbrowser=False, quiet=True,
                            prevent_thread_lock=True, ssr_mode=False, theme=theme(), css=CSS,
                            footer_links=["settings"], app_kwargs={"middleware": [host_check]},
                            head=f"<script>{STREAM_JS.read_text()}</script><script>{TAB_JS.read_text()}</script>")
    mount(demo.app, app)
    if block:
        print(f"localmoe web: serving on {url}", flush=True)
        demo.block_thread()
    return demo, url
