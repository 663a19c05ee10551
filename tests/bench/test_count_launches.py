"""``bench/count_hybrid_launches.py`` on the CPU: the launch plans it counts, pinned.

The fused hybrid plan's launches per layer are the issue's budget (<= 300 a qwen3.5-2b step):
a change that adds launches to it shows here as a count, not as a timing. The dense count is
the counter's check against the profiler (174 for the whole dense-2b step on the H200).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "count_hybrid_launches.py"


def _module():
    spec = importlib.util.spec_from_file_location("count_hybrid_launches_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_counts_of_the_fused_and_dense_plans(capsys):
    mod = _module()
    assert mod.main(["--impl", "fla,fused", "--verify", "3", "--dense-layers", "28",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fused, fla = out["fused decode"], out["fla decode"]
    # 8 launches a layer (linear: projection GEMV, gates, conv, delta rule, gated norm, output
    # GEMV + norm, gate/up, down; attention: q/k/v GEMV, norms + rotary + KV write, attention,
    # gate sigmoid and product, output GEMV + norm, gate/up, down), the embedding and nothing
    # else: 194 at qwen3.5-2b's 24 layers
    assert fused["per_4_layers"] == 32 and fused["estimate"] == 194, fused
    assert fused["host_reads"] == 0 and fla["estimate"] > 5 * fused["estimate"]
    verify = out["fused verify k=3 snapshots"]
    # a full-width verify's packed rows are the [B, R] grid (RoundInputs.grid): no gather
    # either way per linear layer, the decode's launches per layer
    assert verify["per_4_layers"] == fused["per_4_layers"], verify
    swap = out["fused verify k=3 scratch_swap"]
    # the scratch strategy: one save copy per linear layer, the replay's conv and delta rule
    assert swap["per_4_layers"] == verify["per_4_layers"] + 9, swap
    dense = out["dense (Qwen3) decode"]
    assert dense["per_4_layers"] == 24 and dense["estimate"] == 169, dense


def test_depth_must_be_whole_groups():
    with pytest.raises(SystemExit):
        _module().main(["--layers", "10"])
