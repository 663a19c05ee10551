"""``torchrun --nproc-per-node 2 -m speccal calibrate --tp 2``: rank 0 alone prints and writes one
table recording the topology; bad topologies and a missing launcher environment are refused
with the field, the value and what was expected (in process, before any group is joined)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.table import load_table

CAL = {
    "request_buckets": [1],
    "target_graph_rows": {"1": [2]},
    "contexts": [{"prefill_tokens": 16, "min_kv_length": 1, "max_kv_length": 64}],
    "warmup_steps": 1,
    "window_steps": 2,
    "windows_per_point": 2,
}
ARGS = ["--request-buckets", "1", "--max-model-len", "128", "--remeasure-rounds", "0",
        "--accept-noisy"]
NO_LAUNCHER = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "MASTER_ADDR": None,
               "MASTER_PORT": None, "COLUMNS": "120"}


def _error_line(res) -> str:
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, res.output
    return " ".join(lines[0].split())


def test_torchrun_calibrate_tp2_rank0_alone_prints_and_writes(tmp_path):
    (tmp_path / "cal.json").write_text(json.dumps(CAL))
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           # --standalone: the agent binds its store to a free port itself and hands it to the
           # ranks (no port chosen here that another process could take before the bind)
           "--standalone", "-m", "speccal", "calibrate", "--tp", "2",
           "--config", str(tmp_path / "cal.json"), "--out", str(out), *ARGS, "--json",
           # two-round windows on 2 shared cores skew ~5 % between TP ranks: the refusal has its
           # own test (a 3x clock, test_distributed_ranks); this one checks the CLI's plumbing
           "--max-rank-skew-pct", "25"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"})
    assert res.returncode == 0, res.stderr[-4000:]
    docs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 1  # one summary: rank 0's
    summary = docs[0]
    assert summary["topology"]["tp"] == 2 and summary["topology"]["world_size"] == 2
    assert res.stderr.count(f"wrote {out}") == 1
    assert res.stderr.count("rank skew: largest") == 1
    table = load_table(out)
    assert (table.compatibility.topology.tp, table.compatibility.topology.dp) == (2, 1)
    assert table.provenance.command.startswith("torchrun --nproc-per-node 2 -m speccal calibrate "
                                               "--tp 2 --config")


def test_world_size_other_than_tp_times_dp_is_refused(tmp_path):
    env = {**NO_LAUNCHER, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    res = CliRunner().invoke(app, ["calibrate", "--tp", "2", "--dp", "2", "--out",
                                   str(tmp_path / "t.json")], env=env)
    assert res.exit_code == 2
    assert _error_line(res) == (
        "error: world size (torchrun --nproc-per-node x nodes): got 2, expected tp * dp = "
        "2 * 2 = 4")


def test_missing_launcher_environment_is_refused(tmp_path):
    res = CliRunner().invoke(app, ["calibrate", "--tp", "2", "--out", str(tmp_path / "t.json")],
                             env=NO_LAUNCHER)
    assert res.exit_code == 2
    assert _error_line(res) == (
        "error: environment variable RANK: got None, expected set by torchrun: launch with "
        "torchrun --nproc-per-node N -m speccal ...")


@pytest.mark.parametrize("flag,value", [("--tp", "0"), ("--dp", "-1")])
def test_bad_sizes_are_refused(tmp_path, flag, value):
    env = {**NO_LAUNCHER, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    res = CliRunner().invoke(app, ["calibrate", flag, value, "--out", str(tmp_path / "t.json")],
                             env=env)
    assert res.exit_code == 2
    assert _error_line(res) == f"error: {flag}: got {value}, expected an integer >= 1"


class _FailingComm:
    """What init_comm returns in the run_ranks tests: its barrier raises ``exc``."""

    def __init__(self, exc):
        self.exc, self.left = exc, False

    def agree(self, phase, fn):
        raise self.exc

    def leave(self):
        self.left = True


def _run_ranks_raising(monkeypatch, rank: int, exc):
    from speccal.cli.dist import run_ranks
    from speccal.runner.distributed import comm as comm_mod

    fake = _FailingComm(exc)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(comm_mod, "init_comm", lambda topology, env, device: fake)
    try:
        run_ranks(2, 1, "cpu", lambda comm, console: None, command="generate")
    finally:
        assert fake.left  # the group is left whatever happened
    raise AssertionError("run_ranks returned")


def _failures(*ranks, message="m", phase="speccal generate"):
    from speccal.runner.distributed.failure import Failure

    return [Failure(r, "InputError", message, 2, phase, i + 1) for i, r in enumerate(ranks)]


def test_an_error_every_rank_raised_alike_is_printed_as_one_rank_would(monkeypatch):
    import typer

    from speccal.base.errors import InputError
    from speccal.runner.distributed.failure import RankError

    cause = InputError("--prompt", "hi", "token ids")
    alike = RankError("speccal generate", _failures(0, 1, message=str(cause)))
    alike.__cause__ = cause
    with pytest.raises(InputError) as info:
        _run_ranks_raising(monkeypatch, 0, alike)
    assert info.value is cause
    with pytest.raises(typer.Exit) as info:
        _run_ranks_raising(monkeypatch, 1, alike)
    assert info.value.exit_code == 2


def test_the_rank_that_caused_an_unagreed_failure_prints_it(monkeypatch, capsys):
    import typer

    from speccal.runner.distributed.failure import RankError

    left = RankError("speccal generate", _failures(1, 0), agreed=False)
    with pytest.raises(typer.Exit) as info:  # rank 1, the root cause: says it itself
        _run_ranks_raising(monkeypatch, 1, left)
    assert info.value.exit_code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: speccal generate failed on 2 rank(s), first on rank 1: ")
    with pytest.raises(typer.Exit):  # another quiet rank stays quiet
        _run_ranks_raising(monkeypatch, 2, left)
    assert capsys.readouterr().err == ""
    with pytest.raises(RankError):  # rank 0 raises it for the CLI to print
        _run_ranks_raising(monkeypatch, 0, left)


def test_an_error_before_the_group_lets_rank_0_exit_first(monkeypatch):
    """A wrong world size (raised on every rank before the group is joined): rank 0 raises at
    once for the CLI to print; every other rank waits PRE_GROUP_EXIT_DELAY_S, then leaves its
    line for torchrun's report and exits with the same code, silently."""
    import typer

    from speccal.base.errors import InputError
    from speccal.cli import dist
    from speccal.runner.distributed import comm as comm_mod

    slept, noted = [], []
    monkeypatch.setattr(dist.time, "sleep", slept.append)
    monkeypatch.setattr(dist, "note_for_launcher", noted.append)

    def wrong_world(topology, env, device):
        raise InputError("world size", 2, "4")

    monkeypatch.setattr(comm_mod, "init_comm", wrong_world)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(InputError):
        dist.run_ranks(2, 2, "cpu", lambda comm, console: None)
    assert slept == [] and noted == []  # the CLI prints and notes rank 0's error
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(typer.Exit) as exit_info:
        dist.run_ranks(2, 2, "cpu", lambda comm, console: None)
    assert exit_info.value.exit_code == 2
    assert slept == [dist.PRE_GROUP_EXIT_DELAY_S]
    assert noted == ["error: world size: got 2, expected 4"]
