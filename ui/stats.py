"""Live statistics for the UIs' status bar and plots: speed, latency, expert-tier hit rates
and memory use, read from a Service (and the last turn, when the caller has one).

    snapshot(service, conversation.last_turn)
    # {"tokens_per_second": 41.2, "time_to_first_token": 0.18, "tier_hit_rates": {"ram": 0.93},
    #  "ram_used_bytes": 1203412992, "vram_used_bytes": None, ...}
"""

from __future__ import annotations


def _vram_used_bytes() -> int | None:
    """Bytes allocated by torch on all CUDA devices, None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - a broken driver must not take the status bar down
        return None


def snapshot(service, turn=None) -> dict:
    """The current figures.

    tokens_per_second: generated tokens / seconds of `turn` (a TurnResult) when given, else the
    service's rate over its recent window; time_to_first_token likewise (else the mean over all
    requests, None before the first). tier_hit_rates: {tier: hits / requests} of the expert pager
    ({} for dense models). ram_used_bytes: this process's resident memory; vram_used_bytes: CUDA
    memory allocated by torch (None without CUDA). spec_acceptance (drafts kept / drafted) and
    spec_tokens_per_step (tokens per forward): of the turn where it speculated, else of the service's
    finished sequences while it runs --spec; None without speculation.
    """
    import psutil

    metrics = service.metrics
    if turn is not None and turn.seconds > 0:
        tokens_per_second = turn.completion_tokens / turn.seconds
        ttft = turn.time_to_first_token
        decode_seconds = turn.seconds - turn.time_to_first_token
        decode_rate = (turn.completion_tokens - 1) / decode_seconds if turn.completion_tokens > 1 and \
            decode_seconds > 0 else None
    else:
        tokens_per_second = metrics.tokens_per_second()
        ttft = metrics.ttft_sum / metrics.ttft_n if metrics.ttft_n else None
        decode_rate = None
    from localmoe.runtime.metrics import paging_tiers

    tiers = paging_tiers(service.model)
    spec = _speculation(service, turn)
    return {
        "tokens_per_second": tokens_per_second,
        "decode_tokens_per_second": decode_rate,
        "time_to_first_token": ttft,
        "tier_hit_rates": {name: stats.hit_rate for name, stats in tiers.items()},
        "tier_bytes_read": {name: stats.bytes_read for name, stats in tiers.items()},
        "ram_used_bytes": psutil.Process().memory_info().rss,
        "ram_total_bytes": psutil.virtual_memory().total,
        "vram_used_bytes": _vram_used_bytes(),
        "completion_tokens_total": metrics.completion_tokens,
        "spec_acceptance": spec.acceptance if spec is not None else None,
        "spec_tokens_per_step": spec.tokens_per_step if spec is not None else None,
    }


def _speculation(service, turn):
    """The SpecStats to show: the turn's where it speculated, else the service's finished sequences' while
    it speculates (--spec); None: no speculation to report."""
    spec = getattr(turn, "spec", None) if turn is not None else None
    if spec is not None and spec.steps:
        return spec
    speculation = getattr(service, "speculation", None)
    if turn is None and speculation is not None and speculation.on and speculation.stats.steps:
        return speculation.stats
    return None


def human_bytes(n: int | None) -> str:
    """1.2G, 340M, 12K; "-" for None."""
    if n is None:
        return "-"
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def status_line(figures: dict) -> str:
    """One line for an 80-column status bar: tok/s, TTFT, tier hit rates, RAM, VRAM, and with speculation
    the share of drafts kept and the tokens per step (`spec 75% x3.4`)."""
    rate = figures.get("tokens_per_second")
    ttft = figures.get("time_to_first_token")
    parts = [f"{rate:.1f} tok/s" if rate else "- tok/s", f"TTFT {ttft:.2f}s" if ttft is not None else "TTFT -"]
    tiers = figures.get("tier_hit_rates") or {}
    parts.append(" ".join(f"{t} {r:.0%}" for t, r in tiers.items()) if tiers else "dense (no paging)")
    parts.append(f"RAM {human_bytes(figures.get('ram_used_bytes'))}")
    vram = figures.get("vram_used_bytes")
    if vram is not None:
        parts.append(f"VRAM {human_bytes(vram)}")
    if figures.get("spec_tokens_per_step") is not None:
        parts.append(f"spec {figures['spec_acceptance']:.0%} x{figures['spec_tokens_per_step']:.1f}")
    return " | ".join(parts)
