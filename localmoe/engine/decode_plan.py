"""Single-sequence decode as one kernel call per token for the whole layer stack (kernels/decode_layers).

`DecodePlan.build(model)` returns a plan where every layer qualifies, in one of two forms:
- GQA + routed MXFP4 MoE (gpt-oss): a GQA layer with the fused decode step (GQAttention.fused_step),
  then a MoE block whose routing and resident MXFP4 experts go into one kernel call
  (MoEBlock.routed_table), without latent projection or shared expert. The decoder calls the same
  kernel entry points in the same order as the op-by-op step: the same bits.
- GQA + dense SiLU-gated MLP (Llama, SmolLM2, Qwen2, Qwen3): attention without an output gate,
  every matrix fp32, bf16 or GGUF blocks of a kernels/ggml_gemv type (Linear, BlockLinear; parts of
  different block types as a stacked Matrix).
Plain residuals only (no attention residuals or hyper-connections). The plan checks on every call
that the layers still hold what it was built from (paging hooks wrap routers, a pager replaces the
experts) and that the cache can be written in place; where not, the caller runs the layers op by op.
"""

from __future__ import annotations

import torch

from localmoe.engine.layers.attention import GQAttention
from localmoe.engine.layers.mlp import GatedMLP
from localmoe.engine.layers.moe import MoEBlock, Router
from localmoe.engine.linear import Linear
from localmoe.engine.quantized import BlockLinear
from localmoe.kernels import decode_layers
from localmoe.kernels.gqa_decode import StepKernel
from localmoe.kernels.mxfp4_moe import GLU_KINDS, SCORINGS


def _fp32_vectors(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
               for t in tensors)


def _matrix(linear) -> tuple | None:
    """(data, type, rows, cols, bias) of a decode_layers Matrix for a Linear or BlockLinear, or None."""
    if type(linear) is Linear and linear.weight.dtype in decode_layers.MATRIX_TYPES and linear.weight.is_contiguous():
        w = linear.weight
        return w, decode_layers.MATRIX_TYPES[w.dtype], w.shape[0], w.shape[1], linear.bias
    ggml = decode_layers.GGML_MATRIX_TYPES
    if type(linear) is not BlockLinear or not linear.segments or any(int(k) not in ggml for _, k, _ in linear.segments):
        return None
    if linear.raw is not None:
        return linear.raw, int(linear.ggml_type), linear.out_features, linear.in_features, linear.bias
    # parts of different types: a stacked Matrix over one descriptor per segment (its slice of the bias)
    descriptors = torch.zeros(len(linear.segments) + 1, 5, dtype=torch.int64)  # matrix.h Matrix fields; 0 ends
    row = 0
    for i, (raw, kind, rows) in enumerate(linear.segments):
        bias = 0 if linear.bias is None else linear.bias[row:row + rows].data_ptr()
        descriptors[i] = torch.tensor([raw.data_ptr(), int(kind), rows, linear.in_features, bias])
        row += rows
    return descriptors, decode_layers.STACKED, linear.out_features, linear.in_features, None


class DecodePlan:
    def __init__(self, model, decoder, parts: list[tuple]):
        self.model, self.decoder = model, decoder
        self.parts = parts  # (owner, attribute, the object it held at build time) for `current`

    @classmethod
    def build(cls, model) -> DecodePlan | None:
        """The plan, or None. The Transformer tries again at every decode step while there is none, so
        each form stops at the first layer that does not qualify (a few microseconds)."""
        if (model.residuals is not None or not decode_layers.available() or not model.layers
                or not _fp32_vectors(model.norm)):
            return None
        if isinstance(model.layers[0][3], MoEBlock):
            return cls._moe(model)
        return cls._dense(model)

    @classmethod
    def _moe(cls, model) -> DecodePlan | None:
        layers, parts = [], []
        for attn_norm, mixer, mlp_norm, block in model.layers:
            if not (isinstance(mixer, GQAttention) and isinstance(mixer.fused_step, StepKernel)
                    and isinstance(block, MoEBlock) and _fp32_vectors(attn_norm, mlp_norm)):
                return None
            table = block.routed_table(1)
            if table is None or block.latent is not None or block.shared is not None:
                return None
            step, router = mixer.fused_step, block.router
            layers.append({
                "attn_norm": attn_norm, "wqkv": step.wqkv, "bqkv": step.bqkv, "wo": step.wo, "bo": step.bo,
                "sinks": step.sinks, "heads": step.heads, "kv_heads": step.kv_heads, "head_dim": step.head_dim,
                "rot": step.rot, "window": mixer.window, "scale": step.scale, "mlp_norm": mlp_norm,
                "router_w": router.linear.weight, "router_b": router.linear.bias, "correction": router.correction_bias,
                "table": table.addresses, "scoring": SCORINGS.index(router.rule.scoring),
                "renormalize": router.rule.renormalize, "scaling": router.rule.scaling,
                "intermediate": table.intermediate, "top_k": router.rule.top_k, "glu": GLU_KINDS.index(block.act.kind),
                "p0": block.act.p0, "p1": block.act.p1, "keep": table})
            parts += [(mixer, "fused_step", step), (block, "router", router), (block, "experts", block.experts)]
        decoder = decode_layers.GqaMoeDecoder(layers, model.spec.hidden_size, model.norm, model.eps,
                                              model.config.expert_precision == "q8")
        return cls(model, decoder, parts)

    @classmethod
    def _dense(cls, model) -> DecodePlan | None:
        spec = model.spec
        if spec.hidden_act != "silu" or spec.glu_limit:
            return None
        layers, parts = [], []
        for attn_norm, mixer, mlp_norm, mlp in model.layers:
            if not (type(mixer) is GQAttention and type(mlp) is GatedMLP and _fp32_vectors(attn_norm, mlp_norm)):
                return None
            norms = [None if n is None else n.float().contiguous() for n in (mixer.q_norm, mixer.k_norm)]
            if not ((norms[0] is None) == (norms[1] is None) and mixer.gate is None and mixer.head_dim % 8 == 0
                    and mixer.head_dim <= 512 and mixer.rotary_dim % 2 == 0 and 0 < mixer.rotary_dim <= mixer.head_dim
                    and _fp32_vectors(mixer.head_sinks) and mixer.eps == model.eps):
                return None
            matrices = {name: _matrix(linear) for name, linear in
                        (("qkv", mixer.qkv), ("o", mixer.o_proj), ("gate_up", mlp.gate_up), ("down", mlp.down))}
            if any(m is None or not _fp32_vectors(m[4]) for m in matrices.values()):
                return None
            layers.append({"attn_norm": attn_norm, "mlp_norm": mlp_norm, "sinks": mixer.head_sinks,
                           "q_norm": norms[0], "k_norm": norms[1],
                           "heads": mixer.heads, "kv_heads": mixer.kv_heads, "head_dim": mixer.head_dim,
                           "rot": mixer.rotary_dim, "window": mixer.window, "scale": mixer.scale, **matrices})
            parts += [(mixer, "qkv", mixer.qkv), (mixer, "o_proj", mixer.o_proj), (mlp, "gate_up", mlp.gate_up),
                      (mlp, "down", mlp.down)]
        return cls(model, decode_layers.DenseDecoder(layers, spec.hidden_size, model.norm, model.eps), parts)

    def current(self) -> bool:
        """Whether every layer still holds what the plan was built from."""
        return all(getattr(owner, name) is held for owner, name, held in self.parts) and all(
            type(held) is Router for _, name, held in self.parts if name == "router")

    def run(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """tokens [1, 1] -> the final-normed hidden state [1, 1, hidden], the cache advanced; None (nothing
        done) where this call must run op by op: a padded cache, a top-k attention selection or a
        cache that cannot be written in place."""
        pos = cache.offset
        if cache.key_mask is not None or pos + 1 > cache.max_len:
            return None
        model = self.model
        for i, (_, mixer, _, _) in enumerate(model.layers):
            pools = cache.layers[i].decode_pools(pos) if not mixer._selects(pos + 1) else None
            if pools is None:
                return None
            self.decoder.set_pools(i, *pools)
        x = model.embed[tokens.view(-1)[0]].clone()  # the residual stream, updated in place
        h = self.decoder(x, pos, model.rope.cos[pos], model.rope.sin[pos])
        cache.advance(1)
        return h.view(1, 1, -1)
