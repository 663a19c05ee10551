"""The calibration report's KV-model paragraph: leave-one-context-out errors per point, their
median (the figure issue 23 bounds), mean, max and per context, from the table's own points."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from speccal.calibrate import report
from speccal.costmodel.table import load_table

ROOT = Path(__file__).resolve().parents[2]


def _table(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_table(ROOT / "tables" / name)


def test_kv_model_errors_of_a_multi_context_table():
    t = _table("dense-2b-h200.json")
    assert t.kv_model is not None and len(t.fits) > 1
    e = report.kv_model_errors(t)
    pct = np.array([abs(p.loco_ms - p.step_ms) / p.step_ms * 100 for p in t.kv_model.points])
    assert e["leave_one_context_out_median_pct"] == pytest.approx(np.median(pct), rel=1e-12)
    assert e["leave_one_context_out_mean_pct"] == t.kv_model.leave_one_context_out.mean_abs_pct
    assert set(e["per_context_loco_median_pct"]) == {f.context_index for f in t.fits}
    assert e["points"] == len(t.kv_model.points)
    out = io.StringIO()
    report.print_kv_model(Console(file=out, width=80), t)
    text = out.getvalue()
    assert "leave-one-context-out median" in text
    assert f"{e['leave_one_context_out_median_pct']:.2f} %" in text


def test_no_kv_paragraph_for_a_single_context_table():
    t = _table("dense-2b-h200-draft-step.json")
    assert report.kv_model_errors(t) is None
    out = io.StringIO()
    report.print_kv_model(Console(file=out, width=80), t)
    assert out.getvalue() == ""
