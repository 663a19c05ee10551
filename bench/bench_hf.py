"""Plain decode tokens/s: speccal's captured runner vs Hugging Face transformers, same config.

Usage (H200): python3 bench/bench_hf.py --out DIR [--budget-s 150]

Peer: a transformers ``Qwen3ForCausalLM`` with the dense-2b preset's shapes, random weights,
bf16, ``StaticCache``, a hand-written greedy decode loop (gpt-fast style) whose one-token forward
is ``torch.compile(mode="reduce-overhead")`` when that works within the budget, else the same
loop uncompiled (the configuration used is recorded). Ours: ``Engine.step`` end to end (host
prepare + graph replay + collect) with ``graph_mode="split"``, triton backend, speculative=False.
Both at KV ~256, B = 1 / 8 / 32 [decode_speedup_vs_hf_b1, _b8, _b32].
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams

PROMPT = 256
STEPS = 32


def ours(batches: tuple[int, ...]) -> dict[int, float]:
    eng = Engine(EngineConfig(model="dense-2b", device="cuda", dtype="bfloat16",
                              attention_backend="triton", graph_mode="split", speculative=False,
                              request_buckets=batches, max_model_len=PROMPT + 3 * STEPS + 8))
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(0)
    out = {}
    for b in batches:
        eng.reset()
        for _ in range(b):
            eng.add_request(rng.integers(0, vocab, PROMPT).tolist(),
                            SamplingParams(max_tokens=3 * STEPS, ignore_eos=True))
        eng.prefill_pending()
        for _ in range(4):
            eng.step(RoundPlan(num_draft_steps=0))
        eng.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            eng.step(RoundPlan(num_draft_steps=0))
        eng.synchronize()
        out[b] = b * STEPS / (time.perf_counter() - t0)
    del eng
    torch.cuda.empty_cache()
    return out


def hf(batches: tuple[int, ...], budget_s: float) -> tuple[dict[int, float], dict[int, str]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache  # noqa: PLC0415

    from speccal.runner.presets import PRESETS  # noqa: PLC0415

    cfg = dict(PRESETS["dense-2b"].config)
    conf = Qwen3Config(**{k: v for k, v in cfg.items() if k in Qwen3Config().to_dict()})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(conf).to("cuda", torch.bfloat16).eval()
    start = time.time()
    tps, used = {}, {}
    for b in batches:
        cache = StaticCache(config=conf, max_cache_len=PROMPT + STEPS + 16)
        ids = torch.randint(0, conf.vocab_size, (b, PROMPT), device="cuda")

        def one(tok, pos, cache=cache):
            return model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

        step_fn, mode = one, "static cache, no compile"
        if time.time() - start < budget_s:
            step_fn = torch.compile(one, mode="reduce-overhead", fullgraph=False)
            mode = "static cache + torch.compile(reduce-overhead)"
        with torch.inference_mode():
            model(ids, past_key_values=cache, cache_position=torch.arange(PROMPT, device="cuda"))
            tok = ids[:, -1:]
            try:
                for i in range(4):
                    pos = torch.tensor([PROMPT + i], device="cuda")
                    tok = step_fn(tok, pos)[:, -1:].argmax(-1).clone()
            except Exception as exc:  # noqa: BLE001 - record and fall back to eager
                mode = f"static cache, no compile (compile failed: {type(exc).__name__})"
                step_fn = one
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(STEPS):
                pos = torch.tensor([PROMPT + 4 + i], device="cuda")
                tok = step_fn(tok, pos)[:, -1:].argmax(-1).clone()
            torch.cuda.synchronize()
        tps[b] = b * STEPS / (time.perf_counter() - t0)
        used[b] = mode
    return tps, used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    batches = (1, 8, 32)
    a = ours(batches)
    h, used = hf(batches, args.budget_s)
    res = {}
    for b in batches:
        res[f"ours_tok_s_b{b}"] = a[b]
        res[f"hf_tok_s_b{b}"] = h[b]
        res[f"decode_speedup_vs_hf_b{b}"] = a[b] / h[b]
        res[f"hf_config_b{b}"] = used[b]
    Path(args.out, "hf.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
