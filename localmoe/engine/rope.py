"""Rotary position embeddings: inverse frequencies (plain, linear, llama3, YaRN) and application.

Convention: NeoX / HF style, rotating the two halves of each head (`rotate_half`).
Checkpoints in GPT-J (adjacent-pair) order are permuted to this order when loaded.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] in float64 and the attention scale factor YaRN asks for (1.0 otherwise)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        between = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == "yarn":  # as transformers 5.23 `_compute_yarn_parameters`
        original = float(scaling.get("original_max_position_embeddings", 4096))
        beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):  # gpt-oss sets truncate=False: a fractional ramp
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1 where we keep the original frequency
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return inv, _yarn_attention_factor(scaling, factor)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    """cos/sin multiplier: `attention_factor`, else 0.1 ln(factor) + 1 (DeepSeek: the ratio of
    that with `mscale` over that with `mscale_all_dim`)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


class RotaryTable:
    """cos/sin for every position up to `max_positions`, [P, head_dim] float32, computed once."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 freq_factors: torch.Tensor | None = None, device: str | torch.device = "cpu",
                 mrope_section: tuple[int, ...] | None = None):
        """The tables are computed on the CPU in float64 (the same bits on every device) and kept on `device`.
        `mrope_section` (Qwen3-VL): how many frequencies take the temporal, height and width positions (`at_mrope`)."""
        inv_freq, mscale = inverse_frequencies(head_dim, theta, scaling)
        if freq_factors is not None:  # GGUF `rope_freqs`: per-frequency divisors (Llama 3.1 scaling)
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = (angles.cos() * mscale).float().to(device)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]: fold the sign into the table
        half = head_dim // 2
        sin = angles.sin() * mscale
        sin[:, :half] = -sin[:, :half]
        self.sin = sin.float().to(device)
        self.mrope_axes = None if not mrope_section else mrope_axes(head_dim, mrope_section).to(device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

    def at_mrope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MRoPE: positions [3, T] (temporal, height, width) -> cos, sin [1, T, 1, D], each column at the position
        of its axis (`mrope_axes`). A token whose three positions are equal gets `at`'s rows."""
        index = positions[self.mrope_axes].T  # [T, D]: column d's position
        return (self.cos.gather(0, index)[None, :, None], self.sin.gather(0, index)[None, :, None])


def mrope_axes(head_dim: int, section: tuple[int, ...]) -> torch.Tensor:
    """The position axis (0 temporal, 1 height, 2 width) of each of the head_dim rotary columns, interleaved as
    transformers' Qwen3-VL does it: frequency j takes height where j % 3 == 1 and j < 3 * section[1], width where
    j % 3 == 2 and j < 3 * section[2], temporal elsewhere; both halves of a head alike."""
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must be 3 counts summing to head_dim / 2 = {head_dim // 2}")
    j = torch.arange(head_dim // 2)
    axes = torch.zeros(head_dim // 2, dtype=torch.long)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return torch.cat([axes, axes])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by the tables' cos / signed sin [B, T, 1, D] (three ops: decode is op-bound)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
