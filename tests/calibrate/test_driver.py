"""The driver's window-major order and the advanced prompts that keep each window's KV range."""

from __future__ import annotations

import json

from rich.console import Console

from speccal.calibrate.config import UserConfig, parse_config_file, resolve_config
from speccal.calibrate.driver import synthetic_prompts
from speccal.calibrate.grid import GridPoint
from speccal.calibrate.pipeline import CalibrateOptions, calibrate


def _cfg(tmp_path, small_config, engine_factory, **over):
    cfg = json.loads(small_config.read_text())
    cfg.update(over)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "t.json"
    opts = CalibrateOptions(config_path=path, out=out, progress=False)
    calibrate(opts, console=Console(quiet=True), engine_factory=engine_factory)
    lines = [json.loads(x) for x in opts.journal_path.read_text().splitlines()]
    rows = [x["row"] for x in lines if x.get("kind") == "window"]
    return rows


def test_windows_run_window_major(tmp_path, small_config, engine_factory):
    rows = _cfg(tmp_path, small_config, engine_factory, windows_per_point=3)
    order = [(r["window_index"], r["bcap"], r["g"]) for r in rows]
    assert [o[0] for o in order] == sorted(o[0] for o in order)  # window 0 of all, then 1, ...
    assert len(order) == 4 * 3 and len(set(order)) == 12


def test_window_i_starts_where_a_sequential_run_would(tmp_path, small_config, engine_factory):
    """Forced acceptance grows each request by v + 1 per round: window i's mean KV sits
    ``window_steps * (v + 1)`` above window i - 1's, as if the windows ran back to back."""
    rows = _cfg(tmp_path, small_config, engine_factory, windows_per_point=3, window_steps=3)
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["bcap"], r["g"], r["k"]), {})[r["window_index"]] = r[
            "mean_kv_length"
        ]
    for (bcap, g, k), kv in by_point.items():
        per_round = g / bcap  # mean (v + 1) over the batch
        for i in (1, 2):
            assert abs(kv[i] - kv[i - 1] - 3 * per_round) < 1e-9, (bcap, g, k, kv)


def test_advanced_prompts_extend_the_base_prompts(small_config, engine_factory):
    eng = engine_factory(CalibrateOptions())
    cfg = resolve_config(UserConfig.build(parse_config_file(small_config), {}), eng.geometry)
    point = GridPoint(0, 2, 6, 3, (1, 3))
    base = synthetic_prompts(cfg, point, 100)
    adv = synthetic_prompts(cfg, point, 100, advance_rounds=5)
    assert synthetic_prompts(cfg, point, 100) == base  # deterministic
    for b, (p0, p1) in enumerate(zip(base, adv, strict=True)):
        assert p1[: len(p0)] == p0
        assert len(p1) - len(p0) == 5 * ((1, 3)[b] + 1)
