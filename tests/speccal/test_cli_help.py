"""What a first user reads: help pages, warnings and refusal messages (CliRunner, 120 columns).

Help pages: no ``<bool>`` tag on flags, usage lines with plain argument names, commands in
workflow order, jargon explained, the calibration config keys listed. Messages: numbers printed
plainly (no ``np.float64(...)``), warnings one clean line each, once, missing columns named
against the file's own, the model-context hint about the context, an unsupported architecture
and the way to plain decoding named.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.config import CalibrationModel, PolicyModel
from speccal.calibrate.feasibility import check_feasible
from speccal.cli import app
from speccal.cli.app import COMMAND_ORDER
from speccal.costmodel.measurements import REQUIRED_COLUMNS, write_measurements
from speccal.costmodel.synthetic import make_measurements
from speccal.runner.engine import Engine, EngineConfig

from ..calibrate.test_feasibility import cfg_of
from ..runner.test_draft_families import make_checkpoint

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def every_command() -> list[list[str]]:
    """The argv prefix of every command and group (``[]`` is the root)."""
    out = [[]]
    for name in COMMAND_ORDER:
        out.append([name])
    out += [["table", sub] for sub in ("show", "validate", "export", "compat", "diff")]
    return out


@pytest.mark.parametrize("prefix", every_command(), ids=lambda p: " ".join(p) or "root")
def test_help_has_no_type_tags_on_flags_and_plain_usage(prefix):
    r = run(*prefix, "--help")
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output
    usage = next(ln for ln in r.output.splitlines() if "Usage:" in ln)
    assert "{" not in usage and "}" not in usage, usage
    assert "--help" in r.output and "Show this message and exit." in r.output


@pytest.mark.parametrize(
    "prefix, usage",
    [
        (["fit"], "speccal fit [OPTIONS] MEASUREMENTS"),
        (["table", "diff"], "speccal table diff [OPTIONS] TABLE_A TABLE_B"),
        (["table", "show"], "speccal table show [OPTIONS] TABLE"),
        (["plot"], "speccal plot [OPTIONS] TABLE"),
        ([], "speccal [OPTIONS] COMMAND [ARGS]..."),
    ],
)
def test_usage_lines_name_arguments_plainly(prefix, usage):
    assert usage in run(*prefix, "--help").output


def test_commands_are_listed_in_workflow_order():
    out = run("--help").output
    listed = [m.group(1) for m in re.finditer(r"^│ (\w+)\s{2,}", out, re.MULTILINE)]
    listed = [n for n in listed if n in COMMAND_ORDER]
    assert (
        listed
        == list(COMMAND_ORDER)
        == [
            "calibrate",
            "fit",
            "table",
            "trace",
            "replay",
            "plot",
            "bench",
            "generate",
        ]
    )
    table = run("table", "--help").output
    subs = [m.group(1) for m in re.finditer(r"^│ (\w+)\s{2,}", table, re.MULTILINE)]
    assert subs == ["show", "validate", "check", "export", "compat", "diff"]


def test_root_help_explains_the_jargon():
    out = " ".join(run("--help").output.split())
    for words in (
        "split (separately captured draft and target CUDA/NPU graphs",
        "forced (every drafted token accepted",
        "Bcap = the captured draft batch size",
        "G = target rows verified",
    ):
        assert words in out, words


def test_calibrate_help_lists_every_config_key():
    out = " ".join(run("calibrate", "--help").output.replace("│", " ").split())
    keys = [k for k in CalibrationModel.model_fields] + list(PolicyModel.model_fields)
    for key in keys:
        assert key in out, key
    assert "the two config shapes of the xLLM engine" in out and "adaptive-draft-step" in out


def test_validate_json_prints_a_verdict_when_the_table_is_refused(tmp_path):
    df = make_measurements(
        bias_ms=4.0, alpha_ms={1: 0.0, 2: 0.3}, theta_ms={2: 0.1, 4: 0.2}, draft_width=1
    )
    write_measurements(df, tmp_path / "m.csv")
    assert run("fit", tmp_path / "m.csv", "--out", tmp_path / "t.json").exit_code == 0
    expect = json.loads((tmp_path / "t.json").read_text())["compatibility"]
    (tmp_path / "w2.json").write_text(json.dumps({**expect, "draft_width": 2}))
    r = run("table", "validate", tmp_path / "t.json", "--expect", tmp_path / "w2.json", "--json")
    assert r.exit_code == 2
    verdict = json.loads(r.stdout)
    assert verdict["valid"] is False and verdict["path"] == str(tmp_path / "t.json")
    assert "draft_width" in verdict["error"]
    assert r.stderr.strip().splitlines() == [f"error: {verdict['error']}"]


def test_messages_print_numbers_plainly():
    err = InputError("x", np.float64(0.25), "y", hint=None)
    assert str(err) == "x: got 0.25, expected y"
    err = InputError("x", [np.int64(3), (np.float32(0.5),)], "y")
    assert "np." not in str(err) and "[3, (0.5,)]" in str(err)


def test_a_bad_row_message_has_no_numpy_reprs(tmp_path):
    df = make_measurements(bias_ms=4.0, alpha_ms={1: 0.0}, theta_ms={2: 0.1}, draft_width=1)
    df.loc[0, "step_ms"] = 1.0  # not 1000 * elapsed_s / window_steps
    df.to_csv(tmp_path / "m.csv", index=False)
    r = run("fit", tmp_path / "m.csv", "--out", tmp_path / "t.json")
    assert r.exit_code == 2
    assert "np." not in r.stderr and "1000 * elapsed_s / window_steps = 4.1" in r.stderr


def test_a_warning_is_one_clean_line_shown_once(tmp_path):
    # An exact additive truth whose unmeasured cell (Bcap 2, G 3) = 4 - 2 - 3.5 < 0.
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: -2.0},
        theta_ms={1: 0.0, 2: 0.0, 3: -3.5, 4: 1.0},
        points=[(1, 1), (1, 2), (1, 3), (2, 2), (2, 4)],
        draft_width=3,
    )
    write_measurements(df, tmp_path / "m.csv")
    r = run("fit", tmp_path / "m.csv", "--out", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if "non-positive" in ln or "not positive" in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("warning: the additive fit predicts a non-positive step cost")
    assert "Bcap 2 G 3: -1.500 ms" in lines[0]
    assert "NonPositiveCostWarning" not in r.stderr and "warnings.warn" not in r.stderr
    assert ".py:" not in r.stderr  # no source location


def test_missing_columns_are_named_against_the_files_own(tmp_path):
    cols = [f"column_{i:02d}" for i in range(30)] + ["bcap", "g"]
    pd.DataFrame([range(len(cols))], columns=cols).to_csv(tmp_path / "x.csv", index=False)
    r = run("fit", tmp_path / "x.csv", "--out", tmp_path / "t.json")
    assert r.exit_code == 2
    (line,) = r.stderr.strip().splitlines()
    got = line.split("got ", 1)[1].split(", expected", 1)[0]
    assert got == ", ".join(cols)  # every column of the file, not shortened
    missing = line.split("(missing: ", 1)[1].rstrip(")").split(", ")
    assert missing == [c for c in REQUIRED_COLUMNS if c not in cols]
    assert "..." not in line


def test_a_context_beyond_the_model_asks_for_a_smaller_context_not_fewer_warmup_steps():
    geo = Geometry(
        draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=4 * 4096, max_model_len=1024
    )
    obj = {"contexts": [{"prefill_tokens": 64, "min_kv_length": 1, "max_kv_length": 2048}]}
    with pytest.raises(InputError) as exc:
        check_feasible(cfg_of(obj, geo), geo)
    assert "max_kv_length <= 1024" in exc.value.hint and "--max-model-len" in exc.value.hint
    assert "warmup" not in str(exc.value)


def test_an_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "mamba").mkdir()
    cfg = {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "intermediate_size": 128,
        "state_size": 16,
    }
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"backbone.embeddings.weight": torch.zeros(128, 64)}, tmp_path / "mamba" / "m.safetensors"
    )
    r = run("generate", "--model", tmp_path / "mamba", "--prompt-ids", "1,2")
    assert r.exit_code == 2
    assert "MambaForCausalLM" in r.stderr and "'mamba'" in r.stderr


def test_a_checkpoint_without_a_head_names_plain_decoding(tmp_path):
    make_checkpoint(tmp_path / "n", "mimo", depths=0)
    r = run("generate", "--model", tmp_path / "n", "--prompt-ids", "1,2", "--max-tokens", "2")
    assert r.exit_code == 2 and "no MTP head" in r.stderr and "--plain" in r.stderr
    r = run(
        "generate", "--model", tmp_path / "n", "--prompt-ids", "1,2", "--max-tokens", "2", "--plain"
    )
    assert r.exit_code == 0, r.output


def test_a_random_weight_preset_reads_as_one_sentence():
    desc = Engine(EngineConfig(model="tiny")).description
    sentence = f"runner {desc} built and warmed (eager graphs)"
    assert "RANDOM weights of seed 0: its text is meaningless)" in sentence
    assert "meaningless built" not in sentence and "meaningless warmed" not in sentence
