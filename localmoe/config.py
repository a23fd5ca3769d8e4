"""Architecture facts (`ModelSpec`) and runtime settings (`EngineConfig`).

`ModelSpec` is one architecture-neutral description that every family's parser fills in
from an HF `config.json` or GGUF metadata; the engine builds layers from it alone.
`EngineConfig` holds what the user chooses at run time (dtype, threads, context size).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from localmoe.errors import LocalMoEError

# "attention": GQA; "sliding_attention": GQA over a window; "mla": DeepSeek latent attention;
# "dsa": MLA + lightning indexer; "dsa_shared": MLA reusing the previous DSA layer's selection (GLM-5,
# its `dsa` config); "kda": Kimi delta attention; "gated_delta": Gated DeltaNet
ATTENTION_KINDS = ("attention", "sliding_attention", "mla", "dsa", "dsa_shared", "kda", "gated_delta")
MLP_KINDS = ("dense", "moe", "latent_moe")
# ModelSpec fields holding the Config of an engine/layers/<kind>.py (None where the model has no such layer)
SUB_CONFIGS = ("mla", "dsa", "kda", "gated_delta", "attn_res", "hyper_connections")


@dataclass(slots=True)
class ModelSpec:
    """What a checkpoint is: dimensions and per-layer kinds. Built by `localmoe/models/<family>.py`."""

    model_type: str  # HF model_type or GGUF general.architecture
    family: str  # registry key of the family module that parsed it
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # GGUF llama files store q/k rows permuted for GPT-J style RoPE (rotate adjacent
    # pairs); HF checkpoints use NeoX style (rotate the two halves).
    rope_interleaved: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    hidden_act: str = "silu"
    layer_kinds: tuple[str, ...] = ()  # one entry per layer, from ATTENTION_KINDS
    mlp_kinds: tuple[str, ...] = ()  # one entry per layer, from MLP_KINDS
    name: str = ""  # human-readable model name when the checkpoint gives one
    # Mixture of experts (0 for dense models); per-layer placement is in mlp_kinds.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    latent_moe_size: int = 0  # K3 latent MoE: experts run at this width (routed_expert_hidden_size); 0 = hidden
    # Routing and expert activation (engine/layers/moe.py), named after the HF config keys
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" | "topk_softmax" (gpt-oss: top-k logits, then softmax)
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited top-k: keep the topk_group best of n_group expert groups
    topk_group: int = 1
    expert_act: str = "swiglu"  # "swiglu" | "gpt_oss_swiglu" (clamped, biased) | "situ" (Kimi K3)
    swiglu_limit: float = 7.0  # gpt_oss_swiglu clamp
    swiglu_alpha: float = 1.702  # gpt_oss_swiglu sigmoid slope
    # GLM-5-Next `swiglu_limit`: every SwiGLU (dense MLP, shared and routed experts) clamps the gate
    # to <= glu_limit and up to [-glu_limit, glu_limit] before silu(gate) * up; 0 = no clamp
    glu_limit: float = 0.0
    situ_beta: float = 4.0  # K3 SiTU-GLU: situ_beta*tanh(g/situ_beta)*sigmoid(g) * ... (activation_situ_beta)
    situ_linear_beta: float = 25.0  # ... * situ_linear_beta*tanh(u/situ_linear_beta) (activation_situ_linear_beta)
    sliding_window: int = 0  # keys a `sliding_attention` layer sees, its own position included
    # Qwen3-Next full attention: RoPE on the first partial_rotary_factor * head_dim dims of each
    # head; q_proj twice as wide ([query; gate] per head), output * sigmoid(gate)
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen3-Next: its one shared expert's width
    # One sub-config per layer kind the model has (None where it has none), each the `Config` of
    # its engine/layers/<kind>.py: the kind's own facts, as the family parsed them.
    mla: Any = None  # mla.Config of the `mla` layers
    dsa: Any = None  # dsa.Config of the `dsa` layers (its MLA and its lightning indexer)
    kda: Any = None  # kda.Config of the `kda` layers
    gated_delta: Any = None  # gated_deltanet.Config of the `gated_delta` layers
    attn_res: Any = None  # attn_res.Config: K3's attention residuals replace the plain residual adds
    hyper_connections: Any = None  # hyper_connections.Config: GLM-5-Next's hc_mult residual streams
    vision: Any = None  # vision_moonvit.Config / vision_qwen3vl.Config: the image tower (engine/images.py)
    image_token_id: int = -1  # the prompt's image placeholder token; its rows take the image embeddings
    # MRoPE (Qwen3-VL `rope_parameters.mrope_section`): rotary frequencies taking the temporal, height and width
    # positions of a token (interleaved, engine/rope.py `mrope_axes`); None = one position per token
    mrope_section: tuple[int, ...] | None = None
    # MTP / next-n layers a checkpoint appends after the last layer (DeepSeek-V3, GLM-4.5
    # `num_nextn_predict_layers`): not part of the main model; checkpoint.tensor_names leaves their tensors out
    nextn_layers: int = 0

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            self.layer_kinds = ("attention",) * self.num_layers
        if not self.mlp_kinds:
            self.mlp_kinds = ("dense",) * self.num_layers
        self.layer_kinds, self.mlp_kinds = tuple(self.layer_kinds), tuple(self.mlp_kinds)
        if self.mrope_section is not None:
            self.mrope_section = tuple(self.mrope_section)
        if len(self.layer_kinds) != self.num_layers or len(self.mlp_kinds) != self.num_layers:
            raise LocalMoEError(f"{self.model_type}: layer kind lists must have num_layers={self.num_layers} entries")
        unknown = (set(self.layer_kinds) - set(ATTENTION_KINDS)) | (set(self.mlp_kinds) - set(MLP_KINDS))
        if unknown:
            raise LocalMoEError(f"{self.model_type}: unknown layer kinds {sorted(unknown)}")
        if self.num_heads % self.num_kv_heads:
            raise LocalMoEError(f"{self.model_type}: num_heads={self.num_heads} is not a multiple of "
                                f"num_kv_heads={self.num_kv_heads}")
        for kind in SUB_CONFIGS:
            width = getattr(getattr(self, kind), "hidden_size", self.hidden_size)
            if width != self.hidden_size:
                raise LocalMoEError(f"{self.model_type}: the {kind} config's hidden_size={width} is not the "
                                    f"model's {self.hidden_size}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (sub-configs as nested dicts); `engine.specs.spec_from_dict` reads it back."""
        data = dataclasses.asdict(self)
        data["layer_kinds"], data["mlp_kinds"] = list(self.layer_kinds), list(self.mlp_kinds)
        return data

    # ---- derived sizes (used by `inspect` and the planner) ----

    def attention_params(self) -> int:
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return q + kv + q + bias + norms  # q, k, v, o

    def mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def parameter_counts(self) -> dict[str, int]:
        """Total and per-token active parameters (equal for dense models)."""
        per_layer = self.attention_params() + self.mlp_params() + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        total = embed + head + self.num_layers * per_layer + self.hidden_size
        return {"total": total, "active": total, "embedding": embed, "lm_head": head}

    def moe_layers(self) -> list[int]:
        """0-based indices of the layers whose MLP is a routed-expert block."""
        return [i for i, kind in enumerate(self.mlp_kinds) if kind in ("moe", "latent_moe")]

    def kv_bytes_per_token(self, cache_dtype: str | int = "float32") -> int:
        """Cache bytes one more token costs one sequence across all layers: K and V for GQA layers,
        the latent + rope row for MLA layers; delta-rule layers keep a constant-size state.

        `cache_dtype` is a KV_CACHE_DTYPES name ("fp8": 1 byte per value plus one fp32 scale per
        token and KV head, or per MLA row, as engine/cache.py stores them) or a byte count per value.
        Sliding-window layers are counted at full length (the cache keeps every position).
        """
        gqa = (2 * self.num_kv_heads * self.head_dim, 2 * self.num_kv_heads)  # (values, fp8 scales)
        mla = (self.mla.row_dim, 1) if self.mla is not None else (0, 0)
        dsa = shared = (0, 0)
        if self.dsa is not None:
            shared = (self.dsa.mla.row_dim, 1)  # dsa_shared layers keep no index keys
            # the MLA row plus one index key (fp8: one scale per block of up to 128 values, layers/index_cache.py);
            # k-pool indexers also keep each token's pool-gate logits, as many again
            index_dim = self.dsa.index_cache_dim
            dsa = (self.dsa.mla.row_dim + index_dim, 1 + -(-index_dim // min(128, index_dim)))
        per_kind = {"attention": gqa, "sliding_attention": gqa, "mla": mla, "dsa": dsa, "dsa_shared": shared,
                    "kda": (0, 0), "gated_delta": (0, 0)}
        values = sum(per_kind[kind][0] for kind in self.layer_kinds)
        if isinstance(cache_dtype, int):
            return values * cache_dtype
        if cache_dtype not in KV_CACHE_DTYPES:
            raise LocalMoEError(f"cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {cache_dtype!r}")
        if cache_dtype == "fp8":
            return values + 4 * sum(per_kind[kind][1] for kind in self.layer_kinds)
        return values * (4 if cache_dtype == "float32" else 2)


DTYPES = ("auto", "float32", "bfloat16")
EXPERT_PRECISIONS = ("q8", "q8-all", "exact")  # EngineConfig.expert_precision; the experts' is kernels/mxfp4_moe PRECISIONS
KV_CACHE_DTYPES = ("float32", "bfloat16", "fp8")  # engine/cache.py; fp8 = e4m3 + one fp32 scale per head/row
PAGING_POLICIES = ("lru", "lfu", "lfru", "belady")  # paging/policy.py
PAGING_IO = ("odirect", "mmap")  # paging/disk.py
# --spec-k's default, the most drafts per step: 7 (8 rows, the decode kernels' GEMV_MAX_ROWS; engine/spec/speculator.py
# K_MAX); the speculator drafts fewer per match class where more do not pay (a quote in progress takes all 7: on the
# code edit 1.41x against 1.35x at 4, same process, session 15)
SPEC_K = 7


@dataclass(slots=True)
class PagingConfig:
    """Where a packed store's routed experts live (localmoe/paging; the --ram ... --trace flags)."""

    ram_budget: int = 0  # bytes of host RAM for expert slots; 0 = no pager (the page cache decides)
    gpu_budget: int = 0  # bytes per GPU for device expert slots; 0 = no GPU tier
    policy: str = "lfru"  # PAGING_POLICIES; "belady" needs `trace`
    io: str = "odirect"  # PAGING_IO
    prefetch: bool = True  # router lookahead + parallel loads of each layer's chosen experts
    profile: str = ""  # calibration profile (localmoe calibrate): hot experts pinned, and LFRU's popularity prior
    trace: str = ""  # routing trace (localmoe trace): the future the Belady oracle sees
    io_threads: int = 4  # ~0.9 GB/s with 4 parallel reads vs ~0.5 GB/s with one on the dev machine
    timeout: float = 30.0  # seconds before a read is declared hung
    verify: bool = True  # check each extent's xxh3 after reading it

    def __post_init__(self) -> None:
        if self.ram_budget < 0 or self.gpu_budget < 0:
            raise LocalMoEError(f"--ram and --gpu-mem must be >= 0 bytes, not {self.ram_budget} / {self.gpu_budget}")
        if self.policy not in PAGING_POLICIES:
            raise LocalMoEError(f"unknown paging policy {self.policy!r}; choose one of {', '.join(PAGING_POLICIES)}")
        if self.io not in PAGING_IO:
            raise LocalMoEError(f"unknown paging I/O backend {self.io!r}; choose one of {', '.join(PAGING_IO)}")
        if self.policy == "belady" and not self.trace:
            raise LocalMoEError("the belady policy needs --trace (a routing trace from `localmoe trace`)")
        if self.timeout <= 0 or self.io_threads < 1:
            raise LocalMoEError("the I/O timeout must be > 0 s and io_threads >= 1")


@dataclass(slots=True)
class EngineConfig:
    """Runtime choices; independent of the checkpoint."""

    dtype: str = "auto"  # weights for GEMV; "auto" picks by measurement (see engine/weights.py)
    threads: int = 0  # 0 = all physical cores
    max_context: int = 0  # KV cache length; 0 = min(model max, 8192)
    kv_cache_dtype: str = "float32"  # K/V and MLA latent rows: KV_CACHE_DTYPES; delta-rule state stays fp32
    # MXFP4 and GGUF-block routed experts: "q8" rounds each projection's input to int8 per 32 values
    # (per 256 for K-quant blocks: llama.cpp's trade, ~2x faster on AVX2), and so does a MoE model's GGUF block
    # lm_head (engine/transformer.py _head; a dense model's Q8_0 head rounds to int16 per 32 instead); "q8-all" rounds
    # every model's GGUF block lm_head to int8 (dense ones: llama.cpp's numerics); "exact" keeps fp32 activations
    # there (kernels/mxfp4_moe)
    expert_precision: str = "q8"
    device: str = "cpu"
    max_batch: int = 1
    paging: PagingConfig = dataclasses.field(default_factory=PagingConfig)  # a packed store's routed experts
    # training-free top-k over dense MLA/GQA attention scores (engine/sparse_topk.py): each query
    # attends only to its sparse_topk best-scoring cached tokens; None = exact dense attention
    sparse_topk: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LocalMoEError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise LocalMoEError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                f"not {self.kv_cache_dtype!r}")
        if self.expert_precision not in EXPERT_PRECISIONS:
            raise LocalMoEError(f"--expert-precision must be one of {', '.join(EXPERT_PRECISIONS)}, "
                                f"not {self.expert_precision!r}")
        if self.threads < 0 or self.max_context < 0 or self.max_batch < 1:
            raise LocalMoEError("threads and max_context must be >= 0 and max_batch >= 1")
        if self.sparse_topk is not None and self.sparse_topk < 1:
            raise LocalMoEError(f"--sparse-topk must be a positive number of tokens, not {self.sparse_topk}")

    @property
    def expert_kernel_precision(self) -> str:
        """What routed experts compute at (kernels/mxfp4_moe PRECISIONS): "q8" under q8 and q8-all, else "exact"."""
        return "exact" if self.expert_precision == "exact" else "q8"

    def resolved_threads(self) -> int:
        if self.threads:
            return self.threads
        try:
            import psutil

            return psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except (ImportError, OSError):  # no psutil, or no physical-core count on this platform
            return os.cpu_count() or 1

    def context_for(self, spec: ModelSpec) -> int:
        return self.max_context or min(spec.max_position_embeddings, 8192)
