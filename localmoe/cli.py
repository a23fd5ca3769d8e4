"""`localmoe` command line: one click group; each subcommand lives in localmoe/commands/."""

from __future__ import annotations

import click

from localmoe import __version__
from localmoe.commands import (
    analyze,
    calibrate,
    chat,
    convert,
    inspect,
    plan,
    probe_recall,
    run,
    serve,
    trace,
    verify,
    web,
)
from localmoe.commands.base import Group


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localmoe")
def cli() -> None:
    """Run giant Mixture-of-Experts language models on one workstation.

    With no --model, the embedded default model (SmolLM2-135M-Instruct) is used.
    """


for _module in (run, chat, web, serve, analyze, inspect, verify, convert, trace, plan, calibrate, probe_recall):
    cli.add_command(_module.command)


def main() -> None:
    cli(prog_name="localmoe")


if __name__ == "__main__":
    main()
