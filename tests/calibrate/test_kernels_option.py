"""The kernel configuration a calibration measures is chosen explicitly (``--kernels FILE``,
``CalibrateOptions.kernels``), recorded in the table, and re-used by ``table check``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speccal.base.errors import InputError
from speccal.calibrate.check import engine_options
from speccal.calibrate.pipeline import CalibrateOptions, make_engine
from speccal.cli import app
from speccal.costmodel.table import load_table
from speccal.kernels.config import KernelConfig, NormFusion, PdlConfig

ENV = {"COLUMNS": "120"}
FAST = ["--warmup-steps", "1", "--window-steps", "2", "--windows-per-point", "1",
        "--request-buckets", "1,2", "--accept-noisy", "--remeasure-rounds", "0"]


def test_make_engine_takes_the_given_kernel_configuration():
    chosen = KernelConfig(pdl=PdlConfig("off"), norm=NormFusion("o"))
    eng = make_engine(CalibrateOptions(model="tiny", request_buckets=(1,),
                                       kernels=chosen.to_dict()))
    assert eng.path.kernels == chosen
    # a dense target records the linear-attention group at the value older tables ran
    assert eng.compatibility()["kernels"]["digest"] == chosen.for_model(
        linear_attention=False).digest()
    default = make_engine(CalibrateOptions(model="tiny", request_buckets=(1,)))
    assert default.path.kernels == KernelConfig()


def test_a_bad_kernel_configuration_names_its_field():
    with pytest.raises(InputError, match="kernels.pdl.mode"):
        make_engine(CalibrateOptions(model="tiny", kernels={"pdl": {"mode": "sometimes"}}))


def test_calibrate_records_the_kernels_file_and_table_check_reuses_them(tmp_path):
    chosen = KernelConfig(pdl=PdlConfig("early"))
    kfile = tmp_path / "kernels.json"
    kfile.write_text(json.dumps(chosen.to_dict()))
    out = tmp_path / "t.json"
    r = CliRunner().invoke(app, ["calibrate", "--model", "tiny", "--kernels", str(kfile),
                                 "--out", str(out), *FAST], env=ENV)
    assert r.exit_code == 0, r.output
    table = load_table(out)
    recorded = chosen.for_model(linear_attention=False)  # a dense target
    assert table.compatibility.kernels.digest == recorded.digest()
    opts = engine_options(table, model=None, device=None)
    assert KernelConfig.from_dict(opts.kernels) == recorded


def test_calibrate_refuses_an_unreadable_kernels_file(tmp_path):
    bad = tmp_path / "k.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(app, ["calibrate", "--model", "tiny", "--kernels", str(bad),
                                 "--out", str(tmp_path / "t.json"), *FAST], env=ENV)
    assert r.exit_code == 2 and "--kernels" in r.output
    assert not (tmp_path / "t.json").exists()
