"""Prefill throughput of the runner (what a calibration's transitions spend their time on).

Builds the preset's engine (eager rounds; prefill always runs on the torch backend, see
``runner/path.prefill_path``), prefills prompts of each length ``--repeats`` times and reports
prompt tokens/s per length, the median over repeats, against a GEMM floor measured in the same
run (the model's matmul FLOPs per token over the bf16 ``torch.matmul`` rate of a 4096 x 2048 x
6144 product). With ``--profile`` one prefill of the longest length runs under
``torch.profiler`` and its top operators (by device time, then host time) are written to
``prefill_profile.txt`` next to ``prefill.json``.

    python3 bench/bench_prefill.py --model dense-2b --device cuda --dtype bfloat16 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.sampling import SamplingParams


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _matmul_tflops(device: str, dtype: torch.dtype) -> float:
    a = torch.randn(4096, 2048, device=device, dtype=dtype)
    b = torch.randn(2048, 6144, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        a @ b
    _sync(device)
    return 2 * 4096 * 2048 * 6144 * n / (time.perf_counter() - t0) / 1e12


def _prefill_once(eng: Engine, prompt: list[int], device: str) -> float:
    eng.reset()
    eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    _sync(device)
    t0 = time.perf_counter()
    eng.prefill_pending()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dense-2b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="256,1024,2048,4000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    backend = "triton" if args.device.startswith("cuda") else "torch"
    eng = Engine(EngineConfig.flat(model=args.model, device=args.device, dtype=args.dtype,
                                   request_buckets=(1,), max_model_len=max(lengths) + 64,
                                   prefill_chunk=args.chunk, graph_mode="eager",
                                   attention_backend=backend))
    cfg = eng.loaded.config
    vocab = cfg.vocab_size
    rng = np.random.default_rng(0)
    # matmul FLOPs per prompt token: every projection of the target (the MTP head's one layer
    # and its projection are small next to them and left out of the floor)
    per_layer = cfg.hidden_size * (
        cfg.num_attention_heads * cfg.head_dim * 2 + cfg.num_key_value_heads * cfg.head_dim * 2
        + 3 * cfg.intermediate_size)
    flops_per_token = 2 * cfg.num_hidden_layers * per_layer
    dtype = getattr(torch, args.dtype)
    tflops = _matmul_tflops(args.device, dtype) if args.device.startswith("cuda") else float("nan")
    out = {"setup": vars(args), "matmul_tflops": tflops, "flops_per_token": flops_per_token,
           "lengths": {}}
    for n in lengths:
        prompt = rng.integers(0, vocab, n).tolist()
        _prefill_once(eng, prompt, args.device)  # warm
        times = [_prefill_once(eng, prompt, args.device) for _ in range(args.repeats)]
        med = statistics.median(times)
        floor = n * flops_per_token / (tflops * 1e12)
        out["lengths"][n] = {"seconds": times, "median_s": med, "tokens_per_s": n / med,
                             "gemm_floor_s": floor, "ratio_to_floor": med / floor}
        print(f"prefill {n:5d} tokens: median {1e3 * med:8.2f} ms  {n / med:9.0f} tok/s  "
              f"floor {1e3 * floor:7.2f} ms  x{med / floor:5.1f}  (runs {[round(1e3 * t, 1) for t in times]})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "prefill.json").write_text(json.dumps(out, indent=1))
    if args.profile:
        prompt = rng.integers(0, vocab, max(lengths)).tolist()
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            _prefill_once(eng, prompt, args.device)
        key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        text = prof.key_averages().table(sort_by=key, row_limit=25)
        text += "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
        Path(args.out, "prefill_profile.txt").write_text(text)


if __name__ == "__main__":
    main()
