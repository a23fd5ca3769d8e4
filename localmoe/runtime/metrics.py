"""Server metrics in the Prometheus text format (`GET /metrics`)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW = 30.0  # seconds over which tokens/s is measured


class Metrics:
    """Counters the handlers and the worker update; `render()` writes them out."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.cancelled = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.ttft_n = 0
        self._recent: deque[tuple[float, int]] = deque()  # (finish time, tokens)
        self.started = time.time()

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path, status)] += 1

    def finished(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int, ttft: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.reasoning_tokens += reasoning_tokens
            if completion_tokens:
                index = next((i for i, b in enumerate(TTFT_BUCKETS) if ttft <= b), len(TTFT_BUCKETS))
                self.ttft_counts[index] += 1
                self.ttft_sum += ttft
                self.ttft_n += 1
            now = time.monotonic()
            self._recent.append((now, completion_tokens))
            self._trim(now)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW

    def render(self, queue_depth: int, active: int, tiers: dict | None = None, worker=None, spec=None,
               images=None, routed: int | None = None) -> str:
        """The Prometheus text; `worker` (an EngineWorker) adds the scheduler's gauges and counters, `spec`
        (engine/spec SpecStats of the finished sequences) speculative decoding's, `images` (an ImageEncoder) the
        vision tower's, `routed` (a pager's PagingStats.routed) the routed (token, expert) pairs."""
        rate = self.tokens_per_second()
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        with self._lock:
            requests = sorted(self.requests.items())
            metric("localmoe_requests_total", "counter", "HTTP requests by path and status.",
                   [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in requests])
            metric("localmoe_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("localmoe_generation_tokens_total", "counter", "Tokens generated.",
                   [("", self.completion_tokens)])
            metric("localmoe_reasoning_tokens_total", "counter", "Generated tokens on the reasoning channel.",
                   [("", self.reasoning_tokens)])
            metric("localmoe_cancelled_total", "counter", "Generations cancelled by a client disconnect.",
                   [("", self.cancelled)])
            cumulative, samples = 0, []
            for bound, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
                cumulative += count
                samples.append((f'_bucket{{le="{bound}"}}', cumulative))
            samples += [("_sum", round(self.ttft_sum, 6)), ("_count", self.ttft_n)]
            metric("localmoe_time_to_first_token_seconds", "histogram", "Time from admission to the first token.",
                   samples)
        metric("localmoe_generation_tokens_per_second", "gauge",
               f"Tokens generated per second over the last {RATE_WINDOW:.0f} s.", [("", round(rate, 3))])
        metric("localmoe_queue_depth", "gauge", "Requests waiting for the engine.", [("", queue_depth)])
        metric("localmoe_active_generations", "gauge", "Requests the engine is generating.", [("", active)])
        if worker is not None:
            metric("localmoe_sequences", "gauge", "Sequences by scheduler state (running: in the batch; waiting: "
                   "queued or held by the KV budget; preempted: cache freed for the KV budget, to resume first).",
                   [('{state="running"}', active), ('{state="waiting"}', queue_depth),
                    ('{state="preempted"}', worker.preempted)])
            metric("localmoe_preemptions_total", "counter", "Running sequences preempted (cache's memory freed: "
                   "swapped out or recomputed on resume) because the running caches outgrew the KV budget.",
                   [("", worker.preemptions)])
            metric("localmoe_swaps_total", "counter", "Preemptions that swapped the cache out to a file (read back "
                   "on resume) rather than recomputing it.", [("", worker.swaps)])
            metric("localmoe_kv_cache_bytes", "gauge", "Bytes the running sequences' caches hold.",
                   [("", worker.kv_bytes)])
            if worker.kv_budget is not None:
                metric("localmoe_kv_budget_bytes", "gauge", "The KV-cache budget that admission keeps to.",
                       [("", worker.kv_budget)])
            metric("localmoe_engine_steps_total", "counter", "Engine steps run (one batched forward each).",
                   [("", worker.steps)])
            metric("localmoe_batched_decode_tokens_total", "counter",
                   "Decode tokens run in batched steps (divided by the steps: the mean batch).",
                   [("", worker.batched_tokens)])
        if spec is not None:
            metric("localmoe_spec_steps_total", "counter", "Target forwards of speculating sequences.",
                   [("", spec.steps)])
            metric("localmoe_spec_draft_tokens_total", "counter", "Drafted tokens verified.", [("", spec.drafted)])
            metric("localmoe_spec_accepted_tokens_total", "counter", "Drafted tokens kept.", [("", spec.accepted)])
            metric("localmoe_spec_acceptance_rate", "gauge", "Kept / drafted tokens (finished sequences).",
                   [("", round(spec.acceptance, 6))])
            metric("localmoe_spec_tokens_per_step", "gauge", "Tokens a speculating sequence's forward yields.",
                   [("", round(spec.tokens_per_step, 6))])
        if images is not None:
            metric("localmoe_images_encoded_total", "counter", "Images run through the vision tower (each content "
                   "once while its rows stay cached).", [("", images.encoded)])
            metric("localmoe_image_encode_seconds_total", "counter", "Seconds spent preprocessing and encoding images.",
                   [("", round(images.seconds, 6))])
        tiers = tiers or {}
        metric("localmoe_expert_tier_hit_rate", "gauge", "Expert requests served by each tier / all requests.",
               [(f'{{tier="{t}"}}', round(s.hit_rate, 6)) for t, s in tiers.items()])
        metric("localmoe_expert_tier_hits_total", "counter", "Expert requests served by each tier.",
               [(f'{{tier="{t}"}}', s.hits) for t, s in tiers.items()])
        metric("localmoe_expert_tier_misses_total", "counter", "Expert requests each tier did not hold.",
               [(f'{{tier="{t}"}}', s.misses) for t, s in tiers.items()])
        metric("localmoe_expert_tier_bytes_read_total", "counter", "Bytes brought into each tier.",
               [(f'{{tier="{t}"}}', s.bytes_read) for t, s in tiers.items()])
        if routed is not None:
            metric("localmoe_expert_routes_total", "counter", "(token, expert) pairs the routers chose; the ram "
                   "tier's requests (one per distinct expert of a layer in a step) / these = the share of routed "
                   "experts read.", [("", routed)])
        return "\n".join(lines) + "\n"


def paging_stats(model):
    """The model's expert pager's PagingStats, if it has one (None for dense or resident models)."""
    blocks = getattr(model, "moe_blocks", None)
    if blocks is None:
        return None
    for block in blocks():
        stats = getattr(getattr(block, "experts", None), "stats", None)
        if stats is not None and hasattr(stats, "tiers"):
            return stats
    return None


def paging_tiers(model) -> dict:
    """Per-tier statistics of the model's expert pager, if it has one ({} for dense models)."""
    stats = paging_stats(model)
    return {} if stats is None else dict(stats.tiers)
