"""`localmoe inspect MODEL`: architecture, layer kinds, parameters, dtypes, memory estimate."""

from __future__ import annotations

import json

import click

from localmoe.commands.base import Command
from localmoe.commands.options import kv_cache_dtype_option


@click.command("inspect", cls=Command)
@click.argument("model", required=False)
@click.option("--max-context", type=int, default=0, help="Context length for the KV-cache estimate.")
@kv_cache_dtype_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def command(model, max_context, kv_cache_dtype, as_json):
    """Describe MODEL without loading weights: a GGUF file, an HF directory, or only a config (a folder
    holding just config.json, or a .json file, e.g. localmoe/testing/configs/kimi_k3_real.json).
    Default: the embedded model. Cache sizes are listed for every cache dtype."""
    from localmoe.config import EngineConfig
    from localmoe.describe import describe_model, format_description

    config = EngineConfig(max_context=max_context, kv_cache_dtype=kv_cache_dtype)
    description = describe_model(model, config)
    click.echo(json.dumps(description, indent=2) if as_json else format_description(description))


def main() -> None:
    command(prog_name="localmoe inspect")
