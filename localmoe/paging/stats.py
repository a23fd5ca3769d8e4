"""Paging statistics: what every tier served, read and waited for; prefetch quality.

`PagingStats` is a plain object (the pager updates it; readers take `snapshot()` or
`to_dict()`). Definitions (docs/paging.md, "Reading the statistics"):
- hits / misses: demand requests served from the tier / not found there. A request
  for an expert whose prefetch is still in flight counts as a hit that stalled.
- bytes_read: bytes brought into the tier (from disk for "ram").
- stall_seconds: time the compute thread waited for the tier's loads.
- read_seconds: wall time with at least one read in flight (on the I/O threads);
- lookup_seconds: the pager's own work on the compute thread (finding slots, choosing victims, the
  policy's bookkeeping, routing hints: with the later layers' routers that make the lookahead's guesses,
  `prefetch.hint_seconds`), stalls excluded;
  overlapped_seconds = read time that did not stall compute; overlap = their ratio.
- prefetch precision = prefetched loads later demanded / prefetched loads issued (a guess is settled, used or
  wasted, when it is first demanded, when its layer's next routing does not choose it, or when it leaves);
  recall = demand requests a prefetch covered / (those + demand misses).
- GPU tiers ("gpu0", ...): requests are experts computed for that GPU's layers, hits the ones
  it held, bytes_read the bytes copied in; `computed` counts where each expert ran ("ram": on
  the CPU, from host memory).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    loads: int = 0
    stall_seconds: float = 0.0
    read_seconds: float = 0.0  # wall time with at least one read in flight
    evictions: int = 0
    lookup_seconds: float = 0.0  # the pager's own work on the compute thread (stalls excluded)

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def overlapped_seconds(self) -> float:
        """Read time during which compute was not waiting (stalls happen only while reads are in flight)."""
        return max(0.0, self.read_seconds - self.stall_seconds)

    @property
    def overlap(self) -> float:
        """Fraction of read time that ran while compute went on."""
        return self.overlapped_seconds / self.read_seconds if self.read_seconds > 0 else 0.0


@dataclass
class PrefetchStats:
    issued: int = 0  # prefetch loads started (and those still pending when the counts were reset)
    used: int = 0  # of those, demanded before being evicted
    wasted: int = 0  # not chosen by their layer's next routing, or evicted (or failed) before being demanded
    pending: int = 0  # issued, neither used nor wasted yet (kept across `reset_counts`)
    late: int = 0  # demanded while still loading (the request stalled on it)
    covered: int = 0  # demand requests served by a prefetched load (first use)
    uncovered: int = 0  # demand misses: no prefetch had started
    # the routing hints' work on the compute thread: the later layers' routers making the guesses (`begin_layer`
    # calls them once this layer's reads are submitted) and the wrapped routers' bookkeeping before it; also counted
    # in the RAM tier's lookup_seconds
    hint_seconds: float = 0.0

    @property
    def precision(self) -> float:
        return self.used / self.issued if self.issued else 0.0

    @property
    def recall(self) -> float:
        total = self.covered + self.uncovered
        return self.covered / total if total else 0.0


@dataclass
class PagingStats:
    policy: str = ""
    backend: str = ""
    slots: int = 0
    slot_bytes: int = 0
    steps: int = 0  # forward passes seen (decode: tokens)
    # (token, expert) pairs the routers chose; the RAM tier's requests (one per distinct expert of a layer's
    # call) / routed = the share of routed experts a batched step reads (1.0 for one token per step)
    routed: int = 0
    tiers: dict[str, TierStats] = field(default_factory=lambda: {"ram": TierStats()})
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    computed: dict[str, int] = field(default_factory=dict)  # tier -> experts computed there (with GPU tiers)

    @property
    def ram(self) -> TierStats:
        return self.tiers["ram"]

    def reset_counts(self) -> None:
        """Zero every count, keeping the tiers and the configuration fields; prefetches still pending count as
        issued in the new period (so used + wasted + pending = issued, and precision stays within [0, 1])."""
        self.tiers = {name: TierStats() for name in self.tiers}
        pending = self.prefetch.pending
        self.prefetch, self.computed, self.routed = PrefetchStats(issued=pending, pending=pending), {}, 0

    def snapshot(self) -> PagingStats:
        return copy.deepcopy(self)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name, tier in self.tiers.items():
            out["tiers"][name] |= {"hit_rate": tier.hit_rate, "overlap": tier.overlap,
                                  "overlapped_seconds": tier.overlapped_seconds}
        out["prefetch"] |= {"precision": self.prefetch.precision, "recall": self.prefetch.recall}
        return out

    def summary(self) -> str:
        """One line for `localmoe run --stats`."""
        parts = [f"paging {self.policy}/{self.backend}, {self.slots} slots x {self.slot_bytes / 2**20:.1f} MiB"]
        for name, t in self.tiers.items():
            parts.append(f"{name}: {t.hit_rate:.1%} hits ({t.hits}/{t.requests}), {t.bytes_read / 1e6:.1f} MB read, "
                         f"stall {t.stall_seconds:.2f} s, overlap {t.overlap:.0%}")
        if self.computed:
            parts.append("computed: " + ", ".join(f"{n} {c}" for n, c in sorted(self.computed.items())))
        p = self.prefetch
        if p.issued:
            parts.append(f"prefetch: precision {p.precision:.0%}, recall {p.recall:.0%} ({p.issued} issued)")
        return "; ".join(parts)
