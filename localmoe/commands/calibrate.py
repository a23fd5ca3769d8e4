"""`localmoe calibrate STORE -p PROMPT ... -o profile.json`: expert popularity, for pinning hot experts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from localmoe.commands.base import Command
from localmoe.commands.options import paging_options

FORMAT = "localmoe-profile"


@click.command("calibrate", cls=Command)
@click.argument("store", type=click.Path(file_okay=False))
@click.option("-p", "--prompt", "prompts", multiple=True, help="Sample prompt (repeatable; text or ids:1,2,3).")
@click.option("--prompts", "prompt_file", type=click.Path(dir_okay=False), help="File with one prompt per line.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--max-tokens", type=int, default=16, show_default=True)
@paging_options("store")
@click.option("--threads", type=int, default=0)
def command(store, prompts, prompt_file, output, max_tokens, paging, threads):
    """Run the sample prompts through STORE, count how often every (layer, expert) is chosen, and
    write a profile ranking them, hottest first. Use it with `--profile FILE`
    (PagingConfig.profile): the hottest experts are loaded at start and never evicted
    (at most half the RAM slots)."""
    from localmoe.commands.paged import greedy, open_paged, prompt_ids
    from localmoe.paging.trace import RoutingTrace

    prompts = list(prompts) + (Path(prompt_file).read_text().splitlines() if prompt_file else [])
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise click.UsageError("give at least one --prompt or --prompts FILE")
    trace = RoutingTrace()
    loaded, pager = open_paged(store, paging, threads, trace=trace)
    trace.num_experts = loaded.spec.num_experts
    for prompt in prompts:
        greedy(loaded, prompt_ids(loaded.tokenizer, prompt), max_tokens)
    if pager is not None:
        pager.close()
    counts = trace.popularity()
    ranking = sorted(((layer, e, int(c[e])) for layer, c in counts.items() for e in range(len(c)) if c[e]),
                     key=lambda r: (-r[2], r[0], r[1]))
    profile = {"format": FORMAT, "version": 1, "store": str(loaded.source), "prompts": len(prompts),
               "tokens": trace.tokens, "ranking": ranking}
    Path(output).write_text(json.dumps(profile) + "\n")
    top = sum(r[2] for r in ranking[:max(1, len(ranking) // 10)]) / max(1, sum(r[2] for r in ranking))
    click.echo(f"wrote {output}: {len(ranking)} experts seen over {trace.tokens} tokens; the top 10% take "
               f"{top:.0%} of the routing")


def main() -> None:
    command(prog_name="localmoe calibrate")
