"""Serving throughput and latency under concurrent clients: a real `localmoe serve` on loopback, real
HTTP clients (httpx, streamed chat completions), for 1, 4, 16 and 32 clients.

    python benchmarks/serving.py                       # the embedded model
    python benchmarks/serving.py --model STORE --ram 25% --clients 1,16

Each client sends `--requests` requests one after another (greedy, at most `--max-tokens` tokens;
the prompts ask for long answers, so most run to the limit). Printed per client
count: aggregate generated tokens/s, p50/p99 time to first token, p50/p99 inter-token latency (gaps
between streamed content chunks), the mean batch the engine ran (batched decode tokens / steps, from
/metrics), expert bytes read per generated token (the pager's bytes from /metrics; 0 where the
experts are resident or the model is dense) and, for a paged model, the share of routed experts a step
read (each layer's distinct experts per step / the (token, expert) pairs routed: 1.0 when every step runs
one token, lower where the batch's tokens share experts), the CPU seconds the server process spent (all its
threads, from /proc) and the benchmark's own clients spent (they share the machine's cores with the server), and
generated tokens per server CPU-second (a figure the other loads of a shared machine move much less than the wall
clock's); then each count's aggregate against one client's, its p99 inter-token latency against one client's and
its tokens per server CPU-second against one client's (how much cheaper a token is when batched: the aggregate
ratio is that times the server's CPU use against one client's).

How the ratios are computed: aggregate = (generated tokens / wall seconds of the count's run) over one client's, the
reported figure; tokens per server CPU-second = (generated tokens / the server process's CPU seconds over the run)
over one client's, steadier under other loads but blind to the cores the server could not get; the benchmark's own
clients run on the same cores (~15% of the CPU at 16 clients on two cores: `client_cpu_s`), so both understate
what the server alone would do. The p99 inter-token latency is taken over every client's gaps: ~94 at one client
(2 requests of 48 tokens: its p99 is the largest gap, set by jitter) against ~1,500 at 16, so the p99 ratio is
printed beside the p50 one (the typical step's cost at 16 rows against one).

The server runs with `localmoe serve`'s defaults but for sessions (off) and the concurrency (the largest client
count), so the prefix cache is on as users get it (4 finished sequences: a request whose prompt starts like an
earlier one's reuses that cache, e.g. the chat template's system header; the six prompts repeat across clients);
`-- --prefix-cache 0` measures every prompt prefilled in full. The first printed line states the server's options.
The server runs through benchmarks/serving_steps.py, which logs every engine step (rows, prompt rows, wall, CPU,
GC, expert bytes) and the time each request's turn received each token; `--step-log FILE` keeps that log and prints
a summary of each count's steps after the table. Where a request generated tokens but its stream carried no text (a
random-weight store such as the paged gpt-oss ones: its tokens decode to no text, or the harmony parser holds them
all, so the clients' latencies were NaN), the count's latencies are the server's own (`"latency_from": "server"`):
time to first token from the request's job submission, the gaps between the tokens its turn received.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import httpx

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain in detail how a compiler works.",
           "Describe the history of the bicycle at length.", "List many facts about the ocean.",
           "Tell me everything about volcanoes.", "Write a long letter to a friend about a journey."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # -P (Python 3.11+): `-m` would put the working directory ahead of PYTHONPATH, so an A/B run with PYTHONPATH set
    # to a snapshot tree from inside another tree would serve the other tree's code
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    entry = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving_steps.py"), args.log]
    cmd = [sys.executable, *safe, *entry, "serve", "--port", str(port), "--no-sessions",
           "--max-concurrency", str(max(args.clients)), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.serve_args
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 600 s")


def metric(url: str, name: str, labels: str | None = None) -> float:
    """The sum of `name`'s samples (those with exactly `labels`, e.g. '{tier="ram"}', where given)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    pattern = re.escape(labels) if labels is not None else "(?:{[^}]*})?"
    return sum(float(v) for v in re.findall(rf"^{name}{pattern} ([0-9.e+-]+)$", text, flags=re.MULTILINE))


def expert_counts(url: str) -> tuple[float, float]:
    """(the RAM tier's expert requests: one per distinct expert of a layer's step, (token, expert) pairs routed)."""
    ram = '{tier="ram"}'
    return (metric(url, "localmoe_expert_tier_hits_total", ram) + metric(url, "localmoe_expert_tier_misses_total", ram),
            metric(url, "localmoe_expert_routes_total"))


def one(client: httpx.Client, k: int, max_tokens: int) -> dict:
    """One streamed request: its generated tokens, time to first token, the gaps between its content chunks and
    their arrival times (time.perf_counter)."""
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]}
    started = time.perf_counter()
    arrivals, tokens = [], 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content")
                   for c in event.get("choices", [])):
                arrivals.append(time.perf_counter())
    ttft = arrivals[0] - started if arrivals else float("nan")
    return {"tokens": tokens, "ttft": ttft, "gaps": [b - a for a, b in pairwise(arrivals)], "arrivals": arrivals}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time (user + system, all its threads) from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_times(proc, log: str, start: float, end: float) -> tuple[list[float], list[float]]:
    """(times to first token, gaps between tokens) of the requests the server took between `start` and `end`, from
    its own token log (benchmarks/serving_steps.py writes LOG.tokens on SIGUSR1; same clock as the clients')."""
    name = log + ".tokens"
    if os.path.exists(name):
        os.remove(name)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.time() + 120
    while not os.path.exists(name):
        if time.time() > deadline:
            raise SystemExit("the server did not write its token log")
        time.sleep(0.1)
    jobs: dict[int, list[float]] = {}
    with open(name) as f:
        for job, t, submitted in map(json.loads, f):
            if start <= submitted <= end:
                jobs.setdefault(job, [submitted]).append(t)
    ttfts = [times[1] - times[0] for times in jobs.values()]
    gaps = [b - a for times in jobs.values() for a, b in pairwise(times[1:])]
    return ttfts, gaps


def run(url: str, clients: int, requests: int, max_tokens: int, proc=None, log: str | None = None,
        arrivals: dict | None = None) -> dict:
    server_pid = proc.pid if proc is not None else None
    server0, client0 = (cpu_seconds(server_pid) if server_pid else None), time.process_time()
    bytes0, steps0, batched0 = (metric(url, n) for n in ("localmoe_expert_tier_bytes_read_total",
                                                         "localmoe_engine_steps_total",
                                                         "localmoe_batched_decode_tokens_total"))
    distinct0, routed0 = expert_counts(url)

    def client_loop(c: int) -> list[dict]:
        with httpx.Client(base_url=url, timeout=3600) as client:
            return [one(client, c * requests + r, max_tokens) for r in range(requests)]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
    wall = time.perf_counter() - started
    if arrivals is not None:
        arrivals[clients] = {"start": started, "end": started + wall, "arrivals": [r["arrivals"] for r in results]}
    client_cpu = time.process_time() - client0
    server1 = cpu_seconds(server_pid) if server0 is not None else None
    server_cpu = None if server1 is None else server1 - server0
    tokens = sum(r["tokens"] for r in results)
    steps = metric(url, "localmoe_engine_steps_total") - steps0
    batched = metric(url, "localmoe_batched_decode_tokens_total") - batched0
    read = metric(url, "localmoe_expert_tier_bytes_read_total") - bytes0
    distinct, routed = (b - a for a, b in zip((distinct0, routed0), expert_counts(url)))
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    textless = proc is not None and any(r["tokens"] and not r["arrivals"] for r in results)
    if textless:  # tokens the clients could not see: the server's own times
        ttfts, gaps = server_times(proc, log, started, started + wall)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(pct(ttfts, 0.5), 3), "ttft_p99_s": round(pct(ttfts, 0.99), 3),
            "itl_p50_ms": round(1e3 * pct(gaps, 0.5), 1), "itl_p99_ms": round(1e3 * pct(gaps, 0.99), 1),
            "mean_batch": round(batched / steps, 2) if steps else 0.0,
            "expert_bytes_per_token": round(read / tokens) if tokens else 0,
            "expert_distinct_share": round(distinct / routed, 3) if routed else None,
            "server_cpu_s": None if server_cpu is None else round(server_cpu, 2), "client_cpu_s": round(client_cpu, 2),
            "tokens_per_server_cpu_s": round(tokens / server_cpu, 1) if server_cpu else None,
            "latency_from": "server" if textless else "clients"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--clients", default="1,4,16,32", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-log", default=None, help="keep the server's engine steps in this file (JSON lines, "
                        "benchmarks/serving_steps.py; its tokens in FILE.tokens) and the clients' arrival times in "
                        "FILE.arrivals.json; print a summary of each count's steps")
    parser.add_argument("serve_args", nargs="*", help="more `localmoe serve` options (after --)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    scratch = None if args.step_log else tempfile.mkdtemp(prefix="serving-")
    args.log = args.step_log or os.path.join(scratch, "steps")
    proc, url = start(args)
    print(json.dumps({"server": "localmoe serve defaults (prefix cache on: 4 sequences) with --no-sessions"
                                f" --max-concurrency {max(args.clients)}", "serve_args": args.serve_args}), flush=True)
    try:
        one(httpx.Client(base_url=url, timeout=600), 0, 4)  # warm-up: kernels built, weights touched
        rows, arrivals = [], ({} if args.step_log else None)
        for clients in args.clients:
            row = run(url, clients, args.requests, args.max_tokens, proc, args.log, arrivals)
            rows.append(row)
            print(json.dumps(row), flush=True)
        base = rows[0]
        for row in rows[1:]:
            per_cpu = (f", tokens per server CPU-second {row['tokens_per_server_cpu_s'] / base['tokens_per_server_cpu_s']:.2f}x"
                       if row["tokens_per_server_cpu_s"] and base["tokens_per_server_cpu_s"] else "")
            print(f"{row['clients']} clients vs {base['clients']}: aggregate {row['tokens_per_s'] / base['tokens_per_s']:.2f}x"
                  f", p99 inter-token latency {row['itl_p99_ms'] / base['itl_p99_ms']:.2f}x"
                  f" (p50 {row['itl_p50_ms'] / base['itl_p50_ms']:.2f}x){per_cpu}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.step_log:
        with open(args.step_log + ".arrivals.json", "w") as f:
            json.dump(arrivals, f)
        summarize_steps(args.step_log, arrivals)


def summarize_steps(path: str, arrivals: dict) -> None:
    """Per client count: the engine steps run during it, those carrying prompt rows and those of them beside >= 12
    decode rows (the steps that set the 16-client gaps' tail), the steps' wall and the engine thread's CPU, GC inside
    steps, and the expert MB the steps with and without prompt rows read."""
    with open(path) as f:
        steps = [json.loads(line) for line in f]
    for clients, run_ in arrivals.items():
        ran = [s for s in steps
               if run_["start"] <= s["start"] <= run_["end"] and (s.get("decode") or s.get("prompt"))]
        if not ran:
            continue
        prompt = [s for s in ran if s.get("prompt")]
        heavy = [s for s in prompt if s["decode"] >= 12]
        walls, cpus = [s["wall"] for s in ran], [s["cpu"] for s in ran]
        ms = lambda values, q: round(1e3 * pct(values, q), 1)  # noqa: E731
        print(json.dumps({"clients": clients, "steps": len(ran), "prompt_steps": len(prompt),
                          "prompt_rows": sum(s["prompt"] for s in prompt),
                          "prompt_steps_beside_12_decoding": len(heavy),
                          "step_wall_p50_ms": ms(walls, 0.5), "step_wall_p99_ms": ms(walls, 0.99),
                          "step_cpu_p50_ms": ms(cpus, 0.5), "step_cpu_p99_ms": ms(cpus, 0.99),
                          "gc_ms": round(1e3 * sum(s["gc"] for s in ran), 1),
                          "expert_mb_prompt_steps": round(sum(s["mb"] for s in prompt)),
                          "expert_mb_decode_steps": round(sum(s["mb"] for s in ran if not s.get("prompt")))}),
              flush=True)


if __name__ == "__main__":
    main()
