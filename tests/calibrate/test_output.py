"""``speccal calibrate``'s human output where stderr is not a terminal (CI, nohup, a pipe): plain
progress lines instead of a live bar's last frame, and every table legible at 80 columns."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from tests.calibrate.fakes import CONFIG, POINTS, fake, patch_cli

TOTAL = len(POINTS) * CONFIG["windows_per_point"]


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(CONFIG))
    return path


def calibrate(monkeypatch, tmp_path, cfg_path, make, columns=80):
    patch_cli(monkeypatch, make)
    res = CliRunner().invoke(
        app,
        ["calibrate", "--config", str(cfg_path), "--out", str(tmp_path / "t.json")],
        env={"COLUMNS": str(columns), "NO_COLOR": "1"},
    )
    assert res.exit_code == 0, res.output
    return res.stderr.splitlines()


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(monkeypatch, tmp_path, cfg_path):
    lines = calibrate(monkeypatch, tmp_path, cfg_path, fake())
    progress = [ln for ln in lines if ln.startswith("calibrate: ")]
    assert progress[0] == f"calibrate: 0/{TOTAL} windows, 0 %"
    assert progress[-1].startswith(f"calibrate: {TOTAL}/{TOTAL} windows, 100 %")
    assert len(progress) >= 5  # every 10 % of 15 windows: a line at least every other window
    assert any("(points " in ln and "Bcap=" in ln for ln in progress)


def test_remeasure_round_is_announced_in_the_log(monkeypatch, tmp_path, cfg_path):
    lines = calibrate(monkeypatch, tmp_path, cfg_path, fake(factors={(1, 4): [1.0, 1.3, 1.0]}))
    assert any(
        ln.startswith("re-measuring 1 noisy point(s)") and "Bcap=1 G=4" in ln for ln in lines
    )
    assert any(ln.startswith("calibrate: re-measure 1/1, ") for ln in lines)  # cpu: one round
    total = TOTAL + CONFIG["windows_per_point"]
    assert any(ln.startswith(f"calibrate: re-measure 1/1, {total}/{total} windows") for ln in lines)
    assert any(ln.strip().startswith("Bcap=1 G=4 k=3: 30.0 % -> 0.0 %") for ln in lines)


def test_every_table_is_legible_at_80_columns(monkeypatch, tmp_path, cfg_path):
    lines = calibrate(monkeypatch, tmp_path, cfg_path, fake(), columns=80)
    text = "\n".join(lines)
    assert "…" not in text, text
    assert "effective calibration configuration" in text and "captured graph geometry" in text
    assert "LOPO ms" in text or "LOPO" in text  # the fit report printed
    assert next(ln for ln in lines if ln.lstrip().startswith("threads"))
    assert max(len(ln) for ln in lines if "│" in ln or "─" in ln) <= 80


def test_compile_capture_then_warmup_and_measuring_lines(monkeypatch, tmp_path, cfg_path):
    lines = calibrate(monkeypatch, tmp_path, cfg_path, fake(), columns=120)
    compile_i = next(i for i, ln in enumerate(lines) if ln.startswith("compile/capture "))
    start_i = next(i for i, ln in enumerate(lines) if ln.startswith("calibrate: 0/"))
    warm_i = next(i for i, ln in enumerate(lines) if ln.startswith("warm-up "))
    assert compile_i < start_i < warm_i
    assert "measuring" in lines[warm_i] and f"({TOTAL} windows)" in lines[warm_i]
