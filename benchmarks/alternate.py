"""Peers timed alternately, each run in a process of its own: what every peer benchmark uses.

On a shared machine one engine timed after the other in one process measures the neighbours as much
as the engines (llama.cpp's OpenMP threads fall to a fraction of their speed while another process
holds a core; one run of three gave 4.4x where the other two gave ~1x). Here every run is a fresh
process (`python SCRIPT --worker NAME ...`) that prints one `RESULT {json}` line; the peers take turns,
the order swapped every pair, so load falls on both; ratios are taken per pair and the median reported.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable

MARK = "RESULT "


def emit(result: dict) -> None:
    """A worker's answer: one line the parent reads back."""
    print(MARK + json.dumps(result), flush=True)


def run_worker(argv: list[str], timeout: float = 1800) -> dict:
    """Runs `python *argv` and returns its RESULT; its stderr is shown where it fails."""
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"worker {' '.join(argv)} exited with {done.returncode} and no result:\n{done.stderr[-3000:]}")


def alternate(workers: dict[str, list[str]], pairs: int, between: Callable[[], None] | None = None,
              show: Callable[[int, dict[str, dict]], None] | None = None) -> dict[str, list[dict]]:
    """Each worker's results over `pairs` rounds, the order of the workers reversed every other round;
    `between()` runs after every round (e.g. a bandwidth measurement), `show(round, results)` prints it."""
    names = list(workers)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(pairs):
        this = {}
        for name in names if r % 2 == 0 else names[::-1]:
            this[name] = run_worker(workers[name])
            results[name].append(this[name])
        if between is not None:
            between()
        if show is not None:
            show(r, this)
    return results


def median_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of ours / theirs (each round's pair measured back to back)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))
