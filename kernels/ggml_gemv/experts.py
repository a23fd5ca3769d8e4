"""A MoE layer's routed experts kept in GGUF blocks, as the fused decode step reads them (ggml_moe_cpu.cpp
`ggml_moe_token`: one token's chosen experts in one call, its input rounded to int8 once for the gate and up rows
of all of them).

`BlockExpertTable.of(experts)` takes each expert's (gate, up, down) as block weights (objects with `.raw` U8
[out, row bytes], `.ggml_type` and `.shape` (out, in): engine/quantized.py BlockQuantized) and gives None unless
every expert is in the kernel's form: CPU, contiguous, one type per projection for the whole layer (a type of
KERNEL_TYPES: a repacked one too), the first expert's shapes, whole blocks. `addresses` int64 [E, 3] points at the
blocks; the table holds them, so the addresses stay valid while it lives.

`ggml_moe_token(x, ids, weights, table, glu, params, out)`: out [W] += the weighted experts of one token x [W]
fp32 (ids / weights in the order to add them); the reference is three `naive_ggml_gemv` per expert, the GLU and
the weighted sum (`naive_ggml_moe_token`, reference.py).
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.ggml_gemv import KERNEL_TYPES
from localmoe.kernels.ggml_gemv.reference import naive_ggml_gemv, row_values

MAX_TOP_K = 64  # experts per token ggml_moe_token takes


def _whole(ggml_type, cols: int) -> bool:
    return cols % row_values(ggml_type) == 0


class BlockExpertTable:
    """See the module doc. `types` (gate, up, down) GGMLQuantizationType; `intermediate`, `hidden` the shapes."""

    def __init__(self, experts: list[tuple]):
        self.experts = experts
        gate = experts[0][0]
        self.types = tuple(m.ggml_type for m in experts[0])
        self.intermediate, self.hidden = gate.shape
        self.addresses = torch.tensor([[m.raw.data_ptr() for m in mats] for mats in experts], dtype=torch.int64)
        self.type_codes = torch.tensor([int(t) for t in self.types], dtype=torch.int64)

    @classmethod
    def of(cls, experts: list[tuple]) -> BlockExpertTable | None:
        """From (gate, up, down) block weights per expert; None unless all are in the kernel's form (module doc)."""
        if not experts or library() is None:
            return None
        if not all(hasattr(m, "raw") and hasattr(m, "ggml_type") for mats in experts for m in mats):
            return None
        types = tuple(m.ggml_type for m in experts[0])
        I, W = experts[0][0].shape
        shapes = ((I, W), (I, W), (W, I))
        ok = all(tuple(m.ggml_type for m in mats) == types and all(tuple(m.shape) == s for m, s in zip(mats, shapes))
                 and all(m.raw.dtype == torch.uint8 and m.raw.device.type == "cpu" and m.raw.is_contiguous()
                         for m in mats) for mats in experts)
        whole = _whole(types[0], W) and _whole(types[1], W) and _whole(types[2], I)
        return cls(experts) if ok and whole and all(t in KERNEL_TYPES for t in types) else None


def naive_ggml_moe_token(x: torch.Tensor, ids: list[int], weights: list[float], table: BlockExpertTable, glu,
                         out: torch.Tensor) -> torch.Tensor:
    """The reference: out [W] += sum_j weights[j] * down(glu(gate x, up x)) of expert ids[j], each projection
    through the ggml GEMV reference (x rounded to int8 per 32 values, per 256 for K-quant rows), added in the order given; `glu(gate, up)`."""
    for e, w in zip(ids, weights):
        gate, up, down = table.experts[e]
        g = naive_ggml_gemv(x.view(1, -1), gate.raw, gate.ggml_type, gate.shape)
        u = naive_ggml_gemv(x.view(1, -1), up.raw, up.ggml_type, up.shape)
        y = naive_ggml_gemv(glu(g, u), down.raw, down.ggml_type, down.shape)
        out += w * y.view(-1)
    return out


def ggml_moe_token(x: torch.Tensor, ids: list[int], weights: list[float], table: BlockExpertTable, kind: int,
                   params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """out [W] += one token's experts ids (in that order) with weights, from their blocks; x [W] fp32 contiguous;
    `kind` the glu.h kind index (kernels/mxfp4_moe GLU_KINDS) with params. The CPU library must be built."""
    lib = library()
    k = len(ids)
    if k > MAX_TOP_K:
        raise ValueError(f"{k} experts per token: ggml_moe_token takes at most {MAX_TOP_K}")
    scratch = torch.empty(lib.ggml_moe_token_scratch(k, table.hidden, table.intermediate), dtype=torch.uint8)
    ids_t, w_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(weights, dtype=torch.float32)
    failed = lib.ggml_moe_token(x.data_ptr(), table.hidden, table.intermediate, ids_t.data_ptr(), w_t.data_ptr(), k,
                                table.addresses.data_ptr(), table.type_codes.data_ptr(), kind, params[0], params[1],
                                out.data_ptr(), scratch.data_ptr(), threads())
    if failed:
        raise ValueError(f"ggml_moe_token refused experts of types {[t.name for t in table.types]}")
    return out


def takes_expert(x: torch.Tensor, out: torch.Tensor, mats: tuple) -> bool:
    """Whether `block_expert` computes this expert (else the caller's per-projection path runs)."""
    return (library() is not None and x.dtype == out.dtype == torch.float32 and x.device.type == out.device.type == "cpu"
            and x.is_contiguous() and out.is_contiguous() and BlockExpertTable.of([mats]) is not None)


def block_expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, mats: tuple, kind: int,
                 params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """out[rows[i]] += weights[i] * down(glu(gate x[rows[i]], up x[rows[i]])) for one expert's blocks `mats`
    (gate, up, down; `takes_expert`) over a chunk's rows (distinct), x / out [T, W]: one kernel call, each
    projection one multi-row int8 GEMV over the gathered rows (ggml_moe_cpu.cpp `ggml_moe_expert`)."""
    lib = library()
    I, W = mats[0].shape
    n = rows.shape[0]
    rows, weights = rows.to(torch.int64).contiguous(), weights.float().contiguous()
    addresses = torch.tensor([m.raw.data_ptr() for m in mats], dtype=torch.int64)
    types = torch.tensor([int(m.ggml_type) for m in mats], dtype=torch.int64)
    scratch = torch.empty(lib.ggml_moe_expert_scratch(n, W, I), dtype=torch.uint8)
    if lib.ggml_moe_expert(x.data_ptr(), W, I, rows.data_ptr(), weights.data_ptr(), n, addresses.data_ptr(),
                           types.data_ptr(), kind, params[0], params[1], out.data_ptr(), scratch.data_ptr(), threads()):
        raise ValueError(f"ggml_moe_expert refused experts of types {[m.ggml_type.name for m in mats]}")
    return out


def takes_layer(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `block_layer` takes this chunk (x / out fp32, CPU, contiguous; the table: BlockExpertTable.of)."""
    return (library() is not None and x.dtype == out.dtype == torch.float32 and x.device.type == out.device.type == "cpu"
            and x.is_contiguous() and out.is_contiguous())


def block_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table: BlockExpertTable, experts: list[int],
                kind: int, params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """out [T, W] += for each expert e of `experts`, in that order, its weighted output on the tokens of x [T, W]
    that chose it (ids / weights [T, k]), from the blocks of `table` (`takes_layer`): one kernel call for the
    chunk (ggml_moe_cpu.cpp `ggml_moe_layer`), the bits of one `block_expert` call per expert in that order."""
    lib = library()
    T, k = ids.shape
    ids, weights = ids.to(torch.int64).contiguous(), weights.float().contiguous()
    chosen = torch.tensor(experts, dtype=torch.int64)
    scratch = torch.empty(lib.ggml_moe_layer_scratch(T, k, table.hidden, table.intermediate), dtype=torch.uint8)
    if lib.ggml_moe_layer(x.data_ptr(), T, table.hidden, table.intermediate, ids.data_ptr(), weights.data_ptr(), k,
                          chosen.data_ptr(), len(experts), table.addresses.data_ptr(), table.type_codes.data_ptr(), kind,
                          params[0], params[1], out.data_ptr(), scratch.data_ptr(), threads()):
        raise ValueError(f"ggml_moe_layer refused experts of types {[t.name for t in table.types]}")
    return out


__all__ = ["MAX_TOP_K", "BlockExpertTable", "block_expert", "block_layer", "ggml_moe_token", "naive_ggml_moe_token",
           "takes_expert", "takes_layer"]
