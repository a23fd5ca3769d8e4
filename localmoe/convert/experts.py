"""Routed experts for `localmoe convert`: which checkpoint tensors hold one expert, and the
parts of its extent. A checkpoint's next-n (MTP) layers (`ModelSpec.nextn_layers`, after the model's) are
MoE layers here too: their experts become extents like any layer's.

Parts, in extent order, for each projection P of gate, up, down:
- MXFP4 (`--experts mxfp4`; always for MXFP4 sources): `P.packed` U8 [out, in/2] and
  `P.scales` U8 [out, in/32] in the canonical layout (docs/mxfp4.md), then `P.bias` for
  gpt-oss (split from its interleaved gate_up bias; a GGUF's ggml blocks are repacked and its
  F32 bias kept).
- kept (`--experts keep`, bf16/f16/fp8 sources): `P.weight` as stored, plus
  `P.weight_scale_inv` for block-scaled FP8.
- GGUF experts of a block type (Q4_K, Q8_0, ...; llama.cpp's stacked `ffn_*_exps`): `P.q4_k`, `P.q8_0`,
  ... U8 [out, row bytes], the file's blocks of that expert unchanged, whatever `--experts` says
  (engine/experts.py computes from them); ggml MXFP4 ones without biases (K3) repacked as `P.packed` /
  `P.scales`; GGUF float experts (F32 / F16 / BF16) follow `--experts`.
MXFP4 sources are repacked (bytes moved, never requantised); other float sources are quantised
with `mxfp4.quantize` and every tensor's error is measured (`quantization_error`).
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localmoe.convert.sources import Source, TensorRef
from localmoe.errors import CheckpointError
from localmoe.quant import mxfp4
from localmoe.quant.fp8 import DEFAULT_BLOCK, dequantize_blocks

EXPERT_MODES = ("mxfp4", "keep")
PROJECTIONS = ("gate", "up", "down")
# |x_hat - x| per element under the default (midpoint) scale rule; amax is the 32-value block's max |x|
ERROR_BOUND = "max(|x| / 5, amax / 14, 2^-129)"


class ExpertSource:
    """The routed experts of `source` (per its family's `experts` declaration), read for `mode`."""

    def __init__(self, source: Source, mode: str) -> None:
        if mode not in EXPERT_MODES:
            raise CheckpointError(f"--experts must be one of {', '.join(EXPERT_MODES)}, not {mode!r}")
        self.source, self.mode = source, mode
        self.decl = source.family.gguf_experts if source.kind == "gguf" else source.family.experts
        self.layers = source.spec.moe_layers() + self._nextn_layers() if self.decl is not None else []
        self.num_experts = source.spec.num_experts
        self.mxfp4_source = self.decl is not None and self.decl.format not in ("bf16", "bf16_fused", "ggml")
        floats = self.decl is None or self.decl.format != "ggml" or any(
            source.tensors[n].dtype.is_floating_point for n in self._all_names())
        self.quantises = bool(self.layers) and not self.mxfp4_source and mode == "mxfp4" and floats
        quant = source.config.get("quantization_config") or {}
        self._fp8_block = tuple(quant.get("weight_block_size") or DEFAULT_BLOCK)
        self.names: set[str] = set()  # every checkpoint tensor read as an expert
        for layer in self.layers:
            for e in range(1 if self.decl.stacked else self.num_experts):
                for names in self._names(layer, e).values():
                    for name in names:
                        ref = source.ref(name, f"routed-expert tensor (layer {layer}, expert {e})")
                        if self.decl.stacked and (not ref.shape or ref.shape[0] != self.num_experts):
                            raise CheckpointError(f"{source.path}: stacked expert tensor {name!r} has shape "
                                                  f"{list(ref.shape)}; config.json says {self.num_experts} experts")
                        self.names.add(name)

    def _nextn_layers(self) -> list[int]:
        """The next-n (MTP) layers after the model's whose routed experts the source holds (`--spec mtp` pages
        them like any layer's; a checkpoint shipped without its MTP tensors has none)."""
        spec = self.source.spec
        if not spec.num_experts:
            return []
        layers = range(spec.num_layers, spec.num_layers + spec.nextn_layers)
        first = next(iter(self.decl.patterns))
        return [layer for layer in layers if all(n in self.source.tensors for n in self.decl.tensor_names(layer, 0, first))]

    def _all_names(self) -> list[str]:
        return [n for layer in self.layers for names in self._names(layer, 0).values() for n in names]

    @property
    def stored_format(self) -> str:
        if not self.layers:
            return "none"
        if self.decl.format == "ggml" and not self.quantises:
            return "ggml-blocks-kept"
        return "mxfp4-repacked" if self.mxfp4_source else ("mxfp4-quantized" if self.quantises else "kept")

    def _names(self, layer: int, e: int) -> dict[str, list[str]]:
        out = {}
        for proj in self.decl.patterns:
            names = self.decl.tensor_names(layer, e, proj)
            if self.decl.format == "bf16" and names[0] + "_scale_inv" in self.source.tensors:
                names.append(names[0] + "_scale_inv")  # block-scaled FP8 (DeepSeek's `weight_scale_inv`)
            out[proj] = names
        return out

    def refs(self, layer: int, e: int) -> dict[str, list[TensorRef]]:
        """The checkpoint tensors of one expert, per declared projection, in read order."""
        out = {}
        for proj, names in self._names(layer, e).items():
            refs = [self.source.tensors[n] for n in names]
            out[proj] = [r.index0(e) for r in refs] if self.decl.stacked else refs
        return out

    def parts(self, layer: int, e: int, tensors: dict[str, list[torch.Tensor]]
              ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(the extent's parts, per-projection quantisation error) from the tensors of `refs`."""
        try:
            errors: dict[str, dict] = {}
            if self.decl.format == "compressed_tensors_mxfp4":
                out = {f"{p}.{k}": t for p in PROJECTIONS for k, t in zip(("packed", "scales"), tensors[p])}
                for p in PROJECTIONS:
                    _check_mxfp4(p, out[f"{p}.packed"], out[f"{p}.scales"])
            elif self.decl.format == "gpt_oss_mxfp4":
                out = self._gpt_oss(tensors)
            elif self.decl.format == "ggml_mxfp4":
                out = self._ggml(tensors)
            elif self.decl.format == "ggml":
                out, errors = self._ggml_blocks(layer, tensors)
            elif self.decl.format == "bf16_fused":
                out, errors = self._dense_experts(self._unfused(tensors))
            else:
                out, errors = self._dense_experts(tensors)
            _check_shapes(out)
            return out, errors
        except CheckpointError as err:
            names = [r.name for rs in self.refs(layer, e).values() for r in rs]
            hint = "; try --experts keep" if self.quantises else ""
            raise CheckpointError(f"{self.source.path}: layer {layer} expert {e} ({', '.join(names)}): "
                                  f"{err}{hint}") from None

    def _gpt_oss(self, tensors: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for proj, (blocks, scales, bias) in tensors.items():
            packed, scales = mxfp4.gpt_oss_to_canonical(blocks, scales)
            if proj == "gate_up":  # rows interleave gate (even) and up (odd); so does the bias
                (gp, gs), (up, us) = mxfp4.split_gate_up_interleaved(packed, scales)
                out |= {"gate.packed": gp, "gate.scales": gs, "gate.bias": bias[0::2].contiguous(),
                        "up.packed": up, "up.scales": us, "up.bias": bias[1::2].contiguous()}
            else:
                out |= {f"{proj}.packed": packed, f"{proj}.scales": scales, f"{proj}.bias": bias}
        return out

    def _ggml(self, tensors: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """llama.cpp's gpt-oss experts: ggml block_mxfp4 rows [out, in/32 * 17] + F32 bias, per projection."""
        out = {}
        for proj, (raw, bias) in tensors.items():
            if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % mxfp4.GGML_BLOCK_BYTES:
                raise CheckpointError(f"{proj} is {raw.dtype} {list(raw.shape)}, not ggml MXFP4 rows")
            packed, scales = mxfp4.ggml_to_canonical(raw.reshape(raw.shape[0], -1, mxfp4.GGML_BLOCK_BYTES))
            out |= {f"{proj}.packed": packed, f"{proj}.scales": scales, f"{proj}.bias": bias.float()}
        return out

    def _ggml_blocks(self, layer: int, tensors: dict[str, list[torch.Tensor]]
                     ) -> tuple[dict[str, torch.Tensor], dict]:
        """A GGUF's stacked experts of any ggml type: blocks kept as `P.<type>`, floats as `_dense_experts`."""
        out, floats = {}, {}
        for proj, names in self._names(layer, 0).items():
            (t,) = tensors[proj]
            if t.is_floating_point():
                floats[proj] = tensors[proj]
                continue
            qtype = self.source.ggml_types[names[0]]
            if t.dim() != 2 or t.shape[1] % GGML_QUANT_SIZES[qtype][1]:
                raise CheckpointError(f"{proj} is {t.dtype} {list(t.shape)}, not rows of {qtype.name} blocks")
            if qtype == GGMLQuantizationType.MXFP4:  # K3: repacked to the canonical MXFP4 (bytes moved)
                out[f"{proj}.packed"], out[f"{proj}.scales"] = mxfp4.ggml_to_canonical(
                    t.reshape(t.shape[0], -1, mxfp4.GGML_BLOCK_BYTES))
                continue
            out[f"{proj}.{qtype.name.lower()}"] = t
        dense, errors = self._dense_experts(floats, tuple(floats))
        return out | dense, errors

    def _unfused(self, tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """One expert's fused gate_up and down (either layout, see ExpertTensors) as gate, up [I, D] and down [D, I]."""
        D, I = self.source.spec.hidden_size, self.source.spec.moe_intermediate_size
        gate_up, down = tensors["gate_up"][0], tensors["down"][0]
        gate_up = gate_up if tuple(gate_up.shape) == (2 * I, D) else gate_up.T  # transformers' layout, or released
        down = down if tuple(down.shape) == (D, I) else down.T
        if tuple(gate_up.shape) != (2 * I, D) or tuple(down.shape) != (D, I):
            raise CheckpointError(f"gate_up_proj / down_proj of one expert are {list(tensors['gate_up'][0].shape)} / "
                                  f"{list(tensors['down'][0].shape)}; expected [{D}, {2 * I}] / [{I}, {D}] or transposed")
        return {"gate": [gate_up[:I].contiguous()], "up": [gate_up[I:].contiguous()], "down": [down.contiguous()]}

    def _dense_experts(self, tensors: dict[str, list[torch.Tensor]], projections: tuple[str, ...] = PROJECTIONS
                       ) -> tuple[dict[str, torch.Tensor], dict]:
        out, errors = {}, {}
        for proj in projections:
            w, *scale_inv = tensors[proj]
            if w.dim() != 2 or not (w.is_floating_point()):
                raise CheckpointError(f"{proj} is {w.dtype} {list(w.shape)}, not a float matrix")
            if self.mode == "keep":
                out[f"{proj}.weight"] = w
                if scale_inv:
                    out[f"{proj}.weight_scale_inv"] = scale_inv[0]
                continue
            x = dequantize_blocks(w, scale_inv[0], self._fp8_block) if scale_inv else w
            packed, scales = mxfp4.quantize(x)
            out |= {f"{proj}.packed": packed, f"{proj}.scales": scales}
            errors[proj] = {**mxfp4.quantization_error(x, packed, scales), "numel": x.numel()}
        return out, errors


def _check_mxfp4(proj: str, packed: torch.Tensor, scales: torch.Tensor) -> None:
    if (packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2
            or packed.shape[0] != scales.shape[0] or packed.shape[1] != 16 * scales.shape[1]):
        raise CheckpointError(f"{proj} is not MXFP4: codes {packed.dtype} {list(packed.shape)} with scales "
                              f"{scales.dtype} {list(scales.shape)} (expected uint8 [out, in/2] and [out, in/32])")


def _logical(parts: dict[str, torch.Tensor], proj: str) -> tuple[int, int] | None:
    if f"{proj}.packed" in parts:
        r, half = parts[f"{proj}.packed"].shape
        return r, 2 * half
    from gguf import GGMLQuantizationType

    for name, t in parts.items():
        if name.startswith(f"{proj}.") and name[len(proj) + 1:].upper() in GGMLQuantizationType.__members__:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name[len(proj) + 1:].upper()]]
            return t.shape[0], t.shape[1] // type_size * block_size
    w = parts.get(f"{proj}.weight")
    return None if w is None else tuple(w.shape)


def _check_shapes(parts: dict[str, torch.Tensor]) -> None:
    """gate and up are [I, D]; down is [D, I]."""
    gate, up, down = (_logical(parts, p) for p in PROJECTIONS)
    if gate != up or down != (gate[1], gate[0]):
        raise CheckpointError(f"projection shapes gate {list(gate)}, up {list(up)}, down {list(down)} do not "
                              f"fit an expert (gate and up [I, D], down [D, I])")


# ---- quantisation error records: one per layer, JSON-ready ----

def new_record(layer: int) -> dict:
    return {"layer": layer, "experts": [], "tensors": {}}


def add_to_record(record: dict, expert: int, errors: dict[str, dict]) -> None:
    record["experts"].append(expert)
    for proj, err in errors.items():
        t = record["tensors"].setdefault(proj, {"numel": err["numel"], "rmse": [], "max_abs": [],
                                                "relative_rmse": []})
        for key in ("rmse", "max_abs", "relative_rmse"):
            t[key].append(err[key])


def summarize(records: list[dict]) -> dict:
    """Pooled RMSE (over all elements), mean and max relative RMSE, max |error|, worst tensor."""
    sq = n = 0.0
    rel: list[float] = []
    max_abs, worst = 0.0, None
    for rec in records:
        for proj, t in rec["tensors"].items():
            for i, (rmse, rrel, mabs) in enumerate(zip(t["rmse"], t["relative_rmse"], t["max_abs"])):
                sq, n = sq + rmse * rmse * t["numel"], n + t["numel"]
                rel.append(rrel)
                max_abs = max(max_abs, mabs)
                if worst is None or rrel > worst["relative_rmse"]:
                    worst = {"layer": rec["layer"], "expert": rec["experts"][i], "projection": proj,
                             "relative_rmse": rrel}
    return {"num_tensors": len(rel), "rmse": math.sqrt(sq / n) if n else 0.0,
            "mean_relative_rmse": sum(rel) / len(rel) if rel else 0.0,
            "max_relative_rmse": max(rel, default=0.0), "max_abs": max_abs, "worst": worst}


def describe(summary: dict) -> str:
    return (f"relative RMSE mean {summary['mean_relative_rmse']:.4f} (max {summary['max_relative_rmse']:.4f}), "
            f"RMSE {summary['rmse']:.3g}, max |error| {summary['max_abs']:.3g}")
