"""Routing facts in calibration (issue 37 item 4): a routed-expert target's windows journal the
mean distinct experts its rounds activated, the table carries them per window and per point with
``calibration.routing``, validates them (JSON Schema and loader), and its readers show them.
A fake routed engine gives exact expectations; ``moe-tiny`` runs the whole CLI on the CPU."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from speccal.base.errors import InputError, SchemaError
from speccal.base.runner_face import Routing
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.cli import app
from speccal.costmodel.table import SCHEMA_PATH, load_table, parse_table
from speccal.costmodel.table_build import build_table, refit_table
from tests.calibrate.fakes import CONFIG, fake, fake_experts

ROUTING = Routing(experts=8, top_k=2, layers=3)
#: fake round indices of a window: transition 0, warmup 1, then the window's rounds
WINDOW_ROUNDS = range(1 + CONFIG["warmup_steps"], 1 + CONFIG["warmup_steps"] + CONFIG["window_steps"])


def _calibrate(tmp_path, routing: Routing | None) -> tuple[dict, list[dict]]:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    make = fake(routing=routing)
    out = tmp_path / "t.json"
    calibrate(CalibrateOptions(config_path=cfg, out=out, progress=False, remeasure_rounds=0),
              console=Console(stderr=True, quiet=True), engine_factory=make, clock=make.clock)
    lines = (tmp_path / "t.json.journal.jsonl").read_text().splitlines()
    return json.loads(out.read_text()), [json.loads(x)["row"] for x in lines[1:]]


@pytest.fixture
def routed(tmp_path):
    return _calibrate(tmp_path, ROUTING)


def test_windows_journal_the_mean_over_layers_and_rounds(routed):
    doc, rows = routed
    assert len(rows) == 5 * CONFIG["windows_per_point"]
    for r in rows:
        want = np.mean([fake_experts(ROUTING, r["g"], layer, n)
                        for layer in range(ROUTING.layers) for n in WINDOW_ROUNDS])
        assert r["experts_activated"] == pytest.approx(want, rel=1e-12), r
    assert doc["calibration"]["routing"] == {"source": "random_tokens", "experts": 8,
                                             "top_k": 2, "layers": 3}
    (fit,) = doc["fits"]
    by_window = {(w["bcap"], w["g"], w["window_index"]): w["experts_activated"]
                 for w in fit["windows"]}
    assert by_window == {(r["bcap"], r["g"], r["window_index"]): r["experts_activated"]
                         for r in rows}
    for p in fit["diagnostics"]["points"]:  # the mean of the point's windows
        vals = [v for (b, g, _), v in by_window.items() if (b, g) == (p["bcap"], p["g"])]
        assert p["experts_activated"] == pytest.approx(np.mean(vals), rel=1e-12)
    # G = 8 rows route to every expert; 2 rows to at most 4 of them
    assert {p["g"]: p["experts_activated"] for p in fit["diagnostics"]["points"]}[8] > 7


def test_the_routed_table_validates_and_round_trips(routed, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    doc, _ = routed
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    table = load_table(tmp_path / "t.json")
    assert table.calibration.routing.experts == 8
    again = refit_table(table, provenance=table.provenance)
    assert again.to_json() == table.to_json()  # counts and routing survive a refit
    bad = doc["fits"][0]["windows"][0]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "fits": [{**doc["fits"][0], "windows": [
            {**bad, "experts_activated": 0}]}]}, json.loads(SCHEMA_PATH.read_text()))


def test_a_dense_table_has_no_routing_keys(tmp_path):
    doc, rows = _calibrate(tmp_path, None)
    text = json.dumps(doc)
    assert "routing" not in doc["calibration"] and "experts_activated" not in text
    assert all("experts_activated" not in r for r in rows)


def _edited(doc, edit) -> str:
    doc = json.loads(json.dumps(doc))
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["calibration"].pop("routing"),
     r"fits\.0\.windows\.0\.experts_activated.*absent: the table has no calibration\.routing"),
    (lambda d: d["fits"][0]["windows"][3].update(experts_activated=8.5),
     r"fits\.0\.windows\.3\.experts_activated: got 8\.5.*\[2, 8\]"),
    (lambda d: d["fits"][0]["windows"][1].update(experts_activated=1.5),
     r"fits\.0\.windows\.1\.experts_activated: got 1\.5.*\[2, 8\]"),
    (lambda d: d["fits"][0]["windows"][2].pop("experts_activated"),
     r"fits\.0\.windows\.2\.experts_activated: got .missing."),
    (lambda d: d["fits"][0]["diagnostics"]["points"][0].update(experts_activated=3.0),
     r"fits\.0\.diagnostics\.points\.0\.experts_activated: got 3\.0.*the mean of the point's "
     "windows"),
    (lambda d: d["calibration"]["routing"].update(source="production_traffic"),
     r"calibration\.routing\.source"),
    (lambda d: d["calibration"]["routing"].update(shared=2),
     r"calibration\.routing\.shared.*unknown key"),
])
def test_bad_routing_facts_are_refused_naming_the_field(routed, edit, match):
    doc, _ = routed
    with pytest.raises(SchemaError, match=match):
        parse_table(_edited(doc, edit))


def test_counts_need_the_routing_they_were_measured_under(routed, tmp_path):
    table = load_table(tmp_path / "t.json")
    rows = table.measurements()
    assert "experts_activated" in rows.columns
    cal = table.calibration.model_dump()
    with pytest.raises(InputError, match="calibration.routing"):
        build_table(rows, compatibility=table.compatibility, calibration={**cal, "routing": None})
    with pytest.raises(InputError, match="measurements.experts_activated: got .missing."):
        build_table(rows.drop(columns="experts_activated"), compatibility=table.compatibility,
                    calibration=cal)
    high = rows.assign(experts_activated=rows["experts_activated"].where(rows.index != 4, 9.0))
    with pytest.raises(InputError, match=r"experts_activated\[row 4\]: got 9\.0.*\[2, 8\]"):
        build_table(high, compatibility=table.compatibility, calibration=cal)


#: w = 2: Bcap 1 at G {1, 2, 3}, Bcap 2 at G {2, 6} (connected through G 2)
MOE_SMALL = {
    "request_buckets": [1, 2],
    "target_graph_rows": {"1": [1, 2], "2": [2]},
    "contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 128}],
    "warmup_steps": 1,
    "window_steps": 3,
    "windows_per_point": 2,
}


def test_calibrating_a_tiny_moe_preset_records_and_shows_routing(tmp_path):
    """End to end on the CPU: ``speccal calibrate --model moe-tiny``, the table read back
    against the committed schema, ``speccal table show`` printing the routing facts."""
    jsonschema = pytest.importorskip("jsonschema")
    cfg, out = tmp_path / "cfg.json", tmp_path / "moe.json"
    cfg.write_text(json.dumps(MOE_SMALL))
    env = {"COLUMNS": "200"}
    res = CliRunner().invoke(app, [
        "calibrate", "--model", "moe-tiny", "--device", "cpu", "--draft-width", "2",
        "--request-buckets", "1,2", "--max-model-len", "128", "--threads", "1",
        "--config", str(cfg), "--out", str(out), "--remeasure-rounds", "0", "--accept-noisy"], env=env)
    assert res.exit_code == 0, res.output
    assert "routing: 2 routed layers, top 4 of 16 experts" in res.output
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    table = load_table(out, expect=None)
    assert table.calibration.routing.model_dump() == {
        "source": "random_tokens", "experts": 16, "top_k": 4, "layers": 2}
    points = {(p.bcap, p.g): p.experts_activated for p in table.fits[0].diagnostics.points}
    assert set(points) == {(1, 1), (1, 2), (1, 3), (2, 2), (2, 6)}
    assert points[(1, 1)] == 4.0  # one row: exactly its top 4 in every layer and round
    assert all(4.0 <= v <= 16.0 for v in points.values())
    assert points[(2, 6)] > points[(1, 2)]  # more rows, more experts
    show = CliRunner().invoke(app, ["table", "show", str(out), "--no-params"], env=env)
    assert show.exit_code == 0, show.output
    assert "routing: 2 routed layers, top 4 of 16 experts, calibrated on random tokens" in (
        show.output)
    for (bcap, g), v in points.items():  # the per-point table: context, Bcap, G, k, experts
        assert re.search(rf"│\s+0 │\s+{bcap} │\s+{g} │\s+2 │\s+{v:.2f} │", show.output), (bcap, g)
    js = CliRunner().invoke(app, ["table", "show", str(out), "--json"], env=env)
    routing = json.loads(js.stdout)["routing"]
    assert [(p["bcap"], p["g"], p["experts_activated"]) for p in routing["points"]] == [
        (b, g, v) for (b, g), v in points.items()]
