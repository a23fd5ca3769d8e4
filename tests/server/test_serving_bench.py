"""benchmarks/serving.py's latencies where the clients see no text: a random-weight gpt-oss's chat replies stream
none (its tokens never open a harmony channel), so every client-side time was NaN on the paged stores. The server's
token log (benchmarks/serving_steps.py, written on SIGUSR1) gives each request's time to first token and its gaps
instead: one first token and max_tokens - 1 gaps a request, finite, in the order they came."""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import signal
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Self:
    """The server's process, here this one (`send_signal` runs the token log's handler in this thread)."""

    def send_signal(self, signum):
        os.kill(os.getpid(), signum)


def test_the_server_times_each_token_a_textless_reply_received(tmp_path, monkeypatch):
    from localmoe.chat import ChatMessage
    from localmoe.config import EngineConfig
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model
    from localmoe.runtime import worker as W
    from localmoe.runtime.service import ChatRequest, ServerConfig, Service
    from localmoe.runtime.turn import run_chat
    from localmoe.testing import write_checkpoint

    for name in ("step", "_prompt_chunks", "_advance"):  # the log wraps the worker: restored after the test
        monkeypatch.setattr(W.EngineWorker, name, getattr(W.EngineWorker, name))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    callbacks = list(gc.callbacks)  # and its GC timer
    serving, steps = load("serving"), load("serving_steps")
    log = str(tmp_path / "steps")
    try:
        steps.install(log)
        loaded = load_model(write_checkpoint("gpt_oss", tmp_path / "gpt_oss", "tiny", seed=1), EngineConfig(),
                            progress=False)
        service = Service(loaded, ServerConfig())
        done, start = [], time.perf_counter()
        for text in ("Hello there.", "What is a volcano?", "Count to ten."):
            prep = service.prepare_chat(ChatRequest([ChatMessage("user", text)], 6, SamplingParams(temperature=0.0)))[0]
            service.worker.submit(W.Job(lambda job, p=prep: run_chat(service.format, service.tokenizer, service.model, p,
                                                                     job.emit, lambda: job.cancelled),
                                        lambda kind, payload: done.append(payload) if kind == "done" else None))
        while len(done) < 3 or service.worker.active:
            service.worker.step()
        assert [r.content for r in done] == ["", "", ""] and all(r.completion_tokens == 6 for r in done)  # no text
        ttfts, gaps = serving.server_times(Self(), log, start, time.perf_counter())
        later = serving.server_times(Self(), log, time.perf_counter(), time.perf_counter() + 1)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        gc.callbacks[:] = callbacks
    assert len(ttfts) == 3 and len(gaps) == 3 * 5
    assert all(math.isfinite(t) and t > 0 for t in ttfts + gaps)
    assert later == ([], [])  # requests submitted in the window only
