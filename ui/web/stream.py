"""The answer streamed to the page outside Gradio's queue.

Gradio takes ~45-60 ms from the enter key to the first token drawn (its front end, its queue,
then the whole chat re-rendered for every update). The page's script (stream.js, loaded into the
page's head) sends a typed message to `POST /localmoe/stream` itself and draws the user's message
and the answer's text as they arrive; everything else stays Gradio's. The route runs the tab's
own `WebSession.send` (the same Conversation, approval gate and transcript as Gradio's `respond`)
and writes newline-delimited JSON operations, each a change of the transcript the script can draw
without Gradio:

    {"op": "new", "i": 3, "role": "assistant", "title": "Reasoning" | null, "text": "..."}
    {"op": "append", "i": 3, "text": "..."}
    {"op": "sync"}      anything else changed (a tool card, the approval card, an error note):
                        the script asks Gradio to redraw the chat from the transcript
    {"op": "done"}      the message is answered; the script has Gradio redraw the chat once more

so Gradio's chat ends up holding exactly the transcript, as if its own handler had streamed it.

Only the tab's own page may use the route: the request must come from the page's origin (the
`Origin` header names the host the request was sent to) and carry the tab's key, a secret that
Gradio's load event hands to that tab alone. A page that goes away mid-answer closes the
request; the session's answer is cancelled and its sequence freed (`WebSession.send`'s cleanup).
"""

from __future__ import annotations

import json
import secrets
from urllib.parse import urlsplit

from localmoe.ui.web.transcript import REASONING_TITLE

STREAM_PATH = "/localmoe/stream"
MAX_MESSAGE_CHARS = 1_000_000  # a message longer than this is refused before it reaches the model


def _shape(message: dict) -> tuple:
    metadata = message.get("metadata") or {}
    return message["role"], metadata.get("title"), metadata.get("status"), message["content"]


class PageDiff:
    """What the page must change to show a transcript, against what it was last told."""

    def __init__(self, transcript, gate):
        self.transcript = transcript
        self.gate = gate
        self.told = [_shape(m) for m in transcript.messages]
        self.call = gate.call

    def ops(self) -> list[dict]:
        """The operations since the last call (see the module docstring); a "sync" comes last when present."""
        out: list[dict] = []
        sync = len(self.transcript.messages) < len(self.told) or self.gate.call is not self.call
        now = [_shape(m) for m in self.transcript.messages]
        for i, (role, title, status, content) in enumerate(now):
            if not isinstance(content, str):  # an image: Gradio draws it
                sync = sync or i >= len(self.told) or now[i] != self.told[i]
            elif i >= len(self.told):
                if title is None or title == REASONING_TITLE:
                    out.append({"op": "new", "i": i, "role": role, "title": title, "text": content})
                else:
                    sync = True
            else:
                old_role, old_title, old_status, old = self.told[i]
                if (old_role, old_title) != (role, title) or not content.startswith(old):
                    sync = True
                else:
                    if content != old:
                        out.append({"op": "append", "i": i, "text": content[len(old):]})
                    # a reasoning panel closing changes nothing drawn here; other panels are Gradio's
                    sync = sync or (status != old_status and title != REASONING_TITLE)
        self.told = now
        self.call = self.gate.call
        if sync:
            out.append({"op": "sync"})
        return out


class StreamKeys:
    """Per-tab secrets: the key Gradio's load event gave a tab names that tab's session."""

    def __init__(self):
        self._sessions: dict[str, str] = {}  # key -> Gradio session hash

    def issue(self, session_hash: str) -> str:
        key = secrets.token_urlsafe(24)
        self._sessions[key] = session_hash
        return key

    def session_hash(self, key) -> str | None:
        return self._sessions.get(key) if isinstance(key, str) else None

    def forget(self, session_hash: str) -> None:
        for key in [k for k, h in self._sessions.items() if h == session_hash]:
            del self._sessions[key]


def same_origin(headers) -> bool:
    """The request comes from a page served by this host: its Origin's host:port is the Host it was sent to."""
    origin, host = headers.get("origin"), headers.get("host")
    return bool(origin and host) and urlsplit(origin).netloc.lower() == host.lower()


def mount(fastapi_app, web_app) -> None:
    """Add the route to Gradio's app, ahead of Gradio's own routes (the app's middleware, the Host check
    included, still applies)."""
    from starlette.routing import Route

    async def endpoint(request):
        return await stream_answer(request, web_app)

    fastapi_app.router.routes.insert(0, Route(STREAM_PATH, endpoint, methods=["POST"]))


async def stream_answer(request, web_app):
    """The route: check the request, then stream the session's answer as operations."""
    from starlette.responses import StreamingResponse

    from localmoe.server.errors import error_response

    if not same_origin(request.headers):
        return error_response(403, f"{STREAM_PATH} answers only the page this server served (the Origin header "
                              f"must name {request.headers.get('host')!r})", STREAM_PATH)
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, f"{STREAM_PATH} takes a JSON object {{\"key\", \"text\"}}", STREAM_PATH)
    text = body.get("text") if isinstance(body, dict) else None
    session = web_app.session_for_key(body.get("key") if isinstance(body, dict) else None)
    if session is None:
        return error_response(403, "unknown page key: reload the page", STREAM_PATH)
    if not isinstance(text, str) or not text.strip():
        return error_response(400, "text must be a non-empty string", STREAM_PATH)
    if len(text) > MAX_MESSAGE_CHARS:
        return error_response(413, f"text is {len(text)} characters, more than {MAX_MESSAGE_CHARS}", STREAM_PATH)

    async def lines():
        diff = PageDiff(session.transcript, session.gate)
        async for _ in session.send(text):
            ops = diff.ops()
            if ops:
                yield "".join(json.dumps(op, ensure_ascii=False) + "\n" for op in ops)
        yield json.dumps({"op": "done"}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
