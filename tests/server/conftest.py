"""Real servers for the API tests: `localmoe serve` in a subprocess on 127.0.0.1, random free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

STARTUP_TIMEOUT = 240.0  # the embedded model is fetched on first use


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    args: tuple

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(model: str | Path | None, log_dir: Path, *extra: str, attempts: int = 3) -> Server:
    """Start `localmoe serve` and wait until /health answers (a new port if the chosen one was taken)."""
    for attempt in range(attempts):
        try:
            return _start(model, log_dir, *extra)
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    pass


def _start(model: str | Path | None, log_dir: Path, *extra: str) -> Server:
    import httpx

    port = free_port()
    args = [sys.executable, "-m", "localmoe.server", "--port", str(port), "--threads", "1", "--log-level",
            "warning", *extra]
    if model is not None:
        args += ["--model", str(model)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "address already in use" in log.read_text().lower():
                raise PortTaken(f"port {port} was taken")
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Server(url, proc, log, tuple(extra))
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the server did not answer within {STARTUP_TIMEOUT:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Kimi-Linear checkpoint (Jinja chat template): fast enough for load and fuzzing."""
    from localmoe.testing import write_checkpoint

    return write_checkpoint("kimi_linear", tmp_path_factory.mktemp("tiny-kimi-linear"), size="tiny")


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    server = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--max-context", "512", "--no-sessions",
                          "--max-tokens", "16")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct), with sessions."""
    directory = tmp_path_factory.mktemp("real")
    server = start_server(None, directory, "--sessions", str(directory / "sessions.db"), "--max-tokens", "64")
    yield server
    server.stop()
