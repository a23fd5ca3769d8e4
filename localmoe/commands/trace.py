"""`localmoe trace STORE PROMPT -o trace.json`: record which experts each token chose in each layer."""

from __future__ import annotations

import click

from localmoe.commands.base import Command
from localmoe.commands.options import paging_options


@click.command("trace", cls=Command)
@click.argument("store", type=click.Path(file_okay=False))
@click.argument("prompt", required=False)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Trace file to write (JSON).")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Greedy decode steps after the prompt.")
@paging_options("store")
@click.option("--threads", type=int, default=0)
@click.option("--synthetic", is_flag=True, help="Write a SYNTHETIC trace for this model's shape instead of running it.")
@click.option("--tokens", type=int, default=400, show_default=True, help="--synthetic: decode tokens.")
@click.option("--reuse", type=float, default=0.30, show_default=True, help="--synthetic: next-token reuse.")
@click.option("--zipf", type=float, default=1.0, show_default=True, help="--synthetic: popularity exponent.")
@click.option("--seed", type=int, default=0)
def command(store, prompt, output, max_tokens, paging, threads, synthetic, tokens, reuse, zipf, seed):
    """Run PROMPT (text, or ids:1,2,3) through the packed store STORE greedily and write the routing
    trace: (token, layer, experts) for every token, prompt included. The trace replays against
    any policy and budget (`localmoe plan`, benchmarks/offload.py) and is the future the Belady
    policy needs (--policy belady --trace FILE)."""
    from localmoe.checkpoint import open_checkpoint
    from localmoe.commands.paged import greedy, open_paged, prompt_ids
    from localmoe.paging.trace import RoutingTrace, synthetic_trace

    if synthetic:
        spec = open_checkpoint(store).spec
        trace = synthetic_trace(spec.moe_layers(), spec.num_experts, spec.num_experts_per_tok, tokens, reuse, zipf,
                                seed)
        trace.save(output)
        click.echo(f"wrote {output}: {trace.label}, {tokens} tokens, measured reuse {trace.reuse():.1%}")
        return
    if not prompt:
        raise click.UsageError("give a PROMPT (or --synthetic)")
    loaded, pager = open_paged(store, paging, threads, trace=(trace := RoutingTrace()))
    trace.num_experts = loaded.spec.num_experts
    trace.label = f"recorded: {loaded.source.name}, prompt {prompt[:40]!r}"
    greedy(loaded, prompt_ids(loaded.tokenizer, prompt), max_tokens)
    if pager is not None:
        pager.close()
    trace.save(output)
    click.echo(f"wrote {output}: {trace.tokens} tokens x {len(trace.layers)} MoE layers, next-token reuse "
               f"{trace.reuse():.1%}")


def main() -> None:
    command(prog_name="localmoe trace")
