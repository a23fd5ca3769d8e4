"""Single-sequence decode as one kernel call per token for the whole layer stack (kernels/decode_layers).

`DecodePlan.build(model)` returns a plan where every layer qualifies, in one of two forms:
- GQA + routed MXFP4 MoE (gpt-oss): a GQA layer with the fused decode step (GQAttention.fused_step),
  then a MoE block whose routing and resident MXFP4 experts go into one kernel call
  (MoEBlock.routed_table), without latent projection or shared expert. The decoder calls the same
  kernel entry points in the same order as the op-by-op step: the same bits.
- GQA + dense SiLU-gated MLP (Llama, SmolLM2, Qwen2, Qwen3): attention without an output gate,
  every matrix fp32, bf16 or GGUF blocks of a kernels/ggml_gemv type (Linear, BlockLinear; parts of
  different block types as a stacked Matrix).
- hybrid (Kimi K3, Kimi-Linear, Qwen3-Next, DeepSeek-V3 / V3.2, Kimi K2.5, GLM-5, GLM-5-Next; and GQA + MoE models
  the first form does not take: Qwen3-MoE, GLM-4.5): KDA, MLA (absorbed; NoPE, or RoPE over adjacent pairs; with
  DSA's lightning or k-pool indexer and top-k, or a dsa_shared layer's reuse of the selection) or GQA mixers, dense
  or MoE MLPs (latent projection, shared experts), plain or attention residuals or hyper-connections (`_hybrid`); routed experts in the kernel where resident (an MXFP4 `routed_table`, a dense
  `routed_dense_table`, or GGUF blocks at expert precision q8: `routed_block_table`), else called back into the
  engine (a pager), with the same bits.
The GQA forms take plain residuals only (no attention residuals or hyper-connections). The plan checks on every call
that the layers still hold what it was built from (paging hooks wrap routers, a pager replaces the
experts) and that the cache can be written in place; where not, the caller runs the layers op by op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from localmoe.engine.experts import expert_forward
from localmoe.engine.layers.attention import GQAttention
from localmoe.engine.layers.attn_res import AttentionResiduals
from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.dsa_shared import SharedDSAttention
from localmoe.engine.layers.gated_deltanet import GatedDeltaNet
from localmoe.engine.layers.hyper_connections import HyperConnections
from localmoe.engine.layers.index_cache import DSACache
from localmoe.engine.layers.kda import KimiDeltaAttention
from localmoe.engine.layers.kpool_indexer import KPoolIndexer
from localmoe.engine.layers.mla import MLAttention
from localmoe.engine.layers.mlp import GatedMLP
from localmoe.engine.layers.moe import ExpertGLU, MoEBlock, Router, dispatch
from localmoe.engine.linear import Linear
from localmoe.engine.quantized import BlockEmbedding, BlockLinear, BlockQuantized
from localmoe.kernels import decode_layers, ggml_gemv
from localmoe.kernels.decode_layers import hybrid
from localmoe.kernels.fp8_cache.cpu import cache_rows
from localmoe.kernels.gqa_decode import StepKernel
from localmoe.kernels.mxfp4_moe import EXACT_TOKEN_ROWS, GLU_KINDS, SCORINGS, ExpertTable, mxfp4_moe
from localmoe.kernels.ggml_gemv.experts import ggml_moe_token
from localmoe.kernels.mxfp4_moe.held import HeldBlockTable, HeldDenseTable, HeldTable


def _fp32_vectors(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
               for t in tensors)


def _matrix(linear) -> tuple | None:
    """(data, type, rows, cols, bias) of a decode_layers Matrix for a Linear or BlockLinear (x16: its type + X16), or
    None (exact_x: the Matrix has no fp32-x form)."""
    if type(linear) is Linear and linear.weight.dtype in decode_layers.MATRIX_TYPES and linear.weight.is_contiguous():
        w = linear.weight
        return w, decode_layers.MATRIX_TYPES[w.dtype], w.shape[0], w.shape[1], linear.bias
    ggml = decode_layers.GGML_MATRIX_TYPES
    if (type(linear) is not BlockLinear or not linear.segments or linear.exact_x
            or any(int(k) not in ggml for _, k, _ in linear.segments)):
        return None
    if linear.raw is not None:
        kind = int(linear.ggml_type) + (decode_layers.X16 if linear.x16 else 0)
        return linear.raw, kind, linear.out_features, linear.in_features, linear.bias
    # parts of different types: a stacked Matrix over one descriptor per segment (its slice of the bias)
    descriptors = torch.zeros(len(linear.segments) + 1, 5, dtype=torch.int64)  # matrix.h Matrix fields; 0 ends
    row = 0
    for i, (raw, kind, rows) in enumerate(linear.segments):
        bias = 0 if linear.bias is None else linear.bias[row:row + rows].data_ptr()
        descriptors[i] = torch.tensor([raw.data_ptr(), int(kind), rows, linear.in_features, bias])
        row += rows
    return descriptors, decode_layers.STACKED, linear.out_features, linear.in_features, None


def _plain_router(router):
    """The Router inside a pager's hooks (paging/hooks.py wraps it: `.router`)."""
    while not isinstance(router, Router) and hasattr(router, "router"):
        router = router.router
    return router


def _paged(block: MoEBlock) -> bool:
    """Whether the gpt-oss form runs `block`'s experts through its callback (`_paged_experts`): a provider without a
    resident kernel table (a pager) of MXFP4 experts, a plain routing rule underneath any hooks, and every row of a
    call with its alone-bits (`independent_rows`)."""
    router = _plain_router(block.router)
    return (isinstance(router, Router) and router.rule.n_group == 1 and isinstance(block.act, ExpertGLU)
            and block.experts is not None and block.independent_rows > 0)


def _paged_experts(model):
    """The gpt-oss form's experts callback for a layer without a resident table (a pager's): layer `index`'s
    routed-expert sum of the rows h [N, D] through its block (the pager's router hooks see the routing; `dispatch`:
    one MoE kernel call per chosen expert as the pager hands it out, each over every row routed to it), in slices
    of `independent_rows` rows. Each row's experts are added in increasing id by the same kernel as a resident
    layer's call: its bits. (Holding the rows' whole union and running it in one call, as the hybrid form's
    callback does for one token, measured slower on gpt-oss `large` at 25%: docs/performance.md, session 12.)"""

    def experts(index: int, h: torch.Tensor) -> torch.Tensor:
        block = model.layers[index][3]
        limit = block.independent_rows
        parts = [h] if h.shape[0] <= limit else h.split(limit)
        outs = []
        for part in parts:
            weights, ids = block.router(part)
            outs.append(dispatch(part, weights, ids, block.experts, block.layer, block.act, block.precision))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return experts


class DecodePlan:
    def __init__(self, model, decoder, parts: list[tuple], run=None, plain_routers: bool = True):
        self.model, self.decoder = model, decoder
        self.parts = parts  # (owner, attribute, the object it held at build time) for `current`
        self.plain_routers = plain_routers  # the kernel routes: paging hooks around a router need op by op
        self._run = run  # the hybrid form's own run(plan, tokens, cache)
        self.logits = False  # whether `run` gives the logits (the lm_head in the kernel call), not the hidden state
        # the hybrid form's per-token state (set by `_hybrid`, read by `_hybrid_run`): whether a layer rotates, each
        # layer's (index, kind, mixer), the recurrent layers, the cache tensors each layer's pointers were set from,
        # and (the address of a token's fp32 row, rows) where the kernel copies the token's embedding row itself (an fp32
        # table's row, or a GGUF block table's row dequantised into a kept buffer: ggml_gemv.row_reader)
        self.rope = False
        self.slots: list[tuple[int, str, object]] = []
        self.recurrent: list[int] = []
        self.bound: list[tuple | None] = []
        self.row_sets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> (its layers, bound)
        self.embed_rows: tuple[Callable[[int], int], int] | None = None

    @classmethod
    def build(cls, model) -> DecodePlan | None:
        """The plan, or None. The Transformer tries again at every decode step while there is none, so
        each form stops at the first layer that does not qualify (a few microseconds)."""
        if not decode_layers.available() or not model.layers or not _fp32_vectors(model.norm):
            return None
        if any(isinstance(mixer, (KimiDeltaAttention, MLAttention, GatedDeltaNet)) for _, mixer, _, _ in model.layers):
            return cls._hybrid(model)
        if model.residuals is not None:
            return None
        moe = [mlp for *_, mlp in model.layers if isinstance(mlp, MoEBlock)]
        if any(isinstance(b.act, ExpertGLU) and b.act.kind == "gpt_oss" for b in moe):
            return cls._moe(model)  # gpt-oss: its own form (its op-by-op step's kernels, the same bits) or none
        return cls._hybrid(model) if moe else cls._dense(model)

    @classmethod
    def _moe(cls, model) -> DecodePlan | None:
        layers, parts = [], []
        for attn_norm, mixer, mlp_norm, block in model.layers:
            # decode_gqa_moe's attention has no q/k norms (gpt-oss has none): a layer with them runs op by op
            if not (isinstance(mixer, GQAttention) and isinstance(mixer.fused_step, StepKernel)
                    and mixer.fused_step.q_norm is None and isinstance(block, MoEBlock)
                    and _fp32_vectors(attn_norm, mlp_norm)):
                return None
            table = block.routed_table(1)
            if block.latent is not None or block.shared is not None or (table is None and not _paged(block)):
                return None
            step, router = mixer.fused_step, _plain_router(block.router)
            rule = router.rule
            layers.append({
                "attn_norm": attn_norm, "wqkv": step.wqkv, "bqkv": step.bqkv, "wo": step.wo, "bo": step.bo,
                "sinks": step.sinks, "heads": step.heads, "kv_heads": step.kv_heads, "head_dim": step.head_dim,
                "rot": step.rot, "window": mixer.window, "scale": step.scale, "mlp_norm": mlp_norm,
                "router_w": router.linear.weight, "router_b": router.linear.bias, "correction": router.correction_bias,
                "table": None if table is None else table.addresses, "scoring": SCORINGS.index(rule.scoring),
                "renormalize": rule.renormalize, "scaling": rule.scaling,
                "intermediate": 0 if table is None else table.intermediate, "top_k": rule.top_k,
                "glu": GLU_KINDS.index(block.act.kind), "p0": block.act.p0, "p1": block.act.p1, "keep": table})
            parts += [(mixer, "fused_step", step), (block, "router", block.router), (block, "experts", block.experts)]
        rows = min(block.independent_rows for *_, block in model.layers)
        decoder = decode_layers.GqaMoeDecoder(layers, model.spec.hidden_size, model.norm, model.eps,
                                              model.config.expert_kernel_precision == "q8", _paged_experts(model),
                                              rows or 1)
        return cls(model, decoder, parts, plain_routers=False)

    @classmethod
    def _hybrid(cls, model) -> DecodePlan | None:
        return _hybrid(cls, model)

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
        return all(getattr(owner, name) is held for owner, name, held in self.parts) and (not self.plain_routers or all(
            type(held) is Router for _, name, held in self.parts if name == "router"))

    def run(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """tokens [1, 1] -> the final-normed hidden state [1, 1, hidden] (the logits [1, 1, V] where `logits`),
        the cache advanced; None (nothing done) where this call must run op by op: a padded cache, a top-k
        attention selection or a cache that cannot be written in place."""
        if self._run is not None:
            return self._run(self, tokens, cache)
        pos = cache.offset
        if cache.key_mask is not None or pos + 1 > cache.max_len:
            return None
        model, decoder = self.model, self.decoder
        for i, (_, mixer, _, _) in enumerate(model.layers):
            if mixer._selects(pos + 1):
                return None
            layer = cache.layers[i]
            pools = layer.decode_pools(pos)
            if pools is not None:
                decoder.set_pools(i, *pools)
                continue
            keys, values = layer.keys.storage(pos + 1), layer.values.storage(pos + 1)  # bf16 / fp8: in their dtype
            if keys is None or values is None:
                return None
            decoder.set_storage(i, keys, values)
        x = model.embed[tokens.view(-1)[0]].clone()  # the residual stream, updated in place
        at = pos + cache.rope_delta  # the rotary position (MRoPE after an image: engine/step.py)
        h = decoder(x, pos, model.rope.cos[at], model.rope.sin[at])
        cache.advance(1)
        return h.view(1, 1, -1)


# ---- the hybrid form (kernels/decode_layers/hybrid.py) ----

def _glu(spec) -> tuple | None:
    """The glu.h (kind, p0, p1) of the dense MLPs and shared experts (`mlp.glu_for`), or None."""
    if spec.hidden_act == "situ":
        return GLU_KINDS.index("situ"), spec.situ_beta, spec.situ_linear_beta
    if spec.hidden_act == "silu":
        return GLU_KINDS.index("swiglu"), float(spec.glu_limit or 0.0), 0.0
    return None


def _checked(*matrices) -> bool:
    return all(m is not None and _fp32_vectors(m[4]) for m in matrices)


def _kda_layer(mixer: KimiDeltaAttention) -> dict | None:
    c = mixer.config
    d = {"in_proj": _matrix(mixer.in_proj), "f_b": _matrix(mixer.f_b_proj),
         "g_b": None if mixer.g_b_proj is None else _matrix(mixer.g_b_proj), "conv": mixer.conv_weight,
         "decay": mixer.decay_rate.reshape(-1), "dt_bias": mixer.dt_bias.reshape(-1), "o_norm": mixer.o_norm,
         "heads": c.num_heads, "head_dim": c.head_dim, "conv_kernel": c.conv_kernel, "bounded": c.bounded_gate,
         "lower_bound": c.gate_lower_bound, "eps": c.norm_eps}
    ok = _checked(d["in_proj"], d["f_b"]) and (mixer.g_b_proj is None or _checked(d["g_b"]))
    ok = ok and _fp32_vectors(d["conv"], d["decay"], d["dt_bias"], d["o_norm"])
    return d if ok and c.head_dim <= hybrid.MAX_HEAD_DIM and c.conv_kernel >= 2 else None


def _gdn_layer(mixer: GatedDeltaNet) -> dict | None:
    c = mixer.config
    d = {"in_proj": _matrix(mixer.in_proj), "conv": mixer.conv_weight, "decay": mixer.decay_rate,
         "dt_bias": mixer.dt_bias, "norm": mixer.norm, "key_heads": c.num_key_heads, "value_heads": c.num_value_heads,
         "key_dim": c.key_head_dim, "value_dim": c.value_head_dim, "conv_kernel": c.conv_kernel, "eps": c.norm_eps}
    ok = _checked(d["in_proj"]) and _fp32_vectors(d["conv"], d["decay"], d["dt_bias"], d["norm"])
    return d if ok and max(c.key_head_dim, c.value_head_dim) <= hybrid.MAX_HEAD_DIM and c.conv_kernel >= 2 else None


def _gqa_layer(mixer: GQAttention, model) -> dict | None:
    """Full attention (Qwen3-Next's gated, q/k-normed, partially rotated layers) as the dense plan takes it."""
    norms = [None if n is None else n.float().contiguous() for n in (mixer.q_norm, mixer.k_norm)]
    if not ((norms[0] is None) == (norms[1] is None) and mixer.head_dim % 8 == 0 and mixer.head_dim <= 512
            and mixer.rotary_dim % 2 == 0 and 0 < mixer.rotary_dim <= mixer.head_dim
            and _fp32_vectors(mixer.head_sinks) and model.rope.cos.shape[-1] == mixer.rotary_dim):
        return None
    d = {"qkv": _matrix(mixer.qkv), "gate": None if mixer.gate is None else _matrix(mixer.gate),
         "q_norm": norms[0], "k_norm": norms[1], "sinks": mixer.head_sinks, "heads": mixer.heads,
         "kv_heads": mixer.kv_heads, "head_dim": mixer.head_dim, "rot": mixer.rotary_dim, "window": mixer.window,
         "scale": mixer.scale, "eps": mixer.eps}
    return d if _checked(d["qkv"]) and (mixer.gate is None or _checked(d["gate"])) else None


def _mla_layer(mixer: MLAttention, model) -> dict | None:
    """Absorbed MLA, NoPE (Kimi) or rotating its rope part over adjacent pairs with the model's RoPE tables
    (DeepSeek-V3, Kimi K2.5: the tables must be the rope part's width)."""
    c = mixer.config
    if (mixer.absorb is False or c.kv_lora_rank > hybrid.MAX_LATENT or c.qk_rope_head_dim > 128
            or (not c.use_nope and (c.qk_rope_head_dim % 2 or model.rope is None
                                    or model.rope.cos.shape[-1] != c.qk_rope_head_dim))):
        return None
    d = {"q_a": None if mixer.q_a_proj is None else _matrix(mixer.q_a_proj), "q_b": _matrix(mixer.q_proj),
         "kv_a": _matrix(mixer.kv_a_proj), "g": None if mixer.g_proj is None else _matrix(mixer.g_proj),
         "q_a_norm": mixer.q_a_norm, "kv_a_norm": mixer.kv_a_norm, "w_uk": mixer.w_uk, "w_uv": mixer.w_uv,
         "heads": c.num_heads, "kv_rank": c.kv_lora_rank, "nope": c.qk_nope_head_dim, "rope": c.qk_rope_head_dim,
         "vdim": c.v_head_dim, "rotate": not c.use_nope, "scale": mixer.scale, "eps": c.norm_eps}
    ok = _checked(d["q_b"], d["kv_a"]) and all(_checked(d[n]) for n in ("q_a", "g") if d[n] is not None)
    if isinstance(mixer, DSAttention):
        d["dsa"] = _dsa_fields(mixer, model)
        ok = ok and d["dsa"] is not None
    return d if ok and (d["q_a"] is None) == (mixer.q_a_proj is None) and _fp32_vectors(
        d["q_a_norm"], d["kv_a_norm"], d["w_uk"], d["w_uv"]) else None


def _dsa_fields(mixer: DSAttention, model) -> dict | None:
    """hybrid.Indexer's fields: a dsa_shared layer's context, or the layer's lightning / k-pool indexer (keys
    within one index-cache block, rotated by the model's tables where they have a rope part)."""
    if isinstance(mixer, SharedDSAttention):
        return {"select": 2, "dense_context": mixer.dense_context}
    ix = mixer.indexer
    kpool = isinstance(ix, KPoolIndexer)
    if (ix.rope_dim % 2 or ix.rope_dim > ix.head_dim
            or (ix.rope_dim and (model.rope is None or model.rope.cos.shape[-1] != ix.rope_dim))
            or (kpool and ix.pool > 1 and not ix.tail)):
        return None
    d = {"select": 1, "wq_b": _matrix(ix.wq_b), "wk": _matrix(ix.wk), "weights": _matrix(ix.weights_proj),
         "gate": _matrix(ix.gate) if kpool else None, "k_norm_w": ix.k_norm_weight, "k_norm_b": ix.k_norm_bias,
         "ape": ix.ape if kpool else None, "heads": ix.heads, "head_dim": ix.head_dim, "rope_dim": ix.rope_dim,
         "interleaved": ix.interleaved, "top_k": ix.top_k, "pool": ix.pool if kpool else 0,
         "tail": kpool and ix.tail, "dense_context": ix.dense_context, "weight_scale": ix.weight_scale}
    ok = _checked(d["wq_b"], d["wk"], d["weights"]) and (not kpool or _checked(d["gate"]))
    return d if ok and _fp32_vectors(d["k_norm_w"], d["k_norm_b"], d["ape"]) else None


def _mlp_layer(mlp, glu: tuple | None) -> tuple[dict, list] | None:
    """The MLP's fields of a HybridLayer and the parts `current` checks, or None."""
    shared = mlp.shared if isinstance(mlp, MoEBlock) else mlp
    d: dict = {"moe": isinstance(mlp, MoEBlock)}
    gate = getattr(shared, "gate", None)  # Qwen3-Next's SigmoidGatedMLP (engine/transformer.py): gate [1, D]
    if d["moe"] and gate is not None and type(gate) is Linear and gate.weight.shape[0] == 1:
        if not _fp32_vectors(gate.weight, gate.bias) or gate.bias is not None:
            return None
        d["shared_gate"], shared = gate.weight[0], shared.mlp
    if shared is not None:
        if type(shared) is not GatedMLP or glu is None:
            return None
        d |= {"gate_up": _matrix(shared.gate_up), "down": _matrix(shared.down), "glu": glu}
        if not _checked(d["gate_up"], d["down"]):
            return None
    if not d["moe"]:
        return d, []
    if mlp.experts is None:
        return None
    if mlp.latent is not None:
        lat = mlp.latent
        d |= {"lat_down": _matrix(lat.down), "lat_up": _matrix(lat.up), "lat_norm": lat.norm, "lat_eps": lat.eps}
        if not (_checked(d["lat_down"], d["lat_up"]) and _fp32_vectors(lat.norm)):
            return None
    table = mlp.routed_table(1)
    dense = mlp.routed_dense_table(1) if table is None and mlp.router.rule.top_k <= hybrid.MAX_TOP_K else None
    blocks = mlp.routed_block_table(1) if table is dense is None and mlp.router.rule.top_k <= hybrid.MAX_TOP_K \
        else None
    if table is not None or dense is not None or blocks is not None:  # routing and resident experts in the kernel
        router = mlp.router
        d |= {"router_w": router.linear.weight, "router_b": router.linear.bias, "correction": router.correction_bias,
              "scoring": SCORINGS.index(router.rule.scoring),
              "renormalize": router.rule.renormalize, "scaling": router.rule.scaling, "experts": router.linear.weight.shape[0],
              "top_k": router.rule.top_k, "expert_glu": (GLU_KINDS.index(mlp.act.kind), mlp.act.p0, mlp.act.p1)}
        if table is not None:
            d |= {"table": table.addresses, "keep": table, "intermediate": table.intermediate}
        elif dense is not None:
            d |= {"dense": dense.addresses, "keep": dense, "intermediate": dense.intermediate,
                  "dense_type": decode_layers.MATRIX_TYPES[dense.dtype]}
        else:
            d |= {"blocks": blocks.addresses, "keep": blocks, "intermediate": blocks.intermediate,
                  "block_types": tuple(int(t) for t in blocks.types)}
        if not _fp32_vectors(router.linear.weight, router.linear.bias, router.correction_bias):
            return None
    else:
        d |= {"scoring": 0, "renormalize": 0, "scaling": 1.0, "experts": 0, "intermediate": 0, "top_k": 0,
              "expert_glu": (0, 0.0, 0.0)}
    return d, [(mlp, "router", mlp.router), (mlp, "experts", mlp.experts)]


def _dense_parts(w, precision: str) -> tuple | None:
    """An expert's (gate, up, down) as decode_layers Matrix tuples where all three are dense CPU tensors, or (at
    expert precision q8, whose int8-rounded x the block GEMV takes) GGUF blocks of a kernel type."""
    parts = []
    for proj in (w.gate, w.up, w.down):
        t = proj.weight
        if isinstance(t, BlockQuantized) and precision == "q8" and int(t.ggml_type) in decode_layers.GGML_MATRIX_TYPES \
                and t.raw.device.type == "cpu" and t.raw.is_contiguous() and _fp32_vectors(proj.bias):
            parts.append((t.raw, int(t.ggml_type), t.shape[0], t.shape[1], proj.bias))
            continue
        if not (type(t) is torch.Tensor and t.dtype in decode_layers.MATRIX_TYPES and t.is_contiguous()
                and t.device.type == "cpu" and _fp32_vectors(proj.bias)):
            return None
        parts.append((t, decode_layers.MATRIX_TYPES[t.dtype], t.shape[0], t.shape[1], proj.bias))
    return tuple(parts)


def _routed(model):
    """The decoder's experts callback: layer `index`'s routing of h and its experts on x, in increasing id as
    `moe.dispatch` adds them. Where the provider hands the chosen experts out together (a pager's `hold`), the layer
    runs in one kernel call over a held table of their slots (kernels/mxfp4_moe/held.py), the call a resident layer
    makes inside the step: MXFP4 experts through the MoE kernel (`HeldTable`), dense ones through
    `hybrid.dense_experts_token` (`HeldDenseTable`), GGUF-block ones at q8 through `ggml_moe_token`
    (`HeldBlockTable`). Else one expert at a time: MXFP4 ones through the MoE kernel one call each (the same bits),
    dense and block ones through `hybrid.dense_expert`, others (and experts a pager places on a GPU tier) as the
    engine runs them. Resident and paged experts take the same path: the same bits."""
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    tables: dict[int, list] = {}  # index -> the layer's held tables, the one that last took its experts first

    def scratch(index: int, inner: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        if buffers.get(index, (torch.empty(0),))[0].numel() < 2 * inner + width:
            buffers[index] = (torch.empty(2 * inner + width), torch.empty(hybrid.xq_bytes(max(width, inner)),
                                                                         dtype=torch.uint8))
        return buffers[index]

    def held_call(index: int, block, rows: list, held: dict, x, ids, weights, act, out) -> bool:
        """The layer's chosen experts of every row over a held table; False where no table takes them. MXFP4: one
        kernel call per slice of EXACT_TOKEN_ROWS rows (every expert's group on the one-token path); dense and
        GGUF-block experts one call per row."""
        order = tables.get(index)
        if order is None:
            E = block.router.linear.weight.shape[0]
            order = tables[index] = [HeldTable(E), HeldDenseTable(E)] + \
                ([HeldBlockTable(E)] if block.precision == "q8" else [])
        for i, table in enumerate(order):
            if not table.fill(held):
                continue
            order.insert(0, order.pop(i))
            glu = (GLU_KINDS.index(act.kind), *act.params)
            if isinstance(table, HeldTable):
                for r in range(0, x.shape[0], EXACT_TOKEN_ROWS):
                    part = slice(r, r + EXACT_TOKEN_ROWS)
                    mxfp4_moe(x[part], ids[part], weights[part], table, act.kind, act.params, out[part],
                              precision=block.precision)
            elif isinstance(table, HeldDenseTable):
                for r, chosen in enumerate(rows):
                    hybrid.dense_experts_token(x[r], torch.tensor([e for e, _ in chosen]),
                                               torch.tensor([w for _, w in chosen], dtype=torch.float32), table, glu,
                                               out[r], *scratch(index, table.intermediate, x.shape[-1]))
            else:
                for r, chosen in enumerate(rows):
                    ggml_moe_token(x[r], [e for e, _ in chosen], [w for _, w in chosen], table, glu[0], glu[1:],
                                   out[r])
            return True
        return False

    def token(index: int, block, chosen: list, held: dict | None, x, ids, weights, out) -> None:
        """One row's experts one at a time (x, ids, weights, out: [1, ...] views of its row)."""
        provider, act = block.experts, block.act
        placed = getattr(provider, "placed", None)
        for expert, weight in chosen:
            if held is not None:
                w, tier = held[expert], "ram"
            else:
                w, tier = (provider.get(block.layer, expert), "ram") if placed is None else \
                    placed(block.layer, expert, 1)
            if tier != "ram":  # a GPU tier's copy: computed there
                out += weight * expert_forward(w, x.to(w.device), act, block.precision).to(out.device)
                continue
            parts = _dense_parts(w, block.precision)
            if parts is not None:
                hybrid.dense_expert(x[0], parts, (GLU_KINDS.index(act.kind), *act.params), weight, out[0],
                                    *scratch(index, parts[0][2], x.shape[-1]))
                continue
            table = ExpertTable.single(expert, w, chosen[-1][0] + 1)
            if table is not None:
                mxfp4_moe(x, ids, weights, table, act.kind, act.params, out, only=expert, precision=block.precision)
            else:
                out += weight * expert_forward(w, x, act, block.precision)

    def experts(index: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s routed-expert sum [N, W] of the rows h [N, D] (the router's input), x [N, W] (the
        experts'): the rows' union held together where the provider can (`hold`), each row's experts in
        increasing id."""
        block = model.layers[index][3]
        if h.shape[0] > 1 and _plain_router(block.router).rule.n_group != 1:
            # torch's group-limited routing over [N, E] rounds a row's scores by where it lies in the batch (its
            # vectorised ops' tails): one row at a time, as the one-token step routes it
            parts = [block.router(h[r:r + 1]) for r in range(h.shape[0])]
            weights, ids = torch.cat([w for w, _ in parts]), torch.cat([i for _, i in parts])
        else:
            weights, ids = block.router(h)
        provider, act = block.experts, block.act
        if not isinstance(act, ExpertGLU):
            return dispatch(x, weights, ids, provider, block.layer, act, block.precision)
        out = torch.zeros_like(x)
        rows = [sorted(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]
        union = sorted({e for chosen in rows for e, _ in chosen})
        hold = getattr(provider, "hold", None)
        held = None if hold is None else hold(block.layer, union)
        held = None if held is None else dict(zip(union, held))
        if held is not None and ids.shape[1] <= hybrid.MAX_TOP_K and \
                held_call(index, block, rows, held, x, ids, weights, act, out):
            return out
        for r, chosen in enumerate(rows):
            token(index, block, chosen, held, x[r:r + 1], ids[r:r + 1], weights[r:r + 1], out[r:r + 1])
        return out
    return experts


def _bind(plan: DecodePlan, cache, pos: int, last: int, layers=None, bound: list | None = None) -> bool:
    """Point the layers (the decoder's own, or a `row_set`) at `cache` for tokens at positions pos..last: each layer's
    pointers set again only where the cache's tensors changed (`bound`: what each was set from). False (nothing to
    run in the kernel) where a layer must run op by op: a recurrent state not at `pos`, a top-k attention selection,
    a probe's recording, a cache that cannot be written in place."""
    decoder, caches = plan.decoder, cache.layers
    bound = plan.bound if bound is None else bound
    for i, kind, mixer in plan.slots:
        layer = caches[i]
        if kind == "recurrent":  # KDA, Gated DeltaNet: the state and conv tail, updated in place
            if layer.offset != pos:
                return False
            held = bound[i]
            if held is None or held[0] is not layer.state or held[1] is not layer.conv_tail:
                if layer.state.shape[0] != 1:
                    return False
                layer.state, layer.conv_tail = layer.state.contiguous(), layer.conv_tail.contiguous()  # fp32 already
                decoder.set_state(i, layer.state, layer.conv_tail, layers)
                bound[i] = (layer.state, layer.conv_tail)
        elif mixer.sparse_topk is not None and mixer.sparse_topk < last + 1:
            return False  # top-k selection drops keys now: op by op
        elif kind == "gqa":  # fp32 pools by address; bf16 / fp8 caches in their own dtype (set again as they change)
            keys, values, held = layer.keys, layer.values, bound[i]
            if (held is None or held[0] is not keys or held[1] != keys.generation or held[2] is not values
                    or held[3] != values.generation or last >= keys.capacity or last >= values.capacity):
                pools = layer.decode_pools(last)
                if pools is not None:
                    decoder.set_pools(i, *pools, layers)
                else:
                    rows = keys.storage(last + 1), values.storage(last + 1)
                    if None in rows:
                        return False
                    decoder.set_kv_rows(i, cache_rows(*rows[0]), cache_rows(*rows[1]), layers)
                bound[i] = (keys, keys.generation, values, values.generation)
        elif mixer.record_selection:
            return False  # probe-recall keeps the selection: op by op
        elif kind == "mla":  # the latent cache: its view changes only when the buffer grows or is reallocated
            buffer, held = layer.rows, bound[i]
            if held is None or held[0] is not buffer or held[1] != buffer.generation or last >= buffer.capacity:
                rows = buffer.storage(last + 1)  # one head of r + rope values
                if rows is None:
                    return False
                decoder.set_rows(i, cache_rows(*rows), layers)
                bound[i] = (buffer, buffer.generation)
        else:  # DSA: the latent cache, and where the layer has one of its own the index cache and kept pools
            dsa = isinstance(layer, DSACache)
            rows = (layer.latent if dsa else layer).rows.storage(last + 1)  # one head of r + rope values
            keys = layer.index.rows.storage(last + 1) if dsa else None  # heads: the index cache's blocks
            if rows is None or (dsa and keys is None):
                return False
            decoder.set_rows(i, cache_rows(*rows), layers)
            if dsa:
                kept = layer.pools  # k-pool: the complete pools' keys, kept
                decoder.set_index(i, cache_rows(*keys), *(kept.fused_room((last + 1) // kept.pool) if kept else ()),
                                  layers=layers)
    return True


def _hybrid_run(plan: DecodePlan, tokens: torch.Tensor, cache) -> torch.Tensor | None:
    """The hybrid step with as little Python as it can (a decode token's Python runs on cold caches, after the
    kernel's stream of weights: ~50 us of it hot took ~600 us there): each layer's cache pointers are set again
    only where the cache's tensors changed (`_bind`), the token's embedding row goes to the kernel by address,
    and the kernel computes the lm_head too where it can (`plan.logits`)."""
    pos = cache.offset
    if cache.key_mask is not None or pos + 1 > cache.max_len or not _bind(plan, cache, pos, pos):
        return None
    rope = (None, None)
    if plan.rope:
        at = pos + cache.rope_delta
        rope = (plan.model.rope.cos[at], plan.model.rope.sin[at])
    embed = plan.embed_rows
    if embed is None:
        x = plan.model.embed[tokens.view(-1)[0]].clone()
    else:
        token = int(tokens)
        if not 0 <= token < embed[1]:
            raise IndexError(f"token id {token} is outside the embedding's {embed[1]} rows")
        x = embed[0](token)  # the row's address: the kernel copies it
    out = plan.decoder(x, pos, *rope)
    layers = cache.layers
    for i in plan.recurrent:
        layers[i].offset += 1
    cache.advance(1)
    return out.view(1, 1, -1)


def hybrid_rows(plan: DecodePlan, x: torch.Tensor, starts: list[int], caches: list) -> torch.Tensor | None:
    """The batched step's layers through the hybrid plan (`HybridDecoder.rows`, one kernel call; a paged layer's
    experts called back once per layer for all rows): x [N, D] embeddings (updated) of rows at cache positions
    `starts` (a cache on several rows: consecutive positions, a verify) -> the final-normed hidden states [N, D],
    every row with the bits `_hybrid_run` gives its token alone; None (nothing done) where a cache cannot take the
    plan now (as `_hybrid_run`). Each cache keeps its own bound copy of the layers (`row_set`). A cache whose
    delta-rule layers record (a verify: engine/state_cache.py `record`) runs each row on states of its own, which
    start from the row before's (`carry`; the first a copy of the cache's, which a snapshot may hold), and keeps them
    all; else its states are updated in place."""
    decoder, N = plan.decoder, len(starts)
    spans: dict[int, list[int]] = {}  # id(cache) -> its rows, in row order
    for n, cache in enumerate(caches):
        spans.setdefault(id(cache), []).append(n)
    sets: list = [None] * N
    carry = None
    recorded = []  # (cache, its rows, each row's new (state, tail) per recurrent layer)
    for rows in spans.values():
        cache = caches[rows[0]]
        first, last = starts[rows[0]], starts[rows[-1]]
        if cache.key_mask is not None or last + 1 > cache.max_len:
            return None
        kept = plan.row_sets.get(cache)
        if kept is None:
            kept = plan.row_sets[cache] = (decoder.row_set(), [None] * len(plan.bound))
        if not _bind(plan, cache, first, last, *kept):
            return None
        layers = cache.layers
        if any(layers[i].recording for i in plan.recurrent):  # (one row too: a kept state must not be updated)
            carry = carry or [-1] * N
            states = []
            for j, n in enumerate(rows):
                own = decoder.row_set(kept[0]) if j else kept[0]
                row_states = []
                for i in plan.recurrent:
                    state, tail = torch.empty_like(layers[i].state), torch.empty_like(layers[i].conv_tail)
                    if j == 0:
                        state.copy_(layers[i].state)
                        tail.copy_(layers[i].conv_tail)
                    decoder.set_state(i, state, tail, own)
                    row_states.append((state, tail))
                sets[n] = own
                carry[n] = rows[j - 1] if j else -1
                states.append(row_states)
            kept[1][:] = [None if i in plan.recurrent else b for i, b in enumerate(kept[1])]
            recorded.append((cache, states))
        else:
            for n in rows:
                sets[n] = kept[0]
    cos = sin = None
    if plan.rope:
        at = torch.tensor([start + cache.rope_delta for start, cache in zip(starts, caches)], dtype=torch.long)
        cos, sin = plan.model.rope.cos[at], plan.model.rope.sin[at]
    h = decoder.rows(x, sets, starts, cos, sin, carry, EXACT_TOKEN_ROWS)
    done = {id(cache) for cache, _ in recorded}
    for rows in spans.values():
        cache = caches[rows[0]]
        if id(cache) not in done:
            for i in plan.recurrent:
                cache.layers[i].offset += len(rows)
    for cache, states in recorded:
        for row_states in states:
            for i, (state, tail) in zip(plan.recurrent, row_states):
                cache.layers[i].advance(state, tail, 1)
    return h


def _hyper_connections(hc: HyperConnections, model) -> bool:
    """Whether the fused step takes these hyper-connections: fp32 on the CPU, the streams' norm at the model's
    epsilon, one Sinkhorn setting for all."""
    every = [*hc.attn, *hc.mlp]
    return 1 <= hc.streams and all(
        h.n == hc.streams and h.norm_eps == model.eps and h.iters == every[0].iters and h.hc_eps == every[0].hc_eps
        and h.iters >= 1 and _fp32_vectors(h.fn, h.base, h.scale) for h in every)


def _hybrid(cls, model) -> DecodePlan | None:
    """Kimi K3 / Kimi-Linear / Qwen3-Next / DeepSeek-V3 / V3.2 / Kimi K2.5 / GLM-5 / GLM-5-Next: every layer KDA,
    Gated DeltaNet, MLA (NoPE or RoPE; DSA) or GQA with a dense MLP or a MoE block; plain or attention residuals or
    hyper-connections; fp32, bf16 or GGUF-block matrices."""
    residuals = model.residuals
    hyper = type(residuals) is HyperConnections
    if hyper and not _hyper_connections(residuals, model):
        return None
    if residuals is not None and not hyper and not (
            type(residuals) is AttentionResiduals and residuals.eps == model.eps
            and len(model.layers) // residuals.block_size + 2 <= hybrid.MAX_BLOCKS
            and _fp32_vectors(residuals.output_query, *residuals.attn_queries, *residuals.mlp_queries)):
        return None
    if type(model.embed) not in (torch.Tensor, BlockEmbedding):
        return None
    glu, layers, parts = _glu(model.spec), [], []
    selecting = None  # dense_context of the latest layer with an indexer of its own (dsa_shared layers reuse it)
    for i, (attn_norm, mixer, mlp_norm, mlp) in enumerate(model.layers):
        kind = {KimiDeltaAttention: "kda", MLAttention: "mla", GatedDeltaNet: "gdn", GQAttention: "gqa",
                DSAttention: "mla", SharedDSAttention: "mla"}.get(type(mixer))
        mix = None if kind is None else {"kda": _kda_layer, "mla": lambda m: _mla_layer(m, model), "gdn": _gdn_layer,
                                         "gqa": lambda m: _gqa_layer(m, model)}[kind](mixer)
        o_proj = _matrix(mixer.out_proj if kind == "gdn" else mixer.o_proj) if mix is not None else None
        m = _mlp_layer(mlp, glu) if type(mlp) in (GatedMLP, MoEBlock) else None
        if mix is None or m is None or not _checked(o_proj) or not _fp32_vectors(attn_norm, mlp_norm):
            return None
        select = mix.get("dsa", {}).get("select", 0)
        if select == 2 and selecting != mix["dsa"]["dense_context"]:
            return None  # a shared layer selects only when a layer before it with the same context did
        selecting = mix["dsa"]["dense_context"] if select == 1 else selecting
        d = {"attn_norm": attn_norm, "mlp_norm": mlp_norm, "mixer": kind, kind: mix, "o_proj": o_proj, **m[0]}
        if hyper:
            for name, hc in (("attn", residuals.attn[i]), ("ffn", residuals.mlp[i])):
                d |= {f"hc_{name}": (hc.fn, 0, *hc.fn.shape, None), f"hc_{name}_base": hc.base,
                      f"hc_{name}_scale": hc.scale}
            d["hc"] = (residuals.streams, residuals.attn[i].iters, residuals.attn[i].hc_eps)
        elif residuals is not None:
            d["attn_query"], d["mlp_query"] = residuals.attn_queries[i], residuals.mlp_queries[i]
        layers.append(d)
        parts += m[1]
    block_size = residuals.block_size if residuals is not None and not hyper else 0
    # the head in the kernel call where matvec makes the head's own GEMV call (the same bits): a dense head on the
    # dense GEMV kernel, a GGUF block head of one type on x rounded to int8 (not exact_x)
    lm_head = model.lm_head
    folds = (type(lm_head) is Linear and lm_head.gemv is not None) or (
        type(lm_head) is BlockLinear and not lm_head.exact_x and lm_head.raw is not None)
    head = _matrix(lm_head) if folds else None
    decoder = hybrid.HybridDecoder(layers, model.spec.hidden_size, model.norm, model.eps,
                                   model.config.expert_kernel_precision == "q8", block_size,
                                   residuals.output_query if block_size else None, _routed(model), head)
    plan = cls(model, decoder, parts + [(model, "lm_head", model.lm_head)], run=_hybrid_run, plain_routers=False)
    plan.logits = head is not None
    plan.rope = any(d["mixer"] == "gqa" or (d["mixer"] == "mla" and (d["mla"]["rotate"] or d["mla"].get(
        "dsa", {}).get("rope_dim"))) for d in layers)
    kinds = {KimiDeltaAttention: "recurrent", GatedDeltaNet: "recurrent", GQAttention: "gqa", MLAttention: "mla"}
    plan.slots = [(i, kinds.get(type(mixer), "dsa"), mixer) for i, (_, mixer, _, _) in enumerate(model.layers)]
    plan.recurrent = [i for i, kind, _ in plan.slots if kind == "recurrent"]
    plan.bound = [None] * len(model.layers)
    embed = model.embed
    if type(embed) is torch.Tensor and embed.dtype == torch.float32 and embed.is_contiguous() and \
            embed.device.type == "cpu":
        plan.embed_rows = (lambda token, row0=embed.data_ptr(), stride=embed.stride(0) * 4: row0 + stride * token,
                           embed.shape[0])
        plan.parts.append((model, "embed", embed))
    elif isinstance(embed, BlockEmbedding):  # one library call a token (the general lookup: ~70 us as a token runs)
        read = ggml_gemv.row_reader(embed.rows, embed.weight.ggml_type, embed.weight.shape[1])
        if read is not None:
            plan.embed_rows = (read, embed.rows.shape[0])
            plan.parts.append((model, "embed", embed))
    return plan

