"""CLI command ``speccal fit``: measurement rows -> cost table file, printing the fit report.

A bare fit (no ``--compat``) records ``draft_width`` explicitly (``--draft-width``, default 7 as
in the xLLM seed) and an ``unknown`` model identity, so loading it against a real engine's
compatibility is refused (fail closed) until it is refitted with ``--compat``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable, read_json
from speccal.base.errors import InputError
from speccal.cli.cmd_table import _echo_json, err_console, fit_report
from speccal.costmodel.compat import make_compatibility
from speccal.costmodel.measurements import read_measurements
from speccal.costmodel.report import summary
from speccal.costmodel.table import save_table
from speccal.costmodel.table_build import build_table
from speccal.costmodel.table_schema import Provenance

DEFAULT_DRAFT_WIDTH = 7


def _read_json(path: Path, option: str) -> dict:
    doc = read_json(path, option)  # missing, unreadable, binary or not JSON: InputError
    if not isinstance(doc, dict):
        raise InputError(option, str(path), "a JSON object")
    return doc


def fit(
    measurements: Annotated[
        Path, typer.Argument(help="Measurement rows (.csv or .parquet).", show_default=False)
    ],
    out: Annotated[
        Path,
        typer.Option("--out", help="Cost table JSON to write (atomically).", show_default=False),
    ],
    model: Annotated[str, typer.Option("--model", help="additive or sps.")] = "additive",
    draft_width: Annotated[
        int | None,
        typer.Option(
            "--draft-width",
            help="Draft width w. Default: from --compat, else 7.",
            show_default=False,
        ),
    ] = None,
    compat: Annotated[
        Path | None,
        typer.Option(
            "--compat",
            help="Compatibility JSON (Engine.compatibility()). Default: bare, unknown model.",
        ),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration", help="Effective calibration config JSON. Default: read from the rows."
        ),
    ] = None,
    combine: Annotated[
        str, typer.Option("--combine", help="Combine repeated windows: median or mean.")
    ] = "median",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the fit summary as JSON on stdout.")
    ] = False,
) -> None:
    """Fit an SPS or additive cost model per context interval and write a cost table."""
    if model not in ("additive", "sps"):
        raise InputError("--model", model, "additive or sps")
    if combine not in ("median", "mean"):
        raise InputError("--combine", combine, "median or mean")
    if draft_width is not None and draft_width < 1:
        raise InputError("--draft-width", draft_width, "an integer >= 1")
    if compat is not None:
        comp = _read_json(compat, "--compat")
        if draft_width is not None and comp.get("draft_width") != draft_width:
            raise InputError(
                "--draft-width",
                draft_width,
                f"the --compat draft_width ({comp.get('draft_width')!r})",
            )
    else:
        # every identity and the execution path "unknown": refused by any real engine
        comp = make_compatibility(draft_width=draft_width or DEFAULT_DRAFT_WIDTH)
    cal = _read_json(calibration, "--calibration") if calibration is not None else None
    if out.suffix.lower() != ".json":
        raise InputError("--out", str(out), "a path ending in .json")
    check_writable(out, "--out")  # before fitting: a bad path never costs the fit

    command = f"speccal fit {measurements} --model {model} --out {out}"
    with err_console.status("fitting"):
        df = read_measurements(measurements)
        table = build_table(
            df,
            model=model,
            compatibility=comp,
            calibration=cal,
            provenance=Provenance.now(command=command),
            combine=combine,
        )
    save_table(table, out)
    if as_json:
        _echo_json({"out": str(out), **summary(table)})
    else:
        fit_report(table)
        err_console.print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    """Attach ``speccal fit`` to the root app."""
    app.command("fit")(fit)
