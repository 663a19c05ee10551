"""The top floor: the Typer command line. It imports everything; nothing imports it."""

from speccal.cli.app import app, main

__all__ = ["app", "main"]
