"""What the HTTP handlers call: the served model, request preparation (render, context fit,
limits, budgets, forced tool calls), job submission and session storage.

Handlers stay thin: they turn their API's body into a `ChatRequest`, call `prepare`, and
read the job's events through a `Stream`.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from localmoe.chat.budget import Budget, ThinkingBudgets
from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.config import SPEC_K
from localmoe.engine.generate import PREFILL_CHUNK
from localmoe.engine.prefix_cache import DEFAULT_BYTES, DEFAULT_ENTRIES, PrefixCache, common_prefix
from localmoe.engine.sampler import SamplingParams
from localmoe.errors import CancelledError, LocalMoEError, NotFoundError, RequestError
from localmoe.runtime.context import fit_messages
from localmoe.runtime.forced import plan_forced_call
from localmoe.runtime.images import prompt_images, size_images
from localmoe.runtime.metrics import Metrics, paging_stats
from localmoe.runtime.speculation import Speculation
from localmoe.runtime.turn import Prepared, TurnResult, run_chat, run_completion, run_prefill
from localmoe.runtime.worker import EngineWorker, Job

MODEL_ALIASES = ("default", "localmoe")
HEADER_PROBE = "\u2063"  # a user message no conversation starts with: where it begins, the header ended


@dataclass
class ServerConfig:
    max_tokens_default: int = 512  # when a request gives none
    max_tokens_limit: int | None = None  # the most a request may ask for (None: the context)
    max_active: int = 16  # sequences batched at once; more wait in the queue
    kv_budget: int | None = None  # bytes of KV cache the running sequences may hold before admission waits
    batching: str = "auto"  # the worker's decode step: auto | on | off (runtime/worker.py)
    preemption: str = "swap"  # a preempted sequence's cache: swap | recompute (runtime/worker.py)
    swap_dir: str | None = None  # where swapped-out caches go (None: a private temporary directory)
    spec: str = "off"  # speculative decoding: prompt | draft:PATH | prompt+draft:PATH | mtp | off (speculation.py)
    spec_k: int = SPEC_K  # the most drafts per step (the speculator chooses fewer where more do not pay)
    max_body_bytes: int = 8 << 20
    api_key: str | None = None
    sessions_path: Path | None = None
    budgets: ThinkingBudgets = field(default_factory=ThinkingBudgets)
    threads: int = 0
    prefix_cache_entries: int = DEFAULT_ENTRIES  # finished sequences' caches kept for reuse (0: none)
    prefix_cache_bytes: int = DEFAULT_BYTES
    # folders /v1/documents may read under (`--documents-root`); none: the document endpoints are off
    documents_roots: tuple[Path, ...] = ()
    # Host header names answered (security.py; `--allowed-hosts`, "*": any); others get 403
    allowed_hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")


@dataclass
class ChatRequest:
    """A chat request in API-neutral form."""

    messages: list[ChatMessage]
    max_tokens: int | None
    params: SamplingParams
    tools: list[dict] = field(default_factory=list)
    tool_mode: str = "auto"  # auto | none | required | named
    tool_names: list[str] = field(default_factory=list)  # the forced function (named) / all tools
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    reasoning_tokens: int | None = None  # an explicit reasoning limit (Anthropic budget_tokens)
    stop: list[str] = field(default_factory=list)
    seconds: float | None = None
    bytes_read: int | None = None
    session_id: str | None = None
    output_schema: dict | None = None  # the answer is one JSON value valid against it (structured output)
    output_param: str = "response_format"  # the request field that gave `output_schema` (named in errors)
    spec: str | None = None  # this request's speculation: "off", "prompt", "draft", "prompt+draft", "mtp" (None: the
    # server's)


class Stream:
    """The events of one job, read from the event loop; cancels the job when abandoned."""

    def __init__(self, service: Service, work, on_done=None, on_interrupt=None):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.service = service
        self.on_done = on_done
        self.on_interrupt = on_interrupt  # called with the partial TurnResult when the client goes away
        self.partial = TurnResult(finish_reason="cancelled")  # what has been handed out so far
        self.job = Job(work, self._put)
        self.finished = False
        self.prompt: list[int] = []

    def _put(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening
            pass

    def start(self) -> Stream:
        self.service.worker.submit(self.job)
        return self

    async def events(self):
        """("delta", Delta) ... then ("done", TurnResult); raises the job's error."""
        try:
            while True:
                kind, payload = await self.queue.get()
                if kind == "error":
                    self.finished = True
                    raise payload
                if kind == "done":
                    self.finished = True
                    self.service.record(payload)
                    if self.on_done is not None:
                        self.on_done(payload)
                else:
                    self._seen(payload)
                yield kind, payload
                if kind == "done":
                    return
        finally:
            if not self.finished:
                self.finished = True
                self.cancel()
                if self.on_interrupt is not None:
                    self.on_interrupt(self.partial)

    def _seen(self, delta) -> None:
        if delta.tool_call is not None:
            self.partial.tool_calls.append(delta.tool_call)
        elif delta.channel == "reasoning":
            self.partial.reasoning += delta.text
        else:
            self.partial.content += delta.text

    def cancel(self) -> None:
        if not self.job.cancelled:
            self.job.cancel()
            self.service.metrics.cancel()

    async def result(self, is_disconnected=None) -> TurnResult:
        """Wait for the whole result; cancel the job if the client disconnects meanwhile."""
        collect = asyncio.ensure_future(self._collect())
        if is_disconnected is None:
            return await collect
        watcher = asyncio.ensure_future(_watch(is_disconnected))
        done, _ = await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collect in done:
            watcher.cancel()
            return collect.result()
        collect.cancel()
        self.cancel()
        raise CancelledError()

    async def _collect(self) -> TurnResult:
        async for kind, payload in self.events():
            if kind == "done":
                return payload
        raise CancelledError()


DISCONNECT_POLL = 0.05  # seconds between checks for a vanished client: its generation stops within this


async def _watch(is_disconnected) -> None:
    while not await is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)


class Service:
    """The served model and everything the handlers share."""

    def __init__(self, loaded, config: ServerConfig, chat_format=None, model_id: str | None = None):
        self.loaded = loaded
        self.config = config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if chat_format is None:
            from localmoe.chat import chat_format_for

            chat_format = chat_format_for(loaded.spec, loaded.tokenizer)
        self.format = chat_format
        source = Path(str(loaded.source))
        self.model_id = model_id or (source.name if source.is_dir() else source.stem)
        self.context = int(self.model.max_context)
        self.metrics = Metrics()
        self.prefix_cache = (PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes)
                             if config.prefix_cache_entries > 0 else None)
        self.worker = EngineWorker(config.max_active, config.threads or None, config.kv_budget, config.batching,
                                   config.preemption, config.swap_dir)
        self.speculation = Speculation(loaded, config.spec, config.spec_k)
        self.created = int(time.time())
        self._grammar_tokenizer = None
        self._grammar_error: str | None = None
        self.sessions = None
        if config.sessions_path is not None:
            from localmoe.chat.sessions import SessionStore

            self.sessions = SessionStore(config.sessions_path)

    def start(self) -> None:
        from localmoe.chat.grammar import GrammarError

        try:
            _ = self.grammar_tokenizer  # built once, before the first constrained request needs it
        except GrammarError as e:
            self._grammar_error = str(e)
            print(f"localmoe serve: warning: {e}", file=sys.stderr)
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        if self.sessions is not None:
            self.sessions.close()

    @property
    def grammar_tokenizer(self):
        """The grammar engine's view of the tokenizer (forced tool calls, structured output)."""
        if self._grammar_tokenizer is None:
            from localmoe.chat.grammar import GrammarTokenizer

            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.format.stop_token_ids())
        return self._grammar_tokenizer

    def constraint(self, grammar: str, param: str):
        """A fresh grammar state for one generation; a grammar the engine rejects is a 400 naming `param`."""
        from localmoe.chat.grammar import Constraint, GrammarError

        if self._grammar_error is not None:
            raise RequestError(f"{param}: {self._grammar_error}", param=param)
        try:
            return Constraint(self.grammar_tokenizer, grammar)
        except GrammarError as e:
            raise RequestError(f"{param}: {e}", param=param) from None

    # ---- checks shared by the endpoints ----

    def check_model(self, name: str) -> None:
        if name != self.model_id and name not in MODEL_ALIASES:
            raise NotFoundError(f"model {name!r} is not served here; this server serves {self.model_id!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        limit = self.config.max_tokens_limit or (self.context - 1)
        if requested is not None and requested > limit:
            raise RequestError(f"max_tokens is {requested} but this server allows at most {limit} "
                                f"(context {self.context}); ask for fewer tokens", param="max_tokens")
        room = self.context - prompt_tokens - 1
        if requested is None:
            return max(1, min(self.config.max_tokens_default, limit, room))
        return requested

    def record(self, result: TurnResult) -> None:
        self.metrics.finished(result.prompt_tokens, result.completion_tokens, result.reasoning_tokens,
                              result.time_to_first_token)
        if result.spec is not None:
            self.speculation.finished(result.spec)

    def metrics_text(self) -> str:
        images = vars(self.loaded).get("image_encoder")  # only once an image was shown (a cached property)
        paging = paging_stats(self.model)
        return self.metrics.render(self.worker.waiting, self.worker.active, {} if paging is None else dict(paging.tiers),
                                   self.worker, self.speculation.stats if self.speculation.on or self.speculation.stats.steps
                                   else None, images, None if paging is None else paging.routed)

    # ---- chat ----

    def history(self, session_id: str | None) -> list[ChatMessage]:
        if session_id is None:
            return []
        if self.sessions is None:
            raise RequestError("session_id given but this server stores no sessions (start it with --sessions)",
                           param="session_id")
        if not self.sessions.exists(session_id):
            return []
        return self.sessions.messages(session_id)

    def prepare_chat(self, req: ChatRequest) -> tuple[Prepared, list[ChatMessage]]:
        """Prompt ids and settings for `req` (history of its session included); raises RequestError."""
        fmt = self.format
        messages = size_images(self.loaded, self.history(req.session_id) + req.messages)
        tools = req.tools if req.tool_mode != "none" else []
        names = [t["function"]["name"] for t in req.tools]
        if req.tool_mode in ("required", "named") and not req.tools:
            raise RequestError(f"tool_choice is {req.tool_mode!r} but no tools are given", param="tool_choice")
        if req.tool_mode == "named" and req.tool_names[0] not in names:
            raise RequestError(f"tool_choice names {req.tool_names[0]!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice")

        def render(msgs: list[ChatMessage]) -> list[int]:
            return fmt.render(msgs, tools=tools or None, reasoning_effort=req.reasoning_effort)

        try:
            prompt = render(messages)
            max_tokens = self.max_tokens(req.max_tokens, len(prompt))
            prompt, messages = fit_messages(messages, render, self.context - max_tokens - 2)
        except RequestError:
            raise
        except LocalMoEError as e:
            raise RequestError(str(e), param="messages") from None
        images = prompt_images(self.loaded, messages, prompt)
        reasoning_limit = req.reasoning_tokens
        if reasoning_limit is None and fmt.thinks:
            reasoning_limit = self.config.budgets.limit_for(req.reasoning_effort)
        budget = Budget(reasoning_tokens=reasoning_limit, seconds=req.seconds, bytes_read=req.bytes_read)
        forced, constraint = None, None
        if req.tool_mode in ("required", "named"):
            forced_names = req.tool_names if req.tool_mode == "named" else names
            forced = plan_forced_call(fmt, self.tokenizer, messages, tools, forced_names, prompt, req.reasoning_effort)
            constraint = self.constraint(forced.grammar(), "tools")
        elif req.output_schema is not None:
            from localmoe.chat.grammar import GrammarError, json_schema_grammar

            try:
                grammar = json_schema_grammar(req.output_schema, req.output_param)
            except GrammarError as e:
                raise RequestError(str(e), param=req.output_param) from None
            constraint = self.constraint(grammar, req.output_param)
        prep = Prepared(prompt=prompt, max_tokens=max_tokens, params=req.params, stop=req.stop, budget=budget,
                        forced=forced, constraint=constraint, parallel_tool_calls=req.parallel_tool_calls,
                        keep_tool_calls=req.tool_mode != "none", prefix_cache=self.prefix_cache,
                        anchor=self._header_end(prompt, messages, render),
                        speculator=None if constraint is not None else self.speculator(req.spec), images=images)
        return prep, messages

    def _header_end(self, prompt: list[int], messages: list[ChatMessage], render) -> int | None:
        """Where the conversation's fixed header (leading system messages, tool definitions) ends in `prompt`:
        the tokens it shares with the same header before another message. A chunk ends there, so every
        request with that header reuses its cache (engine/prefix_cache.py); it does with or without a prefix
        cache, so a request's output does not depend on whether one is kept."""
        system = 0
        while system < len(messages) and messages[system].role == "system":
            system += 1
        try:
            other = render(messages[:system] + [ChatMessage("user", HEADER_PROBE)])
        except Exception:  # noqa: BLE001 - a template that refuses the probe: no anchor, chunks as usual
            return None
        end = common_prefix(prompt, other)
        return end if 0 < end < len(prompt) else None

    def warm(self, req: ChatRequest) -> None:
        """Prefill the fixed header of `req`'s conversation into the prefix cache now, in the background (a
        front end does it while the user types, so the first message prefills only itself). Best effort."""
        if self.prefix_cache is None:
            return
        try:
            prep, _ = self.prepare_chat(req)
        except LocalMoEError:
            return
        if prep.anchor is None or self.prefix_cache.holds(prep.prompt[:prep.anchor], PREFILL_CHUNK,
                                                          prep.anchor) == prep.anchor:
            return  # no header, or its cache is kept already
        header = Prepared(prompt=prep.prompt[:prep.anchor], max_tokens=1, params=prep.params,
                          prefix_cache=self.prefix_cache)
        model = self.model
        self.worker.submit(Job(lambda job: run_prefill(model, header, job.emit, lambda: job.cancelled),
                               lambda kind, payload: None))

    def speculator(self, mode: str | None):
        """A new sequence's speculator (None: it does not speculate); a mode this server cannot run is a 400."""
        try:
            return self.speculation.new(mode)
        except LocalMoEError as e:
            raise RequestError(str(e), param="spec") from None

    def store_request(self, req: ChatRequest) -> None:
        """Store the request's new messages in its session, durably, before generating."""
        if req.session_id is not None and self.sessions is not None:
            self.sessions.ensure(req.session_id, model=self.model_id)
            if req.messages:
                self.sessions.append(req.session_id, *req.messages)

    async def chat(self, req: ChatRequest) -> Stream:
        """Prepare `req` (off the event loop), store its messages, start generating."""
        prep, _ = await asyncio.to_thread(self.prepare_chat, req)
        await asyncio.to_thread(self.store_request, req)
        on_done = None
        if req.session_id is not None and self.sessions is not None:
            session_id = req.session_id

            def on_done(result: TurnResult) -> None:
                """The answer joins the session; one cut short by its client is kept, marked interrupted."""
                self.sessions.append(session_id, ChatMessage(
                    "assistant", result.content, reasoning=result.reasoning or None,
                    tool_calls=list(result.tool_calls), interrupted=result.finish_reason == "cancelled"))

        fmt, tokenizer = self.format, self.tokenizer
        stream = Stream(self, lambda job: run_chat(fmt, tokenizer, self.model, prep, job.emit, lambda: job.cancelled),
                        on_done, on_interrupt=on_done)
        stream.prompt = prep.prompt
        return stream.start()

    def run_here(self, work):
        """Run one job in this thread (one front end alone: `localmoe run`, the Python API): the worker's
        own step, stepped here instead of on its thread, so the same scheduler and batched step serve it.
        Yields ("delta", Delta) ... ("done", TurnResult); raises the job's error. Closing the generator
        early cancels the job and frees its cache."""
        if self.worker.running:
            raise RuntimeError("run_here steps the worker itself: use chat() / completion_stream() once the "
                               "worker thread runs")
        events: list[tuple[str, object]] = []
        job = Job(work, lambda kind, payload: events.append((kind, payload)))
        self.worker.submit(job)
        try:
            while True:
                self.worker.step()
                for kind, payload in events:
                    if kind == "error":
                        raise payload
                    yield kind, payload
                    if kind == "done":
                        return
                events.clear()
        finally:
            if not events or events[-1][0] not in ("done", "error"):
                job.cancel()
                self.worker.step()  # closes the job and releases its cache

    def chat_here(self, req: ChatRequest):
        """`chat` run in this thread (`run_here`)."""
        prep, _ = self.prepare_chat(req)
        fmt, tokenizer, model = self.format, self.tokenizer, self.model
        return self.run_here(lambda job: run_chat(fmt, tokenizer, model, prep, job.emit, lambda: job.cancelled))

    # ---- completions ----

    def prepare_completion(self, prompt: str | list[int], max_tokens: int | None, params: SamplingParams,
                           stop: list[str], spec: str | None = None) -> Prepared:
        """Prompt ids and settings of a plain completion; raises RequestError."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty: there is nothing to continue", param="prompt")
        max_tokens = self.max_tokens(max_tokens, len(ids))
        if len(ids) + max_tokens + 2 > self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}, but the context "
                                f"holds {self.context}; shorten the prompt or lower max_tokens", param="prompt",
                           code="context_length_exceeded")
        return Prepared(prompt=ids, max_tokens=max_tokens, params=params, stop=stop, prefix_cache=self.prefix_cache,
                        speculator=self.speculator(spec))

    def _completion(self, prep: Prepared):
        tokenizer, model = self.tokenizer, self.model
        return lambda job: run_completion(tokenizer, model, prep, job.emit, lambda: job.cancelled)

    def completion_stream(self, prompt: str | list[int], max_tokens: int | None, params: SamplingParams,
                          stop: list[str], spec: str | None = None) -> Stream:
        return Stream(self, self._completion(self.prepare_completion(prompt, max_tokens, params, stop, spec))).start()

    def completion_here(self, prep: Prepared):
        """A prepared completion run in this thread (`run_here`)."""
        return self.run_here(self._completion(prep))


def sampling_params(temperature, top_p, top_k, min_p, repetition_penalty, seed, default_temperature=1.0):
    try:
        return SamplingParams(temperature=default_temperature if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, min_p=min_p or 0.0,
                              repetition_penalty=repetition_penalty or 1.0, seed=seed)
    except LocalMoEError as e:
        raise RequestError(str(e)) from None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def tool_call_dict(call: ToolCall) -> dict:
    import json

    arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments,
                                                                                        ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
