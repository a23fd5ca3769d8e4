"""What every subcommand shares: errors shown as one line instead of a traceback."""

from __future__ import annotations

import sys

import click

from localmoe.errors import LocalMoEError


def invoke_reporting_errors(invoke, ctx: click.Context):
    """Run a click invoke; a LocalMoEError becomes one line on stderr and exit status 1."""
    try:
        return invoke(ctx)
    except LocalMoEError as error:
        click.echo(f"localmoe: error: {error}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("localmoe: interrupted", err=True)
        sys.exit(130)


class Command(click.Command):
    """A subcommand that reports errors the same way inside the group and run on its own (`main()`)."""

    def invoke(self, ctx: click.Context):
        return invoke_reporting_errors(super().invoke, ctx)


class Group(click.Group):
    def invoke(self, ctx: click.Context):
        return invoke_reporting_errors(super().invoke, ctx)
