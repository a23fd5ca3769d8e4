"""`localmoe convert SRC DST`: rewrite a checkpoint as a packed store (docs/convert.md)."""

from __future__ import annotations

import sys

import click

from localmoe.commands.base import Command


@click.command("convert", cls=Command)
@click.argument("src", type=click.Path(exists=True, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--experts", type=click.Choice(["mxfp4", "keep"]), default="mxfp4", show_default=True,
              help="mxfp4: quantise bf16/f16/fp8 routed experts to MXFP4 (MXFP4 checkpoints are repacked "
                   "losslessly either way); keep: store them as they are.")
@click.option("--overwrite", is_flag=True, help="Replace the packed store already at DST.")
@click.option("--shard-mb", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Largest dense safetensors shard, in MiB.")
def command(src, dst, experts, overwrite, shard_mb):
    """Convert SRC (an HF safetensors directory or a GGUF file) into the packed store DST.

    Dense tensors are copied unchanged; routed experts become one aligned extent each.
    Interrupted (even by kill -9)? Run the same command again: it resumes.
    """
    from tqdm import tqdm

    from localmoe.convert import REPORT_FILE, convert
    from localmoe.convert.experts import describe

    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="convert", file=sys.stderr, disable=None,
              dynamic_ncols=True, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
                bar.refresh()
            bar.update(done - bar.n)

        result = convert(src, dst, experts=experts, overwrite=overwrite, shard_bytes=shard_mb << 20,
                         progress=progress, log=lambda line: tqdm.write(line, file=sys.stderr))
    report = result.report
    ex = report["experts"]
    what = (f"{len(ex['layers'])} MoE layers x {ex['experts_per_layer']} experts "
            f"({ex['stored'].replace('-', ' ')})" if ex["layers"] else "no routed experts")
    rate = result.bytes_read / 1e6 / max(result.seconds, 1e-9)
    click.echo(f"converted {src} -> {dst}: {report['dense']['tensors']} dense tensors, {what}; read "
               f"{result.bytes_read / 1e6:.1f} MB in {result.seconds:.1f} s ({rate:.0f} MB/s)")
    if "quantization" in report:
        click.echo(f"MXFP4 quantisation error: {describe(report['quantization']['summary'])} "
                   f"(per tensor: {dst}/{REPORT_FILE})")


def main() -> None:
    command(prog_name="localmoe convert")
