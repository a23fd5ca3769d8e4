"""One request's generation, written as a generator the engine worker advances one forward
pass at a time: chat turns (reasoning budget, tool calls, stop strings) and plain completions.

A turn yields its `Decoder` whenever it needs the next logits and receives them back
(`logits = yield dec`: None while prompt chunks remain, `next_logits`); the worker runs every
waiting sequence's decode token as one batched forward (worker.py). A front end alone (`run`,
the Python API) steps the same worker in its own thread (`Service.run_here`).

Each job calls `emit(kind, payload)` with ("delta", Delta) while it runs and ("done",
TurnResult) at the end; the HTTP layer turns those into SSE chunks or one response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from localmoe.chat.budget import Action, Budget, BudgetTracker
from localmoe.chat.format import Delta, ToolCall
from localmoe.chat.grammar import Constraint
from localmoe.engine.generate import Decoder
from localmoe.engine.images import PromptImage
from localmoe.engine.prefix_cache import PrefixCache
from localmoe.engine.sampler import SamplingParams
from localmoe.engine.spec.speculator import SpecStats, Speculator
from localmoe.runtime.forced import ForcedPlan

Emit = Callable[[str, object], None]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Prepared:
    """A request resolved to prompt ids and generation settings (built by the HTTP layer)."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    budget: Budget = field(default_factory=Budget)
    forced: ForcedPlan | None = None
    constraint: Constraint | None = None  # the grammar of the forced call, or of the content (response_format)
    parallel_tool_calls: bool = True
    keep_tool_calls: bool = True  # False under tool_choice "none"
    prefix_cache: PrefixCache | None = None  # the service's: reuse a previous sequence's cache for the prompt
    on_prompt: Callable[[], None] | None = None  # called once the whole prompt is in the cache (probe-recall)
    anchor: int | None = None  # where the conversation's fixed header ends: a prompt chunk ends there (reuse)
    speculator: Speculator | None = None  # speculative decoding of this sequence (runtime/speculation.py)
    images: list[PromptImage] = field(default_factory=list)  # the prompt's images, in order (runtime/images.py)


@dataclass
class TurnResult:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    time_to_first_token: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose cache was reused (not prefilled again)
    seconds: float = 0.0
    reasoning_closed_by: str | None = None  # the budget that ended the reasoning, if one did
    stop_sequence: str | None = None  # the stop string that ended the content, if one did
    spec: SpecStats | None = None  # the sequence's speculative decoding, where it speculated


class StopFilter:
    """Streams text, holding back what could begin a stop string and cutting at the first one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.text = ""  # everything emitted
        self.hit = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        self.pending += text
        cuts = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if cuts:
            at, self.matched = min(cuts)
            out, self.pending, self.hit = self.pending[:at], "", True
        else:
            hold = 0
            for stop in self.stops:
                for n in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                    if self.pending.endswith(stop[:n]):
                        hold = n
                        break
            out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        self.text += out
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        self.text += out
        return out


def _max_len(prep: Prepared, extra: int) -> int:
    return len(prep.prompt) + prep.max_tokens + extra + 2


def next_logits(dec: Decoder, prep: Prepared, result: TurnResult, started: float, cancelled: Callable[[], bool]):
    """The step every turn takes: yield the decoder until the worker hands back logits (prompt chunks run
    first) and return them, or None once the request is cancelled. The first logits set the time to first
    token and call `prep.on_prompt`. Use as `logits = yield from next_logits(...)`."""
    while not cancelled():
        logits = yield dec  # the worker runs the step (batched with the other sequences)
        if logits is None:
            continue  # a prompt chunk ran; more remain
        if not result.time_to_first_token:
            result.time_to_first_token = time.perf_counter() - started
            if prep.on_prompt is not None:
                prep.on_prompt()
        return logits
    return None


def run_chat(fmt, tokenizer, model, prep: Prepared, emit: Emit, cancelled: Callable[[], bool]) -> Iterator[None]:
    """A chat turn: forced tool call (constrained) or free generation with the reasoning budget
    (its content constrained when `prep.constraint` is set)."""
    if prep.forced is not None:
        yield from _run_forced(tokenizer, model, prep, emit, cancelled)
    else:
        yield from _run_free(fmt, model, prep, emit, cancelled)


def sample_constrained(dec: Decoder, logits, constraint: Constraint) -> int:
    """Draw the next token among those the grammar allows (the request's sampler, masked logits)."""
    token = dec.sample(constraint.mask(logits))
    if token != constraint.tokenizer.eos:
        constraint.consume(token)
    return token


def _run_free(fmt, model, prep: Prepared, emit: Emit, cancelled) -> Iterator[None]:
    started = time.perf_counter()
    eot = list(fmt.end_of_thinking_ids()) if fmt.thinks else []
    dec = Decoder(model, prep.prompt, prep.params, _max_len(prep, len(eot)), prefix_cache=prep.prefix_cache,
                  anchor=prep.anchor,
                  speculator=prep.speculator if prep.constraint is None else None, images=prep.images)
    parser = fmt.stream_parser()
    stop_ids = fmt.stop_token_ids()
    tracker = BudgetTracker(prep.budget)
    result = TurnResult(prompt_tokens=len(prep.prompt))
    content = StopFilter(prep.stop)
    raw = {"content": "", "reasoning": ""}
    streamed_calls: list[ToolCall] = []
    generated: list[int] = []
    reasoning_open = fmt.thinks
    constraint = prep.constraint
    # where the prompt opens the reasoning (harmony, XTML, a template ending in <think>), the answer and
    # its constraint start after the end-of-thinking marker; elsewhere the constrained answer starts at once
    constrained = constraint is not None and not (fmt.thinks and getattr(fmt, "opens_thinking", True))
    finish = "length"

    def add_call(call: ToolCall) -> None:
        """Stream a parsed call under a fresh id, unless tool_choice "none" or one call only forbids it."""
        if prep.keep_tool_calls and (prep.parallel_tool_calls or not streamed_calls):
            call = ToolCall(call.name, call.arguments, new_call_id(), call.raw_arguments)
            streamed_calls.append(call)
            emit("delta", Delta("tool_call", tool_call=call))

    def close_reasoning() -> bool:
        """Feed the end-of-thinking marker: the answer (and its constraint) starts. True when a stop string
        ended the content while the marker's tokens were published (every one of them is)."""
        nonlocal reasoning_open, constrained
        dec.feed(eot)
        generated.extend(eot)
        reasoning_open, constrained = False, constraint is not None
        stopped = [publish(parser.feed(t)) for t in eot]
        return any(stopped)

    def publish(deltas: list[Delta]) -> bool:
        """Emit deltas; True when a stop string ended the content."""
        nonlocal reasoning_open
        for d in deltas:
            if d.tool_call is not None:
                reasoning_open = False
                add_call(d.tool_call)
                continue
            raw[d.channel] = raw.get(d.channel, "") + d.text
            if d.channel == "content":
                if d.text.strip():
                    reasoning_open = False
                text = content.feed(d.text)
                if text:
                    emit("delta", Delta("content", text))
                if content.hit:
                    return True
            elif d.text:
                emit("delta", Delta(d.channel, d.text))
        return False

    while True:
        logits = yield from next_logits(dec, prep, result, started, cancelled)
        if logits is None:
            finish = "cancelled"
            break
        token = sample_constrained(dec, logits, constraint) if constrained else dec.sample(logits)
        if token in stop_ids:
            if constraint is not None and not constrained and eot:  # no answer yet: open it, constrained
                if close_reasoning():
                    finish = "stop"
                    break
                continue
            finish = "stop"
            break
        result.completion_tokens += 1
        generated.append(token)
        was_reasoning = reasoning_open
        if publish(parser.feed(token)):
            finish = "stop"
            break
        if constrained and constraint.done:
            finish = "stop"
            break
        if eot and generated[-len(eot):] == eot:
            reasoning_open = False
            constrained = constraint is not None
        if was_reasoning:
            result.reasoning_tokens += 1
        action = tracker.check(was_reasoning)
        dec.feed([token])
        if action is Action.CLOSE_THINKING and reasoning_open:
            result.reasoning_closed_by = tracker.closed_by
            if close_reasoning():
                finish = "stop"
                break
        elif action is Action.STOP:
            break
        if result.completion_tokens >= prep.max_tokens or dec.room <= 0:
            break
    reply = parser.finish()
    if finish != "stop" or not content.hit:  # what the parser still held back
        extra = reply.reasoning[len(raw["reasoning"]):] if reply.reasoning.startswith(raw["reasoning"]) else ""
        if extra:
            emit("delta", Delta("reasoning", extra))
        raw["reasoning"] += extra
        tail = reply.content[len(raw["content"]):] if reply.content.startswith(raw["content"]) else ""
        text = content.feed(tail) + content.flush()
        if text:
            emit("delta", Delta("content", text))
        if content.hit:
            finish = "stop"
        for call in reply.tool_calls[len(streamed_calls):]:
            add_call(call)
    # the parser streams whitespace after text as it comes; the turn's text is stripped at the end as before
    result.content = content.text if content.hit else content.text.rstrip()
    result.stop_sequence = content.matched
    result.reasoning = raw["reasoning"].rstrip() or reply.reasoning
    result.tool_calls = streamed_calls
    if streamed_calls and finish == "stop":
        finish = "tool_calls"
    _done(emit, result, finish, dec, started)


def _done(emit: Emit, result: TurnResult, finish: str, dec: Decoder, started: float) -> None:
    """Close a turn: its finish reason and timings into `result`, the decoder's cache released, "done" sent."""
    result.finish_reason = finish
    result.seconds = time.perf_counter() - started
    result.cached_tokens = dec.reused
    result.spec = dec.speculator.stats if dec.speculator is not None else None
    dec.release()
    emit("done", result)


def _run_forced(tokenizer, model, prep: Prepared, emit: Emit, cancelled) -> Iterator[None]:
    started = time.perf_counter()
    plan, constraint = prep.forced, prep.constraint
    dec = Decoder(model, prep.prompt + plan.inject, prep.params, _max_len(prep, len(plan.inject)),
                  prefix_cache=prep.prefix_cache, anchor=prep.anchor, images=prep.images)
    result = TurnResult(prompt_tokens=len(prep.prompt))
    ids: list[int] = []
    finish = "length"
    while result.completion_tokens < prep.max_tokens and dec.room > 0:
        logits = yield from next_logits(dec, prep, result, started, cancelled)
        if logits is None:
            finish = "cancelled"
            break
        token = sample_constrained(dec, logits, constraint)
        if token == constraint.tokenizer.eos:
            finish = "tool_calls"
            break
        result.completion_tokens += 1
        ids.append(token)
        if constraint.done:
            finish = "tool_calls"
            break
        dec.feed([token])
    text = tokenizer.decode(ids)
    split = plan.split(text)
    if split is not None:
        name, arguments = split
        try:
            call = ToolCall(name, json.loads(arguments), new_call_id())
        except json.JSONDecodeError:
            call = ToolCall(name, {}, new_call_id(), raw_arguments=arguments)
        result.tool_calls = [call]
        emit("delta", Delta("tool_call", tool_call=call))
    _done(emit, result, finish, dec, started)


def run_completion(tokenizer, model, prep: Prepared, emit: Emit, cancelled) -> Iterator[None]:
    """Plain text continuation of `prep.prompt` (/v1/completions)."""
    started = time.perf_counter()
    dec = Decoder(model, prep.prompt, prep.params, _max_len(prep, 0), prefix_cache=prep.prefix_cache,
                  speculator=prep.speculator)
    decoder = tokenizer.stream_decoder()
    stops = StopFilter(prep.stop)
    result = TurnResult(prompt_tokens=len(prep.prompt))
    finish = "length"
    while True:
        logits = yield from next_logits(dec, prep, result, started, cancelled)
        if logits is None:
            finish = "cancelled"
            break
        token = dec.sample(logits)
        if token in tokenizer.stop_token_ids:
            finish = "stop"
            break
        result.completion_tokens += 1
        last = result.completion_tokens >= prep.max_tokens or dec.room <= 1
        text = stops.feed(decoder.feed(token) + (decoder.flush() if last else ""))
        if text:
            emit("delta", Delta("content", text))
        if stops.hit:
            finish = "stop"
            break
        if last:
            break
        dec.feed([token])
    text = stops.feed(decoder.flush()) + stops.flush() if not stops.hit else ""
    if text:
        emit("delta", Delta("content", text))
    result.content = stops.text
    result.stop_sequence = stops.matched
    _done(emit, result, finish, dec, started)


def run_prefill(model, prep: Prepared, emit: Emit, cancelled) -> Iterator[None]:
    """Prefill `prep.prompt` and leave its cache to the prefix cache, generating nothing (a front end warms
    its conversation's fixed header while the user types: `Service.warm`)."""
    started = time.perf_counter()
    dec = Decoder(model, prep.prompt, prep.params, len(prep.prompt) + 2, prefix_cache=prep.prefix_cache,
                  anchor=len(prep.prompt))
    result = TurnResult(prompt_tokens=len(prep.prompt))
    logits = yield from next_logits(dec, prep, result, started, cancelled)
    _done(emit, result, "stop" if logits is not None else "cancelled", dec, started)

