"""CLI command ``speccal fit``: measurement rows -> cost table file, printing the fit report.

``speccal.costmodel.fit_rows.fit_rows`` fits: the mode is the rows' ``mode`` column, else
``--mode``, else ``target_verify`` (calibrate's default); the draft width is ``--draft-width``,
else ``--compat``'s, else read from the rows (``speccal.costmodel.measurements.draft_width_of``);
each source is recorded in ``calibration.sources`` and printed. Rows no round of that mode and width can produce are
refused (``measurements.check_shapes``); a window repeated in the rows counts once.
A bare fit (no ``--compat``) records the model identity, the topology, the graph mode, the
device and the execution path as ``unknown`` (``costmodel.compat.UNKNOWN_RUN``), so loading it
against a real engine's compatibility is refused (fail closed) until it is refitted with
``--compat`` (``speccal table compat`` writes one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable, read_json
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.cli.render_table import echo_json, err_console, fit_report, print_sources
from speccal.costmodel.fit_rows import fit_rows
from speccal.costmodel.measurements import MODES, read_measurements
from speccal.costmodel.report import summary
from speccal.costmodel.table import save_table


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
            help="Draft width w. Default: --compat's, else read from the rows (the k of "
            "target_verify rows, the largest k of draft_step rows).",
            show_default=False,
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="target_verify or draft_step, for rows without a mode column. Default: the "
            "rows' mode, else target_verify (as calibrate).",
            show_default=False,
        ),
    ] = None,
    compat: Annotated[
        Path | None,
        typer.Option(
            "--compat",
            help="Compatibility JSON of the run the rows were measured on (speccal table "
            "compat writes it). Default: none, so model, topology, graph mode and device are "
            "recorded as unknown and a real engine refuses the table.",
            show_default=False,
        ),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            help="Effective calibration config JSON (a table's calibration block). Default: "
            "read from the rows.",
            show_default=False,
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
    if mode is not None and mode not in MODES:
        raise InputError("--mode", mode, " or ".join(MODES))
    comp = None
    if compat is not None:
        comp = _read_json(compat, "--compat")
        if draft_width is not None and comp.get("draft_width") != draft_width:
            raise InputError(
                "--draft-width",
                draft_width,
                f"the --compat draft_width ({comp.get('draft_width')!r})",
            )
    cal = _read_json(calibration, "--calibration") if calibration is not None else None
    if out.suffix.lower() != ".json":
        raise InputError("--out", str(out), "a path ending in .json")
    check_outputs(
        [("--out", out)],
        [("MEASUREMENTS", measurements), ("--compat", compat), ("--calibration", calibration)],
    )
    check_writable(out, "--out")  # before fitting: a bad path never costs the fit

    command = f"speccal fit {measurements} --model {model} --out {out}"
    with err_console.status("fitting"):
        table = fit_rows(read_measurements(measurements), model=model, mode=mode,
                         draft_width=draft_width, compatibility=comp, calibration=cal,
                         combine=combine, command=command)
    save_table(table, out)
    if as_json:
        echo_json({"out": str(out), **summary(table)})
        return
    print_sources(table, bare=compat is None)
    fit_report(table, nonpositive=False)  # the root shows the fit's warning once
    err_console.print(f"wrote {out}", markup=False)


def register(app: typer.Typer) -> None:
    """Attach ``speccal fit`` to the root app."""
    app.command("fit")(fit)
