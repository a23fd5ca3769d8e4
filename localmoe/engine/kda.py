"""Kimi Delta Attention (KDA): a gated delta rule with a per-channel decay (Kimi-Linear, Kimi K3).

Per head, with an fp32 state S [K, V] and log-decay g [K] (g <= 0):
    S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q
q and k are L2-normalised (eps 1e-6) after a depthwise causal conv + SiLU, and q is scaled
by K^-0.5. Two decay gates exist, chosen by the model family (never by which tensors exist):
    Kimi-Linear: g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)
    Kimi K3:     g = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)), lower_bound -5
Output: o_proj(RMSNorm_head(o) * sigmoid(gate)), gate = g_b(g_a(x)) (Kimi-Linear) or g_proj(x) (K3).

`recurrent_kda` is the token-by-token form (decode); `chunk_kda` the chunked (WY / UT
transform) form for prefill: within a chunk of C tokens the C delta-rule updates are one
unit-lower-triangular solve, and only the state crosses chunk boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from localmoe.config import ModelSpec
from localmoe.engine.linear import Linear
from localmoe.engine.state_cache import DeltaStateCache
from localmoe.engine.step import Step
from localmoe.errors import CheckpointError, LocalMoEError

CHUNK = 64  # prefill chunk length
RECURRENT_MAX_T = 8  # calls of at most this many tokens use the recurrent form

# What each family's KDA is; the decay/output gate kind is a family fact, not inferred from tensors.
KDA_VARIANTS = {
    "kimi_linear": {"bounded_gate": False, "full_rank_gate": False},
    "kimi_k3": {"bounded_gate": True, "full_rank_gate": True},
}


@dataclass(frozen=True, slots=True)
class KDAConfig:
    """KDA dimensions and variant flags."""

    num_heads: int  # H
    head_dim: int  # K (= V)
    conv_kernel: int = 4
    bounded_gate: bool = False  # K3's lower_bound * sigmoid(...) decay instead of -exp(A) * softplus(...)
    gate_lower_bound: float = -5.0
    full_rank_gate: bool = False  # K3's g_proj instead of the low-rank g_b(g_a(x))
    norm_eps: float = 1e-6  # o_norm epsilon (the model's rms_norm_eps)

    @classmethod
    def from_hf(cls, config: dict[str, Any], family: str) -> KDAConfig:
        """From a Kimi-Linear-style text config (`linear_attn_config` sub-dict) and the family name."""
        if family not in KDA_VARIANTS:
            raise LocalMoEError(f"KDA: no variant known for family {family!r} ({', '.join(KDA_VARIANTS)})")
        linear = config.get("linear_attn_config") or {}
        return cls(num_heads=linear["num_heads"], head_dim=linear["head_dim"],
                   conv_kernel=linear.get("short_conv_kernel_size", 4),
                   gate_lower_bound=float(linear.get("gate_lower_bound", -5.0)),
                   norm_eps=config.get("rms_norm_eps", 1e-6), **KDA_VARIANTS[family])

    def spec_fields(self) -> dict[str, Any]:
        """The ModelSpec fields that carry this config (`from_spec` reads them back)."""
        return {"kda_num_heads": self.num_heads, "kda_head_dim": self.head_dim, "kda_conv_kernel": self.conv_kernel,
                "kda_bounded_gate": self.bounded_gate, "kda_gate_lower_bound": self.gate_lower_bound,
                "kda_full_rank_gate": self.full_rank_gate}

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> KDAConfig:
        """From the `kda_*` fields of a ModelSpec."""
        try:
            return cls(num_heads=spec.kda_num_heads, head_dim=spec.kda_head_dim, conv_kernel=spec.kda_conv_kernel,
                       bounded_gate=spec.kda_bounded_gate, gate_lower_bound=spec.kda_gate_lower_bound,
                       full_rank_gate=spec.kda_full_rank_gate, norm_eps=spec.rms_norm_eps)
        except AttributeError as e:
            raise LocalMoEError(f"{spec.model_type}: ModelSpec lacks the KDA fields ({e})") from None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's l2norm: eps inside the root, not a clamp)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv. x [B, T, C], weight [C, W], tail [B, W-1, C] (the inputs before x).

    Returns (out [B, T, C], new tail [B, W-1, C]); out[t] = sum_j weight[:, j] * input[t - (W-1) + j].
    """
    T, W = x.shape[1], weight.shape[1]
    xs = torch.cat([tail, x], dim=1)
    out = xs[:, :T] * weight[:, 0]
    for j in range(1, W):
        out = out + xs[:, j:j + T] * weight[:, j]
    return out, xs[:, T:].clone()  # a copy: a view would keep all of xs alive in the cache


def recurrent_kda(q, k, v, g, beta, state):
    """Token-by-token KDA. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state [B, H, K, V].

    q, k already normalised and q scaled. Returns (o [B, T, H, V], final state [B, H, K, V]), fp32.
    Per token the old state S is read by one matmul and then updated in place: with a = exp(g),
    (a k)^T S and (a q)^T S come together, and o = (a q)^T S + (q . k) u.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        a = g[:, t].exp()  # [B, H, K]
        kq = torch.stack([k[:, t], q[:, t]], dim=2) * a.unsqueeze(2)  # [B, H, 2, K]
        read = kq @ S  # [B, H, 2, V]: decayed S^T k and S^T q
        u = beta[:, t, :, None] * (v[:, t] - read[:, :, 0])
        out.append(read[:, :, 1] + (q[:, t] * k[:, t]).sum(-1, keepdim=True) * u)
        S.mul_(a.unsqueeze(-1)).addcmul_(k[:, t].unsqueeze(-1), u.unsqueeze(-2))  # no [K, V] temporary
    return torch.stack(out, dim=1), S


SUB = 16  # sub-block length inside a chunk: pairwise decays only within sub-blocks
# Inside a sub-block exp(G_0 - G_j) is formed directly while it stays below e^80 (fp32 max ~e^88.7):
# always for K3's bounded gate (15 steps of >= -5), else when the data allows; otherwise pairwise.
SAFE_EXP = 80.0


def chunk_kda(q, k, v, g, beta, state, chunk_size: int = CHUNK):
    """Chunked KDA, equal to `recurrent_kda` (same shapes and contract).

    Within a chunk (positions i, j; cumulative log-decay G_i = g_1 + ... + g_i, per channel),
    with S0 the state entering it:
      D[i, j] = exp(G_i - G_j) (j <= i, else 0)        per channel, never > 1 since g <= 0
      A[i, j] = beta_i * k_i . (D[i, j] * k_j)  (j < i)  strictly lower triangular
      (I + A) U = beta * (V - (k * exp(G)) S0)           the C delta-rule updates, one solve
      O = (q * exp(G)) S0 + P U,  P[i, j] = q_i . (D[i, j] * k_j)  (j <= i)
      S = exp(G_C) * S0 + (k * exp(G_C - G))^T U
    D is never materialised for the whole chunk. Across sub-blocks of SUB tokens, with r the
    last position of the earlier block, D[i, j] = exp(G_i - G_r) * exp(G_r - G_j), both
    factors <= 1 (no overflow for any gate), so those blocks of A and P are plain matmuls.
    Inside a sub-block the same split through its first position is a matmul too while
    exp(G_0 - G_j) fits in fp32 (SAFE_EXP); a steeper decay falls back to pairwise decays.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = -T % SUB  # zero tokens at the end (g = 0, k = 0, beta = 0) change neither outputs nor state
    q, k, v, g = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2).contiguous() for t in (q, k, v, g))
    beta = F.pad(beta.float(), (0, 0, 0, pad)).transpose(1, 2)  # [B, H, T'] (q, k, v, g: [B, H, T', *])
    S = state.float()
    out = v.new_empty(v.shape)
    tril = torch.ones(SUB, SUB, dtype=torch.bool).tril()
    for s0 in range(0, T + pad, chunk_size):
        c = slice(s0, min(s0 + chunk_size, T + pad))
        qc, kc, vc, bc = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c, None]
        n = kc.shape[2]
        nb = n // SUB
        G = g[:, :, c].cumsum(dim=2)  # [B, H, n, K]
        Gb, kb, qb = (t.reshape(B, H, nb, SUB, -1) for t in (G, kc, qc))  # [B, H, nb, SUB, *]
        G0 = Gb[..., :1, :]  # each sub-block's first position
        if float((G0 - Gb).amax()) < SAFE_EXP:
            # Diagonal sub-blocks through their first position: exp(G_i - G0) <= 1, exp(G0 - G_j) < e^SAFE_EXP.
            right = (kb * (G0 - Gb).exp()).transpose(-1, -2)
            left = (Gb - G0).exp()
            A_diag, P_diag = (kb * left) @ right, ((qb * left) @ right).tril_()
        else:  # a steep decay: form [B, H, nb, SUB(i), SUB(j), K] pairwise decays times k_j
            kd = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill_(~tril[:, :, None], float("-inf"))
            kd = kd.exp_().mul_(kb.unsqueeze(-3))
            A_diag = torch.einsum("bhnijc,bhnic->bhnij", kd, kb)
            P_diag = torch.einsum("bhnijc,bhnic->bhnij", kd, qb)
        A = kc.new_zeros(B, H, n, n)
        P = kc.new_zeros(B, H, n, n)
        for blk in range(nb):
            d = slice(blk * SUB, (blk + 1) * SUB)
            A[:, :, d, d] = A_diag[:, :, blk]
            P[:, :, d, d] = P_diag[:, :, blk]
        # Blocks below the diagonal: every later row against sub-block `blk`, through r.
        for blk in range(nb - 1):
            cols, rows, r = slice(blk * SUB, (blk + 1) * SUB), slice((blk + 1) * SUB, n), (blk + 1) * SUB - 1
            Gr = G[:, :, r:r + 1]
            right = (kc[:, :, cols] * (Gr - G[:, :, cols]).exp()).transpose(-1, -2)  # [B, H, K, SUB]
            left = (G[:, :, rows] - Gr).exp()
            A[:, :, rows, cols] = (kc[:, :, rows] * left) @ right
            P[:, :, rows, cols] = (qc[:, :, rows] * left) @ right
        A = A.mul_(bc).tril_(-1)
        eG = G.exp()
        rhs = torch.cat([bc * vc, bc * (kc * eG)], dim=-1)
        Ub, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split((V, K), dim=-1)
        U = Ub - W @ S  # [B, H, n, V]
        out[:, :, c] = (qc * eG) @ S + P @ U
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        S = G_end.transpose(-1, -2).exp() * S + (kc * (G_end - G).exp()).transpose(-1, -2) @ U
    return out[:, :, :T].transpose(1, 2), S


def valid_tokens(step: Step, T: int) -> torch.Tensor | None:
    """[B, T] bool, False at left-padding slots of this call; None when no row is padded.

    From `step.valid` (engine/step.py), not from the mask: when a whole prefill chunk of a
    row is padding, its last query row sees only itself and would pass for a real token.
    """
    return step.valid


class KimiDeltaAttention:
    """One KDA layer; all input projections (q, k, v, f_a, b, g_a | g_proj) fused into one Linear."""

    def __init__(self, config: KDAConfig, in_proj: Linear, f_b_proj: Linear, g_b_proj: Linear | None,
                 o_proj: Linear, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 o_norm: torch.Tensor):
        self.config = config
        H, K = config.num_heads, config.head_dim
        gate_in = H * K if config.full_rank_gate else K
        self.split = (3 * H * K, K, H, gate_in)  # qkv, f_a, b, gate
        self.in_proj, self.f_b_proj, self.g_b_proj, self.o_proj = in_proj, f_b_proj, g_b_proj, o_proj
        self.conv_weight = conv_weight.float()  # [3 H K, W]
        self.decay_rate = A_log.float().exp().view(1, 1, H, 1)  # exp(A_log[h])
        self.dt_bias = dt_bias.float().view(H, K)
        self.o_norm = o_norm.float()

    @classmethod
    def from_weights(cls, spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str, dtype: str,
                     config: KDAConfig | None = None) -> KimiDeltaAttention:
        """From `{prefix}self_attn.*` as Moonshot stores it (separate q/k/v_conv1d, forget gate inline)."""
        c = config or KDAConfig.from_spec(spec)
        H, K, W, D = c.num_heads, c.head_dim, c.conv_kernel, spec.hidden_size
        p = prefix + "self_attn."

        def get(name: str, *shape: int) -> torch.Tensor:
            t = weights[p + name]
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{p}{name}: shape {tuple(t.shape)}, expected {shape}")
            return t

        gate = [get("g_proj.weight", H * K, D)] if c.full_rank_gate else [get("g_a_proj.weight", K, D)]
        in_proj = torch.cat([get("q_proj.weight", H * K, D), get("k_proj.weight", H * K, D),
                             get("v_proj.weight", H * K, D), get("f_a_proj.weight", K, D),
                             get("b_proj.weight", H, D), *gate])
        conv = torch.cat([get(f"{x}_conv1d.weight", H * K, 1, W)[:, 0] for x in "qkv"])
        A_log = weights[p + "A_log"].flatten()
        if A_log.numel() < H:
            raise CheckpointError(f"{p}A_log: {A_log.numel()} values for {H} heads")
        g_b = None if c.full_rank_gate else Linear(get("g_b_proj.weight", H * K, K), None, dtype)
        return cls(c, Linear(in_proj, None, dtype), Linear(get("f_b_proj.weight", H * K, K), None, dtype), g_b,
                   Linear(get("o_proj.weight", D, H * K), None, dtype), conv,
                   A_log[:H],  # K3 stores A_log padded to max(H, K); the first H are live
                   get("dt_bias", H * K), get("o_norm.weight", K))

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> DeltaStateCache:
        """The recurrent state; it stays fp32 whatever the K/V cache `dtype` (state_cache.py says why)."""
        H, K = self.config.num_heads, self.config.head_dim
        return DeltaStateCache(batch, H, K, K, 3 * H * K, self.config.conv_kernel)

    def nbytes(self) -> int:
        linears = self.in_proj.nbytes() + self.f_b_proj.nbytes() + self.o_proj.nbytes()
        linears += self.g_b_proj.nbytes() if self.g_b_proj is not None else 0
        return linears + sum(t.nbytes for t in (self.conv_weight, self.decay_rate, self.dt_bias, self.o_norm))

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [B, T, H, K] (<= 0) from f = f_b(f_a(x)) [B, T, H, K]."""
        f = f + self.dt_bias
        if self.config.bounded_gate:
            return self.config.gate_lower_bound * torch.sigmoid(self.decay_rate * f)
        return -self.decay_rate * F.softplus(f)

    def __call__(self, x: torch.Tensor, step: Step, cache: DeltaStateCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; folds this step's tokens into `cache`."""
        B, T, _ = x.shape
        H, K = self.config.num_heads, self.config.head_dim
        if cache.offset != step.start:
            raise LocalMoEError(f"KDA cache holds {cache.offset} tokens but this step starts at {step.start}")
        valid = valid_tokens(step, T)
        if valid is not None:  # zeroed padding: the conv tail sees zeros, as at the start of a sequence
            x = x * valid[..., None]
        qkv, f, b, gate = self.in_proj(x).split(self.split, dim=-1)
        qkv, tail = causal_conv(qkv, self.conv_weight, cache.conv_tail)
        q, k, v = F.silu(qkv).view(B, T, 3, H, K).unbind(2)
        q, k = l2norm(q) * K ** -0.5, l2norm(k)
        g = self.decay(self.f_b_proj(f).view(B, T, H, K))
        beta = torch.sigmoid(b)
        if valid is not None:  # padding neither decays nor writes the state
            g, beta = g * valid[..., None, None], beta * valid[..., None]
        kernel = recurrent_kda if T <= RECURRENT_MAX_T else chunk_kda
        o, state = kernel(q, k, v, g, beta, cache.state)
        cache.advance(state, tail, T)
        if self.g_b_proj is not None:
            gate = self.g_b_proj(gate)
        o = F.rms_norm(o, (K,), self.o_norm, self.config.norm_eps) * torch.sigmoid(gate.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))


def state_bytes(config: KDAConfig, batch: int = 1) -> int:
    """Bytes of one layer's cache: fp32 state + conv tails (independent of the context length)."""
    H, K = config.num_heads, config.head_dim
    return 4 * batch * (H * K * K + (config.conv_kernel - 1) * 3 * H * K)


__all__ = ["KDAConfig", "KimiDeltaAttention", "causal_conv", "chunk_kda", "l2norm", "recurrent_kda", "state_bytes"]
