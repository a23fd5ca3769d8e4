"""`localmoe run PROMPT`: answer one prompt through the runtime (the chat turn every front end runs:
reasoning parsed, thinking budget, stop strings), streaming the answer to stdout; reasoning and
speed to stderr."""

from __future__ import annotations

import json
import sys

import click

from localmoe.commands.base import Command
from localmoe.commands.options import model_options, spec_options, thinking_budgets_option
from localmoe.errors import LocalMoEError


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
@click.option("--thinking", type=click.Choice(["low", "high", "max"]), default=None,
              help="Thinking budget tier (reasoning-token limit from --thinking-budgets; a model that takes the "
                   "tier natively, such as Kimi K3, is also told it). Default: the model's own default.")
@thinking_budgets_option
@click.option("--no-stream", is_flag=True, help="Print the answer only when it is complete.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, finish reason and stats.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image to show the model before the prompt (repeatable; a model with a vision tower).")
@click.option("--stats", "show_stats", is_flag=True,
              help="Also print the expert-paging statistics (hits, misses, bytes read, stalls, prefetch) and "
                   "speculative decoding's (acceptance, tokens per step) to stderr.")
@spec_options
def command(prompt, model, engine, system, max_tokens, temperature, top_p, top_k,
            min_p, repetition_penalty, seed, stop, thinking, thinking_budgets, no_stream, as_json, images,
            show_stats, spec, spec_k):
    """Answer PROMPT (use - to read it from stdin)."""
    from localmoe.engine.sampler import SamplingParams
    from localmoe.kernels import _cpu as cpu_kernels
    from localmoe.load import load_model
    from localmoe.paging.metrics import pager_of, stats_line
    from localmoe.runtime.local import LocalModel
    from localmoe.runtime.service import ServerConfig
    from localmoe.runtime.speculation import spec_line

    if prompt == "-":
        prompt = sys.stdin.read()
    if max_tokens < 1:
        raise LocalMoEError("--max-tokens must be at least 1")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed)
    loaded = LocalModel(load_model(model, engine), ServerConfig(budgets=thinking_budgets, prefix_cache_entries=0,
                                                                 spec=spec, spec_k=spec_k, batching="off"))
    stream = not (no_stream or as_json)
    for image in images:
        loaded.image_encoder.size(image)  # a text-only model or a bad file: an error naming it, before the turn
    events = loaded.events(prompt, params, max_tokens, stop, system, images, thinking)
    parts, reasoning, result = [], [], None
    for kind, payload in events:
        if kind == "done":
            result = payload
        elif payload.channel == "reasoning":
            reasoning.append(payload.text)
            if stream and payload.text:
                click.echo(click.style(payload.text, dim=True), err=True, nl=False)
        elif payload.text:
            parts.append(payload.text)
            if stream:
                sys.stdout.write(payload.text)
                sys.stdout.flush()
    text = "".join(parts)
    decode_s = result.seconds - result.time_to_first_token
    rate = (result.completion_tokens - 1) / decode_s if result.completion_tokens > 1 and decode_s > 0 else 0.0
    stats = {"prompt_tokens": result.prompt_tokens, "generated_tokens": result.completion_tokens,
             "reasoning_tokens": result.reasoning_tokens, "time_to_first_token_s": round(result.time_to_first_token, 4),
             "decode_tokens_per_s": round(rate, 2), "reasoning_closed_by": result.reasoning_closed_by}
    pager = pager_of(loaded)
    if as_json:
        out = {"model": str(loaded.source), "text": text, "reasoning": "".join(reasoning),
               "finish_reason": result.finish_reason, "stats": stats, "cpu_kernels": cpu_kernels.describe()}
        if pager is not None:
            out["paging"] = pager.stats.to_dict()
        if result.spec is not None:
            out["spec"] = result.spec.to_dict()
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        if not stream:
            sys.stdout.write(text)
        sys.stdout.write("\n")
        sys.stdout.flush()
    closed = f"; thinking closed by the {result.reasoning_closed_by} budget" if result.reasoning_closed_by else ""
    click.echo(f"[{result.prompt_tokens} prompt tokens, time to first token {result.time_to_first_token:.2f} s; "
               f"{result.completion_tokens} tokens at {rate:.1f} tokens/s; "
               f"finish: {result.finish_reason}{closed}]", err=True)
    if show_stats:
        click.echo(stats_line(loaded) or "[paging: off (experts resident, or --ram 0: the page cache decides)]",
                   err=True)
        click.echo(f"[CPU kernels: {cpu_kernels.describe()}]", err=True)
        if result.spec is not None:
            click.echo(f"[{spec_line(result.spec, pager, result.completion_tokens)}]", err=True)
        if images:
            enc = loaded.image_encoder
            click.echo(f"[images: {len(images)} ({enc.encoded} encoded) in {enc.seconds:.2f} s]", err=True)


def main() -> None:
    command(prog_name="localmoe run")
