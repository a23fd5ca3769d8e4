"""`localmoe chat`: the terminal chat app (Textual) over the same Service as `localmoe serve`."""

from __future__ import annotations

from pathlib import Path

import click

from localmoe.commands.base import Command
from localmoe.commands.options import (
    batching_option,
    budget_option,
    model_options,
    spec_options,
    thinking_budgets_option,
)
from localmoe.errors import LocalMoEError


@click.command("chat", cls=Command)
@model_options
@budget_option("Thinking budget to start with (ctrl+b changes it in the app).")
@thinking_budgets_option
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="Most tokens of one model turn.")
@click.option("--workdir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=".",
              show_default=True, help="Directory the built-in tools (read_file, list_dir, run_command) work in.")
@click.option("--tool-timeout", type=float, default=30.0, show_default=True, help="Seconds a run_command may take.")
@click.option("--tool-output-cap", type=int, default=16384, show_default=True,
              help="Characters of a tool's output the model sees.")
@click.option("--documents", "document_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Files or folders search_documents looks in (repeatable; default: the working directory).")
@click.option("--no-tools", is_flag=True, help="Start with the built-in tools off (ctrl+t turns them on).")
@spec_options
@batching_option("off")
@click.option("--session", "session_id", default=None, help="Resume this stored session.")
@click.option("--sessions", "sessions_path", default=None, metavar="PATH",
              help="SQLite file of the sessions (default: sessions.db in the localmoe cache, shared with serve).")
def command(model, engine, budget, thinking_budgets, max_tokens, workdir, tool_timeout,
            tool_output_cap, document_paths, no_tools, spec, spec_k, batching, session_id, sessions_path):
    """Chat with the model in the terminal: streaming answers, reasoning panels, tool calls you
    approve, thinking budgets, stored sessions and live paging statistics."""
    try:
        from localmoe.ui.tui import ChatApp, load_service
    except ImportError as e:
        raise LocalMoEError(f"the chat app needs its extra: pip install 'localmoe[ui]' ({e})") from None
    from localmoe.commands.serve import default_sessions_path
    from localmoe.runtime.service import ServerConfig
    from localmoe.ui.tools import ToolRunner

    if max_tokens < 1:
        raise LocalMoEError(f"--max-tokens must be at least 1, not {max_tokens}")
    try:
        runner = ToolRunner(workdir, timeout=tool_timeout, output_cap=tool_output_cap,
                            document_paths=list(document_paths) or None)
    except (ValueError, NotADirectoryError) as e:
        raise LocalMoEError(f"--tool-timeout / --tool-output-cap / --workdir: {e}") from None
    config = ServerConfig(max_tokens_default=max_tokens, sessions_path=Path(sessions_path or default_sessions_path()),
                          budgets=thinking_budgets, threads=engine.threads, spec=spec, spec_k=spec_k,
                          batching=batching)
    loader = load_service(model, engine, config)
    app = ChatApp(loader=loader, model_name=Path(model).name if model else "the embedded default model",
                  workdir=workdir, budget=budget, tools_enabled=not no_tools, session_id=session_id,
                  max_tokens=max_tokens, runner=runner)
    app.run()


def main() -> None:
    command(prog_name="localmoe chat")
