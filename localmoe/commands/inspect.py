"""`localmoe inspect MODEL`: architecture, layer kinds, parameters, dtypes, memory estimate."""

from __future__ import annotations

import json

import click

from localmoe.commands.base import Command


@click.command("inspect", cls=Command)
@click.argument("model", required=False)
@click.option("--max-context", type=int, default=0, help="Context length for the KV-cache estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def command(model, max_context, as_json):
    """Describe MODEL (a GGUF file or HF directory; default: the embedded model) without loading weights."""
    from localmoe.config import EngineConfig
    from localmoe.describe import describe_model, format_description
    from localmoe.load import resolve_model_path

    description = describe_model(resolve_model_path(model), EngineConfig(max_context=max_context))
    click.echo(json.dumps(description, indent=2) if as_json else format_description(description))


def main() -> None:
    command(prog_name="localmoe inspect")
