"""`localmoe web`: the Gradio web app on localhost (docs/ui.md)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from localmoe.commands.base import Command
from localmoe.commands.options import (
    allowed_hosts_option,
    batching_option,
    budget_option,
    model_options,
    spec_options,
    thinking_budgets_option,
)
from localmoe.errors import LocalMoEError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@click.command("web", cls=Command)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but localhost lets others on the network use the model and tools.")
@click.option("--port", type=int, default=7860, show_default=True)
@allowed_hosts_option
@click.option("--workdir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".",
              show_default=True, help="Directory the tools (read_file, list_dir, run_command) work in.")
@budget_option("Thinking budget a new tab starts with.")
@click.option("--no-tools", is_flag=True, help="Start with the built-in tools switched off.")
@click.option("--max-tokens", type=int, default=None, help="Most tokens per model turn (default: the server's).")
@thinking_budgets_option
@click.option("--sessions", "sessions_path", default=None, metavar="PATH",
              help="SQLite file for persisted chats (default: sessions.db in the localmoe cache).")
@click.option("--no-sessions", is_flag=True, help="Keep chats only in memory.")
@spec_options
@batching_option("off")
def command(model, engine, host, port, allowed_hosts, workdir, budget, no_tools, max_tokens,
            thinking_budgets, sessions_path, no_sessions, spec, spec_k, batching):
    """Chat with the model in a browser: streaming answers, reasoning panels, approved tool calls,
    questions about uploaded documents, live speed and paging plots."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # never phone home; read when gradio is imported
    try:
        import gradio  # noqa: F401
        import starlette  # noqa: F401
    except ImportError as e:
        raise LocalMoEError(f"the web app needs its extra: pip install 'localmoe[ui]' ({e})") from None
    from localmoe.commands.serve import default_sessions_path
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service
    from localmoe.ui.web import WebApp, launch

    if not 0 < port < 65536:
        raise LocalMoEError(f"--port must be between 1 and 65535, not {port}")
    if max_tokens is not None and max_tokens < 1:
        raise LocalMoEError(f"--max-tokens must be at least 1, not {max_tokens}")
    config = ServerConfig(sessions_path=None if no_sessions else Path(sessions_path or default_sessions_path()),
                          budgets=thinking_budgets, threads=engine.threads, spec=spec, spec_k=spec_k,
                          batching=batching)
    click.echo("localmoe web: loading the model", err=True)
    loaded = load_model(model, engine)
    config.threads = loaded.config.resolved_threads()
    if host not in LOCAL_HOSTS:
        click.echo(f"localmoe: warning: serving on {host}: anyone who can reach it can chat and approve tool calls "
                   f"in {workdir.resolve()}", err=True)
    service = Service(loaded, config)
    service.start()
    try:
        launch(WebApp(service, workdir=workdir, budget=budget, tools_enabled=not no_tools, max_tokens=max_tokens),
               host=host, port=port, allowed_hosts=allowed_hosts)
    finally:
        service.stop()


def main() -> None:
    command(prog_name="localmoe web")
