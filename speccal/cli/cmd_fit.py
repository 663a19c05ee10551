"""CLI command ``speccal fit``: measurement rows -> cost table file, printing the fit report.

The mode is the rows' ``mode`` column, else ``--mode``, else ``target_verify`` (calibrate's
default); the draft width is ``--draft-width``, else ``--compat``'s, else read from the rows
(``speccal.costmodel.measurements.draft_width_of``); each source is recorded in
``calibration.sources`` and printed. Rows no round of that mode and width can produce are
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
from speccal.cli.cmd_table import _echo_json, err_console, fit_report
from speccal.costmodel.compat import UNKNOWN_RUN, make_compatibility
from speccal.costmodel.measurements import DEFAULT_MODE, MODES, draft_width_of, read_measurements
from speccal.costmodel.report import summary
from speccal.costmodel.table import save_table
from speccal.costmodel.table_build import build_table
from speccal.costmodel.table_schema import Provenance


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
        df = read_measurements(measurements)
        sources: dict[str, str] = {}
        if "mode" in df.columns:
            if mode is not None and mode != df["mode"].iloc[0]:
                raise InputError("--mode", mode, f"the rows' mode {df['mode'].iloc[0]!r}")
        elif mode is not None:
            df = df.assign(mode=mode)
            sources["mode"] = "flag"
        if comp is not None:
            sources["draft_width"] = "compatibility"
        elif draft_width is not None:
            comp = make_compatibility(draft_width=draft_width, **UNKNOWN_RUN)
            sources["draft_width"] = "flag"
        else:
            rows_mode = df["mode"].iloc[0] if "mode" in df.columns else None
            width = (cal or {}).get("draft_width") or draft_width_of(
                df, rows_mode or (cal or {}).get("mode") or DEFAULT_MODE
            )
            comp = make_compatibility(draft_width=width, **UNKNOWN_RUN)
            sources["draft_width"] = "calibration" if cal else "measurements"
        table = build_table(
            df,
            model=model,
            compatibility=comp,
            calibration=cal,
            provenance=Provenance.now(command=command),
            combine=combine,
            sources=sources,
        )
    save_table(table, out)
    if as_json:
        _echo_json({"out": str(out), **summary(table)})
        return
    _print_sources(table, bare=compat is None)
    fit_report(table, nonpositive=False)  # the root shows the fit's warning once
    err_console.print(f"wrote {out}", markup=False)


#: How ``fit`` says where a value came from (``calibration.sources``).
_SOURCE_TEXT = {
    "flag": "from the command line",
    "compatibility": "from --compat",
    "calibration": "from --calibration",
    "measurements": "read from the rows",
    "default": "default",
}


def _print_sources(table, *, bare: bool) -> None:
    """Say where the mode and the draft width came from, and what a bare fit records."""
    src = table.calibration.sources
    mode_src = src.get("mode", "default")
    mode_text = (
        "default: the rows have no mode column; calibrate's default"
        if mode_src == "default"
        else _SOURCE_TEXT.get(mode_src, mode_src)
    )
    width_src = src.get("draft_width", "default")
    err_console.print(
        f"mode {table.mode} ({mode_text}); draft width {table.draft_width} "
        f"({_SOURCE_TEXT.get(width_src, width_src)})",
        markup=False,
    )
    if bare:
        err_console.print(
            "no --compat: model, topology, graph mode, device and execution path recorded as "
            "unknown, so a real engine refuses this table; refit with --compat FILE (speccal "
            "table compat writes it)"
        )


def register(app: typer.Typer) -> None:
    """Attach ``speccal fit`` to the root app."""
    app.command("fit")(fit)
