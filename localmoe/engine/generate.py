"""The engine's one generation step: `Decoder` is one sequence's state a forward pass at a time
(the prompt in chunks, then one token per step; the caller sees the logits and may inject tokens),
and `decode_together` runs the decode tokens of several as one batched forward, with a chunk of one
sequence's prompt as more rows of it where the model's rows are computed each on its own
(`prompt_rows`).

The loop over them (sampling, stop tokens and strings, budgets, reasoning, text) is the runtime's
(localmoe/runtime: turn.py, worker.py), the one loop every front end runs.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.images import PromptImage, PromptImages
from localmoe.engine.prefix_cache import PrefixCache, is_boundary, next_boundary
from localmoe.engine.sampler import SamplingParams, sample
from localmoe.engine.spec.speculator import Speculator
from localmoe.engine.spec.verify import speculative_step
from localmoe.engine.swap import Swapped, swap_out
from localmoe.errors import LocalMoEError

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory, keeps GEMMs efficient


class CausalLM(Protocol):
    max_context: int

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> ModelCache: ...

    def forward(self, tokens: torch.Tensor, cache: ModelCache, mask=None, all_logits: bool = False) -> torch.Tensor: ...


class Decoder:
    """One batch-1 sequence's decode state, advanced one forward pass at a time.

    Tokens not yet in the cache are `pending`; `logits()` runs them through the model (a prompt
    in chunks, one chunk per call) and `feed()` queues the next: a sampled token, or injected
    ones (a thinking budget appends the end-of-thinking marker). The caller sees the logits, so
    it may rank the vocabulary itself (constrained tool-call arguments), and a server worker can
    interleave many sequences a step at a time (the runtime's worker).
    """

    def __init__(self, model: CausalLM, prompt: Sequence[int], params: SamplingParams, max_len: int | None = None,
                 cache: ModelCache | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 prefix_cache: PrefixCache | None = None, speculator: Speculator | None = None,
                 anchor: int | None = None, images: Sequence[PromptImage] = ()):
        if not prompt:
            raise LocalMoEError("the prompt is empty: there is nothing to continue")
        # a prompt chunk ends at `anchor` (the end of a conversation's fixed header: engine/prefix_cache.py)
        self.anchor = anchor if anchor is not None and 0 < anchor <= len(prompt) else None
        # the prompt's images (engine/images.py): their rows go to the placeholders' positions as chunks reach them
        self.images = PromptImages(prompt, images, model.spec.image_token_id) if images else None
        keys = self.images.keys if self.images is not None else prompt  # what the prefix cache matches
        self.prefix_cache = prefix_cache if cache is None else None
        self.reused = 0  # prompt tokens whose cache came from `prefix_cache`
        if self.prefix_cache is not None:
            cache, self.reused = self.prefix_cache.take(keys, prefill_chunk, self.anchor)
            if cache is None:  # a fresh one as long as the context: a later, longer prompt may reuse it
                cache = model.new_cache(1, model.max_context)
            elif self.images is None:  # a prefix without images: one position per token (MRoPE, engine/step.py)
                cache.rope_delta = 0
        # the header this sequence leaves to the prefix cache when its prompt passes the anchor (`_ran`), where it
        # prefills it (not one with images); a prompt of a burst that waits for it takes it (`_look_again`)
        self.header: tuple[int, ...] | None = None
        if self.prefix_cache is not None and self.images is None and self.anchor is not None and \
                self.reused < self.anchor < len(prompt):
            self.header = tuple(prompt[:self.anchor])
        self._look = self.header is not None and self.reused == 0  # looks in the prefix cache again before a chunk
        if cache is None:
            cache = model.new_cache(1, min(max_len or model.max_context, model.max_context))
        if cache.offset + len(prompt) - self.reused >= cache.max_len:
            raise LocalMoEError(f"the prompt has {len(prompt)} tokens but the context holds {cache.max_len}; "
                                f"shorten it or raise --max-context")
        self.model = model
        self.params = params
        self.cache = cache
        self._stateful: bool | None = None  # `stateful`, derived once
        self.prompt = list(prompt)
        self.pending: list[int] = list(prompt[self.reused:])
        self.in_cache: list[int] = list(prompt[:self.reused])  # the tokens the cache holds, in order
        self.generator = params.make_generator()
        self.history: list[int] | None = list(prompt) if params.repetition_penalty != 1.0 else None
        self.chunk = prefill_chunk
        self.forwards = 0
        self._prompt_done = False
        self.prefilled = self.reused  # positions the prompt's chunks have filled so far
        # speculative decoding (engine/spec): tokens a verify step decided, each with the logits it was
        # decided from, handed out by `logits()` / `sample()` without a forward; `ahead` = those of them
        # already in the cache (the kept drafts) that the caller has not fed back yet
        self.speculator = speculator
        self.recording = False  # a verify left its delta-rule layers keeping states (engine/spec/verify.py record)
        self.ready: deque[tuple[int, torch.Tensor]] = deque()
        self.ahead: list[int] = []
        # preemption (`preempt`): the forwards after the prompt that ran more than one token (an injected
        # marker), by where they start among the tokens after the prompt -> their length; the groups of
        # tokens still to run again on resume
        self.multi: dict[int, int] = {}
        self._replay: deque[list[int]] = deque()
        self._swapped: Swapped | None = None  # the cache written out by `preempt(swap=...)`
        self.preemptions = 0
        self._watch()

    def resume(self) -> None:
        """After `preempt`: the swapped-out cache read back, or a fresh one (the prompt runs again), watched
        as the first one was. Nothing to do while the cache is in memory."""
        if self.cache is None:
            if self._swapped is not None:
                self.cache, self._swapped = self._swapped.load(), None
            else:
                self.cache = self.model.new_cache(1, self._cache_len)
            self._watch()

    def _watch(self) -> None:
        """A speculator may watch the cache: an MTP drafter reads the target's hidden states
        (engine/spec/mtp.py), a residency the routing by position (engine/spec/residency.py)."""
        if self.speculator is not None:
            self.speculator.watch(self.cache, self.prompt)

    @property
    def room(self) -> int:
        """Positions still free in the cache once pending tokens are in and the kept drafts not handed out yet
        (`ahead`: in the cache, but decided) are handed out: a speculating turn near its max_tokens must not stop
        early because drafts it kept fill the positions its last tokens take (it stopped at 127 of 128)."""
        return self.cache.max_len - self.cache.offset - len(self.pending) + len(self.ahead)

    def logits(self) -> torch.Tensor | None:
        """Run pending tokens; logits [1, V] of the last one, or None while prompt chunks remain. With a
        speculator: a decode step drafts and verifies (engine/spec/verify.py), and while tokens it decided
        are `ready` their logits come back without a forward."""
        if self.ready:
            return self.ready[0][1]
        if not self.pending:
            raise RuntimeError("nothing pending: feed a token first")
        if self.speculating and self.decoding:
            return decode_together([self])[0]
        self.resume()
        self._look_again()
        size = self.chunk
        if not self._prompt_done and self.anchor is not None and len(self.in_cache) < self.anchor:
            size = min(size, self.anchor - len(self.in_cache))  # a chunk ends at the anchor
        batch, self.pending = self.pending[:size], self.pending[size:]
        at = len(self.in_cache)  # the batch's first position in the prompt (or after it)
        images = {}
        if self.images is not None and not self._prompt_done:
            images["image_embeds"] = self.images.rows(at, at + len(batch))
            if self.model.spec.mrope_section is not None:  # Qwen3-VL: the chunk's grid positions
                images["mrope"] = self.images.mrope(at, at + len(batch))
        with torch.inference_mode():
            ids = torch.tensor([batch], dtype=torch.long)
            out = self.model.forward(ids, self.cache, **{k: v for k, v in images.items() if v is not None})
        return self._ran(batch, out[:, -1])

    @property
    def prompt_rows(self) -> bool:
        """Whether its prompt chunks may run as rows of a batched step (`decode_together(chunks=...)`, for
        a model whose rows are each computed on their own: engine/batch.py `rows_independent`): it is
        prefilling, without images or a speculator that watches the cache (an MTP drafter, a residency: those
        take `logits()`); a prompt-lookup sequence prefills as a plain one does, so its text is the same."""
        return self.prefilling and self.images is None and (self.speculator is None or not self.speculator.watches)

    def chunk_size(self, limit: int) -> int:
        """How many tokens `take_prompt(limit)` takes: at most `limit` (at least 1). A cache that keeps a delta-rule
        state stops at the next place `logits()`' chunks end (the anchor, every `chunk` tokens), where `_ran` snapshots
        the state for the prefix cache; other caches take their rows across those places (a prompt row's bits do not
        depend on its chunk, and the K/V at every position is the same), so a short prompt enters in one step."""
        self._look_again()
        at = len(self.in_cache)
        if self.cache is not None and not self.stateful:
            return max(1, min(limit, len(self.pending)))
        return max(1, min(limit, len(self.pending), next_boundary(at, self.chunk, self.anchor) - at))

    @property
    def stateful(self) -> bool:
        """Whether its cache keeps a delta-rule state (then a prompt's rows stop at its chunk boundaries:
        `chunk_size`). Derived from the first cache it asks (the layer kinds are the model's: a copy, a swapped or a
        fresh cache of it agree), not on every call."""
        if self._stateful is None:
            self._stateful = any(hasattr(layer, "snapshot") for layer in self.cache.layers)
        return self._stateful

    @property
    def untouched(self) -> bool:
        """Whether none of its prompt has run and nothing came from the prefix cache (it may still look there
        again before its first chunk: `_look_again`)."""
        return self._look

    def _look_again(self) -> None:
        """Before its first chunk, a prompt that found nothing in the prefix cache when it started looks again:
        a prompt of the same burst may have left its header there meanwhile (`_ran`, `PrefixCache.keep_header`)."""
        if not self._look:
            return
        self._look = False
        if self.cache is None or self.cache.offset:
            return
        cache, reused = self.prefix_cache.take(self.prompt, self.chunk, self.anchor, again=True)
        if cache is None:
            return
        cache.rope_delta = 0
        self.cache, self.reused, self.prefilled = cache, reused, reused
        self.pending, self.in_cache = self.prompt[reused:], self.prompt[:reused]
        if reused >= self.anchor:
            self.header = None
        self._watch()

    def take_prompt(self, limit: int) -> list[int]:
        """The next prompt chunk (`chunk_size(limit)` tokens), taken from `pending` for a batched step to
        run (`decode_together`)."""
        self.resume()
        size = self.chunk_size(limit)
        batch, self.pending = self.pending[:size], self.pending[size:]
        return batch

    def _ran(self, batch: list[int], logits: torch.Tensor | None) -> torch.Tensor | None:
        """Account for a forward over `batch`: its logits, or None while the prompt or a replay goes on."""
        self.forwards += 1
        if self.recording:  # a plain step after a verify (the speculator declined or retired): the delta-rule
            from localmoe.engine.spec.verify import record  # layers stop keeping a state per token

            record(self.cache, False)
            self.recording = False
        if self._prompt_done and len(batch) > 1:
            self.multi[len(self.in_cache) - len(self.prompt)] = len(batch)
        self.in_cache.extend(batch)
        if not self._prompt_done:
            self.prefilled = self.cache.offset
            if self.prefix_cache is not None and is_boundary(len(self.in_cache), self.chunk, self.anchor):
                self.cache.snapshot(keep_earlier=False)  # a delta-rule state can come back to this boundary
            if self.header is not None and len(self.in_cache) >= self.anchor:  # its header is in: left to the others
                self.prefix_cache.keep_header(self.header, self.cache, self.chunk)
                self.header = None
            if self.pending:
                return None
            self._prompt_done = True
        if self._replay:  # resumed after `preempt`: the next group it had run before
            self.pending = self._replay.popleft()
            return None
        return logits

    @property
    def preemptible(self) -> bool:
        """Whether `preempt` may free the cache now: it exists and no speculative step's tokens wait to be
        handed out (between two engine steps a speculating sequence has handed them all out)."""
        return self.cache is not None and not self.ready and not self.ahead

    @property
    def replaying(self) -> bool:
        """Whether the pending token runs again after a `preempt` (a speculating sequence replays it as one
        row of the row kernels, as it ran: engine/spec/verify.py), not a step of its own."""
        return bool(self._replay)

    def preempt(self, swap: str | os.PathLike | None = None) -> None:
        """Free the cache's memory now. With `swap` (a directory; not for a speculating sequence, whose
        drafter holds the cache) the cache is written to a file there (engine/swap.py) and `resume` reads it
        back: the sequence goes on as if never paused. Without, recompute: on resume everything it held runs
        again in the forwards it ran in before: the prompt in the same chunks, then each later token as a
        decode step (an injected group as one forward), then what was pending; only that last forward's
        logits come back, equal to those it would have had (each forward is the one it was; a speculating
        sequence's tokens, kept drafts included, ran as rows of the row kernels, each computed on its own,
        and run again as such)."""
        if not self.preemptible:
            raise RuntimeError("this sequence holds no cache, or a speculative step's tokens wait to be handed "
                               "out: it cannot be preempted now")
        if swap is not None and self.speculator is None:
            self._swapped, self.cache = swap_out(self.cache, swap), None
            self.preemptions += 1
            return
        if self.speculator is not None:
            from localmoe.engine.spec.verify import record

            record(self.cache, False)
            self.speculator.wake()  # its replayed steps run as rows (engine/spec/verify.py), not resting ones
        replay: list[list[int]] = []
        if self._prompt_done:
            after, i = self.in_cache[len(self.prompt):], 0
            while i < len(after):
                n = self.multi.get(i, 1)
                replay.append(after[i:i + n])
                i += n
            replay.append(self.pending)
        self._cache_len = self.cache.max_len
        self.cache, self.in_cache, self.multi = None, [], {}
        self.pending, self._replay = list(self.prompt), deque(replay)
        self._prompt_done, self.prefilled = False, 0
        self.preemptions += 1

    @property
    def swapped(self) -> bool:
        """Whether the cache is swapped out (`preempt(swap=...)`), waiting for `resume`."""
        return self._swapped is not None

    def discard(self) -> None:
        """The sequence is dropped (cancelled): remove a swapped-out cache's file."""
        if self._swapped is not None:
            self._swapped.discard()
            self._swapped = None

    @property
    def prefilling(self) -> bool:
        """Whether prompt chunks are still pending."""
        return not self._prompt_done

    @property
    def decoding(self) -> bool:
        """Whether the next forward is one decode token (the prompt is in, one token is pending): such
        steps of many sequences run as one batch (`decode_together`)."""
        return self._prompt_done and len(self.pending) == 1

    @property
    def speculating(self) -> bool:
        """Whether decode steps draft and verify (a speculator that has not retired)."""
        return self.speculator is not None and not self.speculator.retired

    def sample(self, logits: torch.Tensor) -> int:
        """The next token: drawn from `logits`, or, while a speculative step's tokens are `ready`, the next
        of them (drawn by the acceptance rule, engine/spec/accept.py)."""
        if self.ready:
            return self.ready.popleft()[0]
        history = torch.tensor([self.history], dtype=torch.long) if self.history is not None else None
        return int(sample(logits, self.params, self.generator, history))

    def feed(self, tokens: Sequence[int]) -> None:
        """Queue tokens (a sampled one, or injected ones) to be run by the next `logits()`. Kept drafts
        fed back are in the cache already; a token other than the next kept draft (an injected one)
        drops the kept drafts not fed back yet from the cache, and the tokens still `ready`."""
        if self.history is not None:
            self.history.extend(tokens)
        tokens = list(tokens)
        while tokens and self.ahead and tokens[0] == self.ahead[0]:
            tokens.pop(0)
            self.ahead.pop(0)
        if tokens and (self.ahead or self.ready):
            if self.ahead:
                self.cache.trim(self.cache.offset - len(self.ahead))
                del self.in_cache[len(self.in_cache) - len(self.ahead):]
            self.ahead, self.ready = [], deque()
        self.pending.extend(tokens)

    def release(self) -> None:
        """The sequence is finished: leave its cache to the prefix cache (if any) for later prompts."""
        if self.speculator is not None:
            from localmoe.engine.spec.verify import record

            self.speculator.wake()  # its last steps taken without it (`rest`) counted in its statistics
            if self.cache is not None:
                record(self.cache, False)
                self.cache.hidden_sink = None
        if self.prefix_cache is not None and self.cache is not None:
            keys = self.in_cache if self.images is None else self.images.keyed(self.in_cache)
            self.prefix_cache.put(keys, self.cache, self.prefilled, self.chunk, self.anchor)
            self.prefix_cache = None


def decode_together(decoders: Sequence[Decoder], fused: bool = False,
                    chunks: Sequence[tuple[Decoder, int]] = ()) -> list[torch.Tensor | None]:
    """One decode step of several sequences (each `decoding`, all of one model) as one batched forward
    (engine/batch.py; `fused`: each sequence's own fused step instead); the logits [1, V] of each, in
    order (None for a resumed sequence still replaying, `Decoder.preempt`). A sequence's logits are those
    it gets alone in the same mode. `chunks` [(decoder, limit)]: each of those sequences' next prompt chunk
    (`prompt_rows`, at most `limit` tokens) runs as more rows of the same forward, so every weight is read
    once for all of them (also beside speculating sequences' verify rows); their results (logits or None,
    `logits()`'s) come after the decoders', in order."""
    if len(decoders) == 1:
        spec = decoders[0].speculator
        if spec is None or spec.retired:
            return plain_step(decoders, fused, chunks)
        if spec.quiet and not chunks:  # steps it certainly would not draft in (engine/spec/speculator.py `rest`):
            spec.quiet -= 1  # the plain step, as if it were off
            return plain_step(decoders, fused)
        if spec.alone and not chunks:  # a settled choice without a draft: off's plain step, counted, in one call
            results = spec.decline(decoders[0], plain_step, fused)
            if results is not None:
                return results
    elif not any(d.speculating for d in decoders):
        return plain_step(decoders, fused, chunks)
    return speculative_step(decoders, fused, chunks, plain_step)


def plain_step(decoders: Sequence[Decoder], fused: bool = False,
               chunks: Sequence[tuple[Decoder, int]] = ()) -> list[torch.Tensor | None]:
    """`decode_together` without drafts: each sequence's pending token (and `chunks`) as one forward. Also the
    step of speculating sequences whose speculators all declined to draft (engine/spec/verify.py)."""
    from localmoe.engine.batch import decode_batch
    from localmoe.engine.prompt_rows import forward_with_prompts

    tokens, caches = [d.pending[0] for d in decoders], [d.cache for d in decoders]
    if not chunks:
        logits, prompts = decode_batch(decoders[0].model, tokens, caches, fused), []
    else:
        logits, prompts = forward_with_prompts(chunks[0][0].model, tokens, caches, chunks)
    out = []
    for d, token, row in zip(decoders, tokens, logits.split(1)):
        d.pending = []
        out.append(d._ran([token], row))
    return out + prompts


def prefill(model: CausalLM, prompt: Sequence[int], cache: ModelCache, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt through the model in chunks (a `Decoder`'s prefill); logits [1, V] of its last position."""
    decoder = Decoder(model, prompt, SamplingParams(), cache=cache, prefill_chunk=chunk)
    logits = None
    while logits is None:
        logits = decoder.logits()
    return logits
