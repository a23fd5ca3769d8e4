"""Where localmoe keeps what it fetches, builds and measures: one cache folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LOCALMOE_CACHE, else $XDG_CACHE_HOME/localmoe, else ~/.cache/localmoe."""
    if os.environ.get("LOCALMOE_CACHE"):
        return Path(os.environ["LOCALMOE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "localmoe"
