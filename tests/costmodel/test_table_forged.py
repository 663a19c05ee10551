"""Forged or corrupt numbers in a cost table are refused at load, naming field and value
(issue 34, item 5): strict JSON types, a KV model pricing non-positive costs, a geometry no round
can produce, windows whose step_ms disagrees with their elapsed_s, edited fit parameters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.base.errors import SchemaError
from speccal.cli import app
from speccal.costmodel.table import load_table, parse_table

ROOT = Path(__file__).resolve().parents[2]
KV_TABLE = json.loads((ROOT / "tables" / "tiny-cpu.json").read_text())  # kv_model, w = 3
ADDITIVE = json.loads(
    (ROOT / "tests" / "costmodel" / "fixtures" / "table_v6_additive.json").read_text()
)


def forged(doc: dict, edit) -> str:
    d = copy.deepcopy(doc)
    edit(d)
    return json.dumps(d)


def refused(text: str, *needles: str) -> str:
    with pytest.raises(SchemaError) as exc:
        parse_table(text, source="t.json")
    msg = str(exc.value)
    assert msg.startswith("t.json: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_the_unedited_tables_load():
    parse_table(json.dumps(KV_TABLE))
    parse_table(json.dumps(ADDITIVE))


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (lambda d: d["fits"][0]["additive"].update(bias_ms=True), ["additive.bias_ms", "True"]),
        (lambda d: d["fits"][0]["additive"].update(bias_ms="1.5"), ["additive.bias_ms", "'1.5'"]),
        (lambda d: d["fits"][0]["windows"][0].update(bcap=1.0), ["windows.0.bcap", "1.0"]),
        (lambda d: d["fits"][0]["windows"][0].update(k=False), ["windows.0.k", "False"]),
        (lambda d: d["calibration"].update(window_steps=32.0), ["window_steps", "32.0"]),
        (lambda d: d.update(schema_version=True), ["schema_version"]),
        (lambda d: d["geometry"]["target_rows"].update({"1": [1, 2, True, 4]}), ["target_rows"]),
        (
            lambda d: d["fits"][0]["diagnostics"]["residuals"].update(n_evaluated=-1),
            ["n_evaluated", "-1"],
        ),
    ],
)
def test_strict_json_types(edit, needles):
    refused(forged(ADDITIVE, edit), *needles)


def test_a_kv_model_pricing_a_negative_cost_is_refused():
    def edit(d):  # the largest Bcap's alpha drives its cells below zero
        d["kv_model"]["alpha_ms"][-1] = -100.0

    msg = refused(forged(KV_TABLE, edit), "kv_model", "above 0 ms", "Bcap 8")
    assert "KV 1" in msg or "KV 4096" in msg


def test_a_kv_model_negative_only_at_one_end_of_its_span_is_refused():
    kv = KV_TABLE["kv_model"]
    assert kv["kv_term"] in ("shared_bcap", "per_bcap", "shared", "per_g")

    def edit(d):  # a steep negative slope: positive at the low end, negative at the high end
        d["kv_model"]["beta_ms"] = [-1.0] * len(d["kv_model"]["beta_ms"])

    refused(forged(KV_TABLE, edit), "kv_model", f"KV {kv['max_kv_length']}")


def test_a_geometry_no_round_can_produce_is_refused():
    def edit(d):  # w = 3: Bcap 1 runs at most 4 target rows
        d["geometry"]["target_rows"]["1"] = [1, 2, 3, 4, 5, 6]

    refused(forged(KV_TABLE, edit), "geometry.target_rows.1", "[1, 4]")


def test_target_rows_must_cover_the_request_buckets():
    def edit(d):
        del d["geometry"]["target_rows"]["8"]

    refused(forged(KV_TABLE, edit), "geometry.target_rows", "one key per request bucket")


def test_calibrated_buckets_must_be_captured():
    def edit(d):
        d["calibration"]["target_graph_rows"]["2"] = [2, 3, 4, 5]

    refused(forged(KV_TABLE, edit), "calibration.target_graph_rows.2")


def test_a_window_whose_step_ms_disagrees_with_its_elapsed_s_is_refused():
    def edit(d):
        d["fits"][1]["windows"][2]["step_ms"] *= 1.01

    refused(forged(KV_TABLE, edit), "fits.1.windows.2.step_ms", "1000 * elapsed_s / window_steps")


def test_a_window_of_a_shape_the_mode_cannot_run_is_refused():
    def edit(d):  # target_verify runs k = w
        w = d["fits"][0]["windows"][0]
        w["k"] = 1

    refused(forged(KV_TABLE, edit), "fits.0.windows", "k")


def test_an_edited_fit_parameter_disagrees_with_the_stored_predictions():
    def edit(d):
        d["fits"][0]["additive"]["theta_ms"][-1] += 0.5

    refused(forged(ADDITIVE, edit), "fits.0.additive", "edited after its fit")


def test_table_validate_cli_refuses_a_forged_table_with_exit_2(tmp_path):
    path = tmp_path / "forged.json"
    path.write_text(forged(ADDITIVE, lambda d: d["fits"][0]["additive"].update(bias_ms=True)))
    res = CliRunner().invoke(app, ["table", "validate", str(path)], terminal_width=200)
    assert res.exit_code == 2, res.output
    assert "bias_ms" in res.output and "Traceback" not in res.output
    with pytest.raises(SchemaError, match=str(path)):
        load_table(path)
