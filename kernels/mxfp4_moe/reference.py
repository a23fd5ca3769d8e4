"""MXFP4 expert matmul, the spec in plain PyTorch (float32 accumulate).

Weights are canonical MXFP4 (quant/mxfp4.py): packed U8 [O, K/2], element 2i in the low nibble
of byte i; scales U8 [O, K/32], E8M0 with bias 127.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.quant.mxfp4 import dequantize


def naive_mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, K] -> x W^T + b: [N, O] in x's dtype; W dequantised to fp32, fp32 matmul."""
    y = F.linear(x.float(), dequantize(packed, scales, torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype)


def naive_mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped expert matmul: row m of x through expert ids[m].

    x: [M, K]; packed: [E, O, K/2]; scales: [E, O, K/32]; ids: [M] int; bias: [E, O] or None.
    Returns [M, O] in x's dtype (fp32 accumulate).
    """
    out = x.new_empty(x.shape[0], packed.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = naive_mxfp4_linear(x[rows].float(), packed[e], scales[e], None if bias is None else bias[e])
    return out.to(x.dtype)


def q8_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., K] (K a multiple of `block`) rounded to int8 per `block` elements, what expert precision
    "q8" feeds each projection: q = round(x * 127 / amax) to nearest even, then q * amax / 127, with
    127 / amax and amax / 127 in fp32 (as the CPU kernel); an all-zero block stays zero. block 256: what
    GGUF K-quant rows read (kernels/ggml_gemv, llama.cpp's Q8_K)."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks.float() * inv) if x.dtype != torch.float64 else torch.round(blocks * inv.double())
    return (q.to(x.dtype) * (amax / 127.0).to(x.dtype)).reshape(x.shape)


PRECISIONS = ("exact", "q8")  # expert precision: inputs as given, or q8_round before each projection
GLU_KINDS = ("swiglu", "gpt_oss", "situ")  # the expert activations the fused MoE kernels compute


def glu(kind: str, gate: torch.Tensor, up: torch.Tensor, p0: float, p1: float) -> torch.Tensor:
    """(gate, up) [M, I] -> [M, I]. swiglu: silu(gate) * up, both clamped at limit p0 when p0 > 0
    (gate above only, up both ways); gpt_oss (limit p0, alpha p1): (up + 1) * gate * sigmoid(alpha gate)
    after the same clamp; situ (beta p0, linear beta p1): beta tanh(gate / beta) sigmoid(gate) *
    linear_beta tanh(up / linear_beta)."""
    if kind == "situ":
        return p0 * torch.tanh(gate / p0) * torch.sigmoid(gate) * (p1 * torch.tanh(up / p1))
    if p0 > 0:
        gate, up = gate.clamp(max=p0), up.clamp(-p0, p0)
    if kind == "gpt_oss":
        return (up + 1) * (gate * torch.sigmoid(p1 * gate))
    if kind == "swiglu":
        return F.silu(gate) * up
    raise ValueError(f"expert activation {kind!r} is not one of {', '.join(GLU_KINDS)}")


def naive_mxfp4_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, kind: str,
                    params: tuple[float, float], out: torch.Tensor, only: int | None = None,
                    linear=naive_mxfp4_linear, precision: str = "exact") -> torch.Tensor:
    """out [N, D] += sum_j weights[:, j] * expert_{ids[:, j]}(x), the routed experts of one MoE layer.

    x [N, D] fp32; ids, weights [N, k]; experts: expert id -> object with .gate/.up/.down, each with
    MXFP4 .packed/.scales and .bias or None; only: that expert alone; precision "q8": each projection's
    input goes through q8_round. Experts are added in increasing id, each expert's tokens in
    increasing order (the order the kernels keep).
    """
    rounded = q8_round if precision == "q8" else (lambda t: t)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    for e in ([only] if only is not None else flat.unique().tolist()):
        picks = (flat == e).nonzero().squeeze(1)
        if picks.numel() == 0:
            continue
        rows = picks // k
        w = experts[e]
        h = rounded(x.index_select(0, rows))
        hidden = glu(kind, linear(h, w.gate.packed, w.gate.scales, w.gate.bias),
                     linear(h, w.up.packed, w.up.scales, w.up.bias), *params)
        y = linear(rounded(hidden), w.down.packed, w.down.scales, w.down.bias)
        out.index_add_(0, rows, y * weights.reshape(-1)[picks, None])
    return out


SCORINGS = ("softmax", "sigmoid", "topk_softmax")  # engine/layers/moe.py RoutingRule.scoring, in route.h's order


def naive_route(logits: torch.Tensor, top_k: int, scoring: str, correction: torch.Tensor | None = None,
                renormalize: bool = False, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k], ids [N, k] int64), engine/layers/moe.py's `route` without group-limited
    top-k: scores by `scoring`; the k largest of scores + correction, largest first, ties to the lower id;
    weights = scores at ids (topk_softmax: the softmax of the chosen logits), renormalised if asked,
    times `scaling`."""
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "topk_softmax":
        scores = logits
    else:
        raise ValueError(f"router scoring {scoring!r} is not one of {', '.join(SCORINGS)}")
    choice = scores if correction is None else scores + correction.to(scores.dtype)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if scoring == "topk_softmax":
        weights = weights.softmax(dim=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
