"""`localmoe run PROMPT`: answer one prompt, streaming to stdout; speed to stderr."""

from __future__ import annotations

import json
import sys

import click

from localmoe.commands.base import Command
from localmoe.commands.options import model_options


@click.command("run", cls=Command)
@click.argument("prompt")
@model_options
@click.option("--system", default=None, help="System message.")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--no-stream", is_flag=True, help="Print the answer only when it is complete.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, finish reason and stats.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image to show the model before the prompt (repeatable; a model with a vision tower).")
@click.option("--stats", "show_stats", is_flag=True,
              help="Also print the expert-paging statistics (hits, misses, bytes read, stalls, prefetch) to stderr.")
def command(prompt, model, engine, system, max_tokens, temperature, top_p, top_k,
            min_p, repetition_penalty, seed, stop, no_stream, as_json, images, show_stats):
    """Answer PROMPT (use - to read it from stdin)."""
    from localmoe.engine.sampler import SamplingParams
    from localmoe.kernels import _cpu as cpu_kernels
    from localmoe.load import load_model
    from localmoe.paging.metrics import pager_of, stats_line

    if prompt == "-":
        prompt = sys.stdin.read()
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    loaded = load_model(model, engine)
    stream = not (no_stream or as_json)
    parts, final = [], None
    for chunk in loaded.stream(prompt, params, max_tokens=max_tokens, stop=stop, system=system,
                                images=images):
        parts.append(chunk.text)
        if stream and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.finish_reason:
            final = chunk
    text = "".join(parts)
    stats = final.stats
    pager = pager_of(loaded)
    if as_json:
        out = {"model": str(loaded.source), "text": text, "finish_reason": final.finish_reason,
               "stats": stats.to_dict(), "cpu_kernels": cpu_kernels.describe()}
        if pager is not None:
            out["paging"] = pager.stats.to_dict()
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        if not stream:
            sys.stdout.write(text)
        sys.stdout.write("\n")
        sys.stdout.flush()
    click.echo(f"[{stats.prompt_tokens} prompt tokens, time to first token {stats.time_to_first_token:.2f} s; "
               f"{stats.generated_tokens} tokens at {stats.decode_tokens_per_second:.1f} tokens/s; "
               f"finish: {final.finish_reason}]", err=True)
    if show_stats:
        click.echo(stats_line(loaded) or "[paging: off (experts resident, or --ram 0: the page cache decides)]",
                   err=True)
        click.echo(f"[CPU kernels: {cpu_kernels.describe()}]", err=True)
        if images:
            enc = loaded.image_encoder
            click.echo(f"[images: {len(images)} ({enc.encoded} encoded) in {enc.seconds:.2f} s]", err=True)


def main() -> None:
    command(prog_name="localmoe run")
