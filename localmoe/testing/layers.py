"""Tensor-list builders shared by the families: linears, norms, MLPs, experts, MLA, KDA.

Every builder returns `TensorSpec`s under a name prefix; shapes are PyTorch's
(`nn.Linear` weight is `[out, in]`). Names follow the on-disk checkpoints, not the
in-memory transformers modules (e.g. Kimi's separate `q_conv1d` / `k_conv1d` / `v_conv1d`,
which transformers concatenates at load time).
"""

from __future__ import annotations

from localmoe.testing.plan import TensorSpec
from localmoe.testing.random_data import Init, dt_bias, log_uniform, norm_weight, normal, randint

BF16, F32, U8 = "BF16", "F32", "U8"

# E8M0 exponents 118..124 scale E2M1 codes (|x| <= 6) by 2^-9 .. 2^-3: |w| ~ 0.002 .. 0.75,
# mostly ~0.01-0.1, so random MXFP4 experts give finite, non-trivial activations.
MXFP4_SCALE = randint(118, 125)
MXFP4_CODES = randint(0, 256)  # any byte is two valid E2M1 codes


def tensor(name: str, shape: tuple[int, ...], init: Init, dtype: str = BF16, **kw) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape), init, **kw)


def linear(name: str, out_f: int, in_f: int, *, bias: bool = False, dtype: str = BF16, std: float = 0.02,
           expert: bool = False) -> list[TensorSpec]:
    """`name.weight` [out, in] (and `name.bias` [out])."""
    specs = [TensorSpec(f"{name}.weight", dtype, (out_f, in_f), normal(std), expert=expert, linear=True)]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", dtype, (out_f,), normal(std), expert=expert))
    return specs


def norm(name: str, dim: int, *, dtype: str = BF16, zero_centred: bool = False, bias: bool = False) -> list[TensorSpec]:
    """An RMSNorm/LayerNorm weight near 1 (near 0 for `(1 + w)` norms such as Qwen3-Next's)."""
    specs = [TensorSpec(f"{name}.weight", dtype, (dim,), normal(0.02) if zero_centred else norm_weight())]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", dtype, (dim,), normal(0.02)))
    return specs


def swiglu(prefix: str, hidden: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
           *, expert: bool = False, bias: bool = False) -> list[TensorSpec]:
    """gate [I, D], up [I, D], down [D, I] under `names` (Kimi experts: w1, w3, w2)."""
    gate, up, down = names
    return [*linear(f"{prefix}.{gate}", inter, hidden, expert=expert, bias=bias),
            *linear(f"{prefix}.{up}", inter, hidden, expert=expert, bias=bias),
            *linear(f"{prefix}.{down}", hidden, inter, expert=expert, bias=bias)]


def experts(prefix: str, n: int, hidden: int, inter: int,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[TensorSpec]:
    """`prefix.{e}.{gate,up,down}.weight` for e < n, bf16, one tensor per expert and matrix."""
    return [s for e in range(n) for s in swiglu(f"{prefix}.{e}", hidden, inter, names, expert=True)]


def mxfp4_packed(name: str, out_f: int, in_f: int) -> list[TensorSpec]:
    """compressed-tensors `mxfp4-pack-quantized` linear: `weight_packed` U8 [out, in/2]
    (element 2i in the low nibble) and `weight_scale` U8 [out, in/32] (E8M0)."""
    if in_f % 32:
        raise ValueError(f"{name}: MXFP4 input width {in_f} is not a multiple of 32")
    return [TensorSpec(f"{name}.weight_packed", U8, (out_f, in_f // 2), MXFP4_CODES, expert=True,
                       params_per_element=2),
            TensorSpec(f"{name}.weight_scale", U8, (out_f, in_f // 32), MXFP4_SCALE, expert=True,
                       params_per_element=0)]


def router(prefix: str, n_experts: int, hidden: int, *, correction_bias: bool = True) -> list[TensorSpec]:
    """`prefix.weight` [E, D] and the fp32 selection bias `prefix.e_score_correction_bias` [E]."""
    specs = linear(prefix, n_experts, hidden)
    if correction_bias:
        specs.append(tensor(f"{prefix}.e_score_correction_bias", (n_experts,), normal(0.01), F32))
    return specs


def mla(prefix: str, hidden: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int, qk_nope: int,
        qk_rope: int, v_dim: int, output_gate: bool = False) -> list[TensorSpec]:
    """DeepSeek multi-head latent attention (kv_b_proj not absorbed), optional `g_proj` gate."""
    qk = qk_nope + qk_rope
    if q_lora_rank is None:
        specs = linear(f"{prefix}.q_proj", heads * qk, hidden)
    else:
        specs = [*linear(f"{prefix}.q_a_proj", q_lora_rank, hidden), *norm(f"{prefix}.q_a_layernorm", q_lora_rank),
                 *linear(f"{prefix}.q_b_proj", heads * qk, q_lora_rank)]
    specs += [*linear(f"{prefix}.kv_a_proj_with_mqa", kv_lora_rank + qk_rope, hidden),
              *norm(f"{prefix}.kv_a_layernorm", kv_lora_rank),
              *linear(f"{prefix}.kv_b_proj", heads * (qk_nope + v_dim), kv_lora_rank),
              *linear(f"{prefix}.o_proj", hidden, heads * v_dim)]
    if output_gate:
        specs += linear(f"{prefix}.g_proj", heads * v_dim, hidden)
    return specs


def dsa_indexer(prefix: str, hidden: int, q_lora_rank: int, heads: int, head_dim: int) -> list[TensorSpec]:
    """DeepSeek-V3.2 lightning indexer: wq_b, wk, LayerNorm k_norm (weight + bias), weights_proj."""
    return [*linear(f"{prefix}.wq_b", heads * head_dim, q_lora_rank), *linear(f"{prefix}.wk", head_dim, hidden),
            *norm(f"{prefix}.k_norm", head_dim, bias=True), *linear(f"{prefix}.weights_proj", heads, hidden)]


def kda(prefix: str, hidden: int, heads: int, head_dim: int, conv: int, *, a_log_shape: tuple[int, ...],
        full_rank_gate: bool = False, conv_dtype: str = BF16) -> list[TensorSpec]:
    """Kimi delta attention as stored: q/k/v projections, one depthwise conv per q/k/v
    ([H*K, 1, conv]), forget gate f_a/f_b + A_log + dt_bias (fp32), beta b_proj [H, D],
    output gate (low-rank g_a/g_b, or full-rank g_proj), o_norm [K], o_proj."""
    d = heads * head_dim
    specs: list[TensorSpec] = []
    for x in "qkv":
        specs += linear(f"{prefix}.{x}_proj", d, hidden)
    for x in "qkv":
        specs.append(tensor(f"{prefix}.{x}_conv1d.weight", (d, 1, conv), normal(0.3), conv_dtype))
    specs += [*linear(f"{prefix}.f_a_proj", head_dim, hidden), *linear(f"{prefix}.f_b_proj", d, head_dim),
              tensor(f"{prefix}.A_log", a_log_shape, log_uniform(1.0, 16.0), F32),
              tensor(f"{prefix}.dt_bias", (d,), dt_bias(), F32),
              *linear(f"{prefix}.b_proj", heads, hidden)]
    if full_rank_gate:
        specs += linear(f"{prefix}.g_proj", d, hidden)
    else:
        specs += [*linear(f"{prefix}.g_a_proj", head_dim, hidden), *linear(f"{prefix}.g_b_proj", d, head_dim)]
    specs += [*norm(f"{prefix}.o_norm", head_dim), *linear(f"{prefix}.o_proj", hidden, d)]
    return specs

