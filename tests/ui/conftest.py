"""Fixtures shared by the UI tests: the real embedded SmolLM2 model, a tiny random Kimi K3
(a thinking family: its XTML generation prompt opens the reasoning channel, so every reply
streams real reasoning), Services over them with their own session store, and helpers to
drive async code and Textual pilots from plain pytest tests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from localmoe.ui.tools import ToolRunner

from localmoe.engine.sampler import SamplingParams

K3_BUDGETS = {"low": 3, "high": 7, "max": 11}  # reasoning tokens per tier: small, so replies stay fast
# The tiny random K3 can draw its end-of-message token inside a reasoning budget (unseeded at the app's
# temperature now and then; greedily at once for some prompts). With this seed the budget tests' prompts
# reason until the budget closes the channel, on every run.
K3_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, seed=0)  # seeds 0-3 all pass here


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct (Q4_1 GGUF), loaded once."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    return load_model(None, EngineConfig(threads=1), progress=False)


@pytest.fixture(scope="session")
def k3(tmp_path_factory):
    """A tiny random Kimi K3 checkpoint (seed 0), loaded once."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    source = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3"), "tiny", seed=0)
    return load_model(source, EngineConfig(threads=1), progress=False)


@pytest.fixture
def make_service(tmp_path):
    """make_service(loaded, sessions=True, **ServerConfig fields) -> a started Service, stopped at teardown."""
    from localmoe.chat.budget import ThinkingBudgets
    from localmoe.runtime.service import ServerConfig, Service

    started = []

    def make(loaded, sessions: bool = True, budgets: dict | None = None, **fields):
        config = ServerConfig(sessions_path=tmp_path / "sessions.db" if sessions else None,
                              budgets=ThinkingBudgets(**(budgets or {})), threads=1, **fields)
        service = Service(loaded, config)
        service.start()
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A working directory for the tools with a file and a folder in it."""
    root = tmp_path / "work"
    (root / "docs").mkdir(parents=True)
    (root / "notes.txt").write_text("the answer is 42\n")
    (root / "docs" / "plan.md").write_text("# Plan\nship it\n")
    return root


class RecordingRunner(ToolRunner):
    """A real ToolRunner that also records every call it runs (to prove denied calls never run)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ran = []

    def run(self, call):
        self.ran.append(call)
        return super().run(call)


@pytest.fixture
def recording_runner(workdir) -> RecordingRunner:
    return RecordingRunner(workdir)


def run_async(coro, timeout: float = 300.0):
    """Run a coroutine to completion from a synchronous test."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(pilot, predicate, timeout: float = 120.0, what: str = "condition") -> None:
    """Let the app run until predicate() holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.1)


async def click_until(pilot, widget, done, timeout: float = 30.0) -> None:
    """Click `widget` until done() holds, failing after `timeout` seconds. A click computed before the
    chat scrolled, or delivered while a loaded machine was still laying out, can land elsewhere or be
    lost, so the test waits for the click's effect rather than trusting one click."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s clicking {widget!r}")
        await pilot.pause(0.05)
        if widget.region.area and widget.region in pilot.app.screen.region:
            await pilot.click(widget)
            await pilot.pause(0.1)


async def approve_all(call) -> bool:
    return True
