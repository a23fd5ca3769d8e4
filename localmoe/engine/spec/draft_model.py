"""`DraftModel`: a smaller model sharing the target's tokenizer (checked by `check_vocab`) that proposes drafts token
by token over its own cache (batch 1); it samples its drafts with the request's settings (greedy under greedy), so
q is its distribution.

Drafting off the step's path (session 16). A verify on a paged store waits on the drive most of its time (the
SmolLM2 MoE at 25%: a 5-row verify ~2.6 fused steps, the CPU idle while the pager reads), and a draft model's
forwards (~6-13 ms a token) used to come on top of it. Now, greedy, each `propose` leaves a thread carrying the
draft model's own continuation on while the target verifies: the token the target yields where it keeps every
draft (the draft model's guess of it) and the next step's drafts after that (the all-kept branch). Where the
verify kept every draft and yielded the draft model's guess, the next step's drafts are there already, no forward
on the step's path; otherwise the thread stops at its next token and the cache is trimmed back to the accepted
point (the catch-up and the drafts then run as before). The prompt's catch-up goes to the thread too
(`Speculator.watch`, beside the target's prefill), and a catch-up of more than a few tokens on a step without a
draft (`follow`). The forwards are C++ calls through ctypes, which release the GIL: the thread computes while the
target's thread computes or waits for reads. A catch-up of more than ROWS tokens (the prompt) is one forward of the
model, a prefill, whose GGUF-block matrices run their block kernel on its rows (engine/quantized.py `block_rows`: the
drafts are the target's to check, so the draft model's numerics are its own): the embedded model's 177-token
document prompt in 0.23-0.33 s of CPU instead of 0.55-0.71 s through the fp32 GEMM, and 1.04-1.14 s on the first one,
which dequantised every matrix to fp32 first (kept: 0.5 GiB). One thread a sequence, joined before anything else
touches the draft's cache; one forward of a draft model at a time (sequences share the model and its decode plan's
workspace). Where steps are timed in process CPU time (verify.py `step_clock`), the thread's CPU is left out of
them (it ran beside the step, not in it) and the wall seconds a step waited for the thread are counted instead
(`thread_seconds`, `waited`). A sampled draft is drawn afresh each step (no thread): which of its branches the
target takes is a draw. On a paged target a draft also ends before its first unsure token (`confident`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

import torch

from localmoe.engine.batch import forward_rows, has_rows
from localmoe.engine.quantized import block_rows
from localmoe.engine.sampler import SamplingParams, probabilities
from localmoe.engine.spec.drafters import Draft
from localmoe.errors import LocalMoEError

ROWS = 8  # a draft model catches up on at most this many tokens as decode rows, more as a prompt chunk
# `confident`'s value on a paged target: a draft ends before its first token the draft model gives less than this
# probability (the dense SmolLM2 drafting for its upcycled MoE, the document question's answer: of its guesses at
# 46 positions, those at >= 0.5 were the target's token 96% of the time, 100% at >= 0.6, the others 58%)
CONFIDENT = 0.5
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a draft model -> the lock of its forwards


def check_vocab(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """A draft model must share the target's tokenizer: the same vocabulary, ids and special tokens."""
    t, d = target_tokenizer, draft_tokenizer
    if t.vocab_size != d.vocab_size:
        raise LocalMoEError(f"draft model {draft_name}: its tokenizer has {d.vocab_size} tokens, the target "
                            f"{target_name}'s has {t.vocab_size}; use a draft model with the target's tokenizer "
                            "(the same family), or --spec prompt")
    t_vocab, d_vocab = t.backend.get_vocab(with_added_tokens=True), d.backend.get_vocab(with_added_tokens=True)
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:3]
        raise LocalMoEError(f"draft model {draft_name}: its vocabulary differs from the target {target_name}'s "
                            f"(e.g. {differ}); use a draft model with the target's tokenizer, or --spec prompt")


class DraftModel:
    """A small model proposing drafts token by token over its own cache (batch 1). Its cache follows the
    sequence: tokens it holds that the sequence no longer has are trimmed (to a snapshot of its delta-rule
    states, taken where the accepted history ended), the missing ones are run as one chunk. `ahead`: greedy
    drafts carried on in a thread while the target verifies (module docstring; for a target that waits on reads:
    beside a resident target's verify the thread would take a core its kernels use). `confident`: a draft ends
    before its first token the model gives less probability (CONFIDENT on a paged target, where each verify row
    reads the experts its token routes to; 0: the speculator's k alone)."""

    name = "draft"

    def __init__(self, model, vocab_size: int, ahead: bool = False, confident: float = 0.0):
        self.model = model
        self.vocab_size = vocab_size  # the target's: a draft's logits are cut or padded (-inf) to it
        self.cache = model.new_cache(1, model.max_context)
        self.tokens: list[int] = []  # what the cache holds
        self.caught_up = 0  # tokens of the sequence the last propose ran before drafting (the speculator's pricing)
        self.ahead, self.confident = ahead, confident
        # one forward of the model at a time: sequences share it (a server's), and its decode plan its workspace
        self._lock = _LOCKS.setdefault(model, threading.Lock())
        # the model's own continuation: tokens[own:] are its drafts (each the choice after the ones before it), `next`
        # its choice after the last cached token (None: none made), qs[i] the q of position own + i (`next`'s last),
        # sure[i] whether the model gave that choice at least `confident` probability
        self.own, self.next, self.qs, self.sure = 0, None, [], []
        self.carried = 0  # proposes whose drafts the thread had made (tests count them)
        self.waited = 0.0  # wall seconds the sequence's steps waited for the thread (`_join`)
        self._thread: threading.Thread | None = None
        # the thread is to stop at its next token; it catches up (`follow`, `catch_up`); a step's wait for it is not the
        # sequence's drafting (`follow`'s catch-up: the prompt's, beside the target's prefill, and one far behind)
        self._stop = self._syncing = self._uncounted = False
        # (CPU seconds of the threads that ended, (the live one's CPU clock, its reading at its start) or None): one
        # tuple, so a reader never sees a thread's end half done (`thread_seconds`)
        self._cpu: tuple[float, tuple[int, float] | None] = (0.0, None)

    def _sync(self, history: Sequence[int]) -> torch.Tensor | None:
        """Make the cache hold `history`; the logits [1, V] after its last token (None: it cannot)."""
        keep = 0
        while keep < min(len(self.tokens), len(history) - 1) and self.tokens[keep] == history[keep]:
            keep += 1
        keep = self.cache.rollback_point(keep)
        self.cache.trim(keep)
        del self.tokens[keep:]
        self.own, self.next, self.qs, self.sure = len(self.tokens), None, [], []
        todo = list(history[keep:])
        self.caught_up = len(todo)
        if self.cache.offset + len(todo) >= self.cache.max_len or max(todo) >= self.model.spec.vocab_size:
            return None  # no room, or an id past the draft's embedding (a target's padded vocabulary)
        logits = None
        with torch.inference_mode(), self._lock:
            for begin in range(0, len(todo), 512):
                chunk = todo[begin:begin + 512]
                if 1 < len(chunk) <= ROWS and has_rows(self.model):  # a step's few tokens: as decode rows (the
                    # embedded model catching up on 3 / 5 tokens: 62 / 81 ms, as a prompt chunk 96 / 122 ms at load 10)
                    logits = forward_rows(self.model, chunk, [self.cache] * len(chunk), [len(chunk) - 1])
                else:  # a prompt chunk, its block matrices through their kernel (engine/quantized.py `block_rows`)
                    with block_rows():
                        logits = self.model.forward(torch.tensor([chunk]), self.cache)[:, -1]
        self.tokens.extend(todo)
        self.own = len(self.tokens)
        self.cache.snapshot(keep_earlier=False)  # the next round trims back to here at most
        return self._fit(logits)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V_draft] -> [1, V_target]: the models pad their vocabularies differently (the
        tokenizer is the same, checked), so ids past the draft's get probability 0."""
        V = self.vocab_size
        if logits.shape[-1] >= V:
            return logits[:, :V]
        return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator) -> None:
        """The model's next token after its cache (`next`) from its logits, and its q."""
        q = probabilities(logits, params)[0]
        self.next = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
        self.qs.append(q)
        if self.confident:
            self.sure.append(float(torch.softmax(logits[0].float(), -1)[self.next]) >= self.confident)

    def _extend(self, params: SamplingParams, generator=None) -> None:
        """Run `next` (the continuation one token longer) and choose the one after it."""
        with torch.inference_mode(), self._lock:
            logits = self._fit(self.model.forward(torch.tensor([[self.next]]), self.cache)[:, -1])
        self.tokens.append(self.next)
        self._choose(logits, params, generator)

    def _continues(self, history: Sequence[int]) -> bool:
        """Whether the cache and the continuation hold `history` with the model's own choices from its end on."""
        n, m = len(history), len(self.tokens)
        if self.next is None or not self.own <= n <= m + 1:
            return False
        if n == m + 1:
            return history[m] == self.next and self.tokens == list(history[:m])
        return self.tokens[:n] == list(history)

    def _join(self, history: Sequence[int] | None, k: int = 0) -> None:
        """Wait for the thread: stopped at its next token unless `history` takes its branch and its next k drafts
        are not all made yet (its work is then those drafts)."""
        thread = self._thread
        if thread is None:
            return
        if history is None or self.next is None or len(self.tokens) >= len(history) + k - 1 or \
                list(history[self.own:len(self.tokens)]) != self.tokens[self.own:len(history)]:
            self._stop = True
        began = time.perf_counter()
        thread.join()
        if not self._uncounted:  # (`follow`'s catch-up is the sequence's, as the target's prefill)
            self.waited += time.perf_counter() - began
        self._thread, self._stop = None, False

    def _run(self, work, *args, counted: bool = True) -> None:
        self._stop, self._syncing, self._uncounted = False, work == self._sync, not counted
        self._thread = threading.Thread(target=self._background, args=(work, *args), daemon=True)
        self._thread.start()

    def _background(self, work, *args) -> None:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        began = time.clock_gettime(clock)
        self._cpu = (self._cpu[0], (clock, began))
        try:
            with torch.inference_mode():
                work(*args)
        finally:
            self._cpu = (self._cpu[0] + time.clock_gettime(clock) - began, None)

    def _carry(self, until: int, params: SamplingParams, first: int) -> None:
        """Run on until the choice at position `until` is made; with `confident`, not past an unsure choice at or after
        `first` (the next step's first draft: its draft ends there anyway)."""
        while not self._stop and len(self.tokens) < until:
            if self.confident and len(self.tokens) >= first and not self.sure[-1]:
                return
            self._extend(params)

    def thread_seconds(self) -> float:
        """CPU seconds its threads have run so far (beside the target's steps: verify.py leaves them out of a CPU
        clock's step times and counts `waited` instead)."""
        spent, live = self._cpu
        if live is None:
            return spent
        try:
            return spent + time.clock_gettime(live[0]) - live[1]
        except OSError:  # it ended between the two reads: its total is in `_cpu` now
            return self._cpu[0]

    def follow(self, history: Sequence[int]) -> None:
        """A step without a draft (or the prompt, before the target's prefill): where the cache is behind `history` by
        more than a step's tokens, the thread catches up on it beside the target's step. (Running on through its guess
        of the step's token and the drafts after it as well measured slower: a step without a draft is one where the
        model was unsure, so its guess was often wrong, and at load 5 the thread's forwards slowed those plain steps
        by 20-40%: 12.2 / 13.8 against 13.6 / 16.4 tokens/s.)"""
        if self.ahead and self._thread is None and len(self.tokens) + ROWS < len(history) and \
                self.cache.offset + len(history) < self.cache.max_len:
            self._run(self._sync, list(history), counted=False)

    def catch_up(self, history: Sequence[int]) -> None:
        """A step another drafter drafts for (hybrid.py: prompt lookup): the thread, stopped at its next token where it
        runs on a branch of its own, catches up on `history` (the sequence and that draft: the branch where every draft
        is kept) beside the target's verify, so the next step the model drafts for starts near the sequence's end."""
        if not self.ahead or self.cache.offset + len(history) >= self.cache.max_len:
            return
        if self._thread is not None:
            if self._syncing:  # a catch-up runs already (the prompt's, or the last step's): it is joined at the next
                return        # step the model drafts for, which catches up on the rest
            self._join(None)
        if self.tokens[:len(history)] != list(history):
            self._run(self._sync, list(history))

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Draft:
        k = min(k, self.cache.max_len - len(history) - 1)
        self._join(history if params.greedy else None, k)
        if k <= 0:
            return Draft([])
        n = len(history)
        if params.greedy and self._continues(history):  # the branch the thread took: its drafts are made
            self.caught_up = 0
            self.carried += 1
            del self.qs[:n - self.own], self.sure[:n - self.own]
            self.own = n
        else:
            logits = self._sync(history)
            if logits is None:
                return Draft([])
            self._choose(logits, params, generator)
        # positions n .. n + k - 1 known: tokens[n:] + [next] (`next` may still be the history's last token: run it)
        while len(self.tokens) < n or len(self.tokens) + 1 - n < k:
            if self.confident and len(self.tokens) >= n and not self.sure[-1]:  # the draft ends at `next` (below)
                break
            self._extend(params, generator)
        tokens = (self.tokens[n:] + [self.next])[:k]
        k = len(tokens)
        if self.confident:  # up to its first unsure token (a verify's row reads its experts on a paged target)
            k = next((i for i, sure in enumerate(self.sure[:k]) if not sure), k)
            tokens = tokens[:k]
        if params.greedy and self.ahead:  # the all-kept branch: the target's token after them, then k more drafts
            self._run(self._carry, n + 2 * max(k, 1), params, n + max(k, 1) + 1)
        return Draft(tokens, torch.stack(self.qs[:k]) if k else None)
