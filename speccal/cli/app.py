"""The speccal command line (Typer app).

Commands live in ``speccal/cli/cmd_*.py``; each module exposes ``register(app)``. Commands only parse
options, build a config, call a library function and map domain errors (``speccal.base.errors``) to a
one-line message on stderr and an exit code: 2 for bad input, 1 for runtime failures.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from speccal import __version__
from speccal.base.errors import SpeccalError
from speccal.cli import cmd_calibrate, cmd_fit, cmd_plot, cmd_replay, cmd_run, cmd_table

err_console = Console(stderr=True)


class _SpeccalGroup(TyperGroup):
    """Root group: turns domain errors into one line on stderr and an exit code, no traceback."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except SpeccalError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None


app = typer.Typer(
    cls=_SpeccalGroup,
    name="speccal",
    help="Calibrate, fit, validate and replay cost tables for MTP speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"speccal {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """speccal: cost tables for speculative decoding."""


for _module in (cmd_fit, cmd_table, cmd_run, cmd_calibrate, cmd_replay, cmd_plot):
    _module.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
