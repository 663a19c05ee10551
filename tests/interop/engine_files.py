"""What each engine would write for the acceptance of a speccal round trace (test builders).

Every writer follows the engine's own producer (docs/INTEROP.md): vLLM's
``SpecDecodingStats.observe_draft`` (one draft per request and step; ``per_pos[i] += 1`` for
each accepted position) exported by ``SpecDecodingProm`` as ``vllm:...`` counters with the
``_total`` suffix; vLLM's per-request ``speculative_decoding_stats``; Model Optimizer's
``build_profile`` (``acceptance_length_histogram`` keyed by accepted + 1); a plain CSV.
"""

from __future__ import annotations

import json

import numpy as np

from speccal.trace import RoundTrace


def counts(trace: RoundTrace, rounds: slice = slice(None)) -> dict:
    """vLLM's spec-decode counters over ``rounds`` of the trace."""
    cu = trace.cu_requests
    r0, r1, _ = rounds.indices(trace.num_rounds)
    acc = trace.accepted[cu[r0] : cu[r1]]
    w = trace.draft_width
    return {
        "drafts": int(acc.size),
        "draft_tokens": int(acc.size * w),
        "accepted": int(acc.sum()),
        "per_pos": [int((acc >= i + 1).sum()) for i in range(w)],
    }


def vllm_metrics_text(c: dict, model: str = "dense-2b", engines: int = 1) -> str:
    """A ``/metrics`` scrape holding counters ``c`` (split over ``engines`` DP ranks)."""
    lines = []

    def split(v: int) -> list[int]:
        base = [v // engines] * engines
        base[0] += v - sum(base)
        return base

    for name, key, doc in (
        ("vllm:spec_decode_num_drafts", "drafts", "Number of spec decoding drafts."),
        ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Number of draft tokens."),
        ("vllm:spec_decode_num_accepted_tokens", "accepted", "Number of accepted tokens."),
    ):
        lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
        for e, v in enumerate(split(c[key])):
            lines.append(f'{name}_total{{engine="{e}",model_name="{model}"}} {float(v)}')
            lines.append(f'{name}_created{{engine="{e}",model_name="{model}"}} 1.7e+09')
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [
        f"# HELP {name}_total Accepted tokens per draft position.",
        f"# TYPE {name}_total counter",
    ]
    for pos, v in enumerate(c["per_pos"]):
        for e, x in enumerate(split(v)):
            lines.append(
                f'{name}_total{{engine="{e}",model_name="{model}",position="{pos}"}} {float(x)}'
            )
    lines.append(f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 8.0')
    return "\n".join(lines) + "\n"


def vllm_request_stats(trace: RoundTrace, rounds: int, detailed: bool = True) -> list[dict]:
    """Responses whose choices carry ``speculative_decoding_stats``: request ``i`` is slot ``i``
    of every round (a trace of constant batch size)."""
    b = int(trace.num_requests[0])
    w = trace.draft_width
    acc = trace.accepted[: rounds * b].reshape(rounds, b)
    out = []
    for i in range(b):
        steps = acc[:, i]
        hist = np.bincount(steps, minlength=w + 1)
        stats = {
            "mean_acceptance_length": 1 + float(steps.mean()),
            "draft_acceptance_rate": float(steps.sum()) / (steps.size * w),
            "acceptance_histogram": {str(j): int(n) for j, n in enumerate(hist) if n},
            "num_spec_steps": int(steps.size),
            "num_accepted_draft_tokens": int(steps.sum()),
            "num_draft_tokens": int(steps.size * w),
            "num_spec_tokens": w,
        }
        if detailed:
            stats["per_step_accepted"] = steps.tolist()
            stats["per_step_drafted"] = [w] * steps.size
        out.append(
            {
                "id": f"cmpl-{i}",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "...",
                        "finish_reason": "length",
                        "speculative_decoding_stats": stats,
                    }
                ],
            }
        )
    return out


def speculation_profile(trace: RoundTrace, method: str = "mtp") -> dict:
    """A ``speculation_profile.json`` as Model Optimizer's ``build_profile`` writes it."""
    w = trace.draft_width
    hist = np.bincount(trace.accepted, minlength=w + 1)
    n = int(hist.sum())
    marginal = [float((trace.accepted >= i + 1).sum()) / n for i in range(w)]
    conditional = []
    prev = 1.0
    for m in marginal:
        conditional.append(m / prev if prev > 0 else 0.0)
        prev = m
    mean = 1.0 + float(trace.accepted.mean())
    return {
        "schema_version": "1.0",
        "measured": True,
        "method": method,
        "draft_checkpoint": {"id": "speccal/scenario-transition"},
        "target_model": {"id": "speccal/scenario-transition"},
        "num_speculative_tokens": w,
        "block_size": None,
        "max_supported_k": w,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": [round(x, 6) for x in conditional],
        "marginal_accept_rates": [round(x, 6) for x in marginal],
        "mean_accept_length": round(mean, 6),
        "mean_accept_length_per_request": round(mean, 6),
        "accept_length_model": "measured_per_k",
        "accept_length_by_k": {str(w): round(mean, 6)},
        "acceptance_length_histogram": {str(j + 1): int(c) for j, c in enumerate(hist) if c},
        "per_category": None,
        "measurement_conditions": {"engine": "speccal scenario", "concurrency": 8},
        "validation": None,
    }


def accepted_csv(trace: RoundTrace, rounds: int) -> str:
    """``round,request,accepted,drafted,kv_length`` for the first ``rounds`` rounds."""
    lines = ["round,request,accepted,drafted,kv_length"]
    cu = trace.cu_requests
    for r in range(rounds):
        for i, a in enumerate(trace.accepted[cu[r] : cu[r + 1]]):
            lines.append(f"{r},{i},{int(a)},{trace.draft_width},{trace.kv_length[r]:g}")
    return "\n".join(lines) + "\n"


def dumps(obj) -> str:
    return json.dumps(obj, indent=1) + "\n"
