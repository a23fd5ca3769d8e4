"""`localmoe serve` with a log of its engine steps and tokens, as serving.py starts it: the server's own command
line (`python benchmarks/serving_steps.py LOG serve --port ...`); each engine step appends one JSON line to LOG when the
server is terminated: its start (time.perf_counter, the clock the clients' arrival times use), wall and the engine
thread's CPU seconds, decode rows, prompt rows (and how many prompts they came from, how many waited), GC seconds
inside the step, running sequences, and the expert bytes the pager read (MB; 0 where the experts are resident).
LOG.tokens gets one JSON line per token a request's turn received (its job's id, the time, the time the job was
submitted): the server's own times to first token and between tokens, for a model whose tokens stream no text (a
random-weight store: serving.py reads them where its clients saw none). SIGUSR1 writes both files and goes on.
The worker is wrapped from outside, so the server's code is the tree's own."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time


def install(path: str) -> None:
    from localmoe.runtime import worker as W
    from localmoe.runtime.metrics import paging_stats

    log: list[dict] = []
    now: dict = {}
    collecting = {"total": 0.0, "since": None}

    def on_gc(phase, info):
        if phase == "start":
            collecting["since"] = time.perf_counter()
        elif collecting["since"] is not None:
            collecting["total"] += time.perf_counter() - collecting["since"]
            collecting["since"] = None

    gc.callbacks.append(on_gc)
    chunks_of, step_of, advance_of, model = W.EngineWorker._prompt_chunks, W.EngineWorker.step, \
        W.EngineWorker._advance, {}
    tokens: list[tuple[int, float, float]] = []  # (job id, time, job submitted)

    def prompt_chunks(self, decode, prefill):
        out = chunks_of(self, decode, prefill)
        now.update(decode=len(decode), prompt=sum(n for _, n in out), prompts=len(out),
                   waiting=sum(1 for r in prefill if r.wants.prefilling))
        return out

    def read_mb(self) -> float:
        for r in self._active:
            if hasattr(r.wants, "model"):
                model["it"] = r.wants.model
        stats = paging_stats(model["it"]) if "it" in model else None
        return 0.0 if stats is None else stats.ram.bytes_read / 1e6

    def step(self):
        now.clear()
        mb, collected = read_mb(self), collecting["total"]
        start, cpu = time.perf_counter(), time.thread_time()
        step_of(self)
        now.update(start=start, wall=time.perf_counter() - start, cpu=time.thread_time() - cpu,
                   gc=collecting["total"] - collected, active=len(self._active), mb=read_mb(self) - mb)
        log.append(dict(now))

    def advance(self, running, logits, first=False):
        if logits is not None and not first:  # the job's turn receives a token's logits
            tokens.append((id(running.job), time.perf_counter(), running.job.submitted))
        return advance_of(self, running, logits, first)

    W.EngineWorker._prompt_chunks, W.EngineWorker.step, W.EngineWorker._advance = prompt_chunks, step, advance

    def write(name: str, lines: list) -> None:
        with open(name + ".part", "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        os.replace(name + ".part", name)  # whole files only: the reader polls for them

    def dump(signum, _frame):
        write(path + ".tokens", list(tokens))
        write(path, list(log))
        if signum == signal.SIGTERM:
            os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    signal.signal(signal.SIGUSR1, dump)


def main() -> None:
    install(sys.argv[1])
    from localmoe.cli import main as cli

    sys.argv = ["localmoe", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()
