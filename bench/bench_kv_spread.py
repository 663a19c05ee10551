"""What a spread of KV lengths inside a batch costs at the same mean KV (issue 35's residual).

Usage (GPU): python3 bench/bench_kv_spread.py --out DIR [--model dense-2b] [--repeats 5]
    [--batches 8,32] [--means 350,900] [--draft-widths 1,3] [--record]

The cost table is measured with every request of a point at one KV length and a round is priced
at its batch's mean KV; the fidelity sweep's mixed-prompt workloads (prompts of 64 and 512
tokens in one batch) ran 2-4 % slower than their replay, the uniform ones within 1.6 %. This
bench times one speculative round (the draft graph of ``k`` steps, then the target verify graph
of ``(k + 1) B`` rows, forced acceptance, bf16, split graphs) of ``B`` requests whose KV lengths
have the same mean ``M`` laid out three ways:

- ``uniform``: every request at ``M``;
- ``two_level``: half at ``M / 4``, half at ``7 M / 4`` (the sweep's short / long mix);
- ``one_long``: one request at ``B M / 2`` capped by the context, the others sharing the rest.

For each (``B``, ``k``, ``M``) the median of ``--repeats`` (each the mean of 30 replays of both
graphs, CUDA events), and the ratio of each spread layout to ``uniform`` measured in the same
run: a ratio above 1 is what the mean-KV price misses. Writes ``DIR/kv_spread.json`` after every
point; ``--record`` appends ``kv_spread_round_ratio_max`` (the largest ratio) to
bench/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_decode import fill as decode_fill
from cuda_timing import events_ms
from results import append_results, git_commit

from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.graphs import GraphKey


def layouts(batch: int, mean: int, context: int) -> dict[str, list[int]]:
    """The three KV layouts of one point, each with mean ``mean`` (up to rounding)."""
    out = {"uniform": [mean] * batch}
    if batch >= 2:
        lo, hi = max(mean // 4, 16), None
        hi = 2 * mean - lo
        out["two_level"] = [lo] * (batch // 2) + [hi] * (batch - batch // 2)
        long = min(batch * mean // 2, context)
        rest = max((batch * mean - long) // (batch - 1), 16)
        out["one_long"] = [long] + [rest] * (batch - 1)
    return out


def fill(eng: Engine, lengths: list[int], k: int) -> None:
    """Requests at KV ``lengths``, one real round of ``k`` drafts (``bench_decode.fill``; few
    tokens to go, so the longest prompt fits the context)."""
    decode_fill(eng, len(lengths), k, lengths=lengths, max_tokens=64)


def round_ms(eng: Engine, bcap: int, k: int, repeats: int) -> float:
    draft = GraphKey("draft", bcap, k)
    target = GraphKey("target", bcap, k, (k + 1) * bcap, "in_graph", "greedy")

    def one() -> None:
        eng.runner.graphs.replay(draft)
        eng.runner.graphs.replay(target)

    return events_ms(one, 30, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default="dense-2b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--means", default="350,900")
    ap.add_argument("--draft-widths", default="1,3")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    means = [int(x) for x in args.means.split(",")]
    widths = [int(x) for x in args.draft_widths.split(",")]
    context = 4096
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device_name": torch.cuda.get_device_name(), "commit": git_commit(),
                 "points": []}

    def save() -> None:
        (out / "kv_spread.json").write_text(json.dumps(res, indent=1))

    t0 = time.time()
    eng = Engine(EngineConfig.flat(
        model=args.model, device="cuda", dtype="bfloat16", attention_backend="triton",
        graph_mode="split", max_model_len=context + 64,  # fill's prompts + max_tokens block_size=16,
        request_buckets=tuple(batches), draft_width=max(widths), acceptance="forced",
        target_rows={b: tuple((k + 1) * b for k in widths) for b in batches},
        kv_capacity_tokens=max(batches) * (2 * max(means) + 64) + context))
    res["build_s"] = time.time() - t0
    for b in batches:
        for k in widths:
            for m in means:
                point = {"batch": b, "k": k, "mean_kv": m, "ms": {}, "ratio": {}}
                for name, lengths in layouts(b, m, context).items():
                    fill(eng, lengths, k)
                    point["ms"][name] = round_ms(eng, b, k, args.repeats)
                for name, ms in point["ms"].items():
                    point["ratio"][name] = ms / point["ms"]["uniform"]
                res["points"].append(point)
                print(f"B={b:3d} k={k} M={m:5d}  " + "  ".join(
                    f"{n} {ms:.3f} ms ({point['ratio'][n]:.3f})" for n, ms in point["ms"].items()),
                    flush=True)
                save()
    worst = max((r, p) for p in res["points"] for n, r in p["ratio"].items() if n != "uniform")
    res["kv_spread_round_ratio_max"] = worst[0]
    save()
    if args.record:
        p = worst[1]
        append_results([{
            "metric": "kv_spread_round_ratio_max", "value": round(worst[0], 4), "unit": "x",
            "device": res["device_name"], "commit": res["commit"],
            "date": time.strftime("%Y-%m-%d"),
            "command": "python3 bench/bench_kv_spread.py " + " ".join(sys.argv[1:]),
            "model": args.model, "batch": p["batch"], "k": p["k"], "mean_kv": p["mean_kv"],
            "repeats": args.repeats, "note": "round time of a spread KV layout over the uniform "
            "layout of the same mean, same run"}])


if __name__ == "__main__":
    main()
