"""Running a command on every rank that ``torchrun`` started.

``torchrun --nproc-per-node N -m speccal calibrate --tp T --dp D ...`` starts ``N`` copies of
the CLI; each calls :func:`run_ranks`, which reads the launcher's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: here, at the entry point,
never in library code), checks ``WORLD_SIZE == T * D``, joins the process group and runs the
command's body with this rank's :class:`~speccal.runner.distributed.comm.Comm` and console.

Rank 0 alone prints: the other ranks get a console that writes nowhere, and an error on them
is not printed there but exchanged (``Comm.agree``) so that rank 0 reports it naming the rank
(``RankError``); every rank exits with the same code. The whole body is one more error barrier,
so a rank failing outside the command's own barriers (inside a collective, say) is reported the
same way: it leaves the group after ``Topology.failure_grace_s``, its peers' collectives fail
and they report its error, root cause first. Such a failure is also printed by the rank that
caused it (``torchrun`` stops every rank once one exits non-zero, possibly before rank 0
printed). An error that every rank raised alike is printed once, as on one rank. Errors
before the group is joined (bad options, missing environment, a wrong world size) are the same
on every rank and printed by rank 0 only (its rank is read from the environment); the other
ranks wait :data:`PRE_GROUP_EXIT_DELAY_S` before they exit, so rank 0's exit is the one
``torchrun`` reports.

``torchrun`` itself exits 1 and prints its own ``ChildFailedError`` report (a traceback of the
launcher, not of speccal) once any rank exits non-zero: its exit status cannot carry the rank's.
So that the report names the error, every rank that exits on one leaves its one line in the file
``torchrun`` reads for the report (``TORCHELASTIC_ERROR_FILE``: :func:`note_for_launcher`); the
report's root cause then shows that line and the rank's exit code (2 for bad input).
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from speccal.base.errors import InputError, SpeccalError
from speccal.base.rich_tables import make_console

T = TypeVar("T")

#: Seconds the other ranks wait before exiting on an error raised before the group is joined
#: (the same error on every rank, printed by rank 0): ``torchrun`` stops every rank once one
#: exits, and its report names the first failure it saw, so rank 0 must exit first; a rank
#: that exited first got rank 0 killed (exit code -15 in the report) on a loaded 2-core
#: machine. ``torchrun`` ends the waiting ranks as soon as rank 0 has exited.
PRE_GROUP_EXIT_DELAY_S = 5.0


def env_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched by torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def note_for_launcher(line: str) -> None:
    """Under ``torchrun``, write this rank's one-line error where the launcher's failure report
    reads it (``TORCHELASTIC_ERROR_FILE``, set for every rank); nothing elsewhere."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            # the layout torch's own ``@record`` writes (torch.distributed.elastic errors)
            extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": line, "extraInfo": extra}}, fh)
    except OSError:
        pass  # the report then points at torch's docs instead: the rank's line is on stderr


def check_sizes(tp: int, dp: int) -> None:
    for name, v in (("--tp", tp), ("--dp", dp)):
        if v < 1:
            raise InputError(name, v, "an integer >= 1")


def is_distributed(tp: int, dp: int) -> bool:
    """Whether a command runs on several ranks (``--tp``/``--dp`` above 1, or launched by
    torchrun with more than one process); refuses sizes below 1 first."""
    check_sizes(tp, dp)
    return tp * dp > 1 or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def run_ranks(tp: int, dp: int, device: str, body: Callable[[Any, Console], T],
              console: Console | None = None, command: str = "run") -> T | None:
    """Join the ``tp`` x ``dp`` run and call ``body(comm, console)`` on this rank, behind the
    error barrier ``speccal COMMAND`` (module docstring).

    Returns ``body``'s value on rank 0 and None on the others (which print nothing). A
    :class:`SpeccalError` propagates on rank 0 (the CLI prints it) and becomes a ``typer.Exit``
    with the same code on the other ranks, silent unless this rank caused a failure that the
    ranks did not agree on.
    """
    # the runner is imported inside commands only (the CLI starts without torch); this module
    # of it is torch-free
    from speccal.runner.distributed.failure import RankError

    rank = env_rank()
    quiet = rank != 0
    out = make_console(file=io.StringIO()) if quiet else (console or make_console())
    phase = f"speccal {command}"
    try:
        # the runner's distributed package imports torch: only once a run is distributed
        from speccal.runner.distributed.comm import Topology, init_comm

        check_sizes(tp, dp)
        comm = init_comm(Topology(tp=tp, dp=dp), dict(os.environ), device)
        try:
            value = comm.agree(phase, lambda: body(comm, out))
        finally:
            comm.leave()
    except RankError as exc:
        alike = exc.agreed and exc.phase == phase and len({
            (f.kind, f.message) for f in exc.failures}) == 1 and len(exc.failures) > 1
        if alike and isinstance(exc.__cause__, SpeccalError):
            exc = exc.__cause__  # every rank raised this one error: say it as one rank would
        elif quiet and not exc.agreed and exc.first_rank == rank:
            make_console().print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        if quiet:
            note_for_launcher(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        raise exc from None
    except SpeccalError as exc:
        if quiet:  # an error before the group (every rank raised it): rank 0 exits first
            time.sleep(PRE_GROUP_EXIT_DELAY_S)
            note_for_launcher(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        raise
    return None if quiet else value
