"""Routed experts with dense (fp32 / bf16) matrices over a chunk's tokens: one call per expert.

`dense_expert(x, rows, weights, gate, up, down, kind, params, out)`: out[rows[n]] += weights[n] *
down(glu(gate x[rows[n]], up x[rows[n]])). CPU tensors the kernel takes (`takes`) with the CPU library
(kernels/_cpu) run `cpu.dense_expert`, each weight row read once for all of the expert's tokens;
otherwise the reference (reference.py).

`DenseExpertTable` holds a MoE layer's resident dense experts for `dense_moe_layer`: every chosen expert of a
chunk (each with at most `max_tokens` tokens) in one kernel call, in increasing id, the same bits as one
`dense_expert` call per expert.
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library
from localmoe.kernels.dense_moe import cpu
from localmoe.kernels.dense_moe.reference import naive_dense_expert


def takes(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the CPU kernel computes this expert on x (else the reference runs)."""
    mats = (gate, up, down)
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and all(m.device.type == "cpu" and m.dtype == gate.dtype and m.is_contiguous() for m in mats)
            and gate.dtype in cpu.DTYPES and library() is not None)


def dense_expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, kind: str, params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """x, out [T, D] fp32; rows [N] int64 (distinct), weights [N] fp32; gate, up [I, D], down [D, I] fp32 or bf16;
    out += the routed expert's weighted output on its rows, in place; returns out."""
    if takes(x, gate, up, down) and out.is_contiguous():
        return cpu.dense_expert(x, rows.contiguous(), weights.float().contiguous(), gate, up, down, kind, params,
                                out)
    return naive_dense_expert(x, rows, weights, gate, up, down, kind, params, out)


class DenseExpertTable:
    """A MoE layer's routed experts with dense matrices, as `dense_moe_layer` reads them: `experts` lists each
    expert's (gate [I, D], up [I, D], down [D, I]), all fp32 or all bf16, contiguous, on the CPU, no biases.
    `addresses` int64 [E, 3] points at them; the table holds the tensors, so the addresses stay valid while it
    lives. `of` gives None where the experts are not all in that form."""

    def __init__(self, experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.experts = experts
        self.dtype = experts[0][0].dtype
        self.intermediate, self.hidden = experts[0][0].shape
        self.addresses = torch.tensor([[m.data_ptr() for m in mats] for mats in experts], dtype=torch.int64)

    @classmethod
    def of(cls, experts: list[tuple[object, object, object]]) -> DenseExpertTable | None:
        """From (gate, up, down) weights per expert; None unless every one is a plain tensor of the kernel's form
        with the first expert's shapes and dtype."""
        if not experts or not all(isinstance(m, torch.Tensor) for mats in experts for m in mats):
            return None
        I, D = experts[0][0].shape
        dtype = experts[0][0].dtype
        ok = all(g.shape == u.shape == (I, D) and d.shape == (D, I) and g.dtype == u.dtype == d.dtype == dtype
                 and all(m.device.type == "cpu" and m.is_contiguous() for m in (g, u, d)) for g, u, d in experts)
        return cls(experts) if ok and dtype in cpu.DTYPES else None


def dense_moe_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table: DenseExpertTable,
                    experts: list[int], kind: str, params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """out [T, D] += for each expert e of `experts` (increasing ids), in that order, the weighted output of expert e
    on the tokens of x [T, D] that chose it (ids [T, k], weights [T, k]); in place, returns out. One kernel call
    where it `takes` the tensors, else one reference expert at a time (the same order)."""
    g, u, d = table.experts[experts[0]] if experts else table.experts[0]
    if takes(x, g, u, d) and out.is_contiguous():
        return cpu.dense_layer(x, ids.contiguous(), weights.float().contiguous(), table.addresses,
                               torch.tensor(experts, dtype=torch.int64), table.dtype, table.intermediate, kind, params,
                               out)
    flat = ids.reshape(-1)
    for e in experts:
        picks = (flat == e).nonzero().squeeze(1)
        naive_dense_expert(x, picks // ids.shape[1], weights.reshape(-1)[picks].float(), *table.experts[e], kind,
                           params, out)
    return out


__all__ = ["DenseExpertTable", "dense_expert", "dense_moe_layer", "naive_dense_expert", "takes"]
