"""MXFP4 expert dispatchers: one matrix (`mxfp4_linear`), stacked experts (`mxfp4_grouped`) and
a whole MoE layer's routed experts (`mxfp4_moe`), W as canonical MXFP4 bytes.

`mxfp4_linear`, y = x W^T (+ b):
- CUDA tensors with Triton: `triton.mxfp4_grouped` (a GEMV up to 16 rows per expert, fp32 `tl.dot`
  tiles above; tile tables built on the device, no host sync).
- CPU with the C++ kernel (cpu.py): N <= GEMV_MAX_TOKENS tokens stream the codes once through
  `cpu.gemv`; more tokens dequantise with `cpu.dequantize` and run one fp32 sgemm (F.linear),
  where the matmul, not the bytes, is the cost.
- otherwise the reference (reference.py).
`precision` "q8" rounds x per 32-element block first (below).
Every path accumulates in fp32 and returns x's dtype (bf16/fp16 inputs are computed in fp32 and
rounded once at the end). The path depends only on the device, dtype and N, so the same call
(paged or resident weights) always gives the same bits.

`mxfp4_moe`, out += the weighted routed experts of N tokens: with the C++ library and N <=
GEMV_MAX_TOKENS, one call per layer (moe_cpu.cpp: both GEMVs, the GLU and the weighted sum); with
more tokens (prefill) one kernel call per expert that has at most EXPERT_GEMV_MAX_TOKENS of them (its codes
read once for all its tokens) and the reference's dequantise + sgemm for an expert with more;
without the library the reference's per-expert loop over `mxfp4_linear`. Either way experts are added in
increasing id, so one call over all experts and one call per expert (`only`, what a paging provider
holding one expert at a time does) give the same bits. With Triton, for x on the table's GPU: every
expert of the table in three grouped calls (grouped_moe.py: no host sync; each token's choices summed in
choice order). `precision` "q8" rounds each projection's
input to int8 per 32-element block on every path (reference.q8_round; llama.cpp's Q8_0 trade: ~2x
faster integer dot products on AVX2, activation error ~2^-8 of a block's largest value); "exact"
keeps fp32 activations (the C kernel's integer parts are within ~2^-23 of them).

`mxfp4_routed_moe` is `mxfp4_moe` with the router in the same call (logits GEMV and `naive_route`'s
rule; moe_cpu.cpp `mxfp4_moe_routed`), for a layer whose experts are all resident: decode then pays
one call per MoE layer instead of a GEMV, a top-k, a softmax and the experts' call.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from localmoe.kernels._triton import usable
from localmoe.kernels.mxfp4_moe import cpu
from localmoe.kernels.mxfp4_moe.reference import (
    GLU_KINDS,
    PRECISIONS,
    SCORINGS,
    glu,
    naive_mxfp4_grouped,
    naive_mxfp4_linear,
    naive_mxfp4_moe,
    naive_route,
    q8_round,
)

GEMV_MAX_TOKENS = 96  # measured: GEMV at 0.6x the time of dequantise + sgemm for 64 tokens, 1.0x at 128
# prefill: tokens of one expert up to which the fused kernel computes it. Measured on K3 small's
# 512-token chunk (57-113 tokens per expert): all 48 experts through the kernel took 0.06 s of CPU,
# 0.32 s with the 11 experts above 96 tokens through the reference; larger counts are unmeasured.
EXPERT_GEMV_MAX_TOKENS = 512
# precision "exact": an expert's group of up to this many tokens runs the integer path per token (moe_cpu.cpp
# kTokenPathMax), so each has the bits it has alone; at "q8" every group up to EXPERT_GEMV_MAX_TOKENS does
EXACT_TOKEN_ROWS = 32
SINGLE_TABLES_MAX = 1024  # one-expert tables kept for reuse (ExpertTable.single), cleared when full
_SINGLE_TABLES: dict[tuple, ExpertTable] = {}


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"expert precision {precision!r} is not one of {', '.join(PRECISIONS)}")


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, precision: str = "exact") -> torch.Tensor:
    """x [N, K] -> [N, O] in x's dtype; packed U8 [O, K/2], scales U8 [O, K/32], bias [O] or None;
    `precision` "q8" rounds x with q8_round first (on the CPU GEMV, the integer q8 path of the fused
    MoE layer, with its bits)."""
    _check_precision(precision)
    q8 = precision == "q8"
    if usable(x):
        from localmoe.kernels.mxfp4_moe import triton as tk

        return tk.mxfp4_linear(q8_round(x) if q8 else x, packed, scales, bias)
    if x.device.type == "cpu" and packed.device.type == "cpu" and cpu.library() is not None:
        xf = x.float()
        if x.shape[0] <= GEMV_MAX_TOKENS:
            y = cpu.gemv(xf, packed, scales, q8=q8)
            if bias is not None:
                y += bias.float()
        else:
            y = F.linear(q8_round(xf) if q8 else xf, cpu.dequantize(packed, scales), None if bias is None else bias.float())
        return y.to(x.dtype)
    return naive_mxfp4_linear(q8_round(x) if q8 else x, packed, scales, bias)


def mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row m of x [M, K] through expert ids[m] of stacked packed [E, O, K/2], scales [E, O, K/32]."""
    if usable(x):
        from localmoe.kernels.mxfp4_moe import triton as tk

        return tk.mxfp4_grouped(x, packed, scales, ids, bias)
    return naive_mxfp4_grouped(x, packed, scales, ids, bias)


class ExpertTable:
    """Some MXFP4 experts of one MoE layer as `mxfp4_moe` reads them: `experts` maps expert id to an
    object with .gate/.up/.down, each with .packed U8 and .scales U8 (canonical layout) and .bias
    ([out], any float dtype) or None, all on one `device`. On the CPU, `addresses` is the CPU kernel's
    int64 [E, 9] table (rows of absent experts are 0), with biases as fp32 (converted here where they
    are not: exact from bf16); the table holds every tensor it points to, so the addresses stay valid
    while it lives. Elsewhere (a GPU) `addresses` stays zero and the dispatcher runs grouped_moe.py's
    grouped Triton calls over `grouped` (the experts as stacks, made once per table)."""

    def __init__(self, experts: Mapping[int, object], num_experts: int):
        rows = torch.zeros(num_experts, 9, dtype=torch.int64)
        self.experts = dict(experts)
        first = next(iter(self.experts.values()))
        self.hidden, self.intermediate = first.gate.packed.shape[1] * 2, first.gate.packed.shape[0]
        self.device = first.gate.packed.device
        self.grouped = None  # grouped_moe.GroupedExperts, built at the first call on a GPU
        self._held = []
        for e, w in self.experts.items():
            if not self.holds(w, self.device) or w.gate.packed.shape[0] != self.intermediate or \
                    w.down.packed.shape != (self.hidden, self.intermediate // 2):
                raise ValueError(f"expert {e}: not MXFP4 experts of width {self.intermediate} over {self.hidden} "
                                 f"on {self.device}")
            if self.device.type != "cpu":
                continue
            row, held = self.row(w)
            self._held += held
            rows[e] = torch.tensor(row)
        self.addresses = rows

    @staticmethod
    def row(w) -> tuple[list[int], list[torch.Tensor]]:
        """An expert's row of `addresses` (CPU weights in the kernels' form: `holds`), and the fp32 bias copies it
        points to that `w` does not hold (the row is valid while `w` and those live)."""
        parts = [t for p in (w.gate, w.up, w.down)
                 for t in (p.packed, p.scales, None if p.bias is None else p.bias.float().contiguous())]
        copies = [t for p, t in zip((w.gate, w.up, w.down), parts[2::3]) if t is not None and t is not p.bias]
        return [0 if t is None else t.data_ptr() for t in parts], copies

    @classmethod
    def single(cls, expert: int, w, num_experts: int) -> ExpertTable | None:
        """`ExpertTable({expert: w}, num_experts)`, or None where `w` is not in the kernels' form (`holds` on
        its own device). A paging provider hands out views of the same slots over and over: a table of
        bias-free experts is kept per (expert, memory it points to) and reused (the addresses would be
        the same; a bias may be a converted copy, so those are built each time). A kept table holds its
        tensors: meant for providers whose weights are views of fixed slots (the pager's RAM and GPU slabs)."""
        parts = [t for p in (w.gate, w.up, w.down) for t in (p.packed, p.scales)]
        cacheable = all(p.bias is None for p in (w.gate, w.up, w.down)) and all(t is not None for t in parts)
        key = (expert, *((t.data_ptr(), t.shape, t.device) for t in parts)) if cacheable else None
        table = _SINGLE_TABLES.get(key) if cacheable else None
        if table is not None and table.addresses.shape[0] >= num_experts:  # more (empty) rows change nothing
            return table
        if w.gate.packed is None or not cls.holds(w, w.gate.packed.device):
            return None
        table = cls({expert: w}, max(num_experts, 0 if table is None else table.addresses.shape[0]))
        if cacheable:
            if len(_SINGLE_TABLES) >= SINGLE_TABLES_MAX:
                _SINGLE_TABLES.clear()
            _SINGLE_TABLES[key] = table
        return table

    @staticmethod
    def holds(w, device: str | torch.device = "cpu") -> bool:
        """Whether expert weights `w` are MXFP4 in the form the kernels take: contiguous U8 codes and
        scales and float biases, on `device` (type "cpu" or "cuda", or an exact torch.device)."""
        def on(t: torch.Tensor) -> bool:
            return t.device == device if isinstance(device, torch.device) else t.device.type == device

        return all(p.packed is not None and p.scales is not None and p.packed.dtype == p.scales.dtype == torch.uint8
                   and p.packed.is_contiguous() and p.scales.is_contiguous() and on(p.packed) and on(p.scales)
                   and (p.bias is None or (p.bias.is_floating_point() and on(p.bias))) for p in (w.gate, w.up, w.down))


def mxfp4_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table: ExpertTable, kind: str,
              params: tuple[float, float], out: torch.Tensor, only: int | None = None,
              precision: str = "exact") -> torch.Tensor:
    """out [N, D] += sum_j weights[:, j] * expert_{ids[:, j]}(x) over the experts of `table` (or just
    expert `only`); x [N, D], ids [N, k] int64, weights [N, k]; `kind` in GLU_KINDS with `params`
    (reference.glu); `precision` in PRECISIONS. Returns out."""
    _check_precision(precision)
    if (x.dtype == out.dtype == torch.float32 and x.device.type == "cpu" and table.device.type == "cpu"
            and out.is_contiguous() and ids.dtype == torch.int64 and cpu.library() is not None):
        args = (x.contiguous(), ids.contiguous(), weights.float().contiguous(), table.addresses, table.intermediate,
                GLU_KINDS.index(kind), params, out)
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return cpu.moe(*args, -1 if only is None else only, q8=precision == "q8")
        # prefill: expert by expert in increasing id, the kernel for an expert that has few tokens
        counts = torch.bincount(ids.reshape(-1), minlength=table.addresses.shape[0]).tolist()
        for e in [only] if only is not None else [e for e, n in enumerate(counts) if n]:
            if counts[e] <= EXPERT_GEMV_MAX_TOKENS:
                cpu.moe(*args, e, q8=precision == "q8", rows=counts[e])
            else:
                naive_mxfp4_moe(x, ids, weights, table.experts, kind, params, out, e, linear=mxfp4_linear,
                                precision=precision)
        return out
    if usable(x) and table.device == x.device:
        from localmoe.kernels.mxfp4_moe.grouped_moe import GroupedExperts, grouped_moe

        if table.grouped is None:
            table.grouped = GroupedExperts(table.experts, table.addresses.shape[0])
        return grouped_moe(x, ids, weights, table.grouped, kind, params, out, only, precision)
    return naive_mxfp4_moe(x, ids, weights, table.experts, kind, params, out, only, linear=mxfp4_linear,
                           precision=precision)


def _routes_on_cpu(router_x: torch.Tensor, router_weight: torch.Tensor, scoring: str, top_k: int,
                   *tensors: torch.Tensor | None, any_rows: bool = False) -> bool:
    """Whether the CPU kernel routes these tokens: a decode-sized call (any number of rows with `any_rows`), a
    known scoring, at most MAX_EXPERTS experts, every tensor fp32 and contiguous on the CPU, the library built."""
    E = router_weight.shape[0]
    fp32_cpu = [t for t in (router_x, router_weight, *tensors) if t is not None]
    return ((any_rows or router_x.shape[0] <= GEMV_MAX_TOKENS) and scoring in SCORINGS
            and 0 < top_k <= E <= cpu.MAX_EXPERTS
            and cpu.library() is not None
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in fp32_cpu))


def route_experts(router_x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                  correction: torch.Tensor | None, scoring: str, top_k: int, renormalize: bool = False,
                  scaling: float = 1.0, any_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [N, k] of N tokens: logits = router_x [N, R] router_weight^T (+ router_bias), then
    `naive_route`'s rule; on the CPU kernel the same bits as the routing inside `mxfp4_routed_moe`. The kernel
    takes calls of up to GEMV_MAX_TOKENS rows, or of any number with `any_rows` (a batched step's rows: each token
    routed with the bits it has alone; the kernel's dense GEMV costs ~3x torch's GEMM at 512 rows of 2880)."""
    if _routes_on_cpu(router_x, router_weight, scoring, top_k, router_bias, correction, any_rows=any_rows):
        return cpu.route(router_x, router_weight, router_bias, correction, SCORINGS.index(scoring), top_k,
                         renormalize, scaling)
    logits = F.linear(router_x.float(), router_weight.float(), None if router_bias is None else router_bias.float())
    return naive_route(logits, top_k, scoring, correction, renormalize, scaling)


def mxfp4_routed_moe(router_x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                     correction: torch.Tensor | None, scoring: str, top_k: int, renormalize: bool, scaling: float,
                     x: torch.Tensor, table: ExpertTable, kind: str, params: tuple[float, float], out: torch.Tensor,
                     precision: str = "exact") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_experts` then `mxfp4_moe(x, ids, weights, table, kind, params, out, precision=precision)`, in
    one kernel call where the CPU kernel takes both (the same bits as the two calls). Returns (out,
    weights, ids)."""
    _check_precision(precision)
    if (_routes_on_cpu(router_x, router_weight, scoring, top_k, router_bias, correction, x, out)
            and table.device.type == "cpu" and table.addresses.shape[0] == router_weight.shape[0]):
        return cpu.moe_routed(router_x, router_weight, router_bias, correction, SCORINGS.index(scoring), top_k,
                              renormalize, scaling, x, table.addresses, table.intermediate, GLU_KINDS.index(kind),
                              params, out, precision == "q8")
    weights, ids = route_experts(router_x, router_weight, router_bias, correction, scoring, top_k, renormalize,
                                 scaling)
    return mxfp4_moe(x, ids, weights, table, kind, params, out, precision=precision), weights, ids


__all__ = ["EXACT_TOKEN_ROWS", "EXPERT_GEMV_MAX_TOKENS", "GEMV_MAX_TOKENS", "GLU_KINDS", "PRECISIONS", "SCORINGS",
           "ExpertTable", "glu", "mxfp4_grouped",
           "mxfp4_linear", "mxfp4_moe", "mxfp4_routed_moe", "naive_mxfp4_grouped", "naive_mxfp4_linear",
           "naive_mxfp4_moe", "naive_route", "q8_round", "route_experts"]
