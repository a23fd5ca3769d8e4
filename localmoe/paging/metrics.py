"""Paging statistics for other front ends: Prometheus text for the server's /metrics, and the
line `localmoe run --stats` prints (`stats_line`)."""

from __future__ import annotations

from localmoe.paging.stats import PagingStats

_TIER_COUNTERS = (("hits", "hits", "Demand requests served from the tier"),
                  ("misses", "misses", "Demand requests the tier did not hold"),
                  ("loads", "loads", "Experts brought into the tier"),
                  ("bytes_read", "bytes_read", "Bytes brought into the tier"),
                  ("evictions", "evictions", "Experts evicted from the tier"),
                  ("stall_seconds", "stall_seconds", "Seconds compute waited for the tier's loads"),
                  ("read_seconds", "read_seconds", "Seconds with at least one load in flight"),
                  ("lookup_seconds", "lookup_seconds", "Seconds of the pager's own work on the compute thread"))
_PREFETCH = (("issued", "Prefetch loads started"), ("used", "Prefetched experts later requested"),
             ("wasted", "Prefetched experts evicted or failed unused"),
             ("late", "Prefetched experts requested while still loading"))


def prometheus_text(stats: PagingStats, prefix: str = "localmoe_paging", labels: dict[str, str] | None = None) -> str:
    """Prometheus text exposition (version 0.0.4) of `stats`; counters end in `_total`."""
    base = {"policy": stats.policy, "backend": stats.backend, **(labels or {})}

    def fmt(extra: dict[str, str]) -> str:
        items = {**base, **extra}
        return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in items.items()) + "}"

    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        full = f"{prefix}_{name}"
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        lines.extend(f"{full}{fmt(lab)} {_num(v)}" for lab, v in samples)

    for attr, name, help_ in _TIER_COUNTERS:
        metric(f"{name}_total", "counter", help_, [({"tier": t}, getattr(s, attr)) for t, s in stats.tiers.items()])
    metric("hit_ratio", "gauge", "hits / requests", [({"tier": t}, s.hit_rate) for t, s in stats.tiers.items()])
    metric("overlap_ratio", "gauge", "Fraction of load time that overlapped compute",
           [({"tier": t}, s.overlap) for t, s in stats.tiers.items()])
    metric("slots", "gauge", "Expert slots in the RAM tier", [({"tier": "ram"}, stats.slots)])
    metric("slot_bytes", "gauge", "Bytes per expert slot", [({"tier": "ram"}, stats.slot_bytes)])
    metric("steps_total", "counter", "Forward passes seen", [({}, stats.steps)])
    if stats.computed:
        metric("computed_total", "counter", "Experts computed in each tier (ram: on the CPU)",
               [({"tier": t}, n) for t, n in sorted(stats.computed.items())])
    for attr, help_ in _PREFETCH:
        metric(f"prefetch_{attr}_total", "counter", help_, [({}, getattr(stats.prefetch, attr))])
    metric("prefetch_precision", "gauge", "used / issued", [({}, stats.prefetch.precision)])
    metric("prefetch_recall", "gauge", "Requests a prefetch covered / (those + misses)",
           [({}, stats.prefetch.recall)])
    return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def pager_of(model):
    """The Pager serving `model`'s experts (a Transformer or LoadedModel), or None."""
    from localmoe.paging.pager import Pager

    model = getattr(model, "model", model)
    for block in getattr(model, "moe_blocks", list)():
        if isinstance(block.experts, Pager):
            return block.experts
    return None


def stats_line(model) -> str | None:
    """The one-line paging summary for `localmoe run --stats` (None when the model is not paged)."""
    pager = pager_of(model)
    return None if pager is None else f"[{pager.stats.summary()}]"
