"""Pager behaviour: prefetch accounting, pinning, Belady divergence, the CLI commands."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from click.testing import CliRunner

from localmoe.cli import cli
from localmoe.engine.experts import ExpertWeights
from localmoe.paging import PagingConfig, attach, make_pager
from localmoe.paging.errors import PagingError
from localmoe.paging.trace import RoutingTrace

from .conftest import run_greedy


def _slot(store):
    return max(store.layout(layer).slot_bytes for layer in store.layers())


def test_prefetch_counts_are_consistent(gpt_oss):
    store = gpt_oss.store()
    pager = make_pager(store, PagingConfig(ram_budget=12 * _slot(store)))
    gpt_oss.model.use_experts(pager)
    attach(gpt_oss.model, pager)
    run_greedy(gpt_oss.model)
    pager.close()
    s, p = pager.stats, pager.stats.prefetch
    assert p.issued > 0 and 0 <= p.used <= p.issued and p.wasted <= p.issued
    assert p.covered == p.used and p.uncovered == s.ram.misses
    assert 0.0 <= p.precision <= 1.0 and 0.0 <= p.recall <= 1.0
    assert s.ram.misses <= s.ram.loads <= s.ram.misses + p.issued
    assert s.steps == 1 + 12  # one prefill forward + 12 decode forwards


def test_pinned_experts_stay(gpt_oss, tmp_path):
    store = gpt_oss.store()
    hot = [[1, 0, 9], [2, 3, 5]]
    (tmp_path / "p.json").write_text(json.dumps({"format": "localmoe-profile", "ranking": hot}))
    pager = make_pager(store, PagingConfig(ram_budget=6 * _slot(store), profile=str(tmp_path / "p.json")))
    gpt_oss.model.use_experts(pager)
    attach(gpt_oss.model, pager)
    run_greedy(gpt_oss.model)
    assert {(1, 0), (2, 3)} <= pager.resident() and pager.pinned == {(1, 0), (2, 3)}
    assert pager.policy.popularity == {}  # a profile without a token count gives LFRU no prior
    pager.close()


def test_profile_is_lfru_prior(gpt_oss, tmp_path):
    """--profile also hands LFRU each expert's uses per token, worth the profile's token count."""
    (tmp_path / "p.json").write_text(json.dumps({"format": "localmoe-profile", "tokens": 50,
                                                 "ranking": [[1, 0, 40], [2, 3, 10]]}))
    pager = make_pager(gpt_oss.store(), PagingConfig(ram_budget=6 * _slot(gpt_oss.store()),
                                                     profile=str(tmp_path / "p.json")))
    assert pager.policy.popularity == {(1, 0): 0.8, (2, 3): 0.2} and pager.policy.popularity_tokens == 50
    pager.close()


def test_belady_refuses_a_diverging_run(gpt_oss, tmp_path):
    trace = RoutingTrace(8, 2, steps=[{1: [[0, 1]]}])
    trace.save(tmp_path / "t.json")
    pager = make_pager(gpt_oss.store(), PagingConfig(ram_budget=1 << 20, policy="belady", trace=str(tmp_path / "t.json"),
                                                     prefetch=False))
    pager.get(1, 0)
    with pytest.raises(PagingError, match="does not match this run at access 1"):
        pager.get(1, 5)
    pager.close()


def test_commands(gpt_oss, tmp_path):
    runner = CliRunner()
    store = str(gpt_oss.store_path)
    out = runner.invoke(cli, ["trace", store, "ids:5,17,3", "-o", str(tmp_path / "t.json"), "--max-tokens", "3"])
    assert out.exit_code == 0, out.output
    t = RoutingTrace.load(tmp_path / "t.json")
    assert t.tokens == 3 + 3 - 1 and not t.synthetic  # the prompt, then each drawn token but the last
    out = runner.invoke(cli, ["trace", store, "--synthetic", "-o", str(tmp_path / "s.json"), "--tokens", "20"])
    assert out.exit_code == 0 and RoutingTrace.load(tmp_path / "s.json").synthetic
    out = runner.invoke(cli, ["calibrate", store, "-p", "ids:1,2,3", "-o", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    ranking = json.loads((tmp_path / "p.json").read_text())["ranking"]
    assert ranking and all(a[2] >= b[2] for a, b in itertools.pairwise(ranking))
    out = runner.invoke(cli, ["plan", store, "--ram", "25%", "--trace", str(tmp_path / "t.json")])
    assert out.exit_code == 0, out.output
    assert "RAM tier: 8 slots" in out.output and "predicted decode" in out.output


def test_held_experts_stay_valid_together(gpt_oss):
    """`hold` hands out a layer's chosen experts valid together: with 3 slots, holding 3 experts at a time (routing
    hints for other experts in between) never overwrites one held expert with another; more experts than slots:
    None (the caller then takes them one at a time)."""
    import random

    store = gpt_oss.store()
    pager = make_pager(store, PagingConfig(ram_budget=3 * _slot(store)))
    rng = random.Random(0)
    try:
        layer = store.layers()[0]
        experts = store.experts_in(layer)
        refs = {e: ExpertWeights.from_parts(store.expert(layer, e)) for e in experts}
        assert pager.hold(layer, experts[:4]) is None
        for _ in range(30):
            chosen = sorted(rng.sample(experts, 3))
            pager.begin_layer(layer, rng.sample(experts, 2))  # loads started for others, maybe chosen ones
            pager.prefetch(layer, rng.sample(experts, 2))
            held = pager.hold(layer, chosen)
            for e, w in zip(chosen, held):
                for proj in ("gate", "up", "down"):
                    got, ref = getattr(w, proj), getattr(refs[e], proj)
                    assert torch.equal(got.packed, ref.packed) and torch.equal(got.scales, ref.scales), (e, proj)
        ram = pager.stats.ram
        assert ram.hits >= 1 and ram.evictions > 0 and ram.lookup_seconds > 0
        again = pager.hold(layer, chosen)
        assert all(w is v for w, v in zip(again, held))  # a slot's tensors are built once and kept
    finally:
        pager.close()


def test_a_slab_of_every_expert_runs_the_layers_whole(kimi_k3):
    """With room for every expert (`--ram 100%`), `attach` reads them all, pins them and adds no hooks
    (`Pager.load_all`): the fused step routes and runs each layer's experts itself over the slots (`kernel_table`),
    as for resident experts; decoding asks the pager nothing and reads nothing, with the resident bits."""
    from localmoe.engine.decode_plan import DecodePlan

    store = kimi_k3.store()
    slots = sum(len(store.experts_in(layer)) for layer in store.layers())
    pager = make_pager(store, PagingConfig(ram_budget=slots * _slot(store)))
    kimi_k3.model.use_experts(pager)
    attach(kimi_k3.model, pager)
    try:
        ram = pager.stats.ram
        assert ram.loads == slots and len(pager.pinned) == slots
        assert all(pager.holds_all(layer) and pager.kernel_table(layer) is not None for layer in store.layers())
        plan = DecodePlan.build(kimi_k3.model)
        assert all(layer.table for layer in plan.decoder.layers if layer.moe)  # every MoE layer in the kernel
        before = (ram.hits, ram.misses, ram.loads)
        tokens, logits = run_greedy(kimi_k3.model)
        assert tokens == kimi_k3.tokens and all(torch.equal(a, b) for a, b in zip(logits, kimi_k3.logits))
        assert (ram.hits, ram.misses, ram.loads) == before
    finally:
        pager.close()
        kimi_k3.restore()


def test_hint_eviction_pool_is_every_ready_requested_unpinned_slot(kimi_k3, tmp_path):
    """The routing hints evict from a pool kept as slots change state (`_evictable`): after every step of a paged
    run with pinned experts it is exactly the ready, requested, unpinned slots (what a scan of the slab gives)."""
    store = kimi_k3.store()
    layers = store.layers()
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"ranking": [[layers[0], 0, 9], [layers[1], 1, 5]], "tokens": 10}))
    pager = make_pager(store, PagingConfig(ram_budget=8 * _slot(store), profile=str(profile)))
    kimi_k3.model.use_experts(pager)
    attach(kimi_k3.model, pager)
    hold = pager.hold
    checked = []

    def checking(layer, experts):
        with pager.lock:
            scan = {s.key for s in pager.slots if s.state == "ready" and s.used and s.key not in pager.pinned}
            assert set(pager._evictable) == scan and all(pager._evictable[k].key == k for k in scan)
            assert list(pager.policy.pool) == list(pager._evictable)  # the policy's copy, in the same order
        checked.append(layer)
        return hold(layer, experts)

    pager.hold = checking
    try:
        tokens, _ = run_greedy(kimi_k3.model)
        assert tokens == kimi_k3.tokens and len(checked) > 10 and pager.stats.ram.evictions > 0
    finally:
        pager.close()
        kimi_k3.restore()
