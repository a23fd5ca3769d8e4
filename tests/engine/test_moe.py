"""MoE block: routers, expert activations, grouped dispatch, shared experts and K3's latent
MoE, each against a float64 per-token re-derivation written here (loops, no shared code)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from localmoe.kernels.mxfp4_moe import glu

from localmoe.engine.experts import ExpertWeights, Projection, ResidentExperts
from localmoe.engine.layers.mlp import GatedMLP, situ_glu
from localmoe.engine.layers.moe import (
    ExpertGLU,
    LatentProjection,
    MoEBlock,
    Router,
    RoutingRule,
    route,
    swiglu,
)
from localmoe.engine.linear import Linear
from localmoe.quant.mxfp4 import dequantize, quantize

E, D, I = 16, 64, 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- float64 references, one token at a time ----

def _ref_route(logits: list[float], rule: RoutingRule, bias: list[float] | None) -> dict[int, float]:
    """expert id -> weight for one token."""
    n = len(logits)
    if rule.scoring == "topk_softmax":
        chosen = sorted(range(n), key=lambda e: -logits[e])[:rule.top_k]
        z = sum(math.exp(logits[e]) for e in chosen)
        weights = {e: math.exp(logits[e]) / z for e in chosen}
    else:
        if rule.scoring == "softmax":
            z = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / z for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(scores)]
        allowed = set(range(n))
        if rule.n_group > 1:
            size = n // rule.n_group
            group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(rule.n_group)]
            kept = sorted(range(rule.n_group), key=lambda g: -group_score[g])[:rule.topk_group]
            allowed = {e for g in kept for e in range(g * size, (g + 1) * size)}
        chosen = sorted(allowed, key=lambda e: -choice[e])[:rule.top_k]
        weights = {e: scores[e] for e in chosen}  # the bias never reaches the weights
    if rule.renormalize:
        total = sum(weights.values())
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * rule.scaling for e, w in weights.items()}


RULES = {
    "softmax": (RoutingRule(top_k=4), False),
    "softmax-renorm": (RoutingRule(top_k=4, renormalize=True), False),
    "sigmoid-bias-groups-renorm-scaled": (RoutingRule(top_k=4, scoring="sigmoid", renormalize=True, scaling=2.446,
                                                      n_group=4, topk_group=2), True),
    "sigmoid-bias": (RoutingRule(top_k=6, scoring="sigmoid", renormalize=True), True),
    "gpt-oss": (RoutingRule(top_k=4, scoring="topk_softmax"), False),
}


@pytest.mark.parametrize("case", list(RULES))
def test_router_matches_float64_rederivation(case):
    rule, with_bias = RULES[case]
    x = torch.randn(2, 5, D, generator=_gen(0))
    weight = torch.randn(E, D, generator=_gen(1)) * 0.3
    logit_bias = torch.randn(E, generator=_gen(2)) * 0.1 if rule.scoring == "topk_softmax" else None
    correction = torch.randn(E, generator=_gen(3)) * 0.5 if with_bias else None
    weights, ids = Router(weight, logit_bias, rule, correction)(x.reshape(-1, D))
    assert weights.dtype == torch.float32 and ids.shape == (10, rule.top_k)
    logits64 = x.reshape(-1, D).double() @ weight.double().T + (0 if logit_bias is None else logit_bias.double())
    for t in range(10):
        expected = _ref_route(logits64[t].tolist(), rule, None if correction is None else correction.tolist())
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected.keys(), f"token {t}"
        for e in expected:
            assert math.isclose(got[e], expected[e], rel_tol=1e-5), (t, e)


def test_correction_bias_changes_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rule = RoutingRule(top_k=2, scoring="sigmoid")
    _, plain_ids = route(logits, rule)
    biased_w, biased_ids = route(logits, rule, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert set(plain_ids[0].tolist()) == {0, 1} and set(biased_ids[0].tolist()) == {0, 3}
    sig = torch.sigmoid(logits[0])
    assert dict(zip(biased_ids[0].tolist(), biased_w[0].tolist())) == pytest.approx({0: sig[0].item(),
                                                                                      3: sig[3].item()})


def test_group_limited_topk_only_picks_from_the_best_groups():
    # group 0 holds the single best expert but group 1 has the best top-2 sum
    scores = torch.tensor([[3.0, -9.0, 2.0, 2.0, -9.0, -9.0]])
    _, ids = route(scores, RoutingRule(top_k=2, scoring="sigmoid", n_group=3, topk_group=1))
    assert set(ids[0].tolist()) == {2, 3}


# ---- activations ----

def test_gpt_oss_clamped_swiglu_formula():
    g = torch.tensor([-9.0, -1.0, 0.0, 0.5, 6.9, 7.0, 12.0], dtype=torch.float64)
    u = torch.tensor([-12.0, -7.5, 0.0, 0.3, 6.0, 9.0, -2.0], dtype=torch.float64)
    got = ExpertGLU("gpt_oss", 7.0, 1.702)(g, u)  # what gpt-oss's MoE blocks compute with
    for gi, ui, out in zip(g.tolist(), u.tolist(), got.tolist()):
        gc, uc = min(gi, 7.0), max(-7.0, min(ui, 7.0))
        assert math.isclose(out, (uc + 1) * gc / (1 + math.exp(-1.702 * gc)), rel_tol=1e-12, abs_tol=1e-15)


def test_situ_glu_formula():
    g = torch.linspace(-30, 30, 41, dtype=torch.float64)
    u = torch.linspace(80, -80, 41, dtype=torch.float64)
    got = situ_glu(g, u)
    for gi, ui, out in zip(g.tolist(), u.tolist(), got.tolist()):
        expected = 4 * math.tanh(gi / 4) / (1 + math.exp(-gi)) * 25 * math.tanh(ui / 25)
        assert math.isclose(out, expected, rel_tol=1e-12, abs_tol=1e-12)


# ---- the block: dispatch, shared experts, latent MoE ----

def _experts(width: int, mxfp4: bool, biases: bool, seed: int) -> list[ExpertWeights]:
    out, g = [], _gen(seed)
    for _ in range(E):
        parts = {}
        for proj, (rows, cols) in (("gate", (I, width)), ("up", (I, width)), ("down", (width, I))):
            w = torch.randn(rows, cols, generator=g) * 0.2
            if mxfp4:
                parts[f"{proj}.packed"], parts[f"{proj}.scales"] = quantize(w)
            else:
                parts[f"{proj}.weight"] = w
            if biases:
                parts[f"{proj}.bias"] = torch.randn(rows, generator=g) * 0.1
        out.append(ExpertWeights.from_parts(parts))
    return out


def _dense64(p: Projection) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = p.weight.double() if p.weight is not None else dequantize(p.packed, p.scales, torch.float64)
    return w, None if p.bias is None else p.bias.double()


def _ref_expert(w: ExpertWeights, x: torch.Tensor, act) -> torch.Tensor:
    def lin(p, v):
        m, b = _dense64(p)
        return m @ v + (0 if b is None else b)

    return lin(w.down, act(lin(w.gate, x), lin(w.up, x)))


# plain callables (not ExpertGLU): the block runs them in torch, per expert
ACTS = {"swiglu": swiglu, "gpt_oss": functools.partial(glu, "gpt_oss", p0=7.0, p1=1.702), "situ": situ_glu}


def _assert_matches_per_token_reference(got, x, router_w, rule, experts, act) -> None:
    """got [B, T, D] against sum over each token's routed experts of weight * expert, in float64."""
    x64 = x.double().reshape(-1, D)
    logits = x64 @ router_w.double().T
    for t in range(x64.shape[0]):
        chosen = _ref_route(logits[t].tolist(), rule, None)
        expected = sum(wt * _ref_expert(experts[e], x64[t], act) for e, wt in chosen.items())
        torch.testing.assert_close(got.reshape(-1, D)[t].double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["plain", "mxfp4"])
@pytest.mark.parametrize("act", list(ACTS))
def test_dispatch_batch2_multi_token_matches_per_token_reference(act, mxfp4):
    experts = _experts(D, mxfp4, biases=act == "gpt_oss", seed=4)
    rule = RoutingRule(top_k=3, scoring="topk_softmax" if act == "gpt_oss" else "softmax", renormalize=True)
    router_w = torch.randn(E, D, generator=_gen(5)) * 0.3
    block = MoEBlock(Router(router_w, None, rule), ResidentExperts({7: experts}), 7, ACTS[act])
    x = torch.randn(2, 9, D, generator=_gen(6))
    got = block(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    _assert_matches_per_token_reference(got, x, router_w, rule, experts, ACTS[act])


KERNEL_ACTS = {"swiglu": ExpertGLU("swiglu"), "gpt_oss": ExpertGLU("gpt_oss", 7.0, 1.702),
               "situ": ExpertGLU("situ", 4.0, 25.0)}


@pytest.mark.parametrize("act", list(KERNEL_ACTS))
def test_kernel_dispatch_matches_reference_and_one_expert_at_a_time(act):
    """MXFP4 experts with a kernel activation run in the MoE kernel: the whole layer at once from a
    resident provider, one expert per call from a provider that hands out one at a time (a pager);
    both match the float64 per-token reference and give the same bits."""
    experts = _experts(D, True, biases=True, seed=14)
    resident = ResidentExperts({7: experts})

    class OneAtATime:
        def get(self, layer, e):
            return resident.get(layer, e)

        def nbytes(self):
            return resident.nbytes()

    assert resident.kernel_table(7) is not None
    rule = RoutingRule(top_k=3, scoring="topk_softmax", renormalize=True)
    router_w = torch.randn(E, D, generator=_gen(15)) * 0.3
    x = torch.randn(2, 3, D, generator=_gen(16))
    blocks = [MoEBlock(Router(router_w, None, rule), p, 7, KERNEL_ACTS[act]) for p in (resident, OneAtATime())]
    assert blocks[0].routed_table(6) is not None and blocks[1].routed_table(6) is None  # one call vs routed
    whole, paged = blocks[0](x), blocks[1](x)
    assert torch.equal(whole, paged)
    _assert_matches_per_token_reference(whole, x, router_w, rule, experts, ACTS[act])
    q8 = [MoEBlock(Router(router_w, None, rule), p, 7, KERNEL_ACTS[act]) for p in (resident, OneAtATime())]
    for block in q8:
        block.precision = "q8"
    whole_q8 = q8[0](x)
    assert torch.equal(whole_q8, q8[1](x)) and not torch.equal(whole_q8, whole)


def test_dense_experts_run_as_one_layer_call_with_the_bits_of_one_expert_at_a_time(monkeypatch):
    """Resident dense experts with a kernel activation run as `dense_moe_layer` calls (runs of experts with at
    most DENSE_MAX_TOKENS tokens, here lowered to 64; expert 0, chosen by every token, in torch between them); a
    provider that hands out one expert at a time (a pager) runs them one call each: the same bits, and the float64
    reference."""
    from localmoe.engine import experts as experts_module
    from localmoe.engine.layers import moe

    DENSE_MAX_TOKENS = 64
    monkeypatch.setattr(experts_module, "DENSE_MAX_TOKENS", DENSE_MAX_TOKENS)
    monkeypatch.setattr(moe, "DENSE_MAX_TOKENS", DENSE_MAX_TOKENS)
    experts = _experts(D, False, biases=False, seed=24)
    resident = ResidentExperts({7: experts})

    class OneAtATime:
        def get(self, layer, e):
            return resident.get(layer, e)

        def nbytes(self):
            return resident.nbytes()

    assert resident.kernel_table(7) is None and resident.dense_table(7) is not None
    rule = RoutingRule(top_k=3, scoring="softmax", renormalize=True)
    router_w = torch.randn(E, D, generator=_gen(25)) * 0.3
    x = torch.randn(2, 40, D, generator=_gen(26))
    x[..., 0] = 4.0
    router_w[0, 0] = 10.0  # expert 0 wins every token: more than DENSE_MAX_TOKENS of them
    calls = []

    def counting(*args, **kwargs):
        calls.append(list(args[4]))
        return real(*args, **kwargs)

    real, moe.dense_moe_layer = moe.dense_moe_layer, counting
    try:
        blocks = [MoEBlock(Router(router_w, None, rule), p, 7, KERNEL_ACTS["situ"]) for p in (resident, OneAtATime())]
        whole, paged = blocks[0](x), blocks[1](x)
    finally:
        moe.dense_moe_layer = real
    _, ids = blocks[0].router(x.reshape(-1, D))
    assert int((ids == 0).sum()) == 80 > DENSE_MAX_TOKENS and 0 not in [e for run in calls for e in run]
    assert sorted(e for run in calls for e in run) == sorted(set(ids.reshape(-1).tolist()) - {0})
    assert torch.equal(whole, paged)
    _assert_matches_per_token_reference(whole, x, router_w, rule, experts, ACTS["situ"])


def test_expert_precision_is_checked_and_defaults_to_q8():
    from localmoe.config import EngineConfig
    from localmoe.errors import LocalMoEError

    assert EngineConfig().expert_precision == "q8"
    # q8-all: the experts at q8 too (it rounds every model's GGUF block lm_head besides: engine/transformer.py)
    assert [EngineConfig(expert_precision=p).expert_kernel_precision for p in ("q8", "q8-all", "exact")] == \
        ["q8", "q8", "exact"]
    with pytest.raises(LocalMoEError, match="--expert-precision must be one of q8, q8-all, exact"):
        EngineConfig(expert_precision="q4")


def test_each_chosen_expert_is_fetched_once_per_call():
    experts = _experts(D, False, False, seed=7)

    class Counting(ResidentExperts):
        calls: list

        def get(self, layer, e):
            self.calls.append(e)
            return super().get(layer, e)

    provider = Counting({0: experts})
    provider.calls = []
    block = MoEBlock(Router(torch.randn(E, D, generator=_gen(8)), None, RoutingRule(top_k=4)), provider, 0, swiglu)
    x = torch.randn(2, 12, D, generator=_gen(9))
    _, ids = block.router(x.reshape(-1, D))
    block(x)
    assert sorted(provider.calls) == sorted(set(ids.reshape(-1).tolist()))


def test_shared_experts_and_latent_moe_match_float64_rederivation():
    L = 32  # latent width < D
    experts = _experts(L, True, False, seed=10)
    g = _gen(11)
    router_w, correction = torch.randn(E, D, generator=g) * 0.3, torch.randn(E, generator=g) * 0.3
    down, up = torch.randn(L, D, generator=g) * 0.2, torch.randn(D, L, generator=g) * 0.2
    norm = 1 + 0.2 * torch.randn(L, generator=g)
    sg, su, sd = (torch.randn(48, D, generator=g) * 0.2, torch.randn(48, D, generator=g) * 0.2,
                  torch.randn(D, 48, generator=g) * 0.2)
    rule = RoutingRule(top_k=4, scoring="sigmoid", renormalize=True, scaling=1.5, n_group=2, topk_group=1)
    shared = GatedMLP(Linear(torch.cat([sg, su]), None, "float32"), Linear(sd, None, "float32"), swiglu)
    latent = LatentProjection(Linear(down, None, "float32"), norm, Linear(up, None, "float32"), 1e-6)
    block = MoEBlock(Router(router_w, None, rule, correction), ResidentExperts({2: experts}), 2, situ_glu,
                     shared=shared, latent=latent)
    x = torch.randn(2, 5, D, generator=_gen(12))
    got = block(x).reshape(-1, D)
    for t, xt in enumerate(x.double().reshape(-1, D)):
        chosen = _ref_route((router_w.double() @ xt).tolist(), rule, correction.tolist())
        h = down.double() @ xt
        y = sum(wt * _ref_expert(experts[e], h, situ_glu) for e, wt in chosen.items())
        y = up.double() @ (y / torch.sqrt((y * y).mean() + 1e-6) * norm.double())
        y = y + sd.double() @ (torch.nn.functional.silu(sg.double() @ xt) * (su.double() @ xt))
        torch.testing.assert_close(got[t].double(), y, rtol=1e-4, atol=1e-5)


def test_resident_experts_from_per_expert_and_stacked_canonical_names():
    experts = _experts(D, True, True, seed=13)
    per_expert = {f"layers.3.mlp.experts.{e}.{proj}.{k}": getattr(getattr(w, proj), k)
                  for e, w in enumerate(experts) for proj in ("gate", "up", "down") for k in ("packed", "scales", "bias")}
    stacked = {f"layers.3.mlp.experts.gate_up_proj.{k}": torch.stack([torch.cat([getattr(w.gate, k), getattr(w.up, k)])
                                                                     for w in experts])
               for k in ("packed", "scales", "bias")}
    stacked |= {f"layers.3.mlp.experts.down_proj.{k}": torch.stack([getattr(w.down, k) for w in experts])
                for k in ("packed", "scales", "bias")}
    for weights in (per_expert, stacked):
        provider = ResidentExperts.from_weights(weights, "layers.3.", 3, E)
        for e in (0, 5, E - 1):
            got, want = provider.get(3, e), experts[e]
            for proj in ("gate", "up", "down"):
                for k in ("packed", "scales", "bias"):
                    assert torch.equal(getattr(getattr(got, proj), k), getattr(getattr(want, proj), k))
        assert provider.nbytes() == sum(w.nbytes() for w in experts)
