"""The speccal command line (Typer app).

Commands live in ``speccal/cli/cmd_*.py``; each module exposes ``register(app)``. Commands only parse
options, build a config, call a library function and map domain errors (``speccal.base.errors``) to a
one-line message on stderr and an exit code: 2 for bad input, 1 for runtime failures. The root group
maps them once, and a missing third-party package (``torch`` for ``calibrate``, ``bench``,
``generate`` and ``trace --kind rounds``; the commands import the runner inside their bodies, so
the CLI itself starts without torch) to one line naming the package and how to install it, exit 2.
Warnings (``warnings.warn``: a ``SpeccalWarning`` such as ``NonPositiveCostWarning``, or a
library's) are shown by the root too, each as one ``warning: ...`` line on stderr, once per
text, with no source line. Help pages follow ``speccal.cli.help`` (plain usage lines, commands in
workflow order: :data:`COMMAND_ORDER`).
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from typing import Annotated

import typer
import typer.rich_utils
from rich.markup import escape

from speccal import __version__
from speccal.base.errors import SpeccalError, show
from speccal.base.rich_tables import make_console
from speccal.cli import (
    cmd_bench,
    cmd_calibrate,
    cmd_export,
    cmd_fit,
    cmd_generate,
    cmd_plot,
    cmd_replay,
    cmd_table,
    cmd_trace,
)
from speccal.cli.dist import note_for_launcher
from speccal.cli.help import HelpGroup, SpeccalTyper
from speccal.costmodel.compat import SpeccalWarning

err_console = make_console()

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


#: The order ``speccal --help`` lists the commands in: the workflow, then the runner's own.
COMMAND_ORDER = ("calibrate", "fit", "table", "trace", "replay", "plot", "bench", "generate")


def warning_line(message: Warning | str, category: type[Warning]) -> str:
    """One line for a warning: its text with line breaks folded, the category named unless it
    is one of speccal's own (whose texts say what they are)."""
    text = " ".join(str(message).split())
    if issubclass(category, SpeccalWarning):
        return f"warning: {text}"
    return f"warning ({category.__name__}): {text}"


def say_error(text: str) -> None:
    """Print ``error: TEXT`` on stderr (the text escaped: a value in it is never markup), and
    under torchrun leave it for the launcher's report too (``speccal.cli.dist``)."""
    err_console.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)
    note_for_launcher(f"error: {text}")


def usage_line(exc: Exception) -> str:
    """The one line of a Click usage error, and where to read the options (``speccal calibrate
    --help``): a value that does not parse reads like every other bad input (``--draft-width:
    got 'abc', expected a valid integer``); any other (a missing or unknown option) is Click's
    message with its line breaks folded."""
    text = _bad_value(exc)
    if text is None:
        fmt = getattr(exc, "format_message", None)
        text = " ".join((fmt() if fmt else str(exc)).split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command_path:
        text += f" (see {ctx.command_path} --help)"
    return text


def _bad_value(exc: Exception) -> str | None:
    """``OPTION: got VALUE, expected WHAT`` for a value Typer could not convert (its pydantic
    validation error is the cause and holds the value); None for any other usage error."""
    param, ctx = getattr(exc, "param", None), getattr(exc, "ctx", None)
    errors = getattr(exc.__cause__, "errors", None)
    if param is None or ctx is None or not callable(errors):
        return None
    try:
        first = errors()[0]
    except Exception:  # a best effort: Click's own message otherwise
        return None
    flags = [o for o in getattr(param, "opts", None) or () if o.startswith("-")]
    name = "/".join(flags) or str(param.metavar or param.name)
    expected = str(first.get("msg", "")).removeprefix("Input should be ").split(",")[0]
    return f"{name}: got {show(first.get('input'))}, expected {expected or 'a valid value'}"


@contextmanager
def clean_warnings():
    """Show every warning raised inside as one line on stderr, once per text (no source line).

    Only the display changes: the filters stay as they are, and code that records warnings
    itself (``warnings.catch_warnings(record=True)``, e.g. ``table validate``) still gets them.
    """
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = warning_line(message, category)
        if text not in seen:
            seen.add(text)
            err_console.print(f"[yellow]{escape(text)}[/]", soft_wrap=True, highlight=False)

    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        warnings.showwarning = show
        yield


class _SpeccalGroup(HelpGroup):
    """Root group: turns domain errors into one line on stderr and an exit code, no traceback,
    and shows warnings as one clean line each (:func:`clean_warnings`)."""

    command_order = COMMAND_ORDER

    def invoke(self, ctx: typer.Context):
        try:
            with clean_warnings():
                return super().invoke(ctx)
        except SpeccalError as exc:
            say_error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except ModuleNotFoundError as exc:
            msg = missing_package_message(ctx.invoked_subcommand, exc)
            if msg is None:
                raise
            say_error(msg)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(130) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the CLI; a usage error (a value of the wrong type, a missing or unknown option)
        is one ``error: ...`` line and exit 2, like every other bad input (no usage box)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            # not standalone: Click raises its errors here instead of printing them in a box;
            # an explicit exit (``typer.Exit``, --help, --version) comes back as its code
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            err_console.print("[bold red]aborted[/]")
            sys.exit(1)
        except typer.TyperException as exc:  # Click's UsageError, BadParameter, ...
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help (exit 2)
                exc.show()
                sys.exit(exc.exit_code)
            say_error(usage_line(exc))
            sys.exit(getattr(exc, "exit_code", 2))
        sys.exit(rv if isinstance(rv, int) else 0)


ROOT_HELP = """Calibrate, fit, validate and replay cost tables for MTP speculative decoding.

Workflow: calibrate (or fit measurement rows) -> table show / validate -> trace -> replay ->
plot; bench and generate run the embedded runner itself.

Terms: Bcap = the captured draft batch size a batch is padded to; G = target rows verified
(padded); w = draft width (most draft tokens per round); k = draft steps run. Graph modes: eager
(no capture, CPU), split (separately captured draft and target CUDA/NPU graphs per shape).
Acceptance modes: greedy (lossless), sample (rejection sampling), synthetic (accepted length
drawn from a per-position profile), forced (every drafted token accepted: how calibration
measures each shape exactly). Details: README.md and docs/.

First use on a CPU: `speccal calibrate --model tiny --out out/tiny-cpu.json` takes under a
minute on a small shared machine (one context interval, 19 points x 6 windows of 24 rounds; each
round timed in thread CPU time against a speed probe, so a busy machine slows the run but not
the table's accuracy: 21-28 s and held-out error 0.3-1.7 % on a 2-vCPU VM beside another
busy process).
"""

app = SpeccalTyper(
    cls=_SpeccalGroup,
    name="speccal",
    help=ROOT_HELP,
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
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """speccal: cost tables for speculative decoding."""


for _module in (cmd_fit, cmd_table, cmd_generate, cmd_bench, cmd_calibrate, cmd_replay, cmd_trace,
                cmd_plot, cmd_export):
    _module.register(app)


#: Width of Typer's help pages when stdout is no terminal and nothing pins one (``COLUMNS``,
#: ``TERMINAL_WIDTH``): the help texts are written in lines of at most 100 characters, and at
#: Rich's fallback of 80 a piped ``--help`` folded every one of them in two.
PIPED_HELP_WIDTH = 120


def main() -> None:
    """Console-script entry point."""
    pinned = any((os.environ.get(v) or "").isdigit() for v in ("COLUMNS", "TERMINAL_WIDTH"))
    if not pinned and not sys.stdout.isatty():
        typer.rich_utils.MAX_WIDTH = PIPED_HELP_WIDTH
    app()
