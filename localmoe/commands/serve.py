"""`localmoe serve`: the OpenAI- and Anthropic-compatible HTTP API (docs/api.md)."""

from __future__ import annotations

from pathlib import Path

import click

from localmoe.commands.base import Command
from localmoe.commands.options import (
    allowed_hosts_option,
    batching_option,
    model_options,
    spec_options,
    thinking_budgets_option,
)
from localmoe.errors import LocalMoEError
from localmoe.paths import cache_dir


def default_sessions_path() -> Path:
    return cache_dir() / "sessions.db"


@click.command("serve", cls=Command)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the API to the network.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="LOCALMOE_API_KEY",
              help="Require this key (Authorization: Bearer KEY or x-api-key) on every request but /health.")
@click.option("--model-id", default=None, help="Name the model is served under (default: the file name).")
@click.option("--max-tokens", "max_tokens_default", type=int, default=512, show_default=True,
              help="max_tokens of a request that gives none.")
@click.option("--max-tokens-limit", type=int, default=None, help="The most max_tokens a request may ask for "
              "(default: the context).")
@click.option("--max-concurrency", type=int, default=16, show_default=True,
              help="Sequences batched at once (one forward per step over all of them); more requests wait "
                   "in the queue.")
@batching_option("auto")
@click.option("--kv-budget", default=None, metavar="SIZE",
              help="KV-cache bytes the running sequences may hold (e.g. 512M, 2G); "
                   "past it new requests wait, and when running sequences outgrow it the latest is preempted "
                   "(its cache's memory freed, swapped out or recomputed on resume with the same output). "
                   "Default: no limit.")
@click.option("--preemption", type=click.Choice(["swap", "recompute"]), default="swap", show_default=True,
              help="How a preempted sequence gives back its cache's memory: swap = written to a file and read back "
                   "on resume; recompute = freed, its prompt and tokens run again on resume (nothing written).")
@click.option("--swap-dir", default=None, metavar="FOLDER",
              help="Where swapped-out caches go (default: a private temporary folder).")
@click.option("--max-body", type=int, default=8 << 20, show_default=True, help="Largest request body in bytes.")
@thinking_budgets_option
@click.option("--sessions", "sessions_path", default=None, metavar="PATH",
              help="SQLite file for persisted sessions (default: sessions.db in the localmoe cache).")
@click.option("--no-sessions", is_flag=True, help="Store no sessions.")
@click.option("--prefix-cache", "prefix_cache_entries", type=int, default=4, show_default=True,
              help="Finished sequences whose cache a later prompt with the same start reuses (0: none).")
@click.option("--documents-root", "documents_roots", multiple=True, metavar="FOLDER",
              help="A folder /v1/documents may read under (repeatable); without one the document endpoints "
                   "are off (403). Paths and links are resolved and must stay inside.")
@allowed_hosts_option
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@spec_options(default="off")
def command(model, engine, host, port, api_key, model_id, max_tokens_default, max_tokens_limit,
            max_concurrency, batching, kv_budget, preemption, swap_dir, max_body, thinking_budgets, sessions_path, no_sessions,
            prefix_cache_entries,
            documents_roots, allowed_hosts, log_level, spec, spec_k):
    """Serve the model over HTTP: /v1/chat/completions, /v1/completions, /v1/models, /v1/messages,
    /health and /metrics."""
    try:
        from localmoe.server import ServerConfig, serve
    except ImportError as e:
        raise LocalMoEError(f"the server needs its extra: pip install 'localmoe[server]' ({e})") from None
    from localmoe.load import load_model
    from localmoe.server.security import allowed_hosts_for

    if max_tokens_default < 1 or (max_tokens_limit is not None and max_tokens_limit < 1) or max_concurrency < 1:
        raise LocalMoEError("--max-tokens, --max-tokens-limit and --max-concurrency must be at least 1")
    budget = None
    if kv_budget is not None:
        from localmoe.commands.paged import parse_size

        budget = parse_size(kv_budget)
        if budget < 1:
            raise LocalMoEError("--kv-budget must be a positive size such as 512M or 2G")
    if prefix_cache_entries < 0:
        raise LocalMoEError("--prefix-cache must be 0 (off) or a number of cached sequences")
    local = host in ("127.0.0.1", "localhost", "::1")
    roots = tuple(Path(r).expanduser().resolve() for r in documents_roots)
    for root in roots:
        if not root.is_dir():
            raise LocalMoEError(f"--documents-root {root}: not a folder")
    config = ServerConfig(max_tokens_default=max_tokens_default, max_tokens_limit=max_tokens_limit,
                          spec=spec, spec_k=spec_k, max_active=max_concurrency, batching=batching, kv_budget=budget,
                          preemption=preemption, swap_dir=swap_dir, max_body_bytes=max_body,
                          api_key=api_key or None,
                          sessions_path=None if no_sessions else Path(sessions_path or default_sessions_path()),
                          budgets=thinking_budgets, threads=engine.threads,
                          prefix_cache_entries=prefix_cache_entries,
                          documents_roots=roots,
                          allowed_hosts=allowed_hosts_for(host, allowed_hosts))
    loaded = load_model(model, engine)
    config.threads = loaded.config.resolved_threads()
    if not local and api_key is None:
        click.echo(f"localmoe: warning: serving on {host} without --api-key: anyone who can reach it can use it",
                   err=True)
    serve(loaded, config, host=host, port=port, log_level=log_level)


def main() -> None:
    command(prog_name="localmoe serve")
