"""One engine step with speculation: every sequence's last token, plus its drafts where it speculates,
as rows of ONE forward (engine/batch.py `forward_rows`), then each speculating sequence keeps what the
acceptance rule accepts and its caches roll back to its last accepted token.

Rolling back: paged K/V and MLA rows trim to any position (a bf16 / fp8 cache keeps its exact ring as it stood
while recording, below, so the positions rejected drafts pushed out of it read exact again). A delta-rule state
(KDA, Gated DeltaNet) cannot be un-added, so during the verify its cache records the state after each row
(`record`: the rows run one at a time through the recurrent kernel, which hands over a new state tensor per token,
so keeping them costs no copy) and `trim` restores the one at the last accepted token. (The
alternative, a snapshot before the verify and a second forward of the accepted tokens, costs a
forward per step; the recorded states cost nothing.) Kimi K3's attention residuals and GLM-5-Next's
hyper-connections mix each token's layer outputs on its own, so their rows run the same way
(`batch._residual_rows`); only a model without rows (`has_rows` False) runs its rows one at a time
through its own decode step, with a copy of the states after each.

Rows of a step are computed as decode tokens, each independently of the others, so a greedy sequence
yields the tokens it yields without speculation in the same mode: with `fused` False a speculating
sequence takes these row kernels on every step, also without a draft. With `fused` (the caller's plain
steps are the model's own fused single-token step: the worker where batching does not pay, a single
sequence) a step without a draft takes that fused step as a plain sequence would, so speculation costs
nothing on the steps where the speculator declines to draft, and the step time it compares drafting
against is the fused step's; the verify rows still round as the row kernels do, so against a fused plain
run the text can part at a near-tie of two tokens, except where the model's fused plan runs the rows
(batch.py `rows_plan`: dense, gpt-oss and hybrid-form models; every row has the fused step's bits, and a row
costs about what the fused step does). (Such a step files no routing for the residency: its sink would keep the model off its fused plan.
An MTP drafter keeps its sink: it needs every hidden state.) A
speculating sequence resumed after a preemption (`Decoder.replaying`) runs each token it had again as
one such row, without drafting, so its caches come back as they were.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from localmoe.engine.batch import decode_batch, forward_rows, has_rows, rows_plan
from localmoe.engine.cache import ModelCache
from localmoe.engine.prompt_rows import forward_with_prompts
from localmoe.engine.sampler import probabilities, sample
from localmoe.engine.spec import costs
from localmoe.engine.spec.accept import accept_greedy, accept_sampled
from localmoe.engine.spec.drafters import NO_DRAFT, Draft
from localmoe.engine.spec.speculator import K_MAX, bucket


def record(cache: ModelCache, on: bool) -> None:
    """Delta-rule layers keep (on) or drop (off) the states of the positions they reach from now on; a bf16 / fp8
    cache's layers keep (on) or drop (off) their exact ring as it stands now.
    A speculating sequence records from the start of a verify until its next step (or its end), so an
    injected token can still drop kept drafts not fed back yet (Decoder.feed). The layers that record are
    the cache's `recorders`, found once when it was made (none in a model without delta-rule layers over an
    fp32 cache)."""
    for layer in cache.recorders:
        layer.record(on)


def step_clock(model):
    """What a step's cost is measured in: the process's CPU time where the model's experts are in memory (the
    compute is the cost; on a loaded host wall time measures the neighbours: at load 10 a plain step and a 5-row
    verify took about the same wall time, and drafts that were never kept looked free). Where a step may wait for
    expert reads (`waits`), which cost time but no CPU: CPU time plus the seconds the pager counts its compute
    thread waiting for reads (every tier's `stall_seconds`), so the neighbours' time slices stay out of it too
    (a paged step at load 9 took 0.4-2.1 s of wall for the same rows); wall time where the waits are not counted
    (the store's page cache)."""
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
    waiting = {id(b.experts): b.experts for b in blocks if getattr(b.experts, "waits", False)}
    if not waiting:
        return time.process_time
    if not all(hasattr(getattr(p, "stats", None), "tiers") for p in waiting.values()):
        return time.perf_counter
    pagers = list(waiting.values())

    def cpu_and_stall() -> float:
        return time.process_time() + sum(t.stall_seconds for p in pagers for t in p.stats.tiers.values())

    return cpu_and_stall


def _beside(clock, drafter):
    """A drafter working in a thread beside the steps (a draft model drafting ahead, draft_model.py): a CPU clock
    leaves its thread's CPU out (it ran beside the step, not in it) and counts the wall seconds a step waited for
    the thread (on the step's path); a wall clock counts both as they are."""
    if clock is time.perf_counter:
        return clock

    def cpu_beside_drafts() -> float:
        return clock() - drafter.thread_seconds() + drafter.waited

    return cpu_beside_drafts


def _rows_alone(model, tokens: Sequence[int], cache: ModelCache) -> torch.Tensor:
    """A non-batchable model's rows, one decode step each, the delta-rule states copied after each."""
    out = []
    for i, t in enumerate(tokens):
        out.append(model.forward(torch.tensor([[t]]), cache)[:, -1])
        if i + 1 < len(tokens):  # the last row is never rolled back to
            cache.snapshot(keep_earlier=True)
    return torch.cat(out)


def _propose(dec) -> Draft:
    """The sequence's draft this step (none where its speculator declines). It runs on every step of a speculating
    sequence that decode_together does not leave to the plain step (`Speculator.rest`), drafting or not: its cost is
    what declining costs (a few calls; the lookup itself is the drafter's)."""
    spec = dec.speculator
    if spec._quiet_set:  # steps decode_together took without it (`Speculator.rest`)
        spec.wake()
    looked, spec.looked = spec.looked, None  # a draft `Speculator.decline` got this step (a drafter asked once)
    k = spec.choose_k()
    if k > 0:
        history, pending = dec.in_cache, dec.pending
        hopeless = spec.hopeless  # (the history with the pending token: its length)
        if hopeless is None or not hopeless(len(history) + len(pending), spec.least):
            k = min(k, dec.room, K_MAX)
            if k > 0:
                # the history is the cached tokens with the pending ones appended for the call and taken off after it
                # (a copy per step cost O(context): ~300 tokens here, a long document's prompt thousands)
                if looked is not None:
                    return spec.fit(looked.first(k), len(history) + len(pending))
                history.extend(pending)
                try:
                    if spec.matches:  # the drafter is told the shortest match worth a draft (none shorter is built)
                        draft = spec.drafter.propose(history, k, dec.params, dec.generator, least=spec.least)
                    else:
                        draft = spec.drafter.propose(history, k, dec.params, dec.generator)
                    at = len(history)
                finally:
                    del history[len(history) - len(pending):]
                return spec.fit(draft.first(k), at) if draft.tokens else draft
    if spec.follows:  # a draft model far behind catches up beside the step (draft_model.py `follow`)
        spec.drafter.follow(dec.in_cache + dec.pending)
    return NO_DRAFT


def _accept(dec, draft: Draft, logits: torch.Tensor) -> tuple[int, int]:
    """(kept drafts j, the token x after them), from the target's logits [k + 1, V]."""
    base = dec.history
    if dec.params.greedy and (base is None or dec.params.repetition_penalty == 1.0):
        # no penalty: `sample` is each row's argmax, so one argmax over the rows gives them all (a call per row cost
        # ~40 us each, 0.2 ms of a 5-row verify of the embedded model); on the CPU numpy's (16 us for 5 rows of 49152
        # logits, torch's 205 us: its CPU argmax is not vectorised), the first of equal maxima as torch's
        rows = logits.float()
        targets = (rows.numpy() if rows.device.type == "cpu" else rows).argmax(-1).tolist()
        return accept_greedy(draft.tokens, targets.__getitem__)
    history = (lambda i: None) if base is None else \
        (lambda i: torch.tensor([base + draft.tokens[:i]], dtype=torch.long))
    if dec.params.greedy:
        return accept_greedy(draft.tokens, lambda i: int(sample(logits[i:i + 1], dec.params, None, history(i))))
    return accept_sampled(draft.tokens, draft.q,
                          lambda i: probabilities(logits[i:i + 1], dec.params, history(i))[0], dec.generator)


def _drafts(decoders: Sequence, fused: bool):
    """Each decoder's draft: (speculating without a replay, replaying, the drafts, the seconds each took, the clock,
    its reading after the last draft)."""
    model = decoders[0].model
    replay = [d.speculating and d.replaying for d in decoders]  # a resumed sequence's tokens: rows, no draft
    spec = [d.speculating and not r for d, r in zip(decoders, replay)]
    drafts, drafting = [], []  # each sequence's draft and the seconds it took (priced apart from the forward)
    for d, s in zip(decoders, spec):
        if s and d.speculator.rows_plain is None:
            # a plain step costs what a row of the verify costs: it is one (batched), or the dense plan runs both
            d.speculator.rows_plain = (not fused and has_rows(model)) or rows_plan(model) is not None
            d.speculator.clock = step_clock(model)
            if d.speculator.follows:
                d.speculator.clock = _beside(d.speculator.clock, d.speculator.drafter)
            # what r rows cost against a plain step is the model's: learned from all its sequences' steps
            d.speculator.costs = costs.shared(model, fused, d.speculator.rows_plain, d.speculator.clock)
            d.speculator.alone = not d.speculator.watches  # set up: a lone step of it may take `_declined`
    clock = next((d.speculator.clock for d, s in zip(decoders, spec) if s), time.perf_counter)
    began = clock()
    for d, s in zip(decoders, spec):  # each clock reading ends one's drafting and starts the next's
        drafts.append(_propose(d) if s else None)
        now = clock()
        drafting.append(now - began)
        began = now
    return spec, replay, drafts, drafting, clock, began


def speculative_step(decoders: Sequence, fused: bool = False, chunks: Sequence = (),
                     plain_step=None) -> list[torch.Tensor | None]:
    """One decode step of `decoders` (each `decoding`; those with a `speculator` draft first) -> each one's
    logits [1, V] for its next token. A speculating decoder is left with the tokens it accepted `ready`
    (engine/generate.py Decoder): its next `sample` calls return them without a forward. `chunks`: other
    sequences' prompt chunks as more rows of the same forward (`decode_together`; not with `fused`), their
    results after the decoders'. `plain_step` (engine/generate.py's, passed in: generate imports this module)
    runs a step in which no sequence drafts."""
    one = decoders[0].speculator if len(decoders) == 1 else None
    if one is not None and one.alone and plain_step is not None and not chunks and not decoders[0]._replay:
        # one sequence (`run`, `chat`, a lone request), set up: the steps where it declines are most of a free
        # answer's, and each line of Python here runs with the caches cold from the forward (~1-2 us a line)
        clock = one.clock
        began = 0.0 if one.free else clock()  # a free drafter's lookup is not priced (tens of us against ms)
        draft = _propose(decoders[0])
        if not draft.tokens:  # off's plain step, counted (and now and then timed) in one call
            return one.decline(decoders[0], plain_step, fused, look=False)
        now = clock()
        spec, replay, drafts, drafting, began = [True], [False], [draft], [0.0 if one.free else now - began], now
    else:
        spec, replay, drafts, drafting, clock, began = _drafts(decoders, fused)
    model = decoders[0].model
    if plain_step is not None and not any(replay) and not any(draft.tokens for draft in drafts if draft is not None) and \
            not any(d.speculator.watches for d, s in zip(decoders, spec) if s):
        # every speculator declined: the plain step (its rows or fused steps, its bits), only the time observed
        results = plain_step(decoders, fused, chunks)
        seconds = clock() - began
        for d, s in zip(decoders, spec):
            if s:
                d.speculator.observe(0, 0, 1, seconds)  # (a draft's time is priced only where it drafted)
        return results
    started = began
    # a speculating sequence without a draft, where plain steps are fused: the fused step (module docstring)
    own = [s and fused and not drafts[n].tokens for n, s in enumerate(spec)]
    rows = [[d.pending[0]] + (draft.tokens if draft is not None else []) for d, draft in zip(decoders, drafts)]
    starts = [d.cache.offset for d in decoders]
    for d, s in zip(decoders, spec):
        if s:
            record(d.cache, False)  # the previous step's
            record(d.cache, True)
            d.recording = True
    out: list[torch.Tensor | None] = [None] * len(decoders)
    if chunks and (fused or not has_rows(model)):
        raise ValueError("prompt chunks run as rows of a batched step only (not fused, a model with rows)")
    chunked = []  # the prompt chunks' results
    if has_rows(model):  # speculating sequences, and plain ones where the worker batches, as rows of one forward
        together = [n for n in range(len(decoders)) if (spec[n] and not own[n]) or replay[n] or not fused]
        tokens = [t for n in together for t in rows[n]]
        caches = [decoders[n].cache for n in together for _ in rows[n]]
        if chunks:
            logits, chunked = forward_with_prompts(model, tokens, caches, chunks)
        else:
            logits = forward_rows(model, tokens, caches) if together else None
        for n, lg in zip(together, logits.split([len(rows[n]) for n in together]) if together else []):
            out[n] = lg
    else:
        for n in range(len(decoders)):
            if (spec[n] and not own[n]) or replay[n]:
                out[n] = _rows_alone(model, rows[n], decoders[n].cache)
    alone = [n for n in range(len(decoders)) if out[n] is None]  # fused plain decoders
    if alone:
        sinks = {}
        for n in alone:  # a residency's sink would keep the model off its fused plan (an MTP drafter's stays)
            c, drafter = decoders[n].cache, decoders[n].speculator and decoders[n].speculator.drafter
            if own[n] and c.hidden_sink is not None and not hasattr(drafter, "watch"):
                sinks[n], c.hidden_sink = c.hidden_sink, None
        try:
            logits = decode_batch(model, [rows[n][0] for n in alone], [decoders[n].cache for n in alone], True)
        finally:
            for n, sink in sinks.items():
                decoders[n].cache.hidden_sink = sink
        for n, lg in zip(alone, logits.split(1)):
            out[n] = lg
    seconds = clock() - started
    results = []
    for n, d in enumerate(decoders):
        d.pending = []
        if not spec[n]:
            results.append(d._ran(rows[n][0:1], out[n]))  # None while a resumed sequence replays
            continue
        began = clock()  # the step's cost is its forward and this sequence's acceptance
        d.forwards += 1
        d.in_cache.append(rows[n][0])
        j, x = _accept(d, drafts[n], out[n])
        kept = drafts[n].tokens[:j]
        if j < len(drafts[n].tokens):  # rejected drafts leave the caches (a trim per layer: not on plain steps)
            d.cache.trim(starts[n] + 1 + j)
        d.in_cache.extend(kept)
        d.ahead = list(kept)
        d.ready = deque(zip(kept + [x], out[n][:j + 1].split(1)))
        d.speculator.observe(len(drafts[n].tokens), j, len(rows[n]), seconds + clock() - began,
                             bucket(drafts[n]), drafting[n])
        results.append(d.ready[0][1])
    return results + chunked
