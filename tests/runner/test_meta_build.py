"""Modules built on the meta device skip ``torch.nn.init`` (``speccal.runner.device.on_meta``),
and an engine build imports no ``torch._dynamo``: on a meta tensor an initialiser (or the rotary
table's arithmetic) goes through ``torch._refs``, which imports ``torch._dynamo``, sympy and
``torch.distributed.fsdp``; on the H200 image, which ships no bytecode, that was seconds of
every cold start (bench/RESULTS.md, 2026-12-02 02:00)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from speccal.runner.device import on_meta
from speccal.runner.rope import RotaryTable


def test_on_meta_skips_initialisers_and_restores_them():
    before = nn.init.normal_
    with on_meta():
        emb = nn.Embedding(10, 4)
        lin = nn.Linear(4, 3)
        assert nn.init.normal_ is not before
    assert emb.weight.is_meta and lin.weight.is_meta and lin.bias.is_meta
    assert nn.init.normal_ is before
    with pytest.raises(RuntimeError, match="inside"), on_meta():
        raise RuntimeError("inside")
    assert nn.init.normal_ is before and nn.init.kaiming_uniform_ is not None
    # outside the block the initialisers work again
    w = torch.empty(3, 3)
    nn.init.ones_(w)
    assert torch.equal(w, torch.ones(3, 3))


def test_rotary_table_is_computed_on_the_cpu_under_a_meta_default():
    from speccal.runner.config import config_from_hf
    from speccal.runner.presets import PRESETS

    cfg = config_from_hf(PRESETS["tiny"].config)
    want = RotaryTable(cfg, 16, 64)
    with on_meta():
        got = RotaryTable(cfg, 16, 64)
    assert not got.cos.is_meta
    assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)


def test_engine_build_and_serving_import_no_dynamo():
    # a build, then what a calibration does first: a chunked prefill (later chunks attend to
    # earlier keys: the lower-right causal mask, whose torch helper imports torch._dynamo; it
    # was seconds of a cold H200 calibration's first window), prompts admitted from it and
    # rounds of both loops
    code = (
        "import sys\n"
        "from speccal.runner.engine import Engine, EngineConfig, RoundPlan\n"
        "from speccal.runner.sampling import SamplingParams\n"
        "def check(where):\n"
        "    bad = [m for m in ('torch._dynamo', 'sympy') if m in sys.modules]\n"
        "    assert not bad, (where, bad)\n"
        "for pipeline in (True, False):\n"
        "    e = Engine(EngineConfig.flat(model='tiny', device='cpu', dtype='float32',"
        " request_buckets=(1, 2), prefill_chunk=16, pipeline=pipeline))\n"
        "    check('build')\n"
        "    e.set_prompt_source([i % 500 + 1 for i in range(90)])\n"
        "    check('prompt source')\n"
        "    for n in (20, 70):\n"
        "        e.add_request([i % 500 + 1 for i in range(n)],"
        " SamplingParams(max_tokens=8, ignore_eos=True))\n"
        "    for _ in range(3):\n"
        "        e.step(RoundPlan(num_draft_steps=2, verify_tokens=(2, 2)))\n"
        "    e.drain()\n"
        "    check('rounds')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
