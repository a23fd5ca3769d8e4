"""Mixture-of-experts block: router, grouped token -> expert dispatch, shared experts, latent MoE.

Routing is a pure function of the router logits (`route`), parametrised by `RoutingRule`:
- "softmax": softmax over all experts, then top-k (Mixtral, Qwen-MoE; renormalise optional)
- "sigmoid": sigmoid scores; `e_score_correction_bias` is added for SELECTION only, the
  weights are the raw scores (DeepSeek-V3, Kimi); optional group-limited top-k (n_group
  groups scored by the sum of their top-2, keep topk_group of them)
- "topk_softmax": top-k on the logits, softmax over the selected (gpt-oss)
then weights are renormalised (optional) and multiplied by `routed_scaling_factor`.

The block asks its `ExpertProvider` for experts by (layer, expert id); see experts.py.
Families describe their routing and expert activation with ModelSpec fields named after
their HF config keys (`scoring_func`, `norm_topk_prob`, `routed_scaling_factor`, `n_group`,
`topk_group`, `expert_act`, `swiglu_limit`, `swiglu_alpha`; `glu_limit`: GLM-5-Next's clamped
SwiGLU), read into a `Config` by `Config.of`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.experts import (
    DENSE_MAX_TOKENS,
    Activation,
    ExpertProvider,
    ResidentExperts,
    expert_accumulate,
    independent_rows,
)
from localmoe.engine.layers import mlp, on_device
from localmoe.engine.layers.mlp import GatedMLP
from localmoe.engine.linear import Linear, make_linear
from localmoe.engine.quantized import in_decode_rows
from localmoe.errors import LocalMoEError
from localmoe.kernels.dense_moe import DenseExpertTable, dense_moe_layer
from localmoe.kernels.ggml_gemv import experts as ggml_experts
from localmoe.kernels.mxfp4_moe import (
    GEMV_MAX_TOKENS,
    GLU_KINDS,
    ExpertTable,
    glu,
    mxfp4_moe,
    mxfp4_routed_moe,
    route_experts,
)

SCORING = ("softmax", "sigmoid", "topk_softmax")


# ---- expert activations: (gate, up) [N, I] -> [N, I] ----

def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class ExpertGLU:
    """A routed-expert activation the MoE kernels compute (kernels/mxfp4_moe: `glu`): kind "swiglu"
    (p0: clamp limit or 0), "gpt_oss" (p0: limit, p1: alpha) or "situ" (p0: beta, p1: linear beta)."""

    kind: str
    p0: float = 0.0
    p1: float = 0.0

    @property
    def params(self) -> tuple[float, float]:
        return self.p0, self.p1

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return glu(self.kind, gate, up, self.p0, self.p1)


def expert_activation(spec) -> ExpertGLU:
    kind = spec.expert_act
    if kind == "swiglu":
        return ExpertGLU("swiglu", float(spec.glu_limit or 0.0))  # GLM-5-Next clamps (swiglu_limit)
    if kind == "gpt_oss_swiglu":
        return ExpertGLU("gpt_oss", spec.swiglu_limit, spec.swiglu_alpha)
    if kind == "situ":
        return ExpertGLU("situ", spec.situ_beta, spec.situ_linear_beta)
    raise LocalMoEError(f"{spec.model_type}: expert activation {kind!r} is not supported")


# ---- routing ----

@dataclass(frozen=True, slots=True)
class RoutingRule:
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    scaling: float = 1.0  # routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise LocalMoEError(f"router scoring {self.scoring!r} is not one of {', '.join(SCORING)}")


def route(logits: torch.Tensor, rule: RoutingRule, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 -> (weights [N, k] fp32, expert ids [N, k] int64)."""
    if rule.scoring == "topk_softmax":
        top, ids = logits.topk(rule.top_k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if rule.scoring == "softmax" else logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if rule.n_group > 1:
            N, E = choice.shape
            groups = choice.view(N, rule.n_group, E // rule.n_group)
            group_scores = groups.topk(min(2, E // rule.n_group), dim=-1).values.sum(-1)  # [N, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(rule.topk_group, dim=-1).indices, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(N, E)
        ids = choice.topk(rule.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * rule.scaling if rule.scaling != 1.0 else weights, ids


class Router:
    """logits = x W^T (+ b) in fp32; `correction_bias` only biases which experts are chosen."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rule: RoutingRule,
                 correction_bias: torch.Tensor | None = None):
        self.linear = Linear(weight, bias, "float32", compact=False)  # an fp32 tensor for the routing kernels
        self.rule = rule
        self.correction_bias = None if correction_bias is None else correction_bias.float()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rule.n_group == 1:
            # the kernels' routing (the same bits as inside the fused routed-experts call; torch off the CPU), for
            # any number of a batched step's rows (each token's bits alone)
            rule = self.rule
            return route_experts(x, self.linear.weight, self.linear.bias, self.correction_bias, rule.scoring,
                                 rule.top_k, rule.renormalize, rule.scaling, any_rows=in_decode_rows())
        return route(self.linear(x), self.rule, self.correction_bias)

    def nbytes(self) -> int:
        return self.linear.nbytes() + (0 if self.correction_bias is None else self.correction_bias.nbytes)


# ---- dispatch ----

def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, provider: ExpertProvider, layer: int,
             act: Activation, precision: str = "exact") -> torch.Tensor:
    """x [N, D], weights/ids [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), [N, D].

    MXFP4 experts with a kernel activation (ExpertGLU) go to the `mxfp4_moe` kernel: the whole layer
    in one call where the provider holds every expert at once (`kernel_table`), else one call per
    expert as the provider hands them out; both add experts in increasing id, so the bits are the
    same; `precision` is the kernel's (kernels/mxfp4_moe: "exact" or "q8"). Other experts are fetched
    once each, run on all of their tokens at once and added in the same order (`expert_accumulate`:
    dense experts through kernels/dense_moe); resident dense experts (`dense_table`) run as one
    `dense_moe_layer` call for the chunk, resident GGUF-block experts at precision q8 (`block_table`) as one
    `block_layer` call, with the same bits.

    A provider with `placed` (a pager with GPU tiers) hands each expert out in the tier to compute it
    in. An expert runs where its weights are: one on another device than x (a GPU tier's under a host
    model, a RAM tier's under a GPU model) on the layer's tokens copied there once, into that device's
    sum, added to x's at the end (with every expert on x's device the bits are as above).
    """
    out = torch.zeros_like(x)
    kernel = isinstance(act, ExpertGLU)
    if kernel and hasattr(provider, "kernel_table"):
        table = provider.kernel_table(layer)
        if table is not None:
            return mxfp4_moe(x, ids, weights, table, act.kind, act.params, out, precision=precision)
        dense = provider.dense_table(layer)
        if dense is not None:
            return _layer_runs(x, weights, ids, provider, layer, len(dense.experts), DENSE_MAX_TOKENS, act, precision,
                               out, lambda run: dense_moe_layer(x, ids, weights, dense, run, act.kind, act.params, out))
        blocks = provider.block_table(layer) if precision == "q8" and ggml_experts.takes_layer(x, out) else None
        if blocks is not None:
            kind = GLU_KINDS.index(act.kind)
            return _layer_runs(x, weights, ids, provider, layer, len(blocks.experts), GEMV_MAX_TOKENS, act, precision,
                               out, lambda run: ggml_experts.block_layer(x, ids, weights, blocks, run, kind, act.params,
                                                                         out))
    placed = getattr(provider, "placed", None)
    elsewhere: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # device -> (x, ids, weights, sum) there
    k = ids.shape[1]
    flat = ids.reshape(-1)
    chosen = flat.unique().tolist()  # ascending
    for expert in chosen:
        w = provider.get(layer, expert) if placed is None else placed(layer, expert, int((flat == expert).sum()))[0]
        if w.device == x.device:
            xs, ids_, weights_, acc = x, ids, weights, out
        else:
            if w.device not in elsewhere:
                elsewhere[w.device] = (*(t.to(w.device, non_blocking=True) for t in (x, ids, weights)),
                                       torch.zeros(x.shape, dtype=x.dtype, device=w.device))
            xs, ids_, weights_, acc = elsewhere[w.device]
        table = ExpertTable.single(expert, w, chosen[-1] + 1) if kernel else None
        if table is not None:
            mxfp4_moe(xs, ids_, weights_, table, act.kind, act.params, acc,
                      only=expert, precision=precision)
            continue
        picks = (ids_.reshape(-1) == expert).nonzero().squeeze(1)
        expert_accumulate(w, xs, picks // k, weights_.reshape(-1)[picks], act, acc, precision,
                          (act.kind, act.params) if kernel else None)
    for *_, acc in elsewhere.values():
        out += acc.to(out.device)
    return out


def _layer_runs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, provider: ExpertProvider, layer: int,
                experts: int, limit: int, act: ExpertGLU, precision: str, out: torch.Tensor,
                run_layer: Callable[[list[int]], object]) -> torch.Tensor:
    """`dispatch` over a layer's resident experts held whole by a kernel (dense: `dense_moe_layer`; GGUF blocks at
    q8: `block_layer`): runs of experts with at most `limit` tokens go to `run_layer(run)` (one kernel call each
    run), larger ones to `expert_accumulate`, in increasing id: the same bits as the per-expert loop (a pager's
    path)."""
    flat, k = ids.reshape(-1), ids.shape[1]
    run: list[int] = []
    for expert, n in enumerate(torch.bincount(flat, minlength=experts).tolist()):
        if 0 < n <= limit:
            run.append(expert)
        elif n:
            if run:
                run_layer(run)
                run = []
            picks = (flat == expert).nonzero().squeeze(1)
            expert_accumulate(provider.get(layer, expert), x, picks // k, weights.reshape(-1)[picks], act, out,
                              precision, (act.kind, act.params))
    if run:
        run_layer(run)
    return out


class LatentProjection:
    """Kimi K3 latent MoE: experts run at width L < D: x_lat = down(x); out = up(RMSNorm(sum))."""

    def __init__(self, down, norm: torch.Tensor, up, eps: float):  # down/up: Linear-like [L, D] / [D, L]
        self.down, self.norm, self.up, self.eps = down, norm.float(), up, eps

    def nbytes(self) -> int:
        return self.down.nbytes() + self.norm.nbytes + self.up.nbytes()


class SigmoidGatedMLP:
    """Qwen3-Next's shared expert: sigmoid(x . w_gate) * mlp(x), the gate one scalar per token."""

    def __init__(self, mlp: GatedMLP, gate: torch.Tensor):
        self.mlp, self.gate = mlp, make_linear([gate], None, "float32", compact=False)  # gate [1, hidden]

    def nbytes(self) -> int:
        return self.mlp.nbytes() + self.gate.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


class MoEBlock:
    """sum over the k chosen experts of weight * expert(x), plus shared experts if any."""

    def __init__(self, router: Router, experts: ExpertProvider | None, layer: int, act: Activation,
                 shared: GatedMLP | None = None, latent: LatentProjection | None = None):
        self.router, self.experts, self.layer, self.act = router, experts, layer, act
        self.shared, self.latent = shared, latent
        self.precision = "exact"  # MXFP4 experts: EngineConfig.expert_precision, set by the Transformer
        self._rows: int | None = None  # independent_rows, found again after experts / router / precision change

    def __setattr__(self, name: str, value) -> None:
        if name in ("experts", "router", "precision", "shared", "latent"):
            self.__dict__["_rows"] = None
        object.__setattr__(self, name, value)

    def _routes_in_kernel(self, tokens: int) -> bool:
        """Whether routing can join the experts' kernel call: a plain Router (not wrapped by paging hooks, which
        must see each routing) without group-limited top-k, kernel experts all resident, a decode-sized call."""
        return (type(self.router) is Router and self.router.rule.n_group == 1 and tokens <= GEMV_MAX_TOKENS
                and isinstance(self.act, ExpertGLU) and hasattr(self.experts, "kernel_table"))

    def routed_table(self, tokens: int) -> ExpertTable | None:
        """The provider's whole-layer MXFP4 kernel table where routing can join the experts' kernel call
        (`_routes_in_kernel`); else None."""
        return self.experts.kernel_table(self.layer) if self._routes_in_kernel(tokens) else None

    def routed_dense_table(self, tokens: int) -> DenseExpertTable | None:
        """The same for resident dense experts (the fused decode step routes and runs them itself)."""
        return self.experts.dense_table(self.layer) if self._routes_in_kernel(tokens) else None

    def routed_block_table(self, tokens: int):
        """The same for resident GGUF-block experts at expert precision q8 (the kernel rounds x to int8, as the
        op-by-op GEMVs do at q8): a kernels/ggml_gemv BlockExpertTable, or None."""
        if self.precision != "q8" or not self._routes_in_kernel(tokens):
            return None
        return self.experts.block_table(self.layer)

    @property
    def independent_rows(self) -> int:
        """The most rows of one call (a batched step's, inside `decode_rows()`) that each get the bits they have
        alone: routing per token on the CPU kernel (no group-limited top-k), the routed experts' kernels
        (engine/experts.py `independent_rows` of the provider's `form`), shared experts run in slices of their own
        `independent_rows`; 0 where some part takes a GEMM over the call (a latent MoE's projections, experts
        without a form or on another device)."""
        if self._rows is None:  # (a provider's form is looked up once per provider, router and precision)
            self._rows = self._independent_rows()
        return self._rows

    def _independent_rows(self) -> int:
        router = self.router
        while not isinstance(router, Router) and hasattr(router, "router"):  # a pager's hooks around it
            router = router.router
        form = getattr(self.experts, "form", None)
        if (not isinstance(router, Router) or router.rule.n_group != 1 or self.latent is not None or form is None
                or getattr(self.experts, "gpu", None) is not None
                or (self.shared is not None and not getattr(self.shared, "independent_rows", 0))):
            return 0
        w = form(self.layer)
        return independent_rows(w, self.precision) if w.device.type == "cpu" else 0

    def nbytes(self) -> int:
        """Bytes of the router, shared experts and latent projections (routed experts are the
        provider's: `Transformer.weight_bytes` counts each provider once)."""
        own = self.router.nbytes() + (self.shared.nbytes() if self.shared else 0)
        return own + (self.latent.nbytes() if self.latent else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] fp32 -> [B, T, D]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        table = self.routed_table(flat.shape[0])
        h = flat if self.latent is None else self.latent.down(flat)
        if table is not None:  # routing and experts in one kernel call
            r = self.router
            y = mxfp4_routed_moe(flat, r.linear.weight, r.linear.bias, r.correction_bias, r.rule.scoring,
                                 r.rule.top_k, r.rule.renormalize, r.rule.scaling, h.contiguous(), table,
                                 self.act.kind, self.act.params, torch.zeros_like(h), self.precision)[0]
        else:
            weights, ids = self.router(flat)
            y = dispatch(h, weights, ids, self.experts, self.layer, self.act, self.precision)
        if self.latent is not None:
            y = self.latent.up(F.rms_norm(y, (y.shape[-1],), self.latent.norm, self.latent.eps))
        if self.shared is not None:
            y = y + self._shared(flat)
        return y.view(shape)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts on x [N, D]; a batched step's rows in slices of the MLP's `independent_rows` (its
        decode kernels: each row's bits alone), other calls whole."""
        limit = getattr(self.shared, "independent_rows", 0)
        if not in_decode_rows() or not limit or x.shape[0] <= limit:
            return self.shared(x)
        return torch.cat([self.shared(part) for part in x.split(limit)])


@dataclass(frozen=True, slots=True)
class Config:
    """A MoE layer: router rule, routed experts (at the latent width for K3's latent MoE), shared experts."""

    hidden_size: int  # D
    num_experts: int  # E
    moe_intermediate_size: int  # each routed expert's I
    rule: RoutingRule
    act: ExpertGLU  # the routed experts' activation
    shared: mlp.Config | None = None  # the shared experts, fused into one gated MLP
    shared_gate: bool = False  # Qwen3-Next: the shared expert scaled by sigmoid(`mlp.shared_expert_gate`)
    correction_bias: bool = False  # DeepSeek / Kimi: `router.e_score_correction_bias` biases the choice
    latent_size: int = 0  # K3 latent MoE: experts run at this width (down, experts, norm, up); 0 = D
    norm_eps: float = 1e-6  # the latent norm's (the model's rms_norm_eps)

    @classmethod
    def of(cls, spec, latent: bool = False) -> Config:
        """A ModelSpec's MoE layers (`latent` for its `latent_moe` ones) from its common MoE fields."""
        rule = RoutingRule(top_k=spec.num_experts_per_tok, scoring=spec.scoring_func, renormalize=spec.norm_topk_prob,
                           scaling=spec.routed_scaling_factor, n_group=spec.n_group, topk_group=spec.topk_group)
        inner = spec.shared_expert_intermediate_size or spec.num_shared_experts * spec.moe_intermediate_size
        shared = mlp.Config.of(spec, inner) if spec.num_shared_experts else None
        return cls(spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, rule, expert_activation(spec), shared,
                   bool(spec.shared_expert_intermediate_size), spec.scoring_func == "sigmoid",
                   spec.latent_moe_size if latent else 0, spec.rms_norm_eps)

    @property
    def width(self) -> int:
        """The routed experts' input and output width."""
        return self.latent_size or self.hidden_size


def expert_shapes(cfg: Config, m: str) -> dict[str, tuple[int, ...]]:
    """bf16 routed experts `{m}experts.{e}.{gate,up,down}.weight` at the config's width."""
    Im, W, shapes = cfg.moe_intermediate_size, cfg.width, {}
    for e in range(cfg.num_experts):
        x = f"{m}experts.{e}."
        shapes |= {x + "gate.weight": (Im, W), x + "up.weight": (Im, W), x + "down.weight": (W, Im)}
    return shapes


def tensors(cfg: Config, prefix: str, experts=expert_shapes) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `mlp.*`: router (+ correction bias), the latent projections of a latent MoE, routed
    experts (`experts(cfg, "{prefix}mlp.")`: bf16 by default; Kimi K3 passes its MXFP4 parts), shared experts."""
    D, m = cfg.hidden_size, prefix + "mlp."
    shapes = {m + "router.weight": (cfg.num_experts, D)}
    if cfg.correction_bias:
        shapes[m + "router.e_score_correction_bias"] = (cfg.num_experts,)
    if cfg.latent_size:
        L = cfg.latent_size
        shapes |= {m + "routed_expert_down_proj.weight": (L, D), m + "routed_expert_norm.weight": (L,),
                   m + "routed_expert_up_proj.weight": (D, L)}
    shapes |= experts(cfg, m)
    if cfg.shared is not None:
        shapes |= mlp.tensors(cfg.shared, prefix, "mlp.shared_experts.")
        if cfg.shared_gate:
            shapes[m + "shared_expert_gate.weight"] = (1, D)
    return shapes


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> MoEBlock:
    """From canonical `{prefix}mlp.router.{weight,bias,e_score_correction_bias}`, routed experts under
    `{prefix}mlp.experts.` (see ResidentExperts; none: the block waits for a provider from
    `Transformer.use_experts`, e.g. a packed store's pager), `mlp.shared_experts.*` (+ `mlp.shared_expert_gate`)
    and, for latent MoE, `mlp.routed_expert_{down_proj,norm,up_proj}.weight`; on `device` (resident routed
    experts too; a provider's stay where it keeps them)."""
    p = prefix + "mlp."
    layer = int(prefix.split(".")[1])

    def w(name: str) -> torch.Tensor | None:
        t = weights.get(p + name)
        return on_device(t, device)

    router = Router(w("router.weight"), w("router.bias"), cfg.rule, w("router.e_score_correction_bias"))
    has_experts = any(p + f"experts.{stem}.{kind}" in weights for stem in ("0.gate", "gate_up_proj")
                      for kind in ("packed", "weight"))
    experts = None
    if has_experts:  # resident experts live on the layer's device
        mine = weights if str(device) == "cpu" else \
            {n: on_device(weights[n], device) for n in weights if n.startswith(p + "experts.")}
        experts = ResidentExperts.from_weights(mine, prefix, layer, cfg.num_experts, dtype)
    shared = None
    if cfg.shared is not None:
        shared = mlp.build(cfg.shared, weights, prefix, device, dtype, "mlp.shared_experts.")
        if cfg.shared_gate:
            shared = SigmoidGatedMLP(shared, w("shared_expert_gate.weight"))
    latent = None
    if cfg.latent_size:
        latent = LatentProjection(make_linear([w("routed_expert_down_proj.weight")], None, dtype),
                                  w("routed_expert_norm.weight"),
                                  make_linear([w("routed_expert_up_proj.weight")], None, dtype), cfg.norm_eps)
    return MoEBlock(router, experts, layer, cfg.act, shared, latent)
