"""CLI commands: replay (filled in by its issue)."""

import typer


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
