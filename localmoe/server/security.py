"""The DNS-rebinding defence: a request whose `Host` header is not an allowed name gets 403.

A web page the user visits can make its own host name resolve to 127.0.0.1 and then read
the API from the user's browser; the browser still sends the page's name in `Host`, so
answering only the names the server is known by stops it (as Jupyter and Ollama do).
Allowed: the loopback names and addresses, the bound address, and what `--allowed-hosts`
adds (`*` turns the check off).
"""

from __future__ import annotations

from localmoe.server.errors import error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")


def allowed_hosts_for(bind: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The Host names a server bound to `bind` answers: loopback, the bound address, `extra`."""
    hosts = list(LOOPBACK_HOSTS)
    if bind not in ANY_ADDRESS:
        hosts.append(bind.strip("[]").lower())
    hosts += [h.strip().lower() for h in extra if h.strip()]
    return tuple(dict.fromkeys(hosts))


def host_name(header: str) -> str:
    """The name in a Host header, without the port: "[::1]:8000" -> "::1", "Example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header  # a bare IPv6 address or a name without a port


class HostCheck:
    """ASGI middleware: 403 unless the Host header names an allowed host (see the module docstring)."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed)
        self.any = "*" in self.allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.any:
            return await self.app(scope, receive, send)
        raw = next((v for k, v in scope.get("headers") or [] if k == b"host"), None)
        name = host_name(raw.decode("latin-1")) if raw is not None else ""
        if name in self.allowed:
            return await self.app(scope, receive, send)
        given = repr(name[:100]) if raw is not None else "none"
        message = (f"the Host header ({given}) is not a name this server answers to "
                   f"({', '.join(sorted(self.allowed))}); a server reached by another name must be started with "
                   f"--allowed-hosts NAME")
        if scope["type"] == "websocket":  # refuse the handshake (a browser sees the close, code 1008)
            await receive()
            return await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return await error_response(403, message, scope["path"])(scope, receive, send)
