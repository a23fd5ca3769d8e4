"""The one engine worker: a thread that owns the model and serves every request's job, with
continuous batching.

Handlers submit a `Job` (a generator: a chat turn or a completion, turn.py) to a queue. A job
yields its `Decoder` whenever it needs logits and is sent them back. Each engine step the
worker collects what its running jobs wait for and runs, in this order:

- the decode tokens of every running sequence as ONE batched forward (`decode_together`:
  each weight and each routed expert read once for all of them; each sequence keeps its own
  cache, so sequences join and leave between steps);
- prompt chunks of sequences still prefilling, so a long prompt delays the others by one chunk per
  step, never by its whole length. Where the model's rows are each computed on their own
  (engine/batch.py `rows_independent`: the dense-plan models, and MoE models with plain GQA whose
  routing and experts run per token, where their experts are paged) they run as more rows of the same
  batched forward: a budget that fills the step to STEP_ROWS + PROMPT_ROWS rows, at least PROMPT_ROWS, shared by
  the prefilling sequences in arrival order, so a step carrying them costs at most ~1.3x a 16-row decode step
  (the others' inter-token latency) and the weights are read once for all; every waiting prompt (each up to its
  chunk, so a long prompt still delays the others by one chunk a step; up to INTAKE_ROWS rows in all) where no
  more sequences decode than prompts wait (a burst: the step delays fewer streams than it starts, and the requests
  then run and end together) and, for a paged MoE model, always (its step reads most routed experts from the tiers
  whatever its rows: one read of each for all the prompts; its MoE calls are sliced at `row_limit` rows inside each
  layer; where that is below a chunk, the step stays within it). A prompt's rows cross its chunk boundaries where
  its cache keeps no delta-rule state (`Decoder.chunk_size`); a prompt token's bits do not depend on its chunk or
  its neighbours. A prompt whose chat header an earlier prompt of the step prefills (the same header, which the
  prefix cache does not hold) waits that step: the earlier one leaves a copy of the header in the prefix cache as
  its prompt passes it, and the waiting one starts from that copy (engine/prefix_cache.py), so a burst's header
  runs once.
  Elsewhere one chunk of the oldest prefilling sequence runs in a forward of its own;
- injected tokens (a closed thinking budget's end-of-thinking marker, a forced call's opening),
  each sequence alone.

`batching` chooses the decode step: "on" always batches; "off" runs each sequence's own decode
step one after another (the fused single-sequence step where the model has one); "auto" (the
default) batches where it pays (engine/batch.py `batching_pays`): dense, gpt-oss and hybrid-form models (Qwen3-MoE,
K3, Kimi-Linear, Qwen3-Next, DeepSeek, ...) whose fused plan runs the batched rows in one kernel call (engine/batch.py `rows_plan`: a step of one sequence costs the fused step, and
every row has the fused step's bits, so "on", "off" and `localmoe run` agree), models without a fused
single-sequence step, and those whose matrices all run multi-row kernels; it keeps the fused step where that is
faster per token than the batched op-by-op step. The choice holds for every step, so a request's output never
depends on the others.

Admission and preemption. Up to `max_active` jobs run at once; the others wait in arrival
order. With `kv_budget` (bytes), a waiting job is admitted only while the running sequences'
caches hold less than the budget. Running caches grow a block at a time; when, at the start of a
step, they hold more than the budget, the sequence that arrived last is preempted
(`Decoder.preempt` frees its cache's memory at once and it waits at the head of the line), until
they fit or one sequence is left. A preempted sequence resumes, before any new job is admitted,
once the bytes it held fit beside the running ones. `preemption` chooses how (`_swaps`): "swap"
(the default) writes the cache to a file (engine/swap.py) and reads it back on resume, so the
sequence goes on at once; "recompute" writes nothing and runs its prompt and every token it had run
through the same forwards again (decode tokens in decode steps, batched with the others), one step
per generated token (a speculating sequence always recomputes). Either way its output is the one it
would have had. A cancelled job (its client went away), running,
preempted or waiting, is closed at the next step and its cache released at once (`kv_bytes` drops;
a swapped-out cache's file is removed). A job may also yield None: it is resumed next step without
a forward.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from localmoe.engine.batch import batching_pays, row_limit, rows_independent
from localmoe.engine.generate import Decoder, decode_together
from localmoe.errors import CancelledError
from localmoe.runtime.metrics import paging_stats

BATCHING = ("auto", "on", "off")
PREEMPTION = ("swap", "recompute")
# Prompt rows a step carries beside its decode rows: enough to fill it to STEP_ROWS + PROMPT_ROWS rows, at least
# PROMPT_ROWS (every waiting prompt where no more sequences decode than prompts wait: INTAKE_ROWS). A batched step
# costs ~a + b * rows (embedded model through its
# dense plan, CPU time of one thread, session 8: 7.1 ms at 1 row, 34.4 at 16; 6.4 and 26.8 with the int8 head of
# q8-all; session 9's int16-input default head: 7.9 and 31.2 on a loaded machine, where the fp32-input head gave 7.9
# and 37.1; a prompt row skips the head), so at 16 clients a step carrying as many prompt rows as it decodes cost
# ~1.95x the decode step it delayed and such steps set the p99 inter-token latency; 8 beside 16 cost ~1.3x. No step
# carrying prompts beside more decode rows than prompts wait is heavier than that (24 rows). A burst of prompts
# enters whole in one step (16 clients: the ramp of ~40 24-row steps that delayed every decoding stream is gone,
# ~137 -> ~100 steps, mean batch ~11 -> ~13-15, first-token p99 lower, p50 higher; docs/performance.md, "The int8
# lm_head (opt-in), prompt rows per step, session 8", "The 16-row step, session 11" and "Serving, session 14"). Its
# prompts share their chat header: the prefix cache copies a kept header to each, and a prompt whose header an
# earlier prompt of the step prefills waits a step for its copy (session 15: ~1,083 -> 459 prompt rows a 16-client run).
PROMPT_ROWS = 8
STEP_ROWS = 16
INTAKE_ROWS = 4096  # the most prompt rows of a step that takes every waiting prompt, each at most its chunk (512)


class Job:
    """One request's work. `events` receive ("delta", ...), ("done", ...) or ("error", exc)."""

    def __init__(self, work: Callable[[Job], Iterator[Decoder | None]], on_event: Callable[[str, object], None]):
        self.work = work
        self.on_event = on_event
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, kind: str, payload: object) -> None:
        self.on_event(kind, payload)


class Running:
    """A started job: its generator, what it waits for (its Decoder, or None), and the cache bytes it held
    when it was preempted."""

    __slots__ = ("held", "job", "steps", "wants")

    def __init__(self, job: Job, steps: Iterator[Decoder | None]):
        self.job, self.steps, self.wants, self.held = job, steps, None, 0

    @property
    def decoder(self) -> Decoder | None:
        """The Decoder it waits on, while its cache exists."""
        return self.wants if isinstance(self.wants, Decoder) and self.wants.cache is not None else None


class EngineWorker:
    """Runs jobs on one thread; `submit` is safe from any thread."""

    def __init__(self, max_active: int = 16, threads: int | None = None, kv_budget: int | None = None,
                 batching: str = "auto", preemption: str = "swap", swap_dir: str | None = None):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, not {batching!r}")
        if preemption not in PREEMPTION:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION)}, not {preemption!r}")
        self.preemption = preemption
        self._swap_dir = swap_dir  # created on the first swap (a private temporary directory where not given)
        self._own_swap_dir = swap_dir is None  # removed with the worker
        self.max_active = max_active
        self.batching = batching
        self.fused: bool | None = None  # decided at the first decode step (see the module docstring)
        self.rows: bool | None = None  # prompt chunks as rows of the batched step (decided once, `_prompt_chunk`)
        self.whole = False  # a MoE model (decided with `rows`): whole prompt chunks per step beside the decode rows
        self.row_limit: int | None = None  # rows a step's MoE calls give their alone-bits (engine/batch.py row_limit)
        self.kv_budget = kv_budget
        self._threads = threads
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting: deque[Job] = deque()  # taken from the queue, not admitted yet (the KV budget is spent)
        self._active: list[Running] = []
        self._preempted: list[Running] = []  # caches freed, in arrival order: resumed before new jobs start
        self._thread = threading.Thread(target=self._run, name="localmoe-engine", daemon=True)
        self._stopping = False
        self.steps = 0  # engine steps run
        self.batched_tokens = 0  # decode tokens run in batched steps (all steps together)
        self.prompt_rows = 0  # prompt chunks run as rows of a batched step
        self.failures = 0
        self.cancelled = 0
        self.preemptions = 0
        self.swaps = 0  # preemptions that swapped the cache out (the others recompute)

    def fused_for(self, model) -> bool:
        """Whether decode steps run each sequence's own fused step (decided once, see the module docstring)."""
        if self.fused is None:
            self.fused = self.batching == "off" or (self.batching == "auto" and not batching_pays(model))
        return self.fused

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._queue.put(None)
        if self._thread.ident is None:  # never started (the caller ran `step`): nothing else closes it
            self.close()
        else:
            self._thread.join(timeout)  # the thread closes when it leaves its loop

    def close(self) -> None:
        """Remove the files of caches still swapped out and the private swap folder (the worker stops)."""
        for running in self._preempted:
            if isinstance(running.wants, Decoder):
                running.wants.discard()
        if self._own_swap_dir and self._swap_dir is not None:
            import shutil

            shutil.rmtree(self._swap_dir, ignore_errors=True)
            self._swap_dir = None

    @property
    def running(self) -> bool:
        """Whether the worker's thread runs (else whoever holds the worker calls `step`)."""
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    @property
    def waiting(self) -> int:
        """Jobs queued and not started yet."""
        return self._queue.qsize() + len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def preempted(self) -> int:
        """Sequences whose caches were freed for the budget, waiting to resume."""
        return len(self._preempted)

    @property
    def kv_bytes(self) -> int:
        """Bytes the running sequences' caches hold (allocated blocks and states)."""
        return sum(d.cache.nbytes() for d in (r.decoder for r in list(self._active)) if d is not None)

    def _take(self, block: bool) -> None:
        """Move queued jobs to the waiting line (blocking for the first when nothing runs)."""
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stopping = True
                return
            self._waiting.append(job)

    def _admit(self) -> None:
        self._take(block=False)
        while self._preempted and len(self._active) < self.max_active:
            running = self._preempted[0]
            if self._active and self.kv_budget is not None and self.kv_bytes + running.held > self.kv_budget:
                return  # not room for it yet; new jobs wait behind it
            self._preempted.pop(0)
            try:
                running.wants.resume()  # a swapped-out cache read back (recompute: a fresh one)
            except Exception as e:  # noqa: BLE001 - a cache that cannot be read back fails its request alone
                running.steps.close()
                self._fail(running.job, e)
                continue
            self._active.append(running)
        while self._waiting and len(self._active) < self.max_active:
            if self.kv_budget is not None and self._active and self.kv_bytes >= self.kv_budget:
                return  # the caches fill the budget: wait until a sequence finishes
            job = self._waiting.popleft()
            if job.cancelled:
                job.emit("error", CancelledError())
                continue
            job.started = time.perf_counter()
            try:
                running = Running(job, job.work(job))
                self._advance(running, None, first=True)
            except Exception as e:  # noqa: BLE001 - a job that cannot start reports its error
                self._fail(job, e)

    def _fail(self, job: Job, error: BaseException) -> None:
        self.failures += 1
        job.emit("error", error)

    def _advance(self, running: Running, logits, first: bool = False) -> None:
        """Resume a job with its logits; keep it running unless it ended (a failure is reported)."""
        try:
            running.wants = next(running.steps) if first else running.steps.send(logits)
        except StopIteration:
            self._drop(running)
            return
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the worker
            self._drop(running)
            self._fail(running.job, e)
            return
        if first:
            self._active.append(running)

    def _drop(self, running: Running) -> None:
        if running in self._active:
            self._active.remove(running)

    def _preempt_over_budget(self) -> None:
        """While the running caches hold more than the budget, preempt the sequence that arrived last."""
        if self.kv_budget is None:
            return
        while len(self._active) > 1 and self.kv_bytes > self.kv_budget:
            held = [r for r in self._active if r.decoder is not None and r.decoder.preemptible]
            if not held:
                return  # none may be preempted now
            victim = max(held, key=lambda r: r.job.submitted)
            victim.held = victim.decoder.cache.nbytes()
            swap = self._swaps(victim.wants)
            try:
                victim.wants.preempt(self.swap_dir if swap else None)
            except OSError:  # the cache could not be written (no room, no folder): recompute instead
                swap = False
                victim.wants.preempt(None)
            self.swaps += swap
            self._drop(victim)
            self._preempted.append(victim)
            self._preempted.sort(key=lambda r: r.job.submitted)
            self.preemptions += 1

    def _swaps(self, dec: Decoder) -> bool:
        """Whether preempting `dec` swaps its cache out ("swap") rather than recomputing it ("recompute", and
        a speculating sequence: its drafter holds the cache). Swapping the embedded model's 11 MiB cache
        out and back cost 7-23x less CPU than recomputing 16-64 generated tokens (docs/performance.md)."""
        return self.preemption == "swap" and dec.speculator is None

    @property
    def swap_dir(self) -> str:
        """Where swapped-out caches go (engine/swap.py)."""
        if self._swap_dir is None:
            import tempfile

            self._swap_dir = tempfile.mkdtemp(prefix="localmoe-swap-")
        return self._swap_dir

    def _close_cancelled(self) -> None:
        for line in (self._active, self._preempted):
            for running in [r for r in line if r.job.cancelled]:
                if isinstance(running.wants, Decoder):
                    running.wants.discard()  # a swapped-out cache's file
                running.steps.close()
                line.remove(running)
                self.cancelled += 1
                running.job.emit("error", CancelledError())

    def step(self) -> None:
        """Close what was cancelled, admit or resume what may run, preempt what no longer fits the KV
        budget, then one engine step over every running job (see the module docstring). The worker thread
        calls it in a loop; a test may call it itself instead of starting the thread."""
        self._close_cancelled()
        self._admit()
        self._close_cancelled()  # a job admitted this step may have been cancelled meanwhile
        self._preempt_over_budget()
        decode = [r for r in self._active if isinstance(r.wants, Decoder) and r.wants.decoding]
        prefill = [r for r in self._active if isinstance(r.wants, Decoder) and not r.wants.decoding]
        idle = [r for r in self._active if r.wants is None]
        results: list[tuple[Running, torch.Tensor | None]] = []
        chunks = self._prompt_chunks(decode, prefill)
        batched = decode + [r for r, _ in chunks]
        if batched:
            model = batched[0].wants.model
            try:
                if not chunks:
                    logits = decode_together([r.wants for r in decode], self.fused_for(model))
                else:
                    logits = decode_together([r.wants for r in decode], False, [(r.wants, n) for r, n in chunks])
                    self.prompt_rows += len(chunks)
                results += zip(batched, logits)
                self.batched_tokens += 0 if self.fused else len(decode)
            except Exception as e:  # noqa: BLE001 - fail the step's jobs alone, keep serving
                for r in batched:
                    self._drop(r)
                    self._fail(r.job, e)
        prompt_run = bool(chunks)
        for r in prefill:
            if any(r is c for c, _ in chunks):
                continue
            dec = r.wants
            if dec.prefilling:
                if prompt_run:
                    continue  # one prompt chunk per step
                prompt_run = True
            try:
                results.append((r, dec.logits()))
            except Exception as e:  # noqa: BLE001
                self._drop(r)
                self._fail(r.job, e)
        results += [(r, None) for r in idle]
        for r, logits in results:
            self._advance(r, logits)
            while r in self._active and isinstance(r.wants, Decoder) and r.wants.ready:
                self._advance(r, r.wants.logits())  # a speculative step's other accepted tokens: no forward
        self.steps += 1

    def _prompt_chunks(self, decode: list[Running], prefill: list[Running]) -> list[tuple[Running, int]]:
        """The prompt chunks that run as rows of this step's batched forward, [(sequence, tokens)], where the
        model's rows are independent (engine/batch.py `rows_independent`, decided once; beside speculating
        sequences' verify rows too): the step's prompt budget (STEP_ROWS + PROMPT_ROWS less the decode rows, at least
        PROMPT_ROWS; every waiting prompt's rows, up to INTAKE_ROWS, where no more sequences decode than prompts
        wait or the model's experts are paged) goes to the prefilling sequences in arrival order
        (`Decoder.chunk_size`), so prompts that arrive together enter together.
        Empty where the first prefilling sequence takes its own forward (images, a speculator:
        `Decoder.logits`)."""
        waiting = [r for r in prefill if r.wants.prefilling]
        if not waiting or not waiting[0].wants.prompt_rows:
            return []
        if self.rows is None:
            model = waiting[0].wants.model
            self.row_limit = row_limit(model)
            # a MoE model's prompts as rows where its experts are paged (a step reads most experts from the tiers
            # whatever its rows, so prompts waiting together share one read of each: gpt-oss `large` at 25%, 16
            # clients, 530 -> 246 MB read per generated token); resident, a prompt's own forward measured no worse
            # (gpt-oss `small`, docs/performance.md, session 10)
            self.rows = not self.fused_for(model) and rows_independent(model) and \
                (self.row_limit is None or paging_stats(model) is not None)
            self.whole = self.row_limit is not None
        if not self.rows:
            return []
        # a MoE model's step reads the routed experts of all its rows once: a prompt trickled in PROMPT_ROWS a step
        # would read them again in each (gpt-oss `small` resident, 16 clients: 0.85x one client's aggregate with
        # that budget, 1.29x with each prompt's own forward); gpt-oss `large` at 25%, 16 clients: a whole chunk (512
        # rows) a step took 6-7 prompt steps of ~9.7 GB each for the first 16 prompts, all of them take one
        if self.whole or len(decode) <= len(waiting):  # every waiting prompt whole: a paged MoE step (its experts
            # read once for all, its MoE calls sliced at row_limit inside each layer), a burst (no more decode rows
            # than prompts wait: the step delays fewer streams than it starts)
            budget = min(INTAKE_ROWS, sum(min(len(r.wants.pending), r.wants.chunk) for r in waiting))
        else:
            budget = max(PROMPT_ROWS, STEP_ROWS + PROMPT_ROWS - len(decode))
        if self.row_limit is not None and self.row_limit < waiting[0].wants.chunk:  # MoE calls of a few rows (exact
            # MXFP4 32, dense 64, GGUF 96): a step within them, as before (measured: 512-row slices re-read nothing)
            budget = min(budget, max(PROMPT_ROWS, self.row_limit - len(decode)))
        chunks, headers = [], set()  # the headers an earlier prompt prefills (left to the prefix cache as it passes)
        for r in waiting:
            dec = r.wants
            if dec.header is not None and dec.untouched and dec.header in headers:
                continue  # waits a step for the header an earlier prompt prefills, then starts from its copy
            if budget <= 0 or not dec.prompt_rows:
                break
            if dec.header is not None:
                headers.add(dec.header)
            chunks.append((r, dec.chunk_size(min(budget, dec.chunk))))  # a long prompt: a chunk a step
            budget -= chunks[-1][1]
        return chunks

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while not self._stopping:
            idle = not self._active and not self._waiting and not self._preempted
            self._take(block=idle)  # sleeps while there is nothing to do
            if not self._stopping:
                self.step()
        self.close()
