"""Config-reading helpers shared by the MoE families (1-indexed layer lists, MoE placement)."""

from __future__ import annotations

from localmoe.errors import CheckpointError


def require(config: dict, key: str, source: str = "config.json"):
    if key not in config:
        raise CheckpointError(f"{source}: field {key!r} is missing (model_type {config.get('model_type')!r})")
    return config[key]


def kinds_from_one_indexed(num_layers: int, lists: dict[str, list[int]], source: str) -> tuple[str, ...]:
    """Per-layer kinds from 1-INDEXED layer lists (e.g. Kimi's `kda_layers` / `full_attn_layers`)."""
    kinds: list[str | None] = [None] * num_layers
    for kind, layers in lists.items():
        for layer in layers:
            if not 1 <= layer <= num_layers:
                raise CheckpointError(f"{source}: layer {layer} in the {kind} list is outside 1..{num_layers} "
                                      f"(these lists are 1-indexed)")
            if kinds[layer - 1] is not None:
                raise CheckpointError(f"{source}: layer {layer} is listed as both {kinds[layer - 1]} and {kind}")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise CheckpointError(f"{source}: layers {missing} (1-indexed) are in no attention-kind list")
    return tuple(kinds)


def moe_placement(num_layers: int, first_dense: int, frequency: int = 1, kind: str = "moe") -> tuple[str, ...]:
    """DeepSeek-style placement: the first `first_dense` layers dense, then MoE every `frequency` layers."""
    return tuple(kind if i >= first_dense and (i - first_dense) % max(frequency, 1) == 0 else "dense"
                 for i in range(num_layers))
