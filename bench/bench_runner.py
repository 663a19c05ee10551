"""Runner speed: ``speccal bench`` (speculative vs plain decoding, one process) for a preset.

Usage: python3 bench/bench_runner.py --model tiny --device cpu [--record]

Prints the JSON result; with ``--record`` appends tokens/s (spec and plain), speed-up,
acceptance rate and mean accepted length to bench/results.jsonl with commit, date and command.
Speed goals live here, never in unit tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

from results import append_results, git_commit

from speccal.kernels.config import KernelConfig
from speccal.live.bench import bench
from speccal.runner.engine import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-width", type=int, default=3)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = EngineConfig.flat(kernels=KernelConfig.from_env(),
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        draft_width=args.draft_width,
        request_buckets=(1, 2, 4, 8, 16, 32),
    )
    res = bench(
        cfg,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        num_draft_steps=args.k or args.draft_width,
        repeats=args.repeats,
    )
    print(json.dumps({k: v for k, v in res.items() if k != "engine"}, indent=1, default=str))
    if not args.record:
        return
    commit = git_commit()
    device = res["engine"]["spec"]["compatibility"]["device"]["name"]
    command = "python3 bench/bench_runner.py " + shlex.join(sys.argv[1:])
    date = datetime.date.today().isoformat()
    tag = f"runner.{args.model}.{args.device.split(':')[0]}.k{args.k or args.draft_width}.b{args.num_requests}"
    rows = [
        (f"{tag}.spec_tokens_per_s", res["spec"]["tokens_per_s"], "tokens/s"),
        (f"{tag}.plain_tokens_per_s", res["plain"]["tokens_per_s"], "tokens/s"),
        (f"{tag}.speedup", res["speedup"], "x"),
        (f"{tag}.acceptance_rate", res["spec"]["acceptance_rate"], "fraction"),
        (f"{tag}.mean_accepted_length", res["spec"]["mean_accepted_length"], "tokens"),
    ]
    append_results(
        {
            "metric": metric,
            "value": value,
            "unit": unit,
            "device": device,
            "commit": commit,
            "date": date,
            "command": command,
        }
        for metric, value, unit in rows
    )


if __name__ == "__main__":
    main()
