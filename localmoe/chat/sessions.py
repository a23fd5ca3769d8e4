"""Persisted conversations: every message with its reasoning and tool calls, in SQLite (WAL).

Crash safety: each append is one transaction committed with `synchronous=FULL` before
`append` returns, so a message whose append returned survives a kill -9 of the process
(and a power cut). The file is shared by the server and the UIs: WAL lets readers run
beside one writer, and `busy_timeout` makes concurrent writers wait instead of failing.

    store = SessionStore("~/.cache/localmoe/sessions.db")
    sid = store.create(title="notes")
    store.append(sid, ChatMessage("user", "hello"))
    store.messages(sid)  # -> [ChatMessage(role="user", content="hello", ...)]

A message's images are kept by content hash in one `images` table (each content once, however many
messages or sessions show it; deleting a session drops the images no message shows any more).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.chat.images import ImageRef
from localmoe.errors import LocalMoEError

SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    reasoning TEXT,
    tool_calls TEXT NOT NULL DEFAULT '[]',
    name TEXT,
    tool_call_id TEXT,
    created REAL NOT NULL,
    interrupted INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS images (
    sha256 TEXT PRIMARY KEY,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    body TEXT NOT NULL
);
"""


UNUSED_IMAGES = ("DELETE FROM images WHERE sha256 NOT IN "
                 "(SELECT json_extract(e.value, '$[0]') FROM messages m, json_each(m.images) e)")


class SessionError(LocalMoEError):
    """A session id is malformed or unknown, or the database cannot be used."""


@dataclass(slots=True)
class SessionInfo:
    id: str
    title: str
    model: str
    created: float
    updated: float
    message_count: int

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "model": self.model, "created": self.created,
                "updated": self.updated, "message_count": self.message_count}


def _calls_to_json(calls: list[ToolCall]) -> str:
    return json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments, "raw_arguments": c.raw_arguments}
                       for c in calls], ensure_ascii=False)


def _calls_from_json(text: str) -> list[ToolCall]:
    return [ToolCall(name=c["name"], arguments=c["arguments"], id=c.get("id"), raw_arguments=c.get("raw_arguments"))
            for c in json.loads(text)]


class SessionStore:
    """Sessions and their messages in one SQLite file; safe to share between threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
            if "interrupted" not in columns:  # a database written before partial answers were kept
                self._db.execute("ALTER TABLE messages ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0")
            if "images" not in columns:  # a database written before messages held images
                self._db.execute("ALTER TABLE messages ADD COLUMN images TEXT NOT NULL DEFAULT '[]'")
        except sqlite3.DatabaseError as e:
            raise SessionError(f"{self.path}: cannot open the sessions database ({e}); "
                               f"move the file away to start a new one") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, statements: Iterable[tuple[str, tuple]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @staticmethod
    def check_id(session_id: str) -> str:
        if not isinstance(session_id, str) or not SESSION_ID.match(session_id):
            raise SessionError(f"session id {session_id!r} is not valid: use 1-128 letters, digits, '_', '-' or '.'")
        return session_id

    def create(self, title: str = "", model: str = "", session_id: str | None = None) -> str:
        """A new session (a random id unless given); returns its id."""
        session_id = self.check_id(session_id) if session_id is not None else uuid.uuid4().hex
        now = time.time()
        try:
            self._write([("INSERT INTO sessions (id, title, model, created, updated) VALUES (?, ?, ?, ?, ?)",
                          (session_id, title, model, now, now))])
        except sqlite3.IntegrityError:
            raise SessionError(f"session {session_id!r} already exists") from None
        return session_id

    def ensure(self, session_id: str, title: str = "", model: str = "") -> str:
        """The session `session_id`, created if it does not exist yet."""
        self.check_id(session_id)
        now = time.time()
        self._write([("INSERT OR IGNORE INTO sessions (id, title, model, created, updated) VALUES (?, ?, ?, ?, ?)",
                      (session_id, title, model, now, now))])
        return session_id

    def exists(self, session_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def append(self, session_id: str, *messages: ChatMessage) -> None:
        """Store `messages` at the end of the session, durably, in one transaction."""
        if not self.exists(session_id):
            raise SessionError(f"no session {session_id!r}")
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE session_id = ?",
                                          (session_id,)).fetchone()
                for i, m in enumerate(messages):
                    for ref in m.images:  # stored once per content, however many messages show it
                        self._db.execute("INSERT OR IGNORE INTO images (sha256, data) VALUES (?, ?)",
                                         (ref.sha256, ref.data))
                    self._db.execute(
                        "INSERT INTO messages (session_id, seq, role, content, reasoning, tool_calls, name, "
                        "tool_call_id, created, interrupted, images) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (session_id, seq + i, m.role, m.content, m.reasoning, _calls_to_json(m.tool_calls), m.name,
                         m.tool_call_id, now, int(m.interrupted),
                         json.dumps([[ref.sha256, ref.offset] for ref in m.images])))
                self._db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def messages(self, session_id: str) -> list[ChatMessage]:
        """Every stored message of the session, in order."""
        if not self.exists(session_id):
            raise SessionError(f"no session {session_id!r}")
        with self._lock:
            rows = self._db.execute("SELECT role, content, reasoning, tool_calls, name, tool_call_id, interrupted, "
                                    "images FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
            hashes = {sha for r in rows for sha, _ in json.loads(r[7])}
            data = dict(self._db.execute(f"SELECT sha256, data FROM images WHERE sha256 IN "
                                         f"({', '.join('?' * len(hashes))})", tuple(hashes)).fetchall()) if hashes else {}
        return [ChatMessage(role=r[0], content=r[1], reasoning=r[2], tool_calls=_calls_from_json(r[3]), name=r[4],
                            tool_call_id=r[5], interrupted=bool(r[6]),
                            images=[ImageRef(sha, bytes(data[sha]), offset) for sha, offset in json.loads(r[7])])
                for r in rows]

    def image_count(self) -> int:
        """Images stored (each content once)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM images").fetchone()[0]

    def set_record(self, session_id: str, body: str) -> None:
        """Keep one document beside the session's messages (the Responses API's response object)."""
        if not self.exists(session_id):
            raise SessionError(f"no session {session_id!r}")
        self._write([("INSERT OR REPLACE INTO records (session_id, body) VALUES (?, ?)", (session_id, body))])

    def record(self, session_id: str) -> str | None:
        """The document kept with `set_record`, or None."""
        with self._lock:
            row = self._db.execute("SELECT body FROM records WHERE session_id = ?", (session_id,)).fetchone()
        return row[0] if row else None

    def info(self, session_id: str) -> SessionInfo:
        with self._lock:
            row = self._db.execute(
                "SELECT s.id, s.title, s.model, s.created, s.updated, COUNT(m.seq) FROM sessions s "
                "LEFT JOIN messages m ON m.session_id = s.id WHERE s.id = ? GROUP BY s.id", (session_id,)).fetchone()
        if row is None:
            raise SessionError(f"no session {session_id!r}")
        return SessionInfo(*row)

    def list(self, limit: int = 100) -> list[SessionInfo]:
        """The most recently updated sessions first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.id, s.title, s.model, s.created, s.updated, COUNT(m.seq) FROM sessions s "
                "LEFT JOIN messages m ON m.session_id = s.id GROUP BY s.id ORDER BY s.updated DESC LIMIT ?",
                (limit,)).fetchall()
        return [SessionInfo(*row) for row in rows]

    def delete(self, session_id: str) -> None:
        if not self.exists(session_id):
            raise SessionError(f"no session {session_id!r}")
        self._write([("DELETE FROM messages WHERE session_id = ?", (session_id,)),
                     ("DELETE FROM records WHERE session_id = ?", (session_id,)),
                     ("DELETE FROM sessions WHERE id = ?", (session_id,)),
                     (UNUSED_IMAGES, ())])


def message_to_dict(m: ChatMessage) -> dict:
    """A stored message as JSON (the server's session endpoints)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        out["reasoning"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.interrupted:
        out["interrupted"] = True
    if m.images:
        out["images"] = [{"sha256": ref.sha256, "offset": ref.offset, "bytes": len(ref.data)} for ref in m.images]
    return out
