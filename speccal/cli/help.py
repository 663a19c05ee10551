"""How ``--help`` pages read: plain usage lines, no type tags on flags, commands in workflow order.

Typer's own rendering shows internal names (``speccal fit [OPTIONS] {measurements}``, ``speccal
table diff [OPTIONS] {a} {b}``) and a ``<bool>`` tag on every flag, and lists commands in the order
they were registered (sub-groups last). The classes here fix that once for every command:

- :class:`HelpCommand` / :class:`HelpGroup`: arguments are shown by their metavar, else their
  name in capitals (``MEASUREMENTS``; ``[NAME]`` when optional, ``...`` when repeated), and
  flags (``--json``, ``--resume``) carry no type tag;
- :class:`HelpGroup` lists its commands in ``command_order`` (the rest after them, in
  registration order);
- :class:`SpeccalTyper`: a ``typer.Typer`` whose commands are :class:`HelpCommand` unless a
  command asks for another class, so every ``app.command(...)`` gets the rules above.
"""

from __future__ import annotations

from typing import Any, ClassVar

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

# Typer vendors its own click (typer._click); parameters and contexts are typed loosely here so
# that nothing imports that private module.


def _plain_params(params: list[Any]) -> list[Any]:
    """Give flags an empty type tag and arguments their capitalised name (once per parameter)."""
    for p in params:
        if isinstance(p, TyperOption) and (p.is_flag or p.count) and p.metavar is None:
            p.metavar = ""  # typer shows the metavar in place of the "<bool>" type tag
        elif isinstance(p, TyperArgument) and p.metavar is None and p.name:
            p.metavar = p.name.upper()
    return params


def usage_pieces(command: Any, ctx: Any) -> list[str]:
    """``[OPTIONS] NAME [OPTIONAL]``: the usage line's pieces after the command path."""
    out = [command.options_metavar] if command.options_metavar else []
    for p in command.get_params(ctx):
        if not isinstance(p, TyperArgument):
            continue
        name = p.metavar or (p.name or "").upper()
        if p.nargs != 1:
            name += "..."
        out.append(name if p.required else f"[{name}]")
    return out


class HelpCommand(TyperCommand):
    """A command whose help follows the module docstring's rules."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_params(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return usage_pieces(self, ctx)


class HelpGroup(TyperGroup):
    """A command group whose help follows the module docstring's rules."""

    #: Subcommand names in the order the help lists them.
    command_order: ClassVar[tuple[str, ...]] = ()

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_params(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*usage_pieces(self, ctx), self.subcommand_metavar]

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {n: i for i, n in enumerate(self.command_order)}
        return sorted(names, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


class SpeccalTyper(typer.Typer):
    """``typer.Typer`` whose commands default to :class:`HelpCommand`."""

    def command(self, name: str | None = None, *, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(name, cls=cls or HelpCommand, **kwargs)
