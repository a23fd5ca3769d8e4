"""The per-request generation loop on a scripted fake model and format: reasoning budget,
end-of-thinking injection, parallel tool calls, stop strings, cancellation, fairness."""

from __future__ import annotations

import time

import torch

from localmoe.chat.budget import Budget
from localmoe.chat.format import Delta, ParsedReply, ToolCall
from localmoe.engine.sampler import SamplingParams
from localmoe.runtime.turn import Prepared, StopFilter, run_chat
from localmoe.runtime.worker import EngineWorker, Job

STOP, EOT, CALL = 0, 2, 3
VOCAB = 256


class ScriptedModel:
    """Greedy decoding yields `script` in order, one token per forward pass; records what it was fed."""

    max_context = 128

    def __init__(self, script: list[int]):
        self.script = list(script)
        self.fed: list[int] = []

    def new_cache(self, batch: int = 1, max_len: int | None = None):
        return type("Cache", (), {"offset": 0, "max_len": max_len or self.max_context})()

    def forward(self, tokens, cache, mask=None, all_logits=False):
        self.fed += tokens[0].tolist()
        cache.offset += tokens.shape[1]
        logits = torch.zeros(1, tokens.shape[1], VOCAB)
        logits[0, -1, self.script.pop(0) if self.script else STOP] = 1.0
        return logits


class FakeFormat:
    """Reasoning until EOT, then content; CALL is a whole tool call; characters are chr(id)."""

    name, thinks = "fake", True

    def stop_token_ids(self):
        return {STOP}

    def end_of_thinking_ids(self):
        return [EOT]

    def stream_parser(self):
        return FakeParser()


class FakeParser:
    def __init__(self):
        self.channel, self.reply = "reasoning", ParsedReply()

    def feed(self, token: int) -> list[Delta]:
        if token == EOT:
            self.channel = "content"
            return []
        if token == CALL:
            call = ToolCall("f", {"n": len(self.reply.tool_calls)})
            self.reply.tool_calls.append(call)
            return [Delta("tool", tool_call=call)]
        setattr(self.reply, self.channel, getattr(self.reply, self.channel) + chr(token))
        return [Delta(self.channel, chr(token))]

    def finish(self) -> ParsedReply:
        return self.reply


def forwards(turn):
    """Drive a turn alone, yielding after each forward it asked for."""
    try:
        dec = next(turn)
        while True:
            yield
            dec = turn.send(dec.logits())
    except StopIteration:
        return


def run(script: list[int], cancel_after: int | None = None, **prep):
    model = ScriptedModel(script)
    events: list[tuple[str, object]] = []
    prepared = Prepared(
        prompt=[5, 6, 7], max_tokens=prep.pop("max_tokens", 32), params=SamplingParams(temperature=0), **prep
    )
    steps = 0

    def cancelled() -> bool:
        return cancel_after is not None and steps >= cancel_after

    for _ in forwards(run_chat(FakeFormat(), None, model, prepared, lambda k, p: events.append((k, p)), cancelled)):
        steps += 1
    (kind, result), deltas = events[-1], [p for k, p in events[:-1]]
    assert kind == "done"
    return result, deltas, model


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_reasoning_budget_injects_end_of_thinking_and_the_answer_follows():
    result, deltas, model = run(ids("abc") + ids("xy") + [STOP], budget=Budget(reasoning_tokens=3))
    assert (result.reasoning, result.content) == ("abc", "xy")
    assert result.reasoning_tokens == 3 and result.completion_tokens == 5
    assert result.reasoning_closed_by == "reasoning_tokens" and result.finish_reason == "stop"
    assert model.fed == [5, 6, 7, *ids("ab"), ord("c"), EOT, *ids("xy")]  # EOT fed right after the 3rd token
    assert "".join(d.text for d in deltas if d.channel == "reasoning") == "abc"


def test_without_a_budget_the_model_closes_reasoning_itself():
    result, _, model = run(ids("ab") + [EOT] + ids("z") + [STOP])
    # the marker the model samples itself is still a reasoning token (the injected one is not sampled)
    assert (result.reasoning, result.content, result.reasoning_tokens) == ("ab", "z", 3)
    assert model.fed.count(EOT) == 1


def test_parallel_tool_calls_and_the_switch_to_one():
    script = [EOT, CALL, CALL, STOP]
    both, deltas, _ = run(script)
    assert [c.arguments for c in both.tool_calls] == [{"n": 0}, {"n": 1}] and both.finish_reason == "tool_calls"
    assert len({c.id for c in both.tool_calls}) == 2 and all(c.id.startswith("call_") for c in both.tool_calls)
    assert [d.tool_call.id for d in deltas if d.tool_call] == [c.id for c in both.tool_calls]
    one, _, _ = run(script, parallel_tool_calls=False)
    assert len(one.tool_calls) == 1
    none, _, _ = run(script, keep_tool_calls=False)
    assert none.tool_calls == [] and none.finish_reason == "stop"


def test_stop_string_ends_the_content():
    result, deltas, _ = run([EOT, *ids("hello world"), STOP], stop=["o w"])
    assert result.content == "hell" and result.finish_reason == "stop" and result.stop_sequence == "o w"
    assert "".join(d.text for d in deltas if d.channel == "content") == "hell"


def test_max_tokens_and_cancellation():
    long = [EOT, *ids("abcdefghijklmnop")]
    result, _, _ = run(long, max_tokens=5)
    assert result.completion_tokens == 5 and result.finish_reason == "length"
    cancelled, _, _ = run(long, cancel_after=3)
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 5


def test_stop_filter_holds_back_a_possible_stop_prefix():
    f = StopFilter(["END"])
    assert f.feed("abcE") == "abc" and f.feed("N") == "" and f.feed("x") == "ENx" and f.flush() == ""
    g = StopFilter(["END"])
    assert g.feed("aE") == "a" and g.feed("ND tail") == "" and g.hit and g.text == "a"


def test_worker_interleaves_jobs_round_robin():
    worker = EngineWorker(max_active=4)
    order: list[str] = []
    done = []

    def work(name: str, steps: int):
        def run_job(job: Job):
            for _ in range(steps):
                order.append(name)
                yield
            done.append(name)

        return run_job

    jobs = [Job(work("long", 6), lambda k, p: None), Job(work("short", 2), lambda k, p: None)]
    worker.start()
    for job in jobs:
        worker.submit(job)
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert done == ["short", "long"]
    assert order.index("short") < 3  # the short job ran while the long one was still going
