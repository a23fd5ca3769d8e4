"""Single-sequence decode of a GQA + routed-MXFP4-MoE model (gpt-oss) as one kernel call per token.

`DecodePlan.build(model)` returns a plan where every layer qualifies: a GQA layer with the fused
decode step (GQAttention.fused_step), then a MoE block whose routing and resident MXFP4 experts go
into one kernel call (MoEBlock._routed_table) with no latent projection or shared expert, and plain
residuals. `plan.run` then does the whole layer stack in kernels/decode_layers (the same kernels,
in the same order, as the op-by-op step: the same bits). The plan checks on every call that the
layers still hold what it was built from (paging hooks wrap routers, a pager replaces the experts)
and that the cache can be written in place; where not, the caller runs the layers op by op.
"""

from __future__ import annotations

import torch

from localmoe.engine.attention import GQAttention
from localmoe.engine.moe import MoEBlock, Router
from localmoe.kernels import decode_layers
from localmoe.kernels.gqa_decode.cpu import StepKernel
from localmoe.kernels.mxfp4_moe import GLU_KINDS, SCORINGS


class DecodePlan:
    def __init__(self, model, decoder: decode_layers.GqaMoeDecoder, parts: list[tuple]):
        self.model, self.decoder = model, decoder
        self.parts = parts  # per layer: (mixer, its fused step, block, its router, its experts)

    @classmethod
    def build(cls, model) -> DecodePlan | None:
        if model.residuals is not None or not decode_layers.available():
            return None
        layers, parts = [], []
        for i, (attn_norm, mixer, mlp_norm, block) in enumerate(model.layers):
            if not (isinstance(mixer, GQAttention) and isinstance(mixer.fused_step, StepKernel)
                    and isinstance(block, MoEBlock)):
                return None
            table = block._routed_table(1)
            if table is None or block.latent is not None or block.shared is not None:
                return None
            step, router = mixer.fused_step, block.router
            following = model.layers[i + 1][0] if i + 1 < len(model.layers) else model.norm
            if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (attn_norm, mlp_norm, following)):
                return None
            layers.append({
                "attn_norm": attn_norm, "wqkv": step.wqkv, "bqkv": step.bqkv, "wo": step.wo, "bo": step.bo,
                "sinks": step.sinks, "heads": step.heads, "kv_heads": step.kv_heads, "head_dim": step.head_dim,
                "rot": step.rot, "window": mixer.window, "scale": step.scale, "mlp_norm": mlp_norm,
                "router_w": router.linear.weight, "router_b": router.linear.bias, "correction": router.correction_bias,
                "table": table.addresses, "scoring": SCORINGS.index(router.rule.scoring),
                "renormalize": router.rule.renormalize, "scaling": router.rule.scaling,
                "intermediate": table.intermediate, "top_k": router.rule.top_k, "glu": GLU_KINDS.index(block.act.kind),
                "p0": block.act.p0, "p1": block.act.p1, "keep": table})
            parts.append((mixer, step, block, router, block.experts))
        decoder = decode_layers.GqaMoeDecoder(layers, model.spec.hidden_size, model.norm, model.eps,
                                              model.config.expert_precision == "q8")
        return cls(model, decoder, parts)

    def current(self) -> bool:
        """Whether every layer still holds what the plan was built from."""
        return all(mixer.fused_step is step and block.router is router and block.experts is experts
                   and type(router) is Router for mixer, step, block, router, experts in self.parts)

    def run(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """tokens [1, 1] -> the final-normed hidden state [1, 1, hidden], the cache advanced; None (nothing
        done) where this call must run op by op: a padded cache, a top-k attention selection or a
        cache that cannot be written in place."""
        pos = cache.offset
        if cache.key_mask is not None or pos + 1 > cache.max_len:
            return None
        for i, (mixer, _, _, _, _) in enumerate(self.parts):
            pools = cache.layers[i].decode_pools(pos) if not mixer._selects(pos + 1) else None
            if pools is None:
                return None
            self.decoder.set_pools(i, *pools)
        model = self.model
        x = model.embed[tokens.view(-1)[0]].clone()  # the residual stream, updated in place
        h = self.decoder(x, pos, model.rope.cos[pos], model.rope.sin[pos])
        cache.advance(1)
        return h.view(1, 1, -1)
