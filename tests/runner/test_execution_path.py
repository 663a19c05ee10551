"""The default execution path per device, shared by calibrate, bench and generate."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.runner.device import default_execution_path

ENV = {"COLUMNS": "120"}


@pytest.mark.parametrize(
    "device, expected",
    [
        ("cpu", ("eager", "torch")),
        ("cuda", ("split", "triton")),
        ("cuda:1", ("split", "triton")),
        ("npu:0", ("split", "torch")),
    ],
)
def test_default_execution_path(device, expected):
    assert default_execution_path(device) == expected


@pytest.mark.parametrize("command", ["bench", "generate"])
@pytest.mark.parametrize(
    "flag, value, reason",
    [
        ("--graph-mode", "split", "captures CUDA/NPU graphs"),
        ("--attention-backend", "nope", "one of torch, triton"),
    ],
)
def test_run_commands_validate_execution_flags(command, flag, value, reason):
    extra = ["--prompt-ids", "1,2,3"] if command == "generate" else []
    res = CliRunner().invoke(app, [command, flag, value, *extra], env=ENV)
    assert res.exit_code == 2, res.output
    assert reason in res.output
