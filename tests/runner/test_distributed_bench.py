"""``torchrun --nproc-per-node 2 -m speccal bench --tp 2`` (and ``--dp 2``): rank 0 alone prints
one result whose tokens/s report says it ran on 2 ranks and records the topology (as ``generate
--tp 2 --json`` records it); options a
multi-rank bench cannot honour are refused with the field, the value and what was expected (in
process, before any group is joined)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from speccal.cli import app

WORKLOAD = ["--model", "tiny", "--num-requests", "3", "--prompt-len", "6", "--max-tokens", "6",
            "--repeats", "1"]


def _torchrun(*args: str, command: str = "bench") -> subprocess.CompletedProcess:
    workload = WORKLOAD if command == "bench" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           # --standalone: the agent binds its store to a free port itself (no port race)
           "--standalone", "-m", "speccal", command, *args, *workload]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"})
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def test_torchrun_bench_tp2_json_is_rank0s_alone_and_records_the_world():
    # DP=2 bench on two gloo ranks (agreed shapes, the world's tokens, a failing rank named)
    # is tested in-process: test_distributed_ranks.py::test_bench_on_ranks_reports_the_world...
    res = _torchrun("--tp", "2", "--json")
    docs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 1  # rank 0's
    doc = docs[0]
    topo = doc["setup"]["topology"]
    assert (topo["tp"], topo["dp"], topo["world_size"]) == (2, 1, 2)
    assert len(topo["devices"]) == 2 and all(topo["devices"])
    assert doc["engine"]["spec"]["compatibility"]["topology"] == topo
    assert doc["outputs_equal"]  # greedy speculative decoding is lossless across shards too
    assert doc["plain"]["tokens_per_run"] == doc["spec"]["tokens_per_run"] == 3 * 6
    assert doc["spec"]["tokens_per_s"] > 0 and doc["spec"]["drafted"] > 0


def test_torchrun_generate_tp2_json_records_every_ranks_device():
    # the device names are gathered while the group is up (the JSON is printed after it left)
    res = _torchrun("--tp", "2", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "4",
                    "--json", command="generate")
    docs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 1
    topo = docs[0]["compatibility"]["topology"]
    assert (topo["tp"], topo["world_size"], len(topo["devices"])) == (2, 2, 2)
    assert len(docs[0]["outputs"][0]["output_ids"]) == 4


NO_LAUNCHER = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "MASTER_ADDR": None,
               "MASTER_PORT": None, "COLUMNS": "120"}


@pytest.mark.parametrize("args,line", [
    (["--tp", "2", "--policy", "fixed:1"],
     "error: --policy: got 'fixed:1', expected unset with --tp/--dp (live policy benches run on "
     "one rank)"),
    (["--dp", "2", "--k", "2"],
     "error: --k: got 2, expected unset with --dp > 1 (the replicas agree on k every round)"),
    (["--tp", "0"], "error: --tp: got 0, expected an integer >= 1"),
    (["--tp", "2"], "error: environment variable RANK: got None, expected set by torchrun: "
     "launch with torchrun --nproc-per-node N -m speccal ..."),
])
def test_multi_rank_bench_refusals(args, line):
    res = CliRunner().invoke(app, ["bench", *args], env=NO_LAUNCHER)
    assert res.exit_code == 2, res.output
    lines = [" ".join(x.split()) for x in res.output.splitlines() if x.startswith("error:")]
    assert lines == [line]
