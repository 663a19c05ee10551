"""CUDA bf16 greedy checks (run on the H200): K=1 batch 1 identical to plain greedy; for K >= 2
every divergence from plain greedy is reported with the target's top-2 logit margin at that
position (a near-tie explanation), never hidden. The report is printed and, when
``SPECCAL_REPORT_DIR`` is set, written to ``cuda_greedy_report.txt`` there.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from speccal.live.generate import generate
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.prefill import prefill
from speccal.runner.request import Request
from speccal.runner.sampling import SamplingParams

MAX_TOKENS = 64


def _top2_margin(eng: Engine, tokens: list[int]) -> tuple[float, int, int]:
    """Plain target logits after ``tokens``: top-1 minus top-2, and the two token ids."""
    req = Request(-1, tokens, SamplingParams())
    _, hidden = prefill(
        req, eng.loaded.target, None, eng.kv, chunk=512, generator=eng.generator, device=eng.device
    )
    logits = eng.loaded.target.logits(hidden[None])[0]
    eng.kv.allocator.free(req.blocks)
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def _report(lines: list[str]) -> None:
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("SPECCAL_REPORT_DIR")
    if out:
        with open(os.path.join(out, "cuda_greedy_report.txt"), "a") as fh:
            fh.write(text + "\n")


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["tiny", "dense-0.5b"])
def test_bf16_greedy_k1_identical_and_divergences_reported(model):
    cfg = dict(
        model=model,
        device="cuda",
        dtype="bfloat16",
        draft_width=5,
        request_buckets=(1,),
        max_model_len=512,
    )
    plain_eng = Engine(EngineConfig(**cfg, speculative=False))
    spec_eng = Engine(EngineConfig(**cfg))
    vocab = plain_eng.loaded.config.vocab_size
    prompts = [np.random.default_rng(s).integers(0, vocab, 24 + 8 * s).tolist() for s in range(3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    lines = [
        f"== {model} bf16 on {torch.cuda.get_device_name()} (batch 1, {MAX_TOKENS} tokens, 3 prompts)"
    ]
    k1_identical = True
    for k in range(1, 6):
        spec_eng.reset()
        for pi, prompt in enumerate(prompts):
            plain = generate(plain_eng, [prompt], params, 0)[0]
            spec = generate(spec_eng, [prompt], params, k)[0]
            if spec == plain:
                lines.append(f"K={k} prompt {pi}: identical")
                continue
            i = next(j for j, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b)
            margin, t1, t2 = _top2_margin(plain_eng, prompt + plain[:i])
            lines.append(
                f"K={k} prompt {pi}: DIVERGES at token {i}: spec={spec[i]} plain={plain[i]}; plain-path "
                f"top-2 logit margin {margin:.4f} (top1={t1}, top2={t2})"
            )
            if k == 1:
                k1_identical = False
        s = spec_eng.stats
        lines.append(
            f"K={k}: acceptance {s.acceptance_rate:.3f}, mean accepted length {s.mean_accepted_length:.3f}"
        )
    _report(lines)
    assert k1_identical, "K=1 batch-1 bf16 greedy must equal plain greedy"
