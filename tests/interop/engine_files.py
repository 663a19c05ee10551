"""What each engine would write for the acceptance of a speccal round trace (test builders).

Every writer follows the engine's own producer (docs/INTEROP.md): vLLM's
``SpecDecodingStats.observe_draft`` (one draft per request and step; ``per_pos[i] += 1`` for
each accepted position) exported by ``SpecDecodingProm`` as ``vllm:...`` counters with the
``_total`` suffix; vLLM's per-request stats, as merged (vllm-project/vllm#48915: top-level
``metrics.speculative_decoding``, dense histograms; ``docs/features/speculative_decoding/
acceptance_metrics.md`` at local-inference-lab/vllm@3b85a950, and the e2e test that reads
``response.json()["metrics"]["speculative_decoding"]``) and in the pre-merge per-choice
``speculative_decoding_stats`` shape; Model Optimizer's ``build_profile``
(``acceptance_length_histogram`` keyed by accepted + 1); a plain CSV.

``acceptance_histogram_by_draft_length`` is not in any stored vLLM snapshot: its layout here
(a list indexed by draft length ``d = 0..num_spec_tokens`` of dense histograms of
``num_spec_tokens + 1`` entries, index = accepted drafts) follows the issue's words ("a
dense-list ``acceptance_histogram``, adds ``acceptance_histogram_by_draft_length``") and vLLM's
own per-draft-length counter ``SpecDecodingStats.num_drafts_by_draft_length`` (a list of
``num_spec_tokens + 1`` indexed by draft length, in a stored vLLM test of ``metrics.py``).
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


def _merged_stats(pairs: np.ndarray, w: int, detailed: bool) -> dict:
    """``metrics.speculative_decoding`` of one request from its ``[steps, 2]`` (drafted,
    accepted) pairs, as vLLM #48915 writes it (+ the by-draft-length histograms)."""
    d, a = pairs[:, 0], pairs[:, 1]
    by_len = np.zeros((w + 1, w + 1), dtype=np.int64)
    np.add.at(by_len, (d, a), 1)
    n = int(a.size)
    stats = {
        "mean_acceptance_length": 1 + float(a.sum()) / n if n else 1.0,
        "draft_acceptance_rate": float(a.sum()) / float(d.sum()) if d.sum() else 0.0,
        "acceptance_histogram": np.bincount(a, minlength=w + 1).tolist(),
        "acceptance_histogram_by_draft_length": by_len.tolist(),
        "num_spec_steps": n,
        "num_accepted_draft_tokens": int(a.sum()),
        "num_draft_tokens": int(d.sum()),
        "num_spec_tokens": w,
    }
    if detailed:
        stats["per_step_accepted"] = a.tolist()
        stats["per_step_drafted"] = d.tolist()
    return stats


def _merged_response(i: int, stats: dict) -> dict:
    return {
        "id": f"cmpl-{i}",
        "object": "text_completion",
        "model": "dense-2b",
        "choices": [{"index": 0, "text": "...", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 512, "completion_tokens": 0, "total_tokens": 512},
        "metrics": {"speculative_decoding": stats},
    }


def vllm_request_metrics(trace: RoundTrace, rounds: int, detailed: bool = True) -> list[dict]:
    """Merged-shape responses (``metrics.speculative_decoding``) of full-width steps: request
    ``i`` is slot ``i`` of every round (a trace of constant batch size)."""
    b = int(trace.num_requests[0])
    w = trace.draft_width
    acc = trace.accepted[: rounds * b].reshape(rounds, b)
    out = []
    for i in range(b):
        pairs = np.stack([np.full(rounds, w), acc[:, i]], axis=1)
        out.append(_merged_response(i, _merged_stats(pairs, w, detailed)))
    return out


#: The dynamic-K fixture: vLLM's num_speculative_tokens_per_batch_size [[1, 2, 3], [3, 4, 2],
#: [5, 8, 1]] at batch sizes cycling 1, 2, 4, 8, with known conditional acceptance per position.
DYNAMIC_SCHEDULE = {1: 3, 2: 3, 4: 2, 8: 1}
DYNAMIC_CONDITIONAL = (0.8, 0.6, 0.5)


def dynamic_k_pairs(
    rounds: int,
    conditional=DYNAMIC_CONDITIONAL,
    schedule=DYNAMIC_SCHEDULE,
    seed: int = 0,
) -> dict[int, np.ndarray]:
    """Per request ``[steps, 2]`` (drafted, accepted) of a dynamic-K deployment: round ``r``
    runs ``b = sorted(schedule)[r % len]`` requests (ids ``0..b-1``), each drafting
    ``schedule[b]`` tokens and accepting the leading ones that pass ``Bernoulli(q_j)``;
    the truth is prefix acceptance ``cumprod(conditional)`` at every position."""
    rng = np.random.default_rng(seed)
    sizes = sorted(schedule)
    q = np.asarray(conditional)
    w = q.size
    steps: dict[int, list] = {}
    for r in range(rounds):
        b = sizes[r % len(sizes)]
        k = schedule[b]
        ok = rng.random((b, w)) < q  # the whole width, then cut at the draft length
        lead = np.cumprod(ok, axis=1).sum(axis=1)
        for i in range(b):
            steps.setdefault(i, []).append((k, int(min(lead[i], k))))
    return {i: np.asarray(v, dtype=np.int64) for i, v in steps.items()}


def vllm_dynamic_k_requests(
    rounds: int, detailed: bool = False, seed: int = 0, w: int = 3
) -> list[dict]:
    """Merged-shape responses of :func:`dynamic_k_pairs` (several K)."""
    pairs = dynamic_k_pairs(rounds, seed=seed)
    return [_merged_response(i, _merged_stats(p, w, detailed)) for i, p in pairs.items()]


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
