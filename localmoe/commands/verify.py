"""`localmoe verify STORE`: check every checksum of a packed store (or that a GGUF, split or not, is whole)."""

from __future__ import annotations

import sys
import time

import click

from localmoe.commands.base import Command


@click.command("verify", cls=Command)
@click.argument("store", type=click.Path(path_type=str))
def command(store):
    """Check every checksum in the packed store STORE: expert extents, dense shards, tokenizer files.

    Prints OK, or one line per bad extent or file and exits with status 1. A .gguf file (any part of
    a split one) is checked for completeness instead: every part present, every header sound and
    every tensor inside its file, every byte readable (GGUF files carry no checksums).
    """
    from tqdm import tqdm

    from localmoe.store.packed import PackedStore

    if store.endswith(".gguf"):
        _verify_gguf(store)
        return
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


def _verify_gguf(path: str) -> None:
    from localmoe.store.gguf_split import open_gguf

    started = time.perf_counter()
    with open_gguf(path) as gguf:
        files, tensors = gguf.files, len(gguf.tensor_names())
    total = 0
    for file in files:  # read through: a bad sector or a short network copy fails here, not mid-run
        with open(file, "rb") as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    seconds = time.perf_counter() - started
    click.echo(f"OK: {path}: {len(files)} file(s), {tensors} tensors, {total / 1e6:.1f} MB read in {seconds:.1f} s")


def main() -> None:
    command(prog_name="localmoe verify")
