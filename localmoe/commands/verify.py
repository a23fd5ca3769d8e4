"""`localmoe verify STORE`: check every checksum of a packed store."""

from __future__ import annotations

import sys
import time

import click

from localmoe.commands.base import Command


@click.command("verify", cls=Command)
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
def command(store):
    """Check every checksum in the packed store STORE: expert extents, dense shards, tokenizer files.

    Prints OK, or one line per bad extent or file and exits with status 1.
    """
    from tqdm import tqdm

    from localmoe.store.packed import PackedStore

    started = time.perf_counter()
    with PackedStore(store) as packed:
        total = packed.total_bytes()
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
                  disable=None, leave=False) as bar:
            problems = packed.verify(progress=bar.update)
        experts = sum(len(packed.experts_in(layer)) for layer in packed.layers())
        dense = len(packed.dense_names())
    for problem in problems:
        click.echo(str(problem))
    if problems:
        click.echo(f"localmoe: {len(problems)} problem(s) in {store}; convert the model again", err=True)
        sys.exit(1)
    seconds = time.perf_counter() - started
    click.echo(f"OK: {store}: {experts} experts, {dense} dense tensors, {total / 1e6:.1f} MB checked in "
               f"{seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)")


def main() -> None:
    command(prog_name="localmoe verify")
