"""Hybrid linear-attention targets (issue 22): decode floor, state strategies, transformers, greedy.

Usage (H200, ~3-4 min incl. Triton/fla compiles and graph capture):
    python3 bench/bench_hybrid.py --out DIR
Usage (CPU smoke, a small hybrid checkpoint folder):
    python3 bench/bench_hybrid.py --device cpu --model FOLDER --kv 48 --rounds 3 ...

One process, one set of weights (loaded once and served by every engine of the run through
``Engine._load_model``), on ``--model`` (default the qwen3.5-2b-shape preset, bf16, split graphs
and Triton attention on CUDA; eager fp32 and torch attention on CPU):

- copy bandwidth of the device (``bench_decode.copy_bandwidth`` on CUDA: a 1 GiB device copy
  timed with CUDA events; on CPU a 64 MiB host copy, perf_counter);
- decode step at B = 1, KV ``--kv``: the plain engine's captured greedy target graph replayed
  (``bench_decode.target_ms``; CPU: ``Engine.step`` wall) vs its HBM floor = (weight bytes:
  ``bench_decode.floor_bytes`` plus the non-matrix parameters; the committed state row read and
  written, ``StateStrategy.round_traffic(1, 0)``; the full-attention layers' KV read) / copy
  bandwidth [hybrid_decode_step_floor_ratio]; the same at B = ``--large-batch`` (8: every
  request's state row and KV, the weights once) [hybrid_decode_step_floor_ratio_b8]; on CUDA,
  where the B = 1 step's device time goes: its
  kernels by name, time and launches per step (``bench_decode.breakdown``, torch.profiler over
  graph replays; ``breakdown_b1``, every kernel of one replay in ``sequence_b1``);
- plain decode tokens/s at B = 1 of ``Engine.step`` end to end (``bench_hf.engine_tok_s``; the
  pipelined round loop, ``EngineConfig.pipeline``, as calibration and serving run it) vs
  transformers' ``Qwen3_5ForCausalLM`` with the same shapes and weights (this run's target
  state dict), greedy loop ``bench_hf.hf_tok_s``: static cache, dynamic cache, and (CUDA, time
  permitting) static cache + ``torch.compile(reduce-overhead)`` in a child process killed at
  the internal deadline (B = 1 first, then the large batch); per batch the fastest that worked
  is the peer, its name recorded [hybrid_decode_speedup_vs_hf_b1, _b8];
- round cost per k = 1 .. w for both state strategies on the same forced-acceptance workload
  (``bench_round_phases.measure_mode``: ``--round-batch`` requests, window mean and, on CUDA,
  the device span of ``execute``), with the state bytes each strategy moves per round
  (``StateStrategy.round_traffic``: read, written, slot-table, saved replay inputs)
  [hybrid_state_strategy_round_ms];
- greedy check at batch 1, both strategies: speculative greedy vs plain greedy for K = 1 .. w on
  ``--check-prompts`` random prompts; each divergence with the plain path's top-2 logit margin
  at that position (fp32 product of the final hidden and the LM head) against one step of the
  run's dtype at the top-1 logit (``explained``: margin below that step).

- ``--linear-attention fla,fused`` (issue 38; not run by default): per
  ``KernelConfig.linear_attention.impl``, on one plain and one speculative engine (the base
  config from ``SPECCAL_*``, ``--la-strategy``), the B = 1 decode step (captured graph) vs
  the floor above [hybrid_decode_step_floor_ratio], its kernel launches per step
  [hybrid_decode_kernels_per_step_b1] and where its time goes, and the full-width verify
  (``w`` drafts, ``w + 1`` rows) over that decode step [hybrid_verify_full_width_ratio] with
  its kernels' breakdown, logged against the decode step's (what grows, largest first); the
  two impls' greedy tokens on one prompt (plain and K = 1), recorded side by side in
  ``linear_attention`` (``fused`` stays off by default until this and
  ``tests/runner/test_hybrid_engine.py -k fused_linear_attention`` pass on the H200).

Prints a progress line per stage and a summary; writes ``DIR/hybrid.json`` (sorted keys, no
NaN) after every stage, so a run cut short keeps what it measured. ``--deadline-s`` counts from
process start: a stage that would start past it is skipped and recorded as skipped. ``--record``
appends the three headline figures to ``bench/results.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_decode import SEQUENCES, breakdown, fill, floor_bytes, target_ms
from bench_decode import copy_bandwidth as cuda_copy_bandwidth
from bench_hf import engine_tok_s, hf_tok_s
from bench_round_phases import measure_mode
from results import append_results, git_commit

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels.config import KernelConfig
from speccal.live.generate import generate
from speccal.runner.device import resolve_device
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.graphs import GraphKey
from speccal.runner.hybrid_state import STATE_STRATEGIES
from speccal.runner.loader import LoadedModel, load_model
from speccal.runner.request import Request
from speccal.runner.sampling import SamplingParams

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class SharedWeightsEngine(Engine):
    """An :class:`Engine` over weights loaded once for the whole run (every engine here serves
    the same target and head; loading random 2B-shape weights takes seconds each time)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self._shared = loaded
        super().__init__(config)

    def _load_model(self, dtype: str, max_len: int, max_positions: int) -> LoadedModel:
        return self._shared


def free(device: torch.device) -> None:
    """Release a finished engine's graphs and buffers (its runner's wrapped methods form
    reference cycles, so collect before emptying the allocator's cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- bandwidth and floor


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes/s of a device copy, read + write counted (CUDA: bench_decode's 1 GiB copy)."""
    if device.type == "cuda":
        return cuda_copy_bandwidth()
    src = torch.empty(1 << 24, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def floor_parts(eng: Engine, kv_tokens: int, batch: int = 1) -> dict[str, int]:
    """Bytes a plain decode step of ``batch`` requests must move: weights (bench_decode's weight
    matrices plus the conv kernels, decays and norms, read once), each request's committed state
    row read and written (the state strategy's accounting), each request's full-attention KV
    read (``kv_tokens`` per request)."""
    t = eng.loaded.target
    matrices = floor_bytes(eng, 0)  # every weight matrix incl. the LM head; KV counted below
    others = sum(p.numel() * p.element_size() for p in t.parameters() if p.dim() != 2)
    c = eng.loaded.config
    kv = (batch * eng.loaded.num_kv_layers * 2 * kv_tokens * c.num_key_value_heads * c.head_dim
          * t.model.embed_tokens.weight.element_size())
    state = eng.runner.state.round_traffic(batch, 0).total
    return {"weight_bytes": matrices + others, "state_bytes": state, "kv_bytes": kv}


def decode_step_ms(eng: Engine, kv: int, repeats: int, batch: int = 1) -> float:
    """Plain decode step of ``batch`` requests at KV ``kv``: captured graph replay (CUDA
    events) or, eager, the median ``Engine.step`` wall time."""
    fill(eng, batch, 0, kv)  # greedy requests: the host picks the fast path
    if eng.runner.graphs is not None:
        return target_ms(eng, batch, 0, batch, eng.runner.resolve_update(batch, 0, batch),
                         repeats)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        eng.step(RoundPlan(num_draft_steps=0))
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


# ---------------------------------------------------------------------- transformers peer


def hf_twin(loaded: LoadedModel, device: torch.device):
    """transformers' ``Qwen3_5ForCausalLM`` with this run's target config and weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = loaded.hybrid
    if cfg is None or cfg.moe is not None:
        raise UnsupportedError(
            f"model {loaded.architecture!r}: the transformers peer is Qwen3_5ForCausalLM "
            "(a dense-MLP Qwen3.5 hybrid text model); routed experts or a dense target have none")
    known = Qwen3_5TextConfig().to_dict()
    conf = Qwen3_5TextConfig(**{k: v for k, v in cfg.base.extra.items() if k in known})
    dtype = next(loaded.target.parameters()).dtype
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(conf)
    finally:
        torch.set_default_dtype(before)
    model.load_state_dict(loaded.target.state_dict(), strict=True)  # copied in HF's dtypes
    return conf, model.eval()


def hf_eager(loaded: LoadedModel, device: torch.device, prompt: int,
             steps: int, batches: tuple[int, ...] = (1,)) -> dict[str, object]:
    """Static and dynamic cache, no compile, at each batch: tokens/s or the error of each."""
    conf, model = hf_twin(loaded, device)
    out: dict[str, object] = {}
    for b in batches:
        for cache in ("static", "dynamic"):
            try:
                out[f"hf_{cache}_tok_s_b{b}"] = hf_tok_s(conf, model, b, False, cache=cache,
                                                         prompt=prompt, steps=steps,
                                                         warmup=min(4, steps),
                                                         device=device.type)
            except Exception as exc:  # a cache transformers cannot run on this model: recorded
                out[f"hf_{cache}_error_b{b}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"transformers {cache} cache B={b}: "
                f"{out.get(f'hf_{cache}_tok_s_b{b}', 'failed')}")
    del model
    return out


def compile_child(args) -> None:
    """Child process: static cache + torch.compile(reduce-overhead) at B = 1, then at the large
    batch, ``hf_compile.json`` rewritten after each (a kill at the parent's deadline keeps the
    batches measured, never a wrong figure)."""
    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device, dtype=args.dtype, seed=0,
                        max_model_len=args.max_len, max_positions=args.max_len + 16,
                        need_draft=False)
    conf, model = hf_twin(loaded, device)
    del loaded
    out: dict[str, float] = {}
    for b in args.batches:
        t0 = time.time()
        out[f"hf_compile_tok_s_b{b}"] = hf_tok_s(conf, model, b, True, cache="static",
                                                 prompt=args.kv, steps=args.hf_steps,
                                                 warmup=min(4, args.hf_steps),
                                                 device=device.type)
        out[f"hf_compile_wall_s_b{b}"] = time.time() - t0
        if b == 1:
            out["hf_compile_wall_s"] = out["hf_compile_wall_s_b1"]
        Path(args.out, "hf_compile.json").write_text(json.dumps(out))


def hf_compiled(args, left_s: float) -> dict[str, object]:
    child = Path(args.out, "hf_compile.json")
    child.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--compile-child", "--out", str(args.out), "--model",
           args.model, "--device", args.device, "--dtype", args.dtype, "--kv", str(args.kv),
           "--draft-width", str(args.draft_width), "--hf-steps", str(args.hf_steps),
           "--large-batch", str(args.large_batch)]
    out: dict[str, object] = {}
    try:
        proc = subprocess.run(cmd, timeout=left_s, capture_output=True, text=True)
        out["hf_compile_status"] = f"exit {proc.returncode}: {proc.stderr[-300:].strip()}"
    except subprocess.TimeoutExpired:
        out["hf_compile_status"] = f"killed at the internal deadline after {left_s:.0f} s"
    if child.exists():
        out.update(json.loads(child.read_text()))
    return out


def pick_peer(res: dict, batches: tuple[int, ...] = (1,)) -> None:
    """Per batch, the fastest transformers configuration that ran, and our speedup over it."""
    for b in batches:
        names = {f"hf_static_tok_s_b{b}": "static cache, no compile",
                 f"hf_dynamic_tok_s_b{b}": "dynamic cache, no compile",
                 f"hf_compile_tok_s_b{b}": "static cache + torch.compile(reduce-overhead)"}
        ran = {k: float(res[k]) for k in names if isinstance(res.get(k), float)}
        if not ran or not isinstance(res.get(f"ours_tok_s_b{b}"), float):
            continue
        best = max(ran, key=ran.get)
        res[f"hf_tok_s_b{b}"] = ran[best]
        res[f"hf_config_b{b}"] = names[best]
        res[f"hybrid_decode_speedup_vs_hf_b{b}"] = res[f"ours_tok_s_b{b}"] / ran[best]


# ---------------------------------------------------------------------- greedy check


def top2_margin(eng: Engine, tokens: list[int]) -> dict[str, float | int]:
    """The plain path's next-token logits after ``tokens`` (hybrid prefill into slot 0 of an
    idle engine): top-1 minus top-2 in fp32 (final hidden x LM head, both as served), and one
    step of the served dtype at the top-1 logit."""
    eng.reset()
    req = Request(-1, list(tokens), SamplingParams())
    req.slot = 0
    _, hidden = eng.runner.state.prefill(req, eng.loaded.target, None, eng.kv,
                                         chunk=eng.config.prefill_chunk,
                                         generator=eng.generator, device=eng.device)
    eng.kv.allocator.free(req.blocks)
    weight = eng.loaded.target.lm_head.weight
    with torch.inference_mode():  # the prefill's hidden is an inference tensor
        top = (hidden.float() @ weight.float().T).topk(2)  # of the [vocab] logits
    v1, v2 = float(top.values[0]), float(top.values[1])
    step = torch.finfo(weight.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(v1), 1e-30)))
    return {"margin": v1 - v2, "dtype_step": step, "top1": int(top.indices[0]),
            "top2": int(top.indices[1]), "explained": bool(v1 - v2 < step)}


def greedy_check(plain: Engine, spec: Engine, prompts, want: list[list[int]],
                 params: SamplingParams, w: int) -> dict:
    """Speculative greedy vs plain greedy (``want``: the plain engine's tokens of each prompt)
    at batch 1 for K = 1 .. w, per prompt."""
    out: dict[str, object] = {}
    for k in range(1, w + 1):
        spec.reset()
        divergences = []
        for i, prompt in enumerate(prompts):
            got = generate(spec, [prompt], params, k)[0]
            if got == want[i]:
                continue
            at = next((j for j, (a, b) in enumerate(zip(got, want[i], strict=False)) if a != b),
                      min(len(got), len(want[i])))
            row = {"prompt": i, "position": at, "spec": got[at] if at < len(got) else None,
                   "plain": want[i][at] if at < len(want[i]) else None}
            row.update(top2_margin(plain, prompt + want[i][:at]))
            divergences.append(row)
        out[f"k{k}"] = {"identical_prompts": len(prompts) - len(divergences),
                        "divergences": divergences,
                        "acceptance_rate": float(spec.stats.acceptance_rate)}
    return out


# ---------------------------------------------------------------------- the run


def versions(device: torch.device) -> dict[str, object]:
    out: dict[str, object] = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "fla", "causal_conv1d", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed here: recorded as absent
            out[name] = None
    out["device_name"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else platform.processor() or platform.machine())
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--model", default="qwen3.5-2b", help="hybrid preset or checkpoint folder")
    ap.add_argument("--out", default=".")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats (medians)")
    ap.add_argument("--draft-width", type=int, default=3, help="w: k = 1 .. w are measured")
    ap.add_argument("--kv", type=int, default=1024, help="KV length of the decode step and of "
                    "the tokens/s comparison's prompt")
    ap.add_argument("--round-batch", type=int, default=8, help="requests of the strategy rounds")
    ap.add_argument("--large-batch", type=int, default=8, help="the second decode batch (floor "
                    "ratio and the transformers comparison at B = 1 and this; 1: B = 1 only)")
    ap.add_argument("--round-prompt", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=32, help="timed rounds per k (and a window)")
    ap.add_argument("--round-warmup", type=int, default=4)
    ap.add_argument("--check-prompts", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=48)
    ap.add_argument("--hf-steps", type=int, default=32, help="timed decode steps of the "
                    "tokens/s comparison (ours and transformers; 4 untimed first)")
    ap.add_argument("--graph-mode", default=None, help="default: split on CUDA, eager on CPU")
    ap.add_argument("--attention-backend", default=None, help="default: triton on CUDA")
    ap.add_argument("--deadline-s", type=float, default=230.0, help="internal wall budget")
    ap.add_argument("--compile-min-s", type=float, default=45.0,
                    help="try the compiled transformers peer only with this much time left")
    ap.add_argument("--skip", default="", help="comma list of stages to skip: hf, compile, "
                    "strategies, greedy")
    ap.add_argument("--record", action="store_true", help="append the headline figures to "
                    "bench/results.jsonl")
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--linear-attention", default="", help="comma list of "
                    "kernels.linear_attention impls to time against each other (fla,fused); "
                    "empty: the stage is skipped")
    ap.add_argument("--la-strategy", default="snapshots", help="comma list of state "
                    "strategies of the --linear-attention verify engines (the first gives "
                    "hybrid_verify_full_width_ratio, each its verify_ms_b1.<strategy>)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.graph_mode = args.graph_mode or ("split" if cuda else "eager")
    args.attention_backend = args.attention_backend or ("triton" if cuda else "torch")
    args.skip = {s for s in args.skip.split(",") if s}
    args.linear_attention = [s for s in args.linear_attention.split(",") if s]
    bad = sorted(set(args.linear_attention) - {"fla", "fused"})
    if bad:
        ap.error(f"--linear-attention {bad}: expected impls among fla, fused")
    args.la_strategy = [s for s in args.la_strategy.split(",") if s]
    bad = sorted(set(args.la_strategy) - set(STATE_STRATEGIES))
    if bad or not args.la_strategy:
        ap.error(f"--la-strategy {bad or args.la_strategy}: expected strategies among "
                 f"{', '.join(STATE_STRATEGIES)}")
    odd = args.skip - {"hf", "compile", "strategies", "greedy"}
    if odd:
        ap.error(f"--skip {sorted(odd)}: expected stages among hf, compile, strategies, greedy")
    for name in ("repeats", "draft_width", "kv", "round_batch", "round_prompt", "rounds",
                 "check_prompts", "check_tokens", "hf_steps", "large_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    w = args.draft_width
    args.check_prompt_len = 32
    args.batches = tuple(sorted({1, args.large_batch}))
    # bench_decode.fill asks for 512 tokens after a KV-long prompt; the strategy rounds need
    # (warmup + 2 * rounds + 1) * (w + 1) + 1 after theirs
    round_need = args.round_prompt + (args.round_warmup + 2 * args.rounds + 1) * (w + 1) + 1
    args.max_len = max(args.kv + 512 + 8, round_need + 8,
                       args.check_prompt_len + args.check_tokens + 8)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compile_child:
        compile_child(args)
        return {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    deadline = T0 + args.deadline_s
    w = args.draft_width
    res: dict[str, object] = {"device": device.type, "versions": versions(device),
                              "setup": {k: v for k, v in vars(args).items() if k != "skip"},
                              "skipped": {}}

    def save() -> None:
        res["elapsed_s"] = round(time.time() - T0, 1)
        (out / "hybrid.json").write_text(json.dumps(res, indent=1, sort_keys=True,
                                                    allow_nan=False))

    def skip(stage: str) -> bool:
        if stage in args.skip:
            res["skipped"][stage] = "--skip"
        elif time.time() > deadline:
            res["skipped"][stage] = f"internal deadline ({args.deadline_s:.0f} s) passed"
        else:
            return False
        log(f"skipping {stage}: {res['skipped'][stage]}")
        return True

    log(f"{args.model} on {res['versions']['device_name']} ({args.dtype}, {args.graph_mode})")
    bw = copy_bandwidth(device, args.repeats)
    res["copy_bandwidth_gbs"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s")
    loaded = load_model(args.model, device=device, dtype=args.dtype, seed=0,
                        max_model_len=args.max_len, max_positions=args.max_len + 2 * w + 8,
                        need_draft=True)
    if not loaded.capabilities.has_recurrent_state:
        raise InputError("--model", args.model, "a hybrid linear-attention target "
                         "(qwen3.5-0.8b, qwen3.5-2b or a Qwen3.5 / Qwen3-Next folder)")
    log("weights loaded")
    common = dict(model=args.model, device=args.device, dtype=args.dtype, draft_width=w,
                  graph_mode=args.graph_mode, attention_backend=args.attention_backend,
                  max_model_len=args.max_len, kernels=KernelConfig.from_env())

    def engine(**kw) -> Engine:
        t0 = time.time()
        eng = SharedWeightsEngine(EngineConfig.flat(**{**common, **kw}), loaded)
        log(f"engine {kw} built in {time.time() - t0:.1f} s")
        return eng

    # ---- decode step vs its HBM floor, ours tokens/s
    plain = engine(speculative=False, request_buckets=args.batches, pipeline=True)
    parts = floor_parts(plain, args.kv)
    res.update(parts)
    res["decode_floor_ms"] = sum(parts.values()) / bw * 1e3
    res["decode_step_ms_b1"] = decode_step_ms(plain, args.kv, args.repeats)
    res["hybrid_decode_step_floor_ratio"] = res["decode_step_ms_b1"] / res["decode_floor_ms"]
    log(f"decode step {res['decode_step_ms_b1']:.3f} ms, floor {res['decode_floor_ms']:.3f} ms")
    if plain.runner.graphs is not None:  # the captured step's kernels (fill staged its inputs)
        key = GraphKey("target", 1, 0, 1, plain.runner.resolve_update(1, 0, 1), "greedy")
        res["breakdown_b1"] = breakdown(plain, key, top=40)
        res["sequence_b1"] = SEQUENCES.get(key)
        for name, us, launches in res["breakdown_b1"]:
            log(f"  {us:9.2f} us {launches:6.2f} x  {name}")
    res["ours_tok_s_b1"] = engine_tok_s(plain, 1, prompt=args.kv, steps=args.hf_steps,
                                        warmup=min(4, args.hf_steps))
    log(f"ours {res['ours_tok_s_b1']:.1f} tok/s")
    for b in args.batches[1:]:  # the large batch: floor (B requests' state and KV), tokens/s
        big = floor_parts(plain, args.kv, b)
        res[f"decode_floor_ms_b{b}"] = sum(big.values()) / bw * 1e3
        res[f"floor_bytes_b{b}"] = big
        res[f"decode_step_ms_b{b}"] = decode_step_ms(plain, args.kv, args.repeats, b)
        res[f"hybrid_decode_step_floor_ratio_b{b}"] = (res[f"decode_step_ms_b{b}"]
                                                        / res[f"decode_floor_ms_b{b}"])
        res[f"ours_tok_s_b{b}"] = engine_tok_s(plain, b, prompt=args.kv, steps=args.hf_steps,
                                               warmup=min(4, args.hf_steps))
        log(f"B={b}: decode step {res[f'decode_step_ms_b{b}']:.3f} ms, floor "
            f"{res[f'decode_floor_ms_b{b}']:.3f} ms; ours {res[f'ours_tok_s_b{b}']:.1f} tok/s")
    save()

    # ---- transformers, eager configurations (the compiled one last: it may take minutes)
    if not skip("hf"):
        try:
            res.update(hf_eager(loaded, device, args.kv, args.hf_steps, args.batches))
        except (ImportError, UnsupportedError) as exc:  # no peer here: the rest still runs
            res["hf_error"] = f"{type(exc).__name__}: {exc}"
            log(f"no transformers peer: {res['hf_error']}")
        pick_peer(res, args.batches)
        save()
    free(device)

    # ---- both state strategies, same forced workload, per k
    if not skip("strategies"):
        per: dict[str, dict] = {}
        ns = argparse.Namespace(ks=list(range(1, w + 1)), batch=args.round_batch,
                                prompt=args.round_prompt, warmup=args.round_warmup,
                                rounds=args.rounds, device=args.device)
        for strategy in STATE_STRATEGIES:
            eng = engine(acceptance="forced", request_buckets=(args.round_batch,),
                         state_strategy=strategy)
            rows = measure_mode(ns, "forced", None, eng=eng)
            state = eng.runner.state
            for k in ns.ks:
                t = state.round_traffic(args.round_batch, k)
                rows[f"k{k}"]["state_bytes"] = {"read": t.read, "written": t.written,
                                                "index_bytes": t.index_bytes,
                                                "saved_inputs": t.saved_inputs,
                                                "total": t.total}
                rows[f"k{k}"]["state_ms_at_copy_bw"] = t.total / bw * 1e3
            per[strategy] = rows
            del eng, state
            free(device)
            log(f"{strategy}: " + ", ".join(
                f"k{k} {rows[f'k{k}']['window_mean']:.3f} ms" for k in ns.ks))
        res["strategy_rounds"] = per
        key = "device_execute" if device.type == "cuda" else "window_mean"
        res["strategy_round_ms_key"] = key
        res["hybrid_state_strategy_round_ms"] = {
            s: {f"k{k}": per[s][f"k{k}"][key] for k in ns.ks} for s in STATE_STRATEGIES}
        res["hybrid_state_bytes_per_round"] = {
            s: {f"k{k}": per[s][f"k{k}"]["state_bytes"]["total"] for k in ns.ks}
            for s in STATE_STRATEGIES}
        save()

    # ---- greedy: speculative == plain at K = 1, K >= 2 divergences with their margins
    if not skip("greedy"):
        vocab = loaded.config.vocab_size
        prompts = [np.random.default_rng(s).integers(0, vocab, args.check_prompt_len).tolist()
                   for s in range(args.check_prompts)]
        params = SamplingParams(max_tokens=args.check_tokens, ignore_eos=True)
        plain.reset()
        want = [generate(plain, [p], params, 0)[0] for p in prompts]
        checks = {}
        for strategy in STATE_STRATEGIES:
            if skip(f"greedy_{strategy}"):
                continue
            spec = engine(acceptance="greedy", request_buckets=(1,), state_strategy=strategy)
            checks[strategy] = greedy_check(plain, spec, prompts, want, params, w)
            del spec
            free(device)
            log(f"greedy {strategy}: " + ", ".join(
                f"K={k}: {checks[strategy][f'k{k}']['identical_prompts']}/{len(prompts)}"
                for k in range(1, w + 1)))
            save()
        res["greedy_check"] = checks
        if checks:
            res["greedy_k1_identical"] = all(not c["k1"]["divergences"] for c in checks.values())
            res["greedy_divergences_explained"] = all(
                d["explained"] for c in checks.values() for kk, v in c.items() if kk != "k1"
                for d in v["divergences"])
        save()
    del plain
    free(device)

    # ---- the linear layers' decode / verify implementations against each other (issue 38)
    if args.linear_attention and not skip("linear_attention"):
        res["linear_attention"] = linear_attention_stage(args, engine, res,
                                                         loaded.config.vocab_size)
        save()

    # ---- transformers compiled (child process, killed at the deadline)
    left = deadline - time.time()
    if device.type != "cuda":
        res["hf_compile_status"] = "not tried: torch.compile(reduce-overhead) is a CUDA-graph mode"
    elif "compile" in args.skip or "hf" in args.skip:
        res["hf_compile_status"] = "not tried: --skip"
    elif left < args.compile_min_s:
        res["hf_compile_status"] = (f"not tried: {left:.0f} s left < {args.compile_min_s:.0f} s")
    else:
        log(f"transformers static cache + torch.compile (child, {left:.0f} s left)")
        res.update(hf_compiled(args, left))
        pick_peer(res, args.batches)
    save()
    show(res)
    if args.record:
        record(res, args)
    return res


def linear_attention_stage(args, engine, res: dict, vocab: int) -> dict[str, dict]:
    """Per ``kernels.linear_attention.impl`` of ``args.linear_attention``: B = 1 decode step
    (ms, floor ratio, launches per step and the kernels' breakdown on CUDA), full-width verify
    step and its ratio to that decode step, greedy tokens of one prompt (plain, K = 1)."""
    w, out = args.draft_width, {}
    base = KernelConfig.from_env()
    prompt = np.random.default_rng(0).integers(0, vocab, args.check_prompt_len).tolist()
    params = SamplingParams(max_tokens=args.check_tokens, ignore_eos=True)
    for impl in args.linear_attention:
        kernels = base.replace(linear_attention=dataclasses.replace(base.linear_attention,
                                                                    impl=impl))
        row: dict[str, object] = {}
        plain = engine(speculative=False, request_buckets=(1,), kernels=kernels)
        row["decode_step_ms_b1"] = decode_step_ms(plain, args.kv, args.repeats)
        row["hybrid_decode_step_floor_ratio"] = row["decode_step_ms_b1"] / res["decode_floor_ms"]
        if plain.runner.graphs is not None:
            key = GraphKey("target", 1, 0, 1, plain.runner.resolve_update(1, 0, 1), "greedy")
            row["breakdown_b1"] = breakdown(plain, key, top=40)
            row["hybrid_decode_kernels_per_step_b1"] = next(
                n for name, _, n in row["breakdown_b1"] if name == "(all kernels)")
        plain.reset()
        row["tokens_plain"] = generate(plain, [prompt], params, 0)[0]
        del plain
        free(resolve_device(args.device))
        for strategy in args.la_strategy:
            spec = engine(acceptance="forced", request_buckets=(1,), kernels=kernels,
                          state_strategy=strategy)
            fill(spec, 1, w, args.kv)
            if spec.runner.graphs is not None:
                update = spec.runner.resolve_update(1, w, w + 1)
                # the full-width verify as served: its rows are the [1, w + 1] grid
                # (RoundInputs.grid); the row-mapped layout of uneven verifies beside it
                key = GraphKey("target", 1, w, w + 1, update, "greedy", grid=True)
                ms = target_ms(spec, 1, w, w + 1, update, args.repeats, grid=True)
                row[f"verify_ms_b1.{strategy}"] = ms
                row[f"verify_ratio.{strategy}"] = ms / row["decode_step_ms_b1"]
                row[f"verify_ms_b1.{strategy}.row_map"] = target_ms(spec, 1, w, w + 1, update,
                                                                    args.repeats)
                log(f"verify ({strategy}) row-mapped layout "
                    f"{row[f'verify_ms_b1.{strategy}.row_map']:.3f} ms")
                # where the verify's time goes next to the decode step's (issue 38's <= 1.15)
                row[f"verify_breakdown_b1.{strategy}"] = brk = breakdown(spec, key, top=40)
                if "breakdown_b1" in row:
                    log(f"verify ({strategy}) {ms:.3f} ms, "
                        f"{ms / row['decode_step_ms_b1']:.3f}x the decode step")
                    log_breakdown_delta(row["breakdown_b1"], brk)
                if strategy == args.la_strategy[0]:
                    row["verify_ms_b1"] = ms
                    row["hybrid_verify_full_width_ratio"] = ms / row["decode_step_ms_b1"]
            del spec
            free(resolve_device(args.device))
        greedy = engine(acceptance="greedy", request_buckets=(1,), kernels=kernels,
                        state_strategy=args.la_strategy[0])
        row["tokens_k1"] = generate(greedy, [prompt], params, 1)[0]
        del greedy
        free(resolve_device(args.device))
        row["state_bytes_per_round"] = res.get("hybrid_state_bytes_per_round")
        out[impl] = row
        log(f"linear_attention {impl}: decode {row['decode_step_ms_b1']:.3f} ms "
            f"({row['hybrid_decode_step_floor_ratio']:.2f}x floor), "
            f"{row.get('hybrid_decode_kernels_per_step_b1')} kernels, verify ratio "
            f"{row.get('hybrid_verify_full_width_ratio')}")
    if {"fla", "fused"} <= set(out):
        out["tokens_equal"] = all(out["fla"][t] == out["fused"][t]
                                  for t in ("tokens_plain", "tokens_k1"))
    return out


def log_breakdown_delta(decode: list, verify: list, top: int = 15) -> None:
    """The kernels whose time per step grows most from the decode step to the full-width
    verify (``breakdown`` rows ``[name, us, launches]``), and the totals."""
    d = {name: (us, n) for name, us, n in decode}
    v = {name: (us, n) for name, us, n in verify}
    rows = sorted(((name, v.get(name, (0.0, 0))[0] - d.get(name, (0.0, 0))[0],
                    d.get(name, (0.0, 0)), v.get(name, (0.0, 0)))
                   for name in set(d) | set(v) if not name.startswith("(")),
                  key=lambda r: -abs(r[1]))
    log("verify - decode, per step (us; launches decode -> verify):")
    for name, delta, (du, dn), (vu, vn) in rows[:top]:
        log(f"  {delta:+9.1f}  {du:8.1f} -> {vu:8.1f}  x{dn:g} -> x{vn:g}  {name}")
    for name in ("(all kernels)", "(span incl. gaps)"):
        if name in d and name in v:
            log(f"  {v[name][0] - d[name][0]:+9.1f}  {d[name][0]:8.1f} -> {v[name][0]:8.1f}  "
                f"{name}")


def record(res: dict, args) -> None:
    commit, date = git_commit(), time.strftime("%Y-%m-%d")
    command = "python3 bench/bench_hybrid.py " + " ".join(sys.argv[1:])
    rows = [("hybrid_decode_step_floor_ratio", res.get("hybrid_decode_step_floor_ratio"), "x"),
            ("hybrid_decode_speedup_vs_hf_b1", res.get("hybrid_decode_speedup_vs_hf_b1"), "x")]
    for b in args.batches[1:]:
        rows += [(f"hybrid_decode_step_floor_ratio_b{b}",
                  res.get(f"hybrid_decode_step_floor_ratio_b{b}"), "x"),
                 (f"hybrid_decode_speedup_vs_hf_b{b}",
                  res.get(f"hybrid_decode_speedup_vs_hf_b{b}"), "x")]
    for s, per_k in res.get("hybrid_state_strategy_round_ms", {}).items():
        rows += [(f"hybrid_state_strategy_round_ms.{s}.{k}", v, "ms") for k, v in per_k.items()]
    for impl, row in res.get("linear_attention", {}).items():
        if isinstance(row, dict):
            rows += [(f"{m}.{impl}", row.get(m), u) for m, u in (
                ("hybrid_decode_step_floor_ratio", "x"),
                ("hybrid_decode_kernels_per_step_b1", "launches"),
                ("hybrid_verify_full_width_ratio", "x"))]
            rows += [(f"hybrid_verify_full_width_ratio.{impl}.{strategy}",
                      row.get(f"verify_ratio.{strategy}"), "x") for strategy in args.la_strategy]
    append_results({"metric": m, "value": v, "unit": u, "device": res["versions"]["device_name"],
                    "commit": commit, "date": date, "command": command, "model": args.model,
                    "dtype": args.dtype} for m, v, u in rows if v is not None)


def show(res: dict) -> None:
    print("\n== summary")
    for key in ("copy_bandwidth_gbs", "weight_bytes", "state_bytes", "kv_bytes",
                "decode_floor_ms", "decode_step_ms_b1", "hybrid_decode_step_floor_ratio",
                "ours_tok_s_b1", "hf_static_tok_s_b1", "hf_dynamic_tok_s_b1",
                "hf_compile_tok_s_b1", "hf_config_b1", "hybrid_decode_speedup_vs_hf_b1",
                "hf_compile_status", "greedy_k1_identical", "greedy_divergences_explained"):
        if key in res:
            v = res[key]
            print(f"{key:34s} {v:12.4f}" if isinstance(v, float) else f"{key:34s} {v}")
    for b in res.get("setup", {}).get("batches", (1,))[1:]:
        for key in (f"decode_floor_ms_b{b}", f"decode_step_ms_b{b}",
                    f"hybrid_decode_step_floor_ratio_b{b}", f"ours_tok_s_b{b}",
                    f"hf_tok_s_b{b}", f"hf_config_b{b}", f"hybrid_decode_speedup_vs_hf_b{b}"):
            if key in res:
                v = res[key]
                print(f"{key:34s} {v:12.4f}" if isinstance(v, float) else f"{key:34s} {v}")
    per = res.get("strategy_rounds", {})
    if per:
        print(f"\n{'strategy':14s} {'k':>3s} {'round ms':>9s} {'state MB':>9s} {'state ms@bw':>11s}")
        key = res["strategy_round_ms_key"]
        for s, rows in per.items():
            for kk, r in rows.items():
                print(f"{s:14s} {kk:>3s} {r[key]:9.3f} {r['state_bytes']['total'] / 1e6:9.2f} "
                      f"{r['state_ms_at_copy_bw']:11.4f}")
    for s, c in res.get("greedy_check", {}).items():
        for kk, v in c.items():
            for d in v["divergences"]:
                print(f"greedy {s} {kk} prompt {d['prompt']}: diverges at {d['position']}, "
                      f"margin {d['margin']:.5f} vs one step {d['dtype_step']:.5f} "
                      f"({'explained' if d['explained'] else 'NOT explained'})")
    for impl, row in res.get("linear_attention", {}).items():
        if isinstance(row, dict):
            print(f"linear_attention {impl:6s} decode {row['decode_step_ms_b1']:.3f} ms "
                  f"{row['hybrid_decode_step_floor_ratio']:.2f}x floor, "
                  f"{row.get('hybrid_decode_kernels_per_step_b1')} kernels/step, "
                  f"verify ratio {row.get('hybrid_verify_full_width_ratio')}")
    if "tokens_equal" in res.get("linear_attention", {}):
        print("linear_attention fla == fused tokens:", res["linear_attention"]["tokens_equal"])
    if res["skipped"]:
        print("skipped:", res["skipped"])


if __name__ == "__main__":
    main()
