"""Routed experts, addressed by (layer, expert id): the `ExpertProvider` protocol.

The MoE block never owns expert weights. It asks a provider for one expert at a time,
`provider.get(layer, expert) -> ExpertWeights`, and computes it with `expert_forward`,
which dequantises that ONE expert on the fly (MXFP4 stays bytes between calls; there is
never a whole-model float copy). Where an expert lives (RAM, a disk extent, a GPU slot)
is the provider's business: `ResidentExperts` holds the loader's canonical tensors in
memory; the pager adds providers behind the same interface and is swapped in after the
model is built (`Transformer.use_experts`).

`ExpertWeights.from_parts` takes the packed store's extent parts unchanged
(`{gate,up,down}.{packed,scales,bias}`, `{gate,up,down}.weight`, or a GGUF's blocks as
`{gate,up,down}.{q4_k,q6_k,...}`: see convert/experts.py), so a paging provider can return what
`PackedStore.expert` gives.

GGML-block experts (a GGUF's Q4_K, Q8_0, ...: `Projection.weight` a `BlockQuantized`) are computed
from their blocks: at expert precision "q8" a call of up to GEMV_MAX_TOKENS rows runs
`kernels/ggml_gemv` (x rounded to int8 per 32 values, llama.cpp's trade) where the type has a
GEMV; otherwise (and at "exact") the one expert is dequantised for the call, bit-exact against
gguf's numpy dequantisers, and multiplied in fp32.

Dense fp32 / bf16 experts of a few tokens (a prefill chunk's share) run `kernels/dense_moe` through
`expert_accumulate`: one call per expert, each weight row read once for all of its tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localmoe.engine.linear import stored_dtype
from localmoe.engine.quantized import BlockQuantized
from localmoe.errors import CheckpointError
from localmoe.kernels import dense_moe, ggml_gemv
from localmoe.kernels._cpu.pages import huge_copy
from localmoe.kernels.dense_moe import DenseExpertTable
from localmoe.kernels.ggml_gemv import experts as ggml_experts
from localmoe.kernels.ggml_gemv.experts import BlockExpertTable
from localmoe.kernels.mxfp4_moe import (
    EXACT_TOKEN_ROWS,
    EXPERT_GEMV_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    GLU_KINDS,
    ExpertTable,
    mxfp4_linear,
)
from localmoe.quant.ggml import FLOAT_TYPES, SUPPORTED_TYPES
from localmoe.quant.mxfp4 import dequantize

PROJECTIONS = ("gate", "up", "down")
# extent part suffix -> ggml block type of a GGUF's expert kept in its blocks (`gate.q4_k`, ...)
BLOCK_PARTS = {t.name.lower(): t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES}


def block_part(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> BlockQuantized:
    """An extent part of ggml blocks U8 [out, row bytes] as the BlockQuantized weight [out, in]."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % type_size:
        raise CheckpointError(f"a {ggml_type.name} expert part is {raw.dtype} {list(raw.shape)}, not rows of "
                              f"{type_size}-byte blocks")
    return BlockQuantized(raw, ggml_type, (raw.shape[0], raw.shape[1] // type_size * block_size))


@dataclass(frozen=True, slots=True)
class Projection:
    """One matrix of one expert, y = x W^T (+ b): MXFP4 `packed` U8 [out, in/2] + `scales`
    U8 [out, in/32] (canonical layout, quant/mxfp4.py), or a `weight` [out, in]: a float tensor or
    a GGUF's blocks (`BlockQuantized`)."""

    packed: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [out]

    def __post_init__(self) -> None:
        if (self.weight is None) == (self.packed is None or self.scales is None):
            raise CheckpointError("an expert projection needs either MXFP4 packed+scales or a weight")

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] as `dtype`, dequantised now if MXFP4 or GGML blocks (a per-call temporary)."""
        if isinstance(self.weight, BlockQuantized):
            return self.weight.float().to(dtype)
        if self.weight is not None:
            return self.weight.to(dtype)
        return dequantize(self.packed, self.scales, dtype)

    def __call__(self, x: torch.Tensor, precision: str = "exact") -> torch.Tensor:
        """x [N, in] fp32 -> [N, out] fp32; MXFP4 goes straight from its bytes (kernels/mxfp4_moe), GGML
        blocks through kernels/ggml_gemv at "q8" (module doc)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        w = self.weight
        if w is None:
            return mxfp4_linear(x, self.packed, self.scales, self.bias)
        if isinstance(w, BlockQuantized):
            if precision == "q8" and x.shape[0] <= GEMV_MAX_TOKENS and w.ggml_type in ggml_gemv.KERNEL_TYPES:
                return ggml_gemv.ggml_gemv(x.float().contiguous(), w.raw.contiguous(), w.ggml_type, w.shape, bias)
            return F.linear(x, w.float().to(device=x.device, dtype=x.dtype), bias)
        return F.linear(x, w.to(x.dtype), bias)

    def nbytes(self) -> int:
        weight = self.weight.raw if isinstance(self.weight, BlockQuantized) else self.weight
        return sum(t.nbytes for t in (self.packed, self.scales, weight, self.bias) if t is not None)

    @property
    def device(self) -> torch.device:
        if isinstance(self.weight, BlockQuantized):
            return self.weight.raw.device
        return (self.weight if self.weight is not None else self.packed).device


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One routed expert: down( act(gate x, up x) )."""

    gate: Projection
    up: Projection
    down: Projection

    @classmethod
    def from_parts(cls, parts: Mapping[str, torch.Tensor]) -> ExpertWeights:
        """From `{proj}.{packed,scales,weight,bias}` tensors (the packed store's extent parts), a GGUF's
        blocks as `{proj}.{q4_k,...}` (BLOCK_PARTS)."""
        try:
            projections = []
            for p in PROJECTIONS:
                fields = {k: parts.get(f"{p}.{k}") for k in ("packed", "scales", "weight", "bias")}
                for suffix, ggml_type in BLOCK_PARTS.items():
                    if f"{p}.{suffix}" in parts:
                        fields["weight"] = block_part(parts[f"{p}.{suffix}"], ggml_type)
                projections.append(Projection(**fields))
            return cls(*projections)
        except CheckpointError as e:
            raise CheckpointError(f"expert parts {sorted(parts)}: {e}") from None

    def nbytes(self) -> int:
        return self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()

    @property
    def device(self) -> torch.device:
        """Where the expert's tensors are, and so where it is computed (host RAM or a GPU slot)."""
        return self.gate.device


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) [N, I] -> [N, I]


def expert_forward(w: ExpertWeights, x: torch.Tensor, act: Activation, precision: str = "exact") -> torch.Tensor:
    """x [N, in] fp32 -> [N, out] fp32 through one expert; MXFP4 matrices are used from their bytes
    by the `mxfp4_linear` dispatcher (CPU kernel, Triton on GPU, or the dequantising reference), GGML
    blocks as `Projection` says for `precision`."""
    return w.down(act(w.gate(x, precision), w.up(x, precision)), precision)


# kernels/dense_moe against torch's sgemm on the widened bf16 expert (one thread, 32 experts of 384 x 768 on 2 MiB
# pages, AVX-512 build, session 13): 1.48x at 48 tokens, 1.23x at 64, 1.10-1.16x at 96-256; a prefill chunk
# (engine/generate.py PREFILL_CHUNK) gives an expert at most 512 tokens
DENSE_MAX_TOKENS = 512


def expert_accumulate(w: ExpertWeights, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, act: Activation,
                      out: torch.Tensor, precision: str = "exact", glu: tuple[str, tuple[float, float]] | None = None
                      ) -> None:
    """out[rows] += weights[:, None] * expert(x[rows]): x, out [T, D] fp32, rows [N] int64 (distinct), weights [N].
    Dense fp32 / bf16 experts without biases whose activation the kernels compute (`glu`: kind, params) run
    `kernels/dense_moe` for up to DENSE_MAX_TOKENS rows: one call, each weight row read once for all the
    expert's tokens; GGUF-block ones at precision q8 `kernels/ggml_gemv` `block_expert` for up to GEMV_MAX_TOKENS
    rows (one call: the projections' multi-row int8 GEMVs and the GLU); others `expert_forward` on the gathered rows."""
    gate, up, down = w.gate.weight, w.up.weight, w.down.weight
    if (glu is not None and precision == "q8" and 0 < rows.shape[0] <= GEMV_MAX_TOKENS
            and isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized) and isinstance(down, BlockQuantized)
            and w.gate.bias is None and w.up.bias is None and w.down.bias is None
            and ggml_experts.takes_expert(x, out, (gate, up, down))):
        ggml_experts.block_expert(x, rows, weights, (gate, up, down), GLU_KINDS.index(glu[0]), glu[1], out)
        return
    if (glu is not None and 0 < rows.shape[0] <= DENSE_MAX_TOKENS and isinstance(gate, torch.Tensor)
            and isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and out.is_contiguous()
            and w.gate.bias is None and w.up.bias is None and w.down.bias is None
            and dense_moe.takes(x, gate, up, down)):
        dense_moe.dense_expert(x, rows, weights, gate, up, down, glu[0], glu[1], out)
        return
    y = expert_forward(w, x.index_select(0, rows), act, precision)
    out.index_add_(0, rows, y * weights[:, None])


def independent_rows(w: ExpertWeights, precision: str) -> int:
    """The most tokens of one call to which an expert of `w`'s form gives each token the bits it has alone
    (engine/batch.py: prompt chunks as rows of a batched step): MXFP4 through kernels/mxfp4_moe (at "q8" every
    group up to EXPERT_GEMV_MAX_TOKENS, at "exact" up to EXACT_TOKEN_ROWS: the integer path per token), dense
    experts without biases through kernels/dense_moe (DENSE_MAX_TOKENS; torch's GEMM above), GGUF blocks at "q8"
    through the multi-row block GEMVs (GEMV_MAX_TOKENS); 0 where a call of several tokens takes a GEMM."""
    parts = (w.gate, w.up, w.down)
    if all(p.weight is None for p in parts):
        return EXPERT_GEMV_MAX_TOKENS if precision == "q8" else EXACT_TOKEN_ROWS
    if any(p.bias is not None for p in parts):
        return 0
    if all(isinstance(p.weight, torch.Tensor) and p.weight.is_floating_point() for p in parts):
        return DENSE_MAX_TOKENS
    if precision == "q8" and all(isinstance(p.weight, BlockQuantized) and p.weight.ggml_type in ggml_gemv.KERNEL_TYPES
                                 for p in parts):
        return GEMV_MAX_TOKENS
    return 0


class ExpertProvider(Protocol):
    """Where routed experts come from. `get` may block (a pager reading from disk) and the
    returned weights are only valid until the next `get` on the same provider."""

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """Expert `expert` of layer `layer` (0-based layer index of the whole model)."""

    def nbytes(self) -> int:
        """Bytes of expert weights this provider holds in memory now."""

    # Optional: `kernel_table(layer) -> ExpertTable | None`, every expert of the layer valid at once in
    # the MoE kernel's form (kernels/mxfp4_moe), so a layer runs in one kernel call (resident providers);
    # a provider with it also has `dense_table(layer) -> DenseExpertTable | None`, the same for dense experts
    # (kernels/dense_moe), and `block_table(layer) -> BlockExpertTable | None` for GGUF-block experts
    # (kernels/ggml_gemv/experts.py, the fused decode step's).
    # Optional: `placed(layer, expert, tokens) -> (ExpertWeights, tier)` in place of `get`: the weights
    # in the tier to compute the expert in for `tokens` tokens, "ram" (the CPU) or a GPU tier "gpuN"
    # (a pager with GPU tiers; the weights are then on that GPU).
    # Optional: `waits = True`: `get` may wait for reads from disk (a step's cost is then wall time, not CPU).
    # Optional: `form(layer) -> ExpertWeights`: an expert of the layer's form (its tensors' kinds, dtypes and
    # shapes; the values need not be any expert's), read without waiting (`independent_rows`).


def _streamed(t, dtype: torch.dtype | None = None):
    """A resident expert's floating weight on huge pages (kernels/_cpu/pages.py: a decode token streams it from
    RAM), matrices as `dtype` where given; MXFP4 bytes, GGUF blocks and other parts as they are."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
        return t
    return huge_copy(t if dtype is None or t.dim() < 2 else t.to(dtype).contiguous())


def _matrix_dtype(weights: Mapping[str, torch.Tensor], names: list[str], dtype: str | None) -> torch.dtype | None:
    """The dtype a layer's dense expert matrices (`names` in `weights`) are stored in for engine dtype `dtype`: as
    `Linear` stores its weights (linear.stored_dtype: bf16 for "bfloat16", and for "float32" where every one holds
    exactly bf16 values), one dtype for the layer (the kernels take one); None (as given) off the CPU, or without
    `dtype`."""
    if dtype is None:
        return None
    mats = [t for t in (weights[n] for n in names if n.endswith("weight"))
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2]
    if not mats or any(t.device.type != "cpu" for t in mats):
        return None
    return stored_dtype(mats, dtype)


class ResidentExperts:
    """Every expert in memory, as loaded: MXFP4 kept as bytes, dequantised per call."""

    def __init__(self, experts: dict[int, list[ExpertWeights]]):
        self.experts = experts  # layer -> experts by id
        self._tables: dict[int, ExpertTable | None] = {}
        self._dense: dict[int, DenseExpertTable | None] = {}
        self._blocks: dict[int, BlockExpertTable | None] = {}

    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor], prefix: str, layer: int,
                     num_experts: int, dtype: str | None = None) -> ResidentExperts:
        """One layer's experts from canonical names under `{prefix}mlp.experts.`, either stacked
        (dim 0 = expert): `gate_up_proj.{packed,scales,weight,bias}` with gate rows first, then
        up rows, and `down_proj.*`; or per expert: `{e}.{gate,up,down}.{packed,scales,weight,bias}`.
        `dtype` (the engine's): dense matrices stored as `Linear` stores its weights (`_matrix_dtype`), so a decode
        token reads a bf16 checkpoint's bytes, not their fp32 widening; None keeps them as given."""
        p = prefix + "mlp.experts."
        kinds = ("packed", "scales", "weight", "bias")
        target = _matrix_dtype(weights, [n for n in weights if n.startswith(p)], dtype)
        if any(p + f"gate_up_proj.{k}" in weights for k in kinds):
            gate_up = {k: _streamed(weights[p + f"gate_up_proj.{k}"], target) for k in kinds
                       if p + f"gate_up_proj.{k}" in weights}
            down = {k: _streamed(weights[p + f"down_proj.{k}"], target) for k in kinds
                    if p + f"down_proj.{k}" in weights}
            rows = next(iter(gate_up.values())).shape[1] // 2
            experts = []
            for e in range(num_experts):
                parts = {f"gate.{k}": t[e, :rows] for k, t in gate_up.items()}
                parts |= {f"up.{k}": t[e, rows:] for k, t in gate_up.items()}
                parts |= {f"down.{k}": t[e] for k, t in down.items()}
                experts.append(ExpertWeights.from_parts(parts))
        else:
            experts = [ExpertWeights.from_parts({name[len(f"{p}{e}."):]: _streamed(weights[name], target)
                                                 for name in weights if name.startswith(f"{p}{e}.")})
                       for e in range(num_experts)]
        return cls({layer: experts})

    def merge(self, other: ResidentExperts) -> ResidentExperts:
        self.experts |= other.experts
        for layer in other.experts:
            self._tables.pop(layer, None)
            self._dense.pop(layer, None)
            self._blocks.pop(layer, None)
        return self

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.experts[layer][expert]

    def form(self, layer: int) -> ExpertWeights:
        return self.experts[layer][0]

    def kernel_table(self, layer: int) -> ExpertTable | None:
        """The layer's experts for the MoE kernel, or None where they are not all MXFP4 (built once)."""
        if layer not in self._tables:
            experts = self.experts[layer]
            usable = all(ExpertTable.holds(w) for w in experts)
            self._tables[layer] = ExpertTable(dict(enumerate(experts)), len(experts)) if usable else None
        return self._tables[layer]

    def dense_table(self, layer: int) -> DenseExpertTable | None:
        """The layer's experts for `dense_moe_layer`, or None where they are not all dense fp32 / bf16 matrices
        without biases (built once)."""
        if layer not in self._dense:
            experts = self.experts[layer]
            plain = all(p.bias is None and p.packed is None for w in experts for p in (w.gate, w.up, w.down))
            self._dense[layer] = DenseExpertTable.of([(w.gate.weight, w.up.weight, w.down.weight)
                                                      for w in experts]) if plain else None
        return self._dense[layer]

    def block_table(self, layer: int) -> BlockExpertTable | None:
        """The layer's experts for the fused decode step's `ggml_moe_token`, or None where they are not all GGUF
        blocks of one kernel type per projection without biases (built once)."""
        if layer not in self._blocks:
            experts = self.experts[layer]
            plain = all(p.bias is None and isinstance(p.weight, BlockQuantized) for w in experts
                        for p in (w.gate, w.up, w.down))
            self._blocks[layer] = BlockExpertTable.of([(w.gate.weight, w.up.weight, w.down.weight)
                                                       for w in experts]) if plain else None
        return self._blocks[layer]

    def nbytes(self) -> int:
        # stacked checkpoints give each expert disjoint views of one tensor: the sum is exact
        return sum(w.nbytes() for layer in self.experts.values() for w in layer)
