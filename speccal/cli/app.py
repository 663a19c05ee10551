"""The speccal command line (Typer app).

Commands live in ``speccal/cli/cmd_*.py``; each module exposes ``register(app)``. Commands only parse
options, build a config, call a library function and map domain errors (``speccal.base.errors``) to a
one-line message on stderr and an exit code: 2 for bad input, 1 for runtime failures. The root group
maps them once, and a missing third-party package (``torch`` for ``calibrate``, ``bench``,
``generate`` and ``trace --kind rounds``; the commands import the runner inside their bodies, so
the CLI itself starts without torch) to one line naming the package and how to install it, exit 2.
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

#: How to install a package a command needs (by top-level module name); others: ``pip install NAME``.
INSTALL_HINTS = {
    "torch": "pip install torch (https://pytorch.org/get-started for a CUDA build)",
    "triton": 'pip install "speccal[cuda]"',
    "torch_npu": 'pip install "speccal[npu]"',
}


def missing_package_message(command: str | None, exc: ModuleNotFoundError) -> str | None:
    """The one-line error for a command whose third-party dependency is not installed; None
    when the missing module is ours (a bug, not an installation problem) or unnamed."""
    name = (exc.name or "").split(".")[0]
    if not name or name == "speccal":
        return None
    hint = INSTALL_HINTS.get(name, f"pip install {name}")
    who = f"speccal {command}" if command else "speccal"
    return f"{who} needs the Python package {name!r}, which is not installed; install it: {hint}"


class _SpeccalGroup(TyperGroup):
    """Root group: turns domain errors into one line on stderr and an exit code, no traceback."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except SpeccalError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except ModuleNotFoundError as exc:
            msg = missing_package_message(ctx.invoked_subcommand, exc)
            if msg is None:
                raise
            err_console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
            raise typer.Exit(2) from None
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
