"""The decoder-only transformer, assembled per layer from the kinds a ModelSpec lists.

Each layer is (norm, mixer, norm, MLP) with plain residual adds, or a residual scheme that
runs the layers itself: Kimi K3's attention residuals (engine/layers/attn_res.py, `spec.attn_res_block_size`)
or GLM-5-Next's hyper-connections (engine/layers/hyper_connections.py, `spec.hc_mult`); the mixer is chosen by
`spec.layer_kinds[i]` from MIXERS and the MLP by `spec.mlp_kinds[i]` from MLPS. A new
layer kind is a class with `from_weights(spec, weights, prefix, dtype)`, `new_cache(batch,
max_len)`, `nbytes()` and `__call__(x, step, cache)`, registered here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.config import EngineConfig, ModelSpec
from localmoe.engine.cache import ModelCache
from localmoe.engine.decode_plan import DecodePlan
from localmoe.engine.experts import ExpertProvider
from localmoe.engine.layers.attention import GQAttention, SlidingAttention
from localmoe.engine.layers.attn_res import AttentionResiduals
from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.gated_deltanet import GatedDeltaNet
from localmoe.engine.layers.hyper_connections import HyperConnections
from localmoe.engine.layers.kda import KimiDeltaAttention
from localmoe.engine.layers.mla import MLAttention
from localmoe.engine.layers.mlp import ACTIVATIONS, GatedMLP
from localmoe.engine.layers.moe import MoEBlock
from localmoe.engine.linear import make_linear
from localmoe.engine.quantized import BlockEmbedding, BlockLinear, BlockQuantized
from localmoe.engine.rope import RotaryTable
from localmoe.engine.step import make_step
from localmoe.errors import LocalMoEError, UnsupportedModelError
from localmoe.kernels import ggml_gemv
from localmoe.kernels._cpu import small_steps
from localmoe.kernels.rms_norm import add_rms_norm

SMALL_STEP_TOKENS = 8  # tokens of one call (batch x new) up to which it counts as a decode step

MIXERS = {"attention": GQAttention, "sliding_attention": SlidingAttention, "kda": KimiDeltaAttention,
          "mla": MLAttention, "dsa": DSAttention, "gated_delta": GatedDeltaNet}


class SigmoidGatedMLP:
    """Qwen3-Next's shared expert: sigmoid(x . w_gate) * mlp(x), the gate one scalar per token."""

    def __init__(self, mlp: GatedMLP, gate: torch.Tensor):
        self.mlp, self.gate = mlp, make_linear([gate], None, "float32")  # gate [1, hidden]

    def nbytes(self) -> int:
        return self.mlp.nbytes() + self.gate.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


def moe_block(spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str, dtype: str) -> MoEBlock:
    """A MoEBlock whose shared experts are gated when `{prefix}mlp.shared_expert_gate.weight` exists."""
    block = MoEBlock.from_weights(spec, weights, prefix, dtype)
    gate = weights.get(prefix + "mlp.shared_expert_gate.weight")
    if gate is not None:
        if block.shared is None:
            raise LocalMoEError(f"{prefix}mlp.shared_expert_gate.weight: the layer has no shared expert to gate")
        block.shared = SigmoidGatedMLP(block.shared, gate)
    return block


MLPS = {"dense": GatedMLP.from_weights, "moe": moe_block, "latent_moe": moe_block}  # latent: from its weights


def _head(weight, dtype: str):
    """The lm_head, never run on int8-rounded activations: its logits pick the token, and on the
    embedded SmolLM2 a Q8_0 head on rounded inputs changed the greedy answer. A GGUF Q8_0, Q4_K or Q6_K
    head (a Q4_K_M file's output.weight is Q6_K) keeps its blocks with fp32 activations (kernels/ggml_gemv
    exact_x: SmolLM2's tied Q8_0 head reads 30 instead of 56 MB per token as bf16); another
    block-quantised head is dequantised (Linear: fp32 or bf16 weights)."""
    if isinstance(weight, BlockQuantized):
        if weight.ggml_type in ggml_gemv.EXACT_X_TYPES and dtype == "auto" and ggml_gemv.kernel_available():
            return BlockLinear([weight], None, exact_x=True)
        weight = weight.float()
    return make_linear([weight], None, dtype)


def _embedding(weight, dtype: str):
    """GGML blocks stay blocks under dtype "auto" (BlockEmbedding: rows dequantised per lookup); else fp32."""
    if isinstance(weight, BlockQuantized) and dtype == "auto":
        return BlockEmbedding(weight)
    return weight.float()


class Transformer:
    """Embedding -> N x (RMSNorm, mixer, RMSNorm, MLP) -> RMSNorm -> lm_head. fp32 activations."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], config: EngineConfig,
                 experts: ExpertProvider | None = None):
        """`experts`: where routed experts come from when `weights` holds none (a packed store)."""
        if spec.hidden_act not in ACTIVATIONS:
            raise LocalMoEError(f"hidden_act {spec.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        for kind in set(spec.layer_kinds) - MIXERS.keys() | set(spec.mlp_kinds) - MLPS.keys():
            raise UnsupportedModelError(f"{spec.model_type}: layer kind {kind!r} is not implemented yet")
        self.spec, self.config = spec, config
        self.max_context = config.context_for(spec)
        self.eps = spec.rms_norm_eps
        self.embed = _embedding(weights["embed_tokens.weight"], config.dtype)
        self.lm_head = _head(weights.get("lm_head.weight", weights["embed_tokens.weight"]), config.dtype)
        self.norm = weights["norm.weight"].float()
        # GGUF llama3 files carry per-frequency divisors (`rope_freqs`) instead of scaling metadata.
        freq_factors = weights.get("rope_freqs.weight")
        rotary_dim = int(spec.head_dim * spec.partial_rotary_factor)
        if any(kind in ("mla", "dsa") for kind in spec.layer_kinds) and not spec.mla_use_nope:
            rotary_dim = spec.qk_rope_head_dim  # DeepSeek MLA rotates only the shared rope part (and the indexer)
        self.rope = RotaryTable(rotary_dim, spec.rope_theta, None if freq_factors is not None else spec.rope_scaling,
                                self.max_context, freq_factors=freq_factors)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            self.layers.append((weights[p + "input_layernorm.weight"].float(),
                                MIXERS[spec.layer_kinds[i]].from_weights(spec, weights, p, config.dtype),
                                weights[p + "post_attention_layernorm.weight"].float(),
                                MLPS[spec.mlp_kinds[i]](spec, weights, p, config.dtype)))
            mixer = self.layers[-1][1]
            if config.sparse_topk is not None and hasattr(mixer, "sparse_topk") and not isinstance(mixer, DSAttention):
                mixer.sparse_topk = config.sparse_topk  # dense MLA/GQA only: DSA layers select with their indexer
        self.residuals = None  # or a scheme with run(x, attn, mlp) -> [B, T, D] and nbytes()
        if spec.attn_res_block_size:
            self.residuals = AttentionResiduals.from_weights(spec, weights)
        elif spec.hc_mult:
            self.residuals = HyperConnections.from_weights(spec, weights)
        for block in self.moe_blocks():
            block.precision = config.expert_precision
        if experts is not None:
            self.use_experts(experts)
        self._plan: DecodePlan | None = None  # engine/decode_plan.py, built at the first decode step
        if any(block.experts is None for block in self.moe_blocks()):
            raise LocalMoEError(f"{spec.model_type}: the weights hold no routed experts and no expert provider "
                                "was given")

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> ModelCache:
        """A cache for `batch` sequences of up to `max_len` tokens (blocks allocated as they fill), in the
        engine config's `kv_cache_dtype`."""
        max_len = max_len or self.max_context
        dtype = self.config.kv_cache_dtype
        return ModelCache([mixer.new_cache(batch, max_len, dtype) for _, mixer, _, _ in self.layers], batch, max_len)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] (left-padded rows marked False in mask [B, T]) -> logits [B, T|1, V] fp32.

        Appends the new tokens to `cache`; prefill and decode are the same call. Decode-sized calls
        (at most SMALL_STEP_TOKENS tokens) run torch single-threaded and the CPU kernels on every
        thread (kernels/_cpu `small_steps`).
        """
        if tokens.numel() <= SMALL_STEP_TOKENS:
            with small_steps():
                if tokens.numel() == 1 and mask is None:
                    h = self._planned_step(tokens, cache)
                    if h is not None:
                        return self.lm_head(h)
                return self._forward(tokens, cache, mask, all_logits)
        return self._forward(tokens, cache, mask, all_logits)

    def _forward(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None,
                 all_logits: bool) -> torch.Tensor:
        T = tokens.shape[1]
        start = cache.reserve(T)
        cache.append_mask(mask, T)
        step = make_step(cache, start, T, self.rope)
        hidden = self.spec.hidden_size
        x = self.embed(tokens) if isinstance(self.embed, BlockEmbedding) else F.embedding(tokens, self.embed)
        if self.residuals is not None:
            def attn(i: int, h: torch.Tensor) -> torch.Tensor:
                norm, mixer, _, _ = self.layers[i]
                return mixer(F.rms_norm(h, (hidden,), norm, self.eps), step, cache.layers[i])

            def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
                _, _, norm, block = self.layers[i]
                return block(F.rms_norm(h, (hidden,), norm, self.eps))

            x = self.residuals.run(x, attn, mlp)
            cache.advance(T)
            return self.lm_head(F.rms_norm(x if all_logits else x[:, -1:], (hidden,), self.norm, self.eps))
        # plain residuals: each add is fused with the norm that follows it (kernels/rms_norm)
        h = add_rms_norm(x, None, self.layers[0][0], self.eps)
        for i, (_, mixer, mlp_norm, mlp) in enumerate(self.layers):
            h = add_rms_norm(x, mixer(h, step, cache.layers[i]), mlp_norm, self.eps)
            following = self.layers[i + 1][0] if i + 1 < len(self.layers) else self.norm
            h = add_rms_norm(x, mlp(h), following, self.eps)
        cache.advance(T)
        return self.lm_head(h if all_logits else h[:, -1:])

    def _planned_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor | None:
        """One sequence's decode step through the model's DecodePlan (every layer in one kernel call),
        built on first use and again when the layers changed (a failed build stops at the first layer
        that does not qualify: a few microseconds); None where it does not apply."""
        if self._plan is None or not self._plan.current():
            self._plan = DecodePlan.build(self)
        return None if self._plan is None else self._plan.run(tokens, cache)

    def moe_blocks(self) -> list[MoEBlock]:
        return [mlp for _, _, _, mlp in self.layers if isinstance(mlp, MoEBlock)]

    def use_experts(self, provider: ExpertProvider) -> None:
        """Route every MoE layer's expert requests to `provider` (e.g. a pager), replacing the
        resident experts the model was built with."""
        for block in self.moe_blocks():
            block.experts = provider

    def head_shares_embedding(self) -> bool:
        """Whether the lm_head reads the embedding's own blocks (a tied GGUF head: one copy for both)."""
        head = getattr(self.lm_head, "raw", None)
        return isinstance(self.embed, BlockEmbedding) and head is not None and \
            head.data_ptr() == self.embed.rows.data_ptr()

    def weight_bytes(self) -> int:
        """Bytes of weights held (embedding, head, norms excluded from layers, layer matrices,
        routed experts as their providers hold them now)."""
        total = (0 if self.head_shares_embedding() else self.embed.nbytes) + self.lm_head.nbytes() + self.norm.nbytes
        total += self.residuals.nbytes() if self.residuals is not None else 0
        providers = {id(b.experts): b.experts for b in self.moe_blocks() if b.experts is not None}
        total += sum(p.nbytes() for p in providers.values())
        return total + sum(mixer.nbytes() + mlp.nbytes() for _, mixer, _, mlp in self.layers)
