"""Sessions survive kill -9: of the server mid-conversation, and of a process mid-append."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest

from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.chat.sessions import SessionError, SessionStore
from tests.server.conftest import start_server


def test_store_round_trip(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    sid = store.create(title="t", model="m")
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "weather?"),
                ChatMessage("assistant", "", reasoning="need a tool",
                            tool_calls=[ToolCall("get_weather", {"city": "Paris", "n": [1, 2]}, "call_1")]),
                ChatMessage("tool", '{"t": 18}', name="get_weather", tool_call_id="call_1"),
                ChatMessage("assistant", "18 degrees ✓")]
    store.append(sid, *messages[:2])
    store.append(sid, *messages[2:])
    store.close()
    again = SessionStore(tmp_path / "s.db")
    assert again.messages(sid) == messages
    assert again.info(sid).message_count == 5 and [s.id for s in again.list()] == [sid]
    with pytest.raises(SessionError):
        again.create(session_id=sid)
    with pytest.raises(SessionError):
        again.messages("missing")
    with pytest.raises(SessionError):
        again.check_id("../x")
    again.delete(sid)
    assert again.list() == []
    assert again._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_kill_9_mid_append_loses_no_committed_message(tmp_path):
    path = tmp_path / "s.db"
    writer = textwrap.dedent(f"""
        import sys
        from localmoe.chat.format import ChatMessage
        from localmoe.chat.sessions import SessionStore
        store = SessionStore({str(path)!r})
        sid = store.ensure("crash")
        for i in range(100000):
            store.append(sid, ChatMessage("user", f"message {{i}} " + "x" * 500))
            print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 150:
            break
    proc.kill()
    proc.wait()
    stored = SessionStore(path).messages("crash")
    assert len(stored) >= acknowledged + 1
    assert [m.content.split()[1] for m in stored] == [str(i) for i in range(len(stored))]


def test_kill_9_of_the_server_mid_conversation(tiny_model, tmp_path):
    db = tmp_path / "sessions.db"
    server = start_server(tiny_model, tmp_path, "--sessions", str(db), "--max-context", "512")
    sent: list[dict] = []
    received: list[str] = []
    try:
        for turn in range(2):
            message = {"role": "user", "content": f"turn {turn}"}
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": "default", "session_id": "conv", "max_tokens": 6, "temperature": 0, "messages": [message]})
            assert reply.status_code == 200, reply.text
            sent.append(message)
            received.append(reply.json()["choices"][0]["message"]["content"])
        last = {"role": "user", "content": "the turn that never finishes"}
        body = {"model": "default", "session_id": "conv", "max_tokens": 400, "temperature": 0, "stream": True,
                "messages": [last]}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 3:
                    server.kill()  # kill -9 while the answer streams
                    break
    finally:
        server.kill()
    restarted = start_server(tiny_model, tmp_path, "--sessions", str(db), "--max-context", "512")
    try:
        session = httpx.get(restarted.url + "/v1/sessions/conv", timeout=30).json()
    finally:
        restarted.stop()
    roles = [m["role"] for m in session["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in session["messages"][::2]] == [m["content"] for m in sent] + [last["content"]]
    assert [m["content"] for m in session["messages"][1::2]] == received


def test_session_history_is_the_prompt_prefix(tiny_model, tmp_path):
    """A turn in a session renders the stored history before the new messages."""
    server = start_server(tiny_model, tmp_path, "--sessions", str(tmp_path / "h.db"), "--max-context", "512")
    try:
        url = server.url + "/v1/chat/completions"
        first = httpx.post(url, timeout=60, json={"model": "default", "session_id": "h", "max_tokens": 4,
                                                  "temperature": 0, "messages": [{"role": "user", "content": "a"}]})
        alone = httpx.post(url, timeout=60, json={"model": "default", "max_tokens": 4, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "b"}]})
        second = httpx.post(url, timeout=60, json={"model": "default", "session_id": "h", "max_tokens": 4,
                                                   "temperature": 0, "messages": [{"role": "user", "content": "b"}]})
        assert second.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"]
        assert first.status_code == 200
        listing = httpx.get(server.url + "/v1/sessions", timeout=30).json()["data"]
        assert [s["id"] for s in listing] == ["h"] and listing[0]["message_count"] == 4
        assert httpx.delete(server.url + "/v1/sessions/h", timeout=30).json()["deleted"] is True
    finally:
        server.stop()
