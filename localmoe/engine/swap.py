"""Swapping a preempted sequence's cache out of memory and back (the runtime's `--preemption swap`).

`swap_out(cache, directory)` writes a batch-1 `ModelCache` (every layer's paged K/V and latent blocks,
delta-rule states and their snapshots, index caches) to one file and returns a `Swapped` that holds
no tensor: once the caller drops its reference the cache's memory is free. `Swapped.load()` reads it
back as an equal cache (the same values, block tables and offsets, on the devices the layers had), so
the sequence goes on from where it stopped with the bits it would have had without the pause; the
file is removed. On the CPU the caches already live in host memory, so the file is the swap: the
operating system may keep it in its page cache or write it to disk, outside the process's memory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from localmoe.engine.cache import ModelCache


class Swapped:
    """A cache written to `path` (`nbytes` of blocks and states when it was swapped out)."""

    def __init__(self, path: Path, nbytes: int):
        self.path, self.nbytes = path, nbytes

    def load(self) -> ModelCache:
        """The cache back in memory; the file is removed."""
        try:
            cache = torch.load(self.path, weights_only=False)
        finally:
            self.discard()
        return cache

    def discard(self) -> None:
        """Remove the file (a cancelled sequence's cache is never loaded again)."""
        self.path.unlink(missing_ok=True)


def swap_out(cache: ModelCache, directory: str | os.PathLike) -> Swapped:
    """Write `cache` to a new file in `directory` (created if missing). The cache's `hidden_sink` (a
    drafter's callback) is not written: the caller sets it again."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="cache-", suffix=".pt", dir=directory)
    sink, cache.hidden_sink = cache.hidden_sink, None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(cache, f)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    finally:
        cache.hidden_sink = sink
    return Swapped(Path(name), cache.nbytes())
