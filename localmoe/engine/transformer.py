"""The decoder-only transformer, assembled per layer from the kinds a ModelSpec lists.

Each layer is (norm, mixer, norm, MLP) with plain residual adds, or a residual scheme that
runs the layers itself: Kimi K3's attention residuals (layers/attn_res.py, `spec.attn_res`)
or GLM-5-Next's hyper-connections (layers/hyper_connections.py, `spec.hyper_connections`). The
mixer of layer i is the module MIXERS[spec.layer_kinds[i]], its MLP MLPS[spec.mlp_kinds[i]]: each
a file of engine/layers/ with a `Config` (`layer_config` finds it: the spec's sub-config of that
kind, or derived from the spec's common fields), `tensors(cfg, prefix)` (composed here into a
model's expected shapes: `model_tensors`) and `build(cfg, weights, prefix, device, dtype)` -> a
layer with `device`, `new_cache(batch, max_len, dtype)` (on that device), `nbytes()` and `__call__(x, step, cache)`.
The model is built on `EngineConfig.device`: every dense weight, the RoPE tables and each layer's cache
live there; routed experts live where their provider keeps them (moe.dispatch moves tokens to them).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from localmoe.config import EngineConfig, ModelSpec
from localmoe.engine import heap
from localmoe.engine.cache import ModelCache
from localmoe.engine.decode_plan import DecodePlan
from localmoe.engine.experts import ExpertProvider
from localmoe.engine.images import build_vision, embed_with_images, image_places, vision_tensors
from localmoe.engine.layers import (
    attention,
    attn_res,
    dsa,
    dsa_shared,
    gated_deltanet,
    hyper_connections,
    kda,
    mla,
    mlp,
    moe,
    on_device,
)
from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.mlp import ACTIVATIONS
from localmoe.engine.layers.moe import MoEBlock
from localmoe.engine.linear import make_linear
from localmoe.engine.quantized import BlockEmbedding, BlockLinear, BlockQuantized, rounded_rows
from localmoe.engine.rope import RotaryTable
from localmoe.engine.step import make_step
from localmoe.errors import CheckpointError, LocalMoEError, UnsupportedModelError
from localmoe.kernels import ggml_gemv
from localmoe.kernels._cpu import small_steps
from localmoe.kernels.rms_norm import add_rms_norm

SMALL_STEP_TOKENS = 8  # tokens of one call (batch x new) up to which it counts as a decode step

MIXERS = {"attention": attention, "sliding_attention": attention, "mla": mla, "dsa": dsa, "dsa_shared": dsa_shared,
          "kda": kda, "gated_delta": gated_deltanet}
MLPS = {"dense": mlp, "moe": moe, "latent_moe": moe}


def layer_config(spec: ModelSpec, kind: str):
    """The Config of a layer kind (ATTENTION_KINDS or MLP_KINDS) in this model: the spec's sub-config of that
    name (mla, dsa, kda, gated_delta; dsa_shared: dsa), else the one its common fields give (attention, MLP, MoE)."""
    if kind in ("attention", "sliding_attention"):
        if kind == "sliding_attention" and not spec.sliding_window:
            raise CheckpointError(f"{spec.model_type}: a sliding_attention layer needs a sliding_window size")
        return attention.Config.of(spec, spec.sliding_window if kind == "sliding_attention" else 0)
    if kind in MLPS:
        return mlp.Config.of(spec) if kind == "dense" else moe.Config.of(spec, latent=kind == "latent_moe")
    cfg = getattr(spec, "dsa" if kind == "dsa_shared" else kind)  # shared DSA layers: the model's DSA config
    if cfg is None:
        raise LocalMoEError(f"{spec.model_type}: the spec lists {kind} layers but has no {kind} config")
    return cfg


def model_tensors(spec: ModelSpec, experts=moe.expert_shapes) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor's shape, composed from the layer kinds: embedding, norms, each layer's mixer and
    MLP (`experts(cfg, prefix)`: the routed experts' parts, bf16 by default), the residual scheme, lm_head."""
    D = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    configs = {kind: layer_config(spec, kind) for kind in {*spec.layer_kinds, *spec.mlp_kinds}}
    for i, (mixer, ffn) in enumerate(zip(spec.layer_kinds, spec.mlp_kinds)):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
        shapes |= MIXERS[mixer].tensors(configs[mixer], p)
        shapes |= mlp.tensors(configs[ffn], p) if ffn == "dense" else moe.tensors(configs[ffn], p, experts)
    if spec.attn_res is not None:
        shapes |= attn_res.tensors(spec.attn_res)
    if spec.hyper_connections is not None:
        shapes |= hyper_connections.tensors(spec.hyper_connections)
    return shapes | vision_tensors(spec)


HEAD_INPUTS = ("int8", "int16", "fp32")  # what a GGUF block lm_head reads (_head)


def head_inputs(spec: ModelSpec, config: EngineConfig) -> str:
    """What the model's GGUF block lm_head reads (HEAD_INPUTS, `_head`): "int8" for a MoE model at expert precision q8
    (`Transformer.rounded`) or any model at q8-all, "fp32" at expert precision exact, else "int16"."""
    rounded = config.expert_kernel_precision == "q8" and any(kind != "dense" for kind in spec.mlp_kinds)
    return ("int8" if rounded or config.expert_precision == "q8-all"
            else "fp32" if config.expert_precision == "exact" else "int16")


def _head(weight, dtype: str, inputs: str):
    """The lm_head. A GGUF block head keeps its blocks (kernels/ggml_gemv). `inputs` (HEAD_INPUTS) "int8" (a MoE
    model at expert precision q8, whose other block GEMVs already round their inputs, or any model at q8-all): its
    input is rounded to int8 per block as llama.cpp does (per 32 values, per 256 for a Q4_K_M file's Q6_K head; any
    of ggml_gemv.TYPES; with fp32 inputs the head was 46% of a Qwen3-MoE Q4_K_M decode token). Otherwise it never
    reads int8-rounded activations: its logits pick the token, and on the embedded SmolLM2 a Q8_0 head on int8
    inputs changes the greedy answer to "What is the capital of France?" (into llama.cpp's, a French list).
    "int16" (a dense model at q8): a Q8_0 head rounds its input to int16 per 32 values (x16: 2^-16 of a block's
    largest value; the embedded SmolLM2's tied head costs ~6.5 instead of 13 ms at 16 rows, its answers unchanged);
    "fp32" (expert precision exact), or a Q4_K / Q6_K head at "int16": fp32 inputs (exact_x). Another
    block-quantised head is dequantised (Linear: fp32 or bf16 weights). The fused single-sequence step and the
    batched rows share this head, so a row's logits are the same alone, batched and in `localmoe run`."""
    if isinstance(weight, BlockQuantized):
        if dtype == "auto" and ggml_gemv.kernel_available():
            if inputs == "int8" and weight.ggml_type in ggml_gemv.KERNEL_TYPES:  # (repacked at load: int8 only)
                return BlockLinear([weight], None)
            if inputs != "fp32" and weight.ggml_type in ggml_gemv.X16_TYPES:
                return BlockLinear([weight], None, x16=True)
            if weight.ggml_type in ggml_gemv.EXACT_X_TYPES:
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
        self.device = device = torch.device(config.device)
        self.max_context = config.context_for(spec)
        self.eps = spec.rms_norm_eps
        self.embed = _embedding(on_device(weights["embed_tokens.weight"], device), config.dtype)
        # a MoE model at expert precision q8: block GEMVs round their inputs (the head's, prefill's: `rounded_rows`);
        # at q8-all every model's GGUF block head does (_head)
        self.rounded = config.expert_kernel_precision == "q8" and any(kind != "dense" for kind in spec.mlp_kinds)
        self.lm_head = _head(on_device(weights.get("lm_head.weight", weights["embed_tokens.weight"]), device),
                             config.dtype, head_inputs(spec, config))
        head = getattr(self.lm_head, "weight", None)
        if ("lm_head.weight" not in weights and isinstance(head, torch.Tensor) and isinstance(self.embed, torch.Tensor)
                and head.dtype == self.embed.dtype and head.shape == self.embed.shape):
            self.embed = head  # tied: one copy, the head's (Linear keeps its weight on huge pages)
        self.norm = on_device(weights["norm.weight"], device).float()
        # GGUF llama3 files carry per-frequency divisors (`rope_freqs`) instead of scaling metadata.
        freq_factors = weights.get("rope_freqs.weight")
        rotary_dim = int(spec.head_dim * spec.partial_rotary_factor)
        latent = spec.mla or (spec.dsa.mla if spec.dsa is not None else None)
        if latent is not None and not latent.use_nope:
            rotary_dim = latent.qk_rope_head_dim  # DeepSeek MLA rotates only the shared rope part (and the indexer)
        self.rope = RotaryTable(rotary_dim, spec.rope_theta, None if freq_factors is not None else spec.rope_scaling,
                                self.max_context, freq_factors=freq_factors, device=device,
                                mrope_section=spec.mrope_section)
        self.layers = []
        configs = {kind: layer_config(spec, kind) for kind in {*spec.layer_kinds, *spec.mlp_kinds}}
        for i in range(spec.num_layers):
            p, kind, ffn = f"layers.{i}.", spec.layer_kinds[i], spec.mlp_kinds[i]
            self.layers.append((on_device(weights[p + "input_layernorm.weight"], device).float(),
                                MIXERS[kind].build(configs[kind], weights, p, device, config.dtype),
                                on_device(weights[p + "post_attention_layernorm.weight"], device).float(),
                                MLPS[ffn].build(configs[ffn], weights, p, device, config.dtype)))
            mixer = self.layers[-1][1]
            if config.sparse_topk is not None and hasattr(mixer, "sparse_topk") and not isinstance(mixer, DSAttention):
                mixer.sparse_topk = config.sparse_topk  # dense MLA/GQA only: DSA layers select with their indexer
        self.residuals = None  # or a scheme with run(x, attn, mlp) -> [B, T, D] and nbytes()
        if spec.attn_res is not None:
            self.residuals = attn_res.build(spec.attn_res, weights, device=device)
        elif spec.hyper_connections is not None:
            self.residuals = hyper_connections.build(spec.hyper_connections, weights, device=device)
        for block in self.moe_blocks():
            block.precision = config.expert_kernel_precision
        if experts is not None:
            self.use_experts(experts)
        self.vision = build_vision(spec, weights, device)  # None without an image tower (engine/images.py)
        self._plan: DecodePlan | None = None  # engine/decode_plan.py, built at the first decode step
        if any(block.experts is None for block in self.moe_blocks()):
            raise LocalMoEError(f"{spec.model_type}: the weights hold no routed experts and no expert provider "
                                "was given")

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> ModelCache:
        """A cache for `batch` sequences of up to `max_len` tokens (blocks allocated as they fill), in the
        engine config's `kv_cache_dtype`, each layer's on that layer's device."""
        max_len = max_len or self.max_context
        dtype = self.config.kv_cache_dtype
        return ModelCache([mixer.new_cache(batch, max_len, dtype) for _, mixer, _, _ in self.layers], batch, max_len,
                          self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None = None,
                all_logits: bool = False, image_embeds: torch.Tensor | None = None,
                mrope: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (left-padded rows marked False in mask [B, T]) -> logits [B, T|1, V] fp32, on the
        model's device (tokens and mask are moved there).

        Appends the new tokens to `cache`; prefill and decode are the same call. Decode-sized calls
        (at most SMALL_STEP_TOKENS tokens) run torch single-threaded and the CPU kernels on every
        thread (kernels/_cpu `small_steps`). `image_embeds` [n, D]: the rows of the n image placeholder
        tokens in `tokens`, in order (the vision tower's projected features); [n, 1 + k, D] where the tower
        also gives k deep-stack feature sets (Qwen3-VL), added to those tokens' hidden states after layers
        0..k-1. `mrope` [3, T]: the tokens' temporal / height / width rotary positions (a Qwen3-VL prompt
        chunk, engine/images.py `PromptImages.mrope`); later tokens continue from the last one's largest.
        """
        places = None if image_embeds is None else \
            image_places(tokens, self.spec.image_token_id, image_embeds.shape[0], self.device)
        if tokens.device != self.device:
            tokens, mask = tokens.to(self.device), None if mask is None else mask.to(self.device)
        if image_embeds is not None or mrope is not None:
            return self._forward(tokens, cache, mask, all_logits, image_embeds, mrope, places)
        if tokens.numel() <= SMALL_STEP_TOKENS:
            with small_steps():
                if tokens.numel() == 1 and mask is None and cache.hidden_sink is None:
                    logits = self._planned_step(tokens, cache)
                    if logits is not None:
                        return logits
                return self._forward(tokens, cache, mask, all_logits)
        return self._forward(tokens, cache, mask, all_logits)

    def _forward(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None,
                 all_logits: bool, image_embeds: torch.Tensor | None = None,
                 mrope: torch.Tensor | None = None, places=None) -> torch.Tensor:
        with rounded_rows() if self.rounded else nullcontext():
            return self._layers(tokens, cache, mask, all_logits, image_embeds, mrope, places)

    def _layers(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None,
                all_logits: bool, image_embeds: torch.Tensor | None, mrope: torch.Tensor | None,
                places) -> torch.Tensor:
        T = tokens.shape[1]
        start = cache.reserve(T)
        cache.append_mask(mask, T)
        if mrope is not None and self.rope.mrope_axes is None:
            raise LocalMoEError(f"{self.spec.model_type}: MRoPE positions given to a model without an mrope_section")
        step = make_step(cache, start, T, self.rope, mrope)
        if mrope is not None:  # the tokens after this chunk continue from its last token's largest position
            cache.rope_delta = int(mrope[:, -1].max()) + 1 - (start + T)
        hidden = self.spec.hidden_size
        lookup = self.embed if isinstance(self.embed, BlockEmbedding) else (lambda t: F.embedding(t, self.embed))
        deep = None
        if image_embeds is not None and image_embeds.dim() == 3:  # [n, 1 + k, D]: k deep-stack feature sets
            image_embeds, deep = image_embeds[:, 0], image_embeds[:, 1:].to(self.device)
        x = lookup(tokens) if image_embeds is None else \
            embed_with_images(lookup, tokens, self.spec.image_token_id, places, image_embeds)
        if self.residuals is not None:
            if deep is not None:
                raise LocalMoEError(f"{self.spec.model_type}: deep-stack image features need plain residuals")
            long = heap.long_chunk(start, T)  # free heap returned before each sublayer (engine/heap.py)

            def attn(i: int, h: torch.Tensor) -> torch.Tensor:
                norm, mixer, _, _ = self.layers[i]
                if long:
                    heap.release()
                return mixer(F.rms_norm(h, (hidden,), norm, self.eps), step, cache.layers[i])

            def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
                _, _, norm, block = self.layers[i]
                if long:
                    heap.release()
                return block(F.rms_norm(h, (hidden,), norm, self.eps))

            x = self.residuals.run(x, attn, mlp)
            cache.advance(T)
            if cache.hidden_sink is not None:
                cache.hidden_sink(start, tokens[0], F.rms_norm(x[0], (hidden,), self.norm, self.eps), True)
            return self.lm_head(F.rms_norm(x if all_logits else x[:, -1:], (hidden,), self.norm, self.eps))
        # plain residuals: each add is fused with the norm that follows it (kernels/rms_norm)
        h = add_rms_norm(x, None, self.layers[0][0], self.eps)
        long = heap.long_chunk(start, T)  # free heap returned before each layer (engine/heap.py)
        for i, (_, mixer, mlp_norm, mlp) in enumerate(self.layers):
            if long:
                heap.release()
            h = add_rms_norm(x, mixer(h, step, cache.layers[i]), mlp_norm, self.eps)
            following = self.layers[i + 1][0] if i + 1 < len(self.layers) else self.norm
            if deep is not None and i < deep.shape[1]:  # deep-stack features join the image tokens' residuals
                x += mlp(h)
                x[places] += deep[:, i]
                h = add_rms_norm(x, None, following, self.eps)
            else:
                h = add_rms_norm(x, mlp(h), following, self.eps)
        cache.advance(T)
        if cache.hidden_sink is not None:
            cache.hidden_sink(start, tokens[0], h[0], True)
        return self.lm_head(h if all_logits else h[:, -1:])

    def _planned_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor | None:
        """One sequence's decode step through the model's DecodePlan (every layer in one kernel call, the lm_head
        too where the plan gives logits) -> logits [1, 1, V]; None where it does not apply."""
        plan = self.decode_plan()
        out = None if plan is None else plan.run(tokens, cache)
        return out if out is None or plan.logits else self.lm_head(out)

    def decode_plan(self) -> DecodePlan | None:
        """The model's DecodePlan (engine/decode_plan.py), built on first use and again when the layers changed
        (a failed build stops at the first layer that does not qualify: a few microseconds); None where there is
        none. The batched step runs its dense form over many rows (engine/batch.py)."""
        if self._plan is None or not self._plan.current():
            self._plan = DecodePlan.build(self)
        return self._plan

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
        total += self.vision.nbytes() if self.vision is not None else 0
        providers = {id(b.experts): b.experts for b in self.moe_blocks() if b.experts is not None}
        total += sum(p.nbytes() for p in providers.values())
        return total + sum(mixer.nbytes() + mlp.nbytes() for _, mixer, _, mlp in self.layers)
