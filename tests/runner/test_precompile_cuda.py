"""Precompiled capture on CUDA (``speccal.kernels.precompile`` through ``RoundRunner.capture``):
a fresh process with an empty Triton cache compiles the graphs' kernels in worker processes, its
in-process compiles afterwards are cache loads, and its greedy tokens (pipelined and synchronous
loops, split graphs + Triton, fp32) equal those of an engine that compiled everything in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from speccal.live.generate import generate
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.round import RoundRunner
from speccal.runner.sampling import SamplingParams

CFG = dict(model="tiny", device="cuda", dtype="float32", draft_width=3, request_buckets=(1, 2),
           max_model_len=256)
PROMPTS = [np.random.default_rng(s).integers(0, 256, 20 + 5 * s).tolist() for s in range(3)]

CHILD = textwrap.dedent("""
    import json, sys
    from speccal.kernels.precompile import CompileMeter
    from speccal.live.generate import generate
    from speccal.runner.engine import Engine, EngineConfig
    from speccal.runner.sampling import SamplingParams
    cfg, prompts, pipeline = json.loads(sys.argv[1])
    meter = CompileMeter()
    with meter.measuring():
        eng = Engine(EngineConfig.flat(**cfg, graph_mode="split", attention_backend="triton",
                                       pipeline=pipeline))
    rep = eng.runner.precompile_report
    out = generate(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True), 3)
    print(json.dumps({"report": rep.to_dict() if rep else None, "tokens": out,
                      "in_process": [meter.count, meter.seconds]}))
""")


@pytest.mark.cuda
@pytest.mark.parametrize("pipeline", [False, True])
def test_precompiled_capture_same_tokens_and_cache_loads(tmp_path, pipeline):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([CFG, PROMPTS, pipeline])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    rep = child["report"]
    assert rep is not None and rep["kernels"] > 0 and rep["failed"] == [], rep
    count, seconds = child["in_process"]
    # every in-process compile of the capture is a cache load (ms each), not a compile (~0.3 s+)
    assert seconds < 0.05 * count + 2.0, (count, seconds, rep)

    RoundRunner.precompile_workers = 0  # the peer: everything compiled in-process, in series
    try:
        eng = Engine(EngineConfig.flat(**CFG, graph_mode="split", attention_backend="triton",
                                       pipeline=pipeline))
    finally:
        RoundRunner.precompile_workers = None
    assert eng.runner.precompile_report is None
    peer = generate(eng, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), 3)
    assert child["tokens"] == peer
