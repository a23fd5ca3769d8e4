"""Speculative decoding over a paged store: greedy output with prompt lookup equals greedy output without,
token for token, on the tiny gpt-oss (sliding windows, sinks, MXFP4 experts) and Kimi K3 paged at one
expert slot per layer and at 25% of the experts; the verify step's rows are routed together, so each
step reads an expert once for all of them; with the residency cost model (the prompt's routing predicts a
draft's experts, the draft is cut where they must be read, the pager prefetches them) likewise."""

from __future__ import annotations

import pytest

from localmoe.engine.generate import Decoder, decode_together
from localmoe.engine.sampler import SamplingParams
from localmoe.engine.spec.drafters import Draft, PromptLookup
from localmoe.engine.spec.residency import Residency, RouteBook
from localmoe.engine.spec.speculator import Speculator
from localmoe.paging import PagingConfig, attach, expert_bytes, make_pager

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11, 8, 5, 17, 3, 99, 42, 7, 250, 12, 5, 17, 3]
STEPS = 24


class NoDraft:
    name = "none"

    def propose(self, history, k, params, generator):
        return Draft([])


def greedy(model, speculator=None, prompt=PROMPT) -> list[int]:
    """Greedy tokens; without a speculator one row of the batched step per token (decode_together, or for
    K3, whose plain `logits()` takes its own decode step, a speculator that never drafts: the same row kernels)."""
    if speculator is None and model.residuals is not None:
        speculator = Speculator(NoDraft(), k=1, adaptive=False)
    dec = Decoder(model, prompt, GREEDY, speculator=speculator)
    out: list[int] = []
    while len(out) < STEPS:
        logits = decode_together([dec])[0] if dec.decoding and speculator is None else dec.logits()
        if logits is None:
            continue
        out.append(dec.sample(logits))
        dec.feed([out[-1]])
    return out


def paged(c, budget: int):
    store = c.store()
    pager = make_pager(store, PagingConfig(ram_budget=budget, policy="lru", io="odirect", prefetch=True, timeout=10))
    c.model.use_experts(pager)
    attach(c.model, pager, lookahead=True)
    return pager


@pytest.mark.parametrize("share", ["1-per-layer", "25%"])
@pytest.mark.parametrize("family", ["gpt_oss", "kimi_k3"])
def test_paged_greedy_with_prompt_lookup_equals_plain(ckpts, family, share):
    c = ckpts[family]
    store = c.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    budget = len(store.layers()) * slot if share == "1-per-layer" else max(1, expert_bytes(store) // 4 // slot) * slot
    try:
        pager = paged(c, budget)
        want = greedy(c.model)
        pager.close()
        pager = paged(c, budget)
        spec = Speculator(PromptLookup(), k=4, adaptive=False)
        got = greedy(c.model, spec)
        pager.close()
        pager = paged(c, budget)  # with the residency cost model (engine/spec/residency.py): it cuts and prefetches
        book = RouteBook()
        attach(c.model, pager, trace=book, lookahead=True)
        priced = Speculator(PromptLookup(), k=4, residency=Residency(pager, book))
        got_priced = greedy(c.model, priced)
        pager.close()
    finally:
        c.restore()
    assert got == want
    assert got_priced == want
    assert spec.stats.drafted > 0
    routes = priced.residency.routes
    assert routes is not None and (routes[:len(PROMPT)] >= 0).all()  # the prompt's routing, filed by position


def test_speculation_prices_experts_only_when_asked(ckpts):
    """runtime Speculation: prompt lookup on a paged model gets a Residency (its routers recording into the
    RouteBook) with price_experts, none by default."""
    from types import SimpleNamespace

    from localmoe.runtime.speculation import Speculation

    c = ckpts["gpt_oss"]
    store = c.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    try:
        pager = paged(c, len(store.layers()) * slot)
        loaded = SimpleNamespace(model=c.model, spec=c.model.spec, tokenizer=None)
        assert Speculation(loaded, "prompt").new().residency is None
        spec = Speculation(loaded, "prompt", price_experts=True).new()
        assert spec.residency is not None and spec.residency.pager is pager
        assert all(block.router.trace is spec.residency.book for block in c.model.moe_blocks())
        pager.close()
    finally:
        c.restore()


def test_spec_auto_speculates_resident_and_not_paged(ckpts):
    """`--spec auto` (run / chat / web's default): prompt lookup on the store's experts held whole, off where a
    pager serves them (a paged store: not measured to pay on every task) or a GPU tier holds some."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.runtime.speculation import Speculation

    c = ckpts["gpt_oss"]
    whole = load_model(c.store_path, EngineConfig(threads=1), progress=False)
    paged_model = load_model(c.store_path, EngineConfig(threads=1, paging=PagingConfig(ram_budget=1 << 30)),
                             progress=False)
    assert Speculation(whole, "auto").mode == "prompt"
    assert Speculation(paged_model, "auto").mode == "off"
    assert Speculation(paged_model, "prompt").mode == "prompt"  # asked for: still speculates


@pytest.mark.parametrize("hybrid", [False, True], ids=["draft", "prompt+draft"])
@pytest.mark.parametrize("family", ["gpt_oss", "kimi_k3"])
def test_paged_greedy_with_a_draft_model_drafting_ahead_equals_plain(ckpts, family, hybrid):
    """A draft model (the target's checkpoint, resident: its drafts are mostly kept) drafting in a thread while the
    paged target verifies (engine/spec/draft_model.py `ahead`): the same tokens, and the thread's drafts used. With
    prompt lookup beside it (engine/spec/hybrid.py) likewise (the prompt: PROMPT, its plain answer and PROMPT again;
    the tiny gpt-oss's answer then repeats some of it, and both drafters draft; the tiny K3's does not)."""
    from localmoe.engine.spec.draft_model import DraftModel
    from localmoe.engine.spec.hybrid import LookupThenModel
    from localmoe.load import load_model

    c = ckpts[family]
    store = c.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    budget = max(1, expert_bytes(store) // 4 // slot) * slot
    draft = load_model(c.src, dtype="float32", progress=False).model
    try:
        pager = paged(c, budget)
        first = greedy(c.model)
        prompt = PROMPT + first[:16] + PROMPT if hybrid else PROMPT
        want = greedy(c.model, prompt=prompt)
        pager.close()
        pager = paged(c, budget)
        drafter = DraftModel(draft, c.model.spec.vocab_size, ahead=True)
        both = LookupThenModel(PromptLookup(), drafter, long=3)
        spec = Speculator(both if hybrid else drafter, k=3, adaptive=False)
        got = greedy(c.model, spec, prompt)
        pager.close()
    finally:
        c.restore()
    assert got == want
    assert spec.stats.drafted > 0 and drafter.carried > 0
    assert (both.lookups > 0) == (hybrid and family == "gpt_oss")
