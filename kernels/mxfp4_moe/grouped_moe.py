"""A MoE layer's routed MXFP4 experts on the GPU in three grouped Triton calls (gate, up, down) instead of
three per expert: every (token, choice) pair is one row, routed to its expert's row of a stack of the
experts' matrices (`stack_parts`: a strided view where they lie at regular offsets of one allocation, as
a GPU slab's slots and a stacked checkpoint's experts do), with the tile tables built on the device
(triton_tiles). No shape depends on the routing (a pair whose expert is not in the table is computed by
the stack's first expert and weighted 0), so nothing waits for the host: capturable in a CUDA graph.
Contract: reference.naive_mxfp4_moe's (out += the weighted experts; "q8" rounds each projection's input).
"""

from __future__ import annotations

import math

import torch
from localmoe.kernels.mxfp4_moe.reference import glu, q8_round

PROJECTIONS = ("gate", "up", "down")


def stack_parts(parts: list[torch.Tensor], rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Tensors of one shape and dtype as one [S, ...] tensor and each one's row in it: a strided view (no copy)
    where they share an allocation at offsets a multiple of one step apart (and fall on `rows` where given),
    else a copy with part i at row rows[i] (default i)."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(p.shape == first.shape and p.dtype == first.dtype and p.is_contiguous()
                                     and p.untyped_storage().data_ptr() == base for p in parts):
        offsets = [p.storage_offset() for p in parts]
        low = min(offsets)
        step = math.gcd(*(o - low for o in offsets)) or first.numel()
        found = [(o - low) // step for o in offsets]
        if rows is None or found == rows:
            return torch.as_strided(first, (max(found) + 1, *first.shape), (step, *first.stride()), low), found
    rows = list(range(len(parts))) if rows is None else rows
    out = first.new_zeros(max(rows) + 1, *first.shape)
    for row, part in zip(rows, parts):
        out[row] = part
    return out, rows


class GroupedExperts:
    """Some experts of one layer as stacks: per projection (packed [S, O, K/2], scales [S, O, K/32], bias [S, O]
    or None) and `rows` int64 [3, num_experts] on their device: expert e's row in each projection's stack,
    -1 where the table lacks e. Built once per table (an H2D copy of `rows`)."""

    def __init__(self, experts: dict, num_experts: int):
        ids = sorted(experts)
        self.stacks, rows = [], []
        for name in PROJECTIONS:
            projections = [getattr(experts[e], name) for e in ids]
            packed, found = stack_parts([p.packed for p in projections])
            scales, _ = stack_parts([p.scales for p in projections], found)
            bias = None
            if any(p.bias is not None for p in projections):
                biases = [p.bias if p.bias is not None else p.packed.new_zeros(p.packed.shape[0]) for p in projections]
                bias, _ = stack_parts([b.float() for b in biases], found)
            self.stacks.append((packed, scales, bias))
            row = [-1] * num_experts
            for e, r in zip(ids, found):
                row[e] = r
            rows.append(row)
        self.rows = torch.tensor(rows, dtype=torch.int64).to(self.stacks[0][0].device)


def grouped_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts, kind: str,
                params: tuple[float, float], out: torch.Tensor, only: int | None = None,
                precision: str = "exact") -> torch.Tensor:
    """out [N, D] += sum_j weights[:, j] * expert_{ids[:, j]}(x) over the experts of `experts` (or just
    `only`); x [N, D], ids [N, k] int64, weights [N, k], all on the experts' device. Returns out."""
    from localmoe.kernels.mxfp4_moe.triton import mxfp4_grouped

    N, k = ids.shape
    flat = ids.reshape(-1)  # row m: token m // k, its choice m % k
    rows = experts.rows.index_select(1, flat)  # [3, N*k]
    keep = rows[0] >= 0 if only is None else flat == only
    rounded = q8_round if precision == "q8" else (lambda t: t)
    h = rounded(x[:, None].expand(N, k, x.shape[1]).reshape(N * k, x.shape[1]))
    (gp, gs, gb), (up, us, ub), (dp, ds, db) = experts.stacks
    rows = rows.clamp(min=0)
    hidden = glu(kind, mxfp4_grouped(h, gp, gs, rows[0], gb), mxfp4_grouped(h, up, us, rows[1], ub), *params)
    y = mxfp4_grouped(rounded(hidden), dp, ds, rows[2], db)
    y = torch.where(keep[:, None], y * weights.reshape(-1, 1).to(y.dtype), 0.0)  # pairs of other experts: 0
    return out.add_(y.view(N, k, -1).sum(1).to(out.dtype))
