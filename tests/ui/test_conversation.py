"""Conversation (localmoe.ui.conversation) over a real Service, and ui.stats.

Models: the embedded SmolLM2 for streamed replies; the same real model with a forced
tool_choice (Conversation.tool_choice -> the server's JSON-constrained forced call) wherever a
tool call must happen for sure; a tiny random Kimi K3 (thinking format) for reasoning and
budgets. Nothing is scripted: every reply comes from the engine.
"""

from __future__ import annotations

import pytest
from localmoe.ui.conversation import DENIED, Conversation
from localmoe.ui.stats import human_bytes, snapshot, status_line

from localmoe.chat.format import ChatMessage

from .conftest import K3_BUDGETS, K3_SAMPLING, approve_all, run_async


async def _collect(conversation, text, approve=approve_all):
    return [event async for event in conversation.send(text, approve)]


def test_a_reply_streams_and_is_stored_in_the_session(smol, make_service, workdir):
    service = make_service(smol, max_tokens_default=12)
    conversation = Conversation(service, workdir=workdir, max_tokens=12, tools_enabled=False)
    events = run_async(_collect(conversation, "Say hello."))
    kinds = [e.kind for e in events]
    assert kinds[-2:] == ["turn_done", "done"]
    pieces = [e.text for e in events if e.kind == "content"]
    turn = events[-2].turn
    streamed = "".join(pieces)
    # streamed piece by piece: the reply, and at most the whitespace it ends in, which the stored reply strips
    # (whitespace streams as it comes: docs/api.md); a sampled reply cut at 12 tokens may end in "\n\n"
    assert len(pieces) > 1 and streamed.startswith(turn.content) and not streamed[len(turn.content):].strip()
    assert turn.completion_tokens <= 12
    stored = service.sessions.messages(conversation.session_id)
    assert [(m.role, m.content) for m in stored] == [("user", "Say hello."), ("assistant", turn.content)]
    assert service.sessions.info(conversation.session_id).title == "Say hello."
    assert [(m.role, m.content) for m in conversation.messages] == [(m.role, m.content) for m in stored]


def test_without_a_store_the_history_travels_in_each_request(smol, make_service, workdir):
    service = make_service(smol, sessions=False)
    conversation = Conversation(service, workdir=workdir, max_tokens=4, tools_enabled=False)
    first = run_async(_collect(conversation, "One."))[-2].turn
    second = run_async(_collect(conversation, "Two."))[-2].turn
    assert conversation.session_id is None and [m.role for m in conversation.messages] == ["user", "assistant"] * 2
    one_message = smol.chat_format.render([ChatMessage("user", "Two.")])
    assert second.prompt_tokens > first.prompt_tokens and second.prompt_tokens > len(one_message)


def test_an_approved_call_runs_and_its_output_goes_back_to_the_model(smol, make_service, recording_runner):
    service = make_service(smol)
    conversation = Conversation(service, runner=recording_runner, max_tokens=16)
    conversation.tool_choice = "list_dir"
    asked = []

    async def approve(call):
        asked.append(call)
        return True

    events = run_async(_collect(conversation, "What is in this folder?", approve))
    (result,) = [e for e in events if e.kind == "tool_result"]
    assert asked == [result.tool_call] == recording_runner.ran and result.tool_call.name == "list_dir"
    assert result.approved and result.result == recording_runner.run(result.tool_call)
    assert sum(e.kind == "turn_done" for e in events) == 2  # the model answered after reading the output
    stored = service.sessions.messages(conversation.session_id)
    assert [m.role for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1].tool_calls[0].id == stored[2].tool_call_id == result.tool_call.id
    assert stored[2].content == result.result and stored[2].name == "list_dir"
    assert conversation.tool_choice is None  # forcing applies to one message only


def test_a_denied_call_never_runs_and_the_model_is_told(smol, make_service, recording_runner):
    service = make_service(smol)
    conversation = Conversation(service, runner=recording_runner, max_tokens=16)
    conversation.tool_choice = "run_command"

    async def deny(call):
        return False

    events = run_async(_collect(conversation, "Delete my files.", deny))
    (result,) = [e for e in events if e.kind == "tool_result"]
    assert recording_runner.ran == []
    assert result.approved is False and result.result == DENIED
    tool_message = service.sessions.messages(conversation.session_id)[2]
    assert tool_message.role == "tool" and tool_message.content == DENIED


@pytest.mark.parametrize("budget", ["low", "high"])
def test_the_budget_sets_the_reasoning_limit(k3, make_service, workdir, budget):
    service = make_service(k3, budgets=K3_BUDGETS)
    conversation = Conversation(service, workdir=workdir, budget=budget, max_tokens=K3_BUDGETS[budget] + 6,
                                tools_enabled=False, params=K3_SAMPLING)
    events = run_async(_collect(conversation, "Think first."))
    turn = events[-2].turn
    assert turn.reasoning_tokens == K3_BUDGETS[budget] and turn.reasoning_closed_by == "reasoning_tokens"
    assert "".join(e.text for e in events if e.kind == "reasoning") == turn.reasoning
    assert service.sessions.messages(conversation.session_id)[1].reasoning == turn.reasoning


def test_budget_and_tool_choice_are_checked(smol, make_service, workdir):
    conversation = Conversation(make_service(smol), workdir=workdir)
    with pytest.raises(ValueError, match="budget must be one of low, high, max"):
        conversation.budget = "medium"
    conversation.tool_choice = "format_disk"
    with pytest.raises(ValueError, match="not a built-in tool"):
        run_async(_collect(conversation, "hi"))


def test_resume_loads_the_stored_history(smol, make_service, workdir):
    service = make_service(smol)
    sid = service.sessions.create(title="old")
    service.sessions.append(sid, ChatMessage("user", "earlier"), ChatMessage("assistant", "reply", reasoning="hm"))
    conversation = Conversation(service, sid, workdir=workdir)
    assert [(m.role, m.content, m.reasoning) for m in conversation.messages] == [
        ("user", "earlier", None), ("assistant", "reply", "hm")]
    with pytest.raises(ValueError, match="keeps no sessions"):
        Conversation(make_service(smol, sessions=False), "x", workdir=workdir)


def test_snapshot_figures_follow_the_last_turn(smol, make_service, workdir):
    import psutil

    service = make_service(smol)
    conversation = Conversation(service, workdir=workdir, max_tokens=6, tools_enabled=False)
    run_async(_collect(conversation, "Hi."))
    turn = conversation.last_turn
    figures = snapshot(service, turn)
    assert figures["tokens_per_second"] == pytest.approx(turn.completion_tokens / turn.seconds)
    assert figures["time_to_first_token"] == turn.time_to_first_token
    assert figures["tier_hit_rates"] == {}  # a dense model has no expert pager
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < figures["ram_used_bytes"] < 2 * rss
    import torch

    assert (figures["vram_used_bytes"] is None) == (not torch.cuda.is_available())
    window = snapshot(service)  # without a turn: the service's own counters
    assert window["completion_tokens_total"] == turn.completion_tokens
    assert window["time_to_first_token"] == pytest.approx(turn.time_to_first_token)


def test_status_line_fits_80_columns():
    figures = {"tokens_per_second": 12.345, "time_to_first_token": 0.25, "tier_hit_rates": {"gpu": 0.5, "ram": 0.875},
               "ram_used_bytes": 3 << 30, "vram_used_bytes": 1536 << 20}
    line = status_line(figures)
    assert line == (f"12.3 tok/s | TTFT 0.25s | gpu 50% ram {0.875:.0%} | RAM {human_bytes(3 << 30)} | "
                    f"VRAM {human_bytes(1536 << 20)}")
    assert len(line) <= 78 and human_bytes(3 << 30) == "3.0G" and human_bytes(None) == "-"
    spec = status_line(figures | {"spec_acceptance": 0.754, "spec_tokens_per_step": 3.43})
    assert spec == line + " | spec 75% x3.4" and len(spec) <= 80
