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


def test_runtime_versions_on_cpu():
    import torch

    from speccal import __version__
    from speccal.runner.device import driver_version

    assert driver_version(torch.device("cpu")) is None
    from speccal.runner.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="tiny", device="cpu", max_model_len=64, request_buckets=(1,)))
    assert eng.runtime_versions() == {
        "speccal_version": __version__,
        "torch_version": torch.__version__,
        "driver_version": None,
    }


@pytest.mark.cuda
def test_driver_version_names_the_cuda_runtime():
    import torch

    from speccal.runner.device import driver_version

    text = driver_version(torch.device("cuda"))
    assert text is not None and f"cuda {torch.version.cuda}" in text
