"""The one engine worker: a thread that owns the model and serves every request's job.

Handlers submit a `Job` (a generator that does one forward pass per step) to a queue.
The worker keeps up to `max_active` jobs running and advances them round-robin, one step
each per turn, so concurrent requests share the model fairly and a long prompt (prefilled
one chunk per step) does not stall the others. Jobs beyond `max_active` wait in the queue
in arrival order. A cancelled job (its client went away) is closed at its next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from localmoe.errors import CancelledError


class Job:
    """One request's work. `events` receive ("delta", ...), ("done", ...) or ("error", exc)."""

    def __init__(self, work: Callable[[Job], Iterator[None]], on_event: Callable[[str, object], None]):
        self.work = work
        self.on_event = on_event
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, kind: str, payload: object) -> None:
        self.on_event(kind, payload)


class EngineWorker:
    """Runs jobs on one thread; `submit` is safe from any thread."""

    def __init__(self, max_active: int = 16, threads: int | None = None):
        self.max_active = max_active
        self._threads = threads
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._active: deque[tuple[Job, Iterator[None]]] = deque()
        self._thread = threading.Thread(target=self._run, name="localmoe-engine", daemon=True)
        self._stopping = False
        self.steps = 0
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    @property
    def waiting(self) -> int:
        """Jobs queued and not started yet."""
        return self._queue.qsize()

    @property
    def active(self) -> int:
        return len(self._active)

    def _admit(self) -> None:
        block = not self._active
        while len(self._active) < self.max_active:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stopping = True
                return
            if job.cancelled:
                job.emit("error", CancelledError())
                continue
            job.started = time.perf_counter()
            try:
                self._active.append((job, job.work(job)))
            except Exception as e:  # noqa: BLE001 - a job that cannot start reports its error
                self._fail(job, e)

    def _fail(self, job: Job, error: BaseException) -> None:
        self.failures += 1
        job.emit("error", error)

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while not self._stopping:
            self._admit()
            for _ in range(len(self._active)):
                job, steps = self._active.popleft()
                if job.cancelled:
                    steps.close()
                    job.emit("error", CancelledError())
                    continue
                try:
                    next(steps)
                except StopIteration:
                    continue
                except Exception as e:  # noqa: BLE001 - one request's failure must not stop the worker
                    self._fail(job, e)
                    continue
                self.steps += 1
                self._active.append((job, steps))

