"""What one forward call shares across its layers: positions, RoPE tables, the mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.rope import RotaryTable


@dataclass(slots=True)
class Step:
    start: int  # cache position of the first new token
    positions: torch.Tensor  # [B|1, T] token positions (per row when the batch is left-padded)
    cos: torch.Tensor | None  # [B|1, T, 1, D] RoPE tables at those positions (None without RoPE)
    sin: torch.Tensor | None
    # [B|1, T, S] bool, True = may attend; None when no row is padded: causal, query t sees positions
    # <= start + t (layers build the mask per key block where they need one, engine/blockwise.py)
    mask: torch.Tensor | None
    # [B, T] bool, False at this call's left-padding slots; None when no row is padded. Recurrent
    # layers (KDA's state and conv tail) must skip those tokens; the mask cannot tell them apart
    # when a whole prefill chunk of a row is padding.
    valid: torch.Tensor | None = None
    # [B, T, k] the latest DSA layer's selection in this call (-1 pads), for the `dsa_shared` layers after it
    selection: torch.Tensor | None = None


def make_step(cache: ModelCache, start: int, T: int, rope: RotaryTable | None,
              mrope: torch.Tensor | None = None) -> Step:
    """Positions, causal/padding mask and RoPE tables for T new tokens at cache position `start`, on the
    cache's device (the model's). Rotary positions are cache positions + `cache.rope_delta`, or `mrope`
    [3, T] (temporal, height, width: a Qwen3-VL prompt chunk, `RotaryTable.at_mrope`)."""
    S = start + T
    valid = None
    device = cache.device
    delta = cache.rope_delta
    if cache.key_mask is None:
        positions = torch.arange(start + delta, S + delta, device=device).unsqueeze(0)
        mask = None
    else:
        keys = cache.key_mask[:, :S]  # [B, S]
        positions = (keys.long().cumsum(-1) - 1).clamp(min=0)[:, start:] + delta
        mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=start)[None] & keys[:, None, :]
        # A padding query sees no key; let it see itself so its (ignored) output stays finite.
        mask[:, torch.arange(T, device=device), torch.arange(start, S, device=device)] = True
        valid = keys[:, start:]
    if mrope is not None:
        cos, sin = rope.at_mrope(mrope.to(device))
    else:
        cos, sin = rope.at(positions) if rope is not None else (None, None)
    return Step(start, positions, cos, sin, mask, valid)
