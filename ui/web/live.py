"""The live plots' data: `ui.stats.snapshot` sampled over time into tables Gradio can draw.

One history per app (the model and its pager are shared by every tab), sampled at most
once per `min_interval` however many tabs' timers tick.
"""

from __future__ import annotations

import threading
import time
from collections import deque

SAMPLES_KEPT = 300  # 5 minutes at one sample a second
THROUGHPUT_SERIES = (("last turn", "tokens_per_second"), ("30 s window", "window_tokens_per_second"))


class LiveHistory:
    """Recent snapshots: seconds since start, tokens/s, and each tier's hit rate."""

    def __init__(self, min_interval: float = 0.9, kept: int = SAMPLES_KEPT, clock=time.monotonic):
        self.min_interval = min_interval
        self.clock = clock
        self.started = clock()
        self.samples: deque[tuple[float, dict]] = deque(maxlen=kept)
        self._lock = threading.Lock()

    def sample(self, snapshot) -> dict:
        """Take `snapshot()` unless the last sample is newer than `min_interval`; returns the latest figures."""
        with self._lock:
            now = self.clock()
            if self.samples and now - self.samples[-1][0] < self.min_interval:
                return self.samples[-1][1]
            figures = snapshot()
            self.samples.append((now, figures))
            return figures

    def throughput(self):
        """Columns seconds, series, tokens_per_second: two rows per sample, the last turn's speed and
        the service's rate over its recent window (which falls back to 0 when idle)."""
        import pandas as pd

        with self._lock:
            rows = [(t - self.started, series, f.get(key) or 0.0) for t, f in self.samples
                    for series, key in THROUGHPUT_SERIES]
        return pd.DataFrame(rows, columns=["seconds", "series", "tokens_per_second"])

    def hit_rates(self):
        """Columns seconds, tier, hit_rate (one row per sample and tier; empty for dense models)."""
        import pandas as pd

        with self._lock:
            rows = [(t - self.started, tier, rate) for t, f in self.samples
                    for tier, rate in (f.get("tier_hit_rates") or {}).items()]
        return pd.DataFrame(rows, columns=["seconds", "tier", "hit_rate"])
