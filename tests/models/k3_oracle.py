"""A float64 Kimi K3 forward written from MODELS.md alone: the oracle for tests/models/test_kimi_k3.py.

It shares no code with localmoe: weights come from the `safetensors` package, MXFP4 is
decoded here, and every layer is the plain textbook form (token-by-token delta rule,
expanded MLA, per-token routing loops). Batch 1, no cache: `logits(tokens)` recomputes
the whole sequence. Slow on purpose; only for tiny checkpoints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors MXFP4: packed U8 [out, in/2] (element 2i in the low nibble), scale U8 [out, in/32]."""
    out_rows, half = packed.shape
    values = torch.empty(out_rows, 2 * half, dtype=torch.float64)
    p = packed.long()
    for parity, nibbles in ((0, p & 0xF), (1, p >> 4)):
        magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7]
        values[:, parity::2] = torch.where((nibbles & 8) > 0, -magnitude, magnitude)
    factor = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    return values * factor


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)


class K3Oracle:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.c = json.loads((path / "config.json").read_text())["text_config"]
        raw = {}
        for f in sorted(path.glob("*.safetensors")):
            raw |= load_file(str(f))
        self.w = {k.removeprefix("language_model."): v for k, v in raw.items()}
        lin = self.c["linear_attn_config"]
        self.mla_layers = {i - 1 for i in lin["full_attn_layers"]}  # 1-indexed in the config
        self.eps = self.c["rms_norm_eps"]

    def t(self, name: str) -> torch.Tensor:
        return self.w[name].double()

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.t(name + ".weight").T

    def act(self, g, u):
        return situ(g, u, self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"])

    # ---- mixers; x [T, D] already normalised ----

    def kda(self, p: str, x: torch.Tensor) -> torch.Tensor:
        lin = self.c["linear_attn_config"]
        H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
        T = x.shape[0]

        def conv_silu(name: str, y: torch.Tensor) -> torch.Tensor:
            w = self.t(f"{p}.{name}_conv1d.weight")[:, 0]  # [C, W]
            padded = torch.cat([torch.zeros(W - 1, y.shape[1], dtype=y.dtype), y])
            out = torch.stack([sum(w[:, j] * padded[t + j] for j in range(W)) for t in range(T)])
            return torch.nn.functional.silu(out)

        q = conv_silu("q", self.linear(f"{p}.q_proj", x)).view(T, H, K)
        k = conv_silu("k", self.linear(f"{p}.k_proj", x)).view(T, H, K)
        v = conv_silu("v", self.linear(f"{p}.v_proj", x)).view(T, H, K)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = self.linear(f"{p}.f_b_proj", self.linear(f"{p}.f_a_proj", x)).view(T, H, K)
        A = self.t(f"{p}.A_log")[:H].exp().view(1, H, 1)  # stored padded; first H live
        g = lin["gate_lower_bound"] * torch.sigmoid(A * (f + self.t(f"{p}.dt_bias").view(1, H, K)))
        beta = torch.sigmoid(self.linear(f"{p}.b_proj", x))  # [T, H]
        S = torch.zeros(H, K, K, dtype=torch.float64)
        outs = []
        for t in range(T):
            S = g[t].exp()[:, :, None] * S
            pred = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        o = rms(torch.stack(outs), self.t(f"{p}.o_norm.weight"), self.eps)
        o = o * torch.sigmoid(self.linear(f"{p}.g_proj", x)).view(T, H, K)
        return self.linear(f"{p}.o_proj", o.reshape(T, H * K))

    def mla(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        H, r, nope, rope, vd = (c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"],
                                c["qk_rope_head_dim"], c["v_head_dim"])
        T = x.shape[0]
        eps = 1e-6  # the latent norms take the Kimi RMSNorm default, not rms_norm_eps (as in Kimi-Linear)
        q = self.linear(f"{p}.q_b_proj", rms(self.linear(f"{p}.q_a_proj", x), self.t(f"{p}.q_a_layernorm.weight"),
                                              eps)).view(T, H, nope + rope)
        kv = self.linear(f"{p}.kv_a_proj_with_mqa", x)
        latent, k_rope = rms(kv[:, :r], self.t(f"{p}.kv_a_layernorm.weight"), eps), kv[:, r:]
        kv = self.linear(f"{p}.kv_b_proj", latent).view(T, H, nope + vd)
        k = torch.cat([kv[..., :nope], k_rope[:, None, :].expand(T, H, rope)], dim=-1)  # NoPE: no rotary
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(nope + rope)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., nope:]).reshape(T, H * vd)
        return self.linear(f"{p}.o_proj", attn * torch.sigmoid(self.linear(f"{p}.g_proj", x)))

    # ---- MLPs ----

    def dense(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return self.linear(f"{p}.down_proj", self.act(self.linear(f"{p}.gate_proj", x), self.linear(f"{p}.up_proj", x)))

    def moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        scores = torch.sigmoid(self.linear(f"{p}.gate", x))  # [T, E]
        bias = self.t(f"{p}.gate.e_score_correction_bias")
        latent = self.linear(f"{p}.routed_expert_down_proj", x)
        out = torch.zeros_like(latent)
        for t in range(x.shape[0]):
            chosen = sorted(range(scores.shape[1]), key=lambda e: -(scores[t, e] + bias[e]).item())
            chosen = chosen[:c["num_experts_per_token"]]
            weights = scores[t, chosen]
            weights = weights / weights.sum() * c["routed_scaling_factor"]
            for e, wt in zip(chosen, weights):
                m = {n: decode_mxfp4(self.w[f"{p}.experts.{e}.{n}.weight_packed"],
                                     self.w[f"{p}.experts.{e}.{n}.weight_scale"]) for n in ("w1", "w2", "w3")}
                out[t] += wt * (m["w2"] @ self.act(m["w1"] @ latent[t], m["w3"] @ latent[t]))
        y = self.linear(f"{p}.routed_expert_up_proj", rms(out, self.t(f"{p}.routed_expert_norm.weight"), self.eps))
        return y + self.dense(f"{p}.shared_experts", x)

    # ---- attention residuals and the whole model ----

    def mix(self, values: list[torch.Tensor], stem: str) -> torch.Tensor:
        query = self.t(f"{stem}_res_norm.weight") * self.t(f"{stem}_res_proj.weight")[0]
        V = torch.stack(values)  # [N, T, D]
        score = (V / torch.sqrt((V * V).mean(-1, keepdim=True) + self.eps) * query).sum(-1)  # [N, T]
        return (score.softmax(0)[..., None] * V).sum(0)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """tokens -> logits [T, V] float64."""
        c = self.c
        x = self.t("model.embed_tokens.weight")[torch.tensor(tokens)]
        blocks, ps = [], x
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = self.mix(blocks + [ps], f"{p}.self_attention") if blocks else ps
            reset = i % c["attn_res_block_size"] == 0
            if reset:
                blocks.append(ps)
            h = rms(h, self.t(f"{p}.input_layernorm.weight"), self.eps)
            a = self.mla(f"{p}.self_attn", h) if i in self.mla_layers else self.kda(f"{p}.self_attn", h)
            ps = a if reset else ps + a
            h = rms(self.mix(blocks + [ps], f"{p}.mlp"), self.t(f"{p}.post_attention_layernorm.weight"), self.eps)
            ps = ps + (self.dense(f"{p}.mlp", h) if i < c["first_k_dense_replace"] else
                       self.moe(f"{p}.block_sparse_moe", h))
        h = rms(self.mix(blocks + [ps], "model.output_attn"), self.t("model.norm.weight"), self.eps)
        return self.linear("lm_head", h)
