"""A bare fit: measurement rows -> cost table, recording where its mode and draft width came from
(what ``speccal fit`` calls).

The mode is the rows' ``mode`` column, else ``mode``, else ``target_verify`` (calibrate's
default); the draft width is ``draft_width``, else the compatibility's, else the calibration
document's, else read from the rows (``speccal.costmodel.measurements.draft_width_of``). Each
source goes into ``calibration.sources`` (``flag``, ``compatibility``, ``calibration``,
``measurements``). Without a compatibility document the run is recorded as unknown
(``speccal.costmodel.compat.UNKNOWN_RUN``), so a real engine refuses the table (fail closed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from speccal.base.errors import InputError
from speccal.costmodel.compat import UNKNOWN_RUN, make_compatibility
from speccal.costmodel.measurements import DEFAULT_MODE, draft_width_of
from speccal.costmodel.table_build import build_table
from speccal.costmodel.table_schema import CostTable, Provenance


def fit_rows(
    df: pd.DataFrame,
    *,
    model: str,
    mode: str | None = None,
    draft_width: int | None = None,
    compatibility: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    combine: str = "median",
    command: str | None = None,
) -> CostTable:
    """Fit ``df`` (measurement rows) into a table; see the module docstring for the sources.

    ``mode``, ``draft_width``: the caller's (``--mode``, ``--draft-width``), None when not
    given; a ``mode`` other than the rows' is refused. ``command``: the provenance's.
    """
    sources: dict[str, str] = {}
    if "mode" in df.columns:
        if mode is not None and mode != df["mode"].iloc[0]:
            raise InputError("--mode", mode, f"the rows' mode {df['mode'].iloc[0]!r}")
    elif mode is not None:
        df = df.assign(mode=mode)
        sources["mode"] = "flag"
    comp = compatibility
    if comp is not None:
        sources["draft_width"] = "compatibility"
    elif draft_width is not None:
        comp = make_compatibility(draft_width=draft_width, **UNKNOWN_RUN)
        sources["draft_width"] = "flag"
    else:
        cal = calibration or {}
        rows_mode = df["mode"].iloc[0] if "mode" in df.columns else None
        width = cal.get("draft_width") or draft_width_of(
            df, rows_mode or cal.get("mode") or DEFAULT_MODE
        )
        comp = make_compatibility(draft_width=width, **UNKNOWN_RUN)
        sources["draft_width"] = "calibration" if calibration else "measurements"
    return build_table(
        df,
        model=model,
        compatibility=comp,
        calibration=calibration,
        provenance=Provenance.now(command=command),
        combine=combine,
        sources=sources,
    )
