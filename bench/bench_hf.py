"""Plain decode tokens/s: speccal's captured runner vs Hugging Face transformers, same config.

Usage (H200): python3 bench/bench_hf.py --out DIR [--deadline-s 120] [--compile-min-s 60]

Peer: a transformers ``Qwen3ForCausalLM`` with the dense-2b preset's shapes, random weights,
bf16, ``StaticCache``, a hand-written greedy decode loop (gpt-fast style: one-token forward,
argmax). Configurations, cheapest first:

1. ``static cache, no compile`` at B = 1 / 8 / 32;
2. only if time remains inside the internal deadline: ``static cache + torch.compile
   (reduce-overhead)`` at each of ``--compile-batches`` (default 1), in a child process killed at
   the deadline (a compile cannot be interrupted in-process), with ``cudagraph_mark_step_begin``
   and a cloned output per step; the child records each batch as soon as it is measured.

Each B's peer figure is the fastest configuration that worked there (recorded). Ours:
``Engine.step`` end to end on the served loop (``speccal run``'s defaults: the pipelined loop,
queue depth 1; host prepare + graph replay + collect) with ``graph_mode="split"``, triton
backend, speculative=False, greedy requests (the greedy fast path). Both at KV ~256,
B = 1 / 8 / 32 [decode_speedup_vs_hf_b1, _b8, _b32].

The deadline counts from process start; ``DIR/hf.json`` is rewritten after every measurement, so
a run cut short still leaves its figures. ``engine_tok_s`` and ``hf_tok_s`` (static or dynamic
cache, any device) are also the hybrid comparison's (``bench_hybrid.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = 256
STEPS = 32
WARMUP = 4
T0 = time.time()


def ours(batches: tuple[int, ...]) -> dict[int, float]:
    """The served loop (``speccal run``'s defaults: the pipelined loop, split graphs, Triton),
    built from a RunSpec as the CLI builds it; kernels from the environment."""
    from speccal.base.run_spec import RunSpec
    from speccal.kernels.config import KernelConfig
    from speccal.runner.engine import Engine
    from speccal.runner.engine_config import from_spec

    eng = Engine(from_spec(RunSpec(
        model="dense-2b", device="cuda", dtype="bfloat16", speculative=False,
        request_buckets=batches, max_model_len=PROMPT + WARMUP + STEPS + 8,
        loop="pipelined", graph_mode="split", attention_backend="triton",
        kernels=KernelConfig.from_env().to_dict())))
    assert eng.queue_depth == 1
    out = {b: engine_tok_s(eng, b) for b in batches}
    del eng
    torch.cuda.empty_cache()
    return out


def engine_tok_s(eng, batch: int, prompt: int = PROMPT, steps: int = STEPS,
                 warmup: int = WARMUP) -> float:
    """Plain decode tokens/s of ``Engine.step`` end to end: ``batch`` random prompts of
    ``prompt`` tokens prefilled, ``warmup`` untimed rounds, then ``steps`` timed ones."""
    from speccal.base.gcpause import paused_gc
    from speccal.runner.engine import RoundPlan
    from speccal.runner.sampling import SamplingParams

    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(0)
    eng.reset()
    for _ in range(batch):
        eng.add_request(
            rng.integers(0, vocab, prompt).tolist(),
            SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True),
        )
    eng.prefill_pending()
    for _ in range(warmup):
        eng.step(RoundPlan(num_draft_steps=0))
    eng.synchronize()
    with paused_gc():  # the served loop runs with the collector paused (speccal.live)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step(RoundPlan(num_draft_steps=0))
        eng.synchronize()
        return batch * steps / (time.perf_counter() - t0)


def hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from speccal.runner.presets import PRESETS

    cfg = dict(PRESETS["dense-2b"].config)
    conf = Qwen3Config(**{k: v for k, v in cfg.items() if k in Qwen3Config().to_dict()})
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # random init on the GPU: seconds, not a CPU minute
            model = Qwen3ForCausalLM(conf)
    finally:
        torch.set_default_dtype(before)
    return conf, model.to("cuda", torch.bfloat16).eval()


def static_cache(conf, batch: int, length: int | None = None, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
    from transformers import StaticCache

    length = length or PROMPT + WARMUP + STEPS + 16
    try:
        return StaticCache(config=conf, max_cache_len=length)
    except TypeError:  # older signature: explicit batch, device, dtype
        return StaticCache(
            config=conf,
            max_batch_size=batch,
            max_cache_len=length,
            device=device,
            dtype=dtype,
        )


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_tok_s(conf, model, batch: int, compiled: bool, *, cache: str = "static",
             prompt: int = PROMPT, steps: int = STEPS, warmup: int = WARMUP,
             device: str = "cuda") -> float:
    """Greedy tokens/s of the hand-written decode loop at ``batch``: ``cache`` is ``static``
    (``StaticCache``) or ``dynamic`` (``DynamicCache``, the model's default; not compiled)."""
    if cache == "static":
        cache_obj = static_cache(conf, batch, prompt + warmup + steps + 16, device,
                                 next(model.parameters()).dtype)
    elif cache == "dynamic" and not compiled:
        from transformers import DynamicCache

        cache_obj = DynamicCache(config=conf)
    else:
        raise ValueError(f"cache={cache!r} (compiled={compiled}): expected 'static', or "
                         "'dynamic' without compile")
    from speccal.base.gcpause import paused_gc

    ids = torch.randint(0, conf.vocab_size, (batch, prompt), device=device)

    def one(tok, pos):
        return model(tok, past_key_values=cache_obj, cache_position=pos, use_cache=True).logits

    step = torch.compile(one, mode="reduce-overhead", fullgraph=False) if compiled else one

    def run(tok, i):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        pos = torch.tensor([prompt + i], device=device)
        return step(tok, pos)[:, -1].argmax(-1, keepdim=True).clone()

    with torch.inference_mode():
        model(ids, past_key_values=cache_obj, cache_position=torch.arange(prompt, device=device))
        tok = ids[:, -1:]
        for i in range(warmup):
            tok = run(tok, i)
        _sync(device)
        with paused_gc():  # the same conditions as the served loop's
            t0 = time.perf_counter()
            for i in range(steps):
                tok = run(tok, warmup + i)
            _sync(device)
    return batch * steps / (time.perf_counter() - t0)


def compile_child(out: Path, batches: list[int]) -> None:
    """Child process: torch.compile(reduce-overhead) per batch; rewrites ``hf_compile.json``
    after each one (a kill at the deadline keeps the batches already measured)."""
    conf, model = hf_model()
    result = {}
    for b in batches:
        t0 = time.time()
        result[f"hf_compile_tok_s_b{b}"] = hf_tok_s(conf, model, b, compiled=True)
        result[f"hf_compile_wall_s_b{b}"] = time.time() - t0
        (out / "hf_compile.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="internal wall-clock budget")
    ap.add_argument("--compile-min-s", type=float, default=60.0, help="skip compile below this")
    ap.add_argument("--compile-batches", default="1", help="comma list of B to compile at")
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    compile_batches = [int(b) for b in args.compile_batches.split(",")]
    if args.compile_child:
        compile_child(out, compile_batches)
        return
    deadline = T0 + args.deadline_s
    batches = (1, 8, 32)
    res: dict[str, object] = {}

    def save() -> None:
        res["elapsed_s"] = round(time.time() - T0, 1)
        (out / "hf.json").write_text(json.dumps(res, indent=1))

    a = ours(batches)
    for b in batches:
        res[f"ours_tok_s_b{b}"] = a[b]
    save()
    best: dict[int, tuple[float, str]] = {}
    conf, model = hf_model()
    for b in batches:
        if time.time() > deadline:
            res[f"hf_skipped_b{b}"] = "internal deadline"
            break
        tps = hf_tok_s(conf, model, b, compiled=False)
        res[f"hf_eager_tok_s_b{b}"] = tps
        best[b] = (tps, "static cache, no compile")
        save()
    del model
    torch.cuda.empty_cache()
    left = deadline - time.time()
    if left >= args.compile_min_s:
        cmd = [sys.executable, __file__, "--compile-child", "--out", str(out),
               "--compile-batches", args.compile_batches]
        try:
            proc = subprocess.run(cmd, timeout=left, capture_output=True, text=True)
            res["hf_compile_status"] = f"exit {proc.returncode}: {proc.stderr[-300:].strip()}"
        except subprocess.TimeoutExpired:
            res["hf_compile_status"] = f"killed at the internal deadline after {left:.0f} s"
        child = out / "hf_compile.json"
        c = json.loads(child.read_text()) if child.exists() else {}
        res.update(c)
        for b in compile_batches:
            tps = c.get(f"hf_compile_tok_s_b{b}")
            if tps is not None and tps > best.get(b, (0.0, ""))[0]:
                best[b] = (tps, "static cache + torch.compile(reduce-overhead)")
    else:
        res["hf_compile_status"] = f"not tried: {left:.0f} s left < {args.compile_min_s:.0f} s"
    for b, (tps, name) in best.items():
        res[f"hf_tok_s_b{b}"] = tps
        res[f"hf_config_b{b}"] = name
        res[f"decode_speedup_vs_hf_b{b}"] = a[b] / tps
    save()
    for k, v in res.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
