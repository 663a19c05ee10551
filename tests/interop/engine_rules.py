"""Re-implementations of each engine's parser rules, to validate exported files in tests.

Written from the engines' code (docs/INTEROP.md lists file, function and commit), independently
of ``speccal.interop``: a file that passes here is one the engine's loader accepts, and
``*_lookup`` is what the engine then runs. Each ``check_*`` raises ``EngineRejects`` naming the
rule, as the engine would raise ``ValueError``.
"""

from __future__ import annotations

import bisect
import json
import math

import yaml


class EngineRejects(ValueError):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------- vLLM
# vllm/v1/spec_decode/dynamic/utils.py @ a6f6bb1d: validate_and_normalize_dynamic_sd_schedule,
# build_dynamic_sd_schedule_lookup; vllm/config/speculative.py @ 002e77c1 (field types).


def check_vllm(text: str) -> dict:
    cfg = json.loads(text)
    n = cfg.get("num_speculative_tokens")
    if not _is_int(n) or n <= 0:
        raise EngineRejects("num_speculative_tokens must be an int > 0")
    sched = cfg.get("num_speculative_tokens_per_batch_size")
    if not isinstance(sched, list):
        raise EngineRejects("schedule must be a list")
    if not sched:
        raise EngineRejects("schedule must not be empty")
    parsed = []
    for e in sched:
        if not isinstance(e, list) or len(e) != 3 or not all(_is_int(x) for x in e):
            raise EngineRejects("each entry is (range_start, range_end, num_speculative_tokens)")
        lo, hi, k = e
        if lo <= 0 or hi <= 0:
            raise EngineRejects("ranges must be positive")
        if lo > hi:
            raise EngineRejects("range start must be <= end")
        if k < 0:
            raise EngineRejects("K >= 0")
        parsed.append((lo, hi, k))
    parsed.sort()
    end = 0
    for lo, hi, _ in parsed:
        if lo <= end:
            raise EngineRejects("ranges must be non-overlapping and sorted")
        end = hi
    if parsed[0][0] != 1:
        raise EngineRejects("the first range must start at 1")
    if cfg.get("method") != "mtp":
        raise EngineRejects("method must be mtp for an MTP head")
    return cfg


def vllm_dense(cfg: dict, max_batch_size: int) -> list[int]:
    """``dense[bs]`` as build_dynamic_sd_schedule_lookup fills it (index 0 unused)."""
    cap = cfg["num_speculative_tokens"]
    dense = [0] * (max_batch_size + 1)
    nxt, last = 1, None
    for lo, hi, k in sorted(map(tuple, cfg["num_speculative_tokens_per_batch_size"])):
        if lo > nxt and last is not None:
            for bs in range(nxt, min(lo, max_batch_size + 1)):
                dense[bs] = min(cap, last)
        for bs in range(max(lo, nxt), min(hi, max_batch_size) + 1):
            dense[bs] = min(cap, k)
        nxt, last = max(nxt, hi + 1), k
        if nxt > max_batch_size:
            break
    for bs in range(nxt, max_batch_size + 1):
        dense[bs] = min(cap, last)
    return dense


# ----------------------------------------------------------------------------------- TRT-LLM
# tensorrt_llm/llmapi/llm_args.py @ 00043967: DecodingBaseConfig.validate_draft_len_schedule_and_sort
# (+ max_concurrency exclusion); tensorrt_llm/_torch/speculative/utils.py @ 011d0933:
# get_draft_len_for_batch_size.


def check_trtllm(text: str) -> dict:
    doc = yaml.safe_load(text)
    spec = doc["speculative_config"]
    if spec.get("decoding_type") != "MTP":
        raise EngineRejects("decoding_type MTP")
    mdl = spec.get("max_draft_len")
    if not _is_int(mdl) or mdl < 0:
        raise EngineRejects("max_draft_len: NonNegativeInt")
    sched = spec.get("draft_len_schedule")
    if not isinstance(sched, dict) or not sched:
        raise EngineRejects("draft_len_schedule: dict[int, int]")
    for bs, dl in sched.items():
        if not _is_int(bs) or not _is_int(dl):
            raise EngineRejects("keys and values are ints")
        if bs < 1:
            raise EngineRejects("batch size threshold must be >= 1")
        if dl < 0:
            raise EngineRejects("draft length must be >= 0")
    if sched[min(sched)] != mdl:
        raise EngineRejects("draft_len_schedule[smallest key] must equal max_draft_len")
    if any(dl > mdl for dl in sched.values()):
        raise EngineRejects("all draft lengths must be <= max_draft_len")
    if spec.get("max_concurrency") is not None:
        raise EngineRejects("max_concurrency and draft_len_schedule are mutually exclusive")
    return {**spec, "draft_len_schedule": dict(sorted(sched.items()))}


def trtllm_draft_len(spec: dict, batch_size: int, min_draft_len: int = 0) -> int:
    keys = list(spec["draft_len_schedule"])
    i = bisect.bisect_left(keys, batch_size)
    if i < len(keys):
        return max(spec["draft_len_schedule"][keys[i]], min_draft_len)
    return min_draft_len


# ----------------------------------------------------------------------------------- SGLang
# python/sglang/srt/speculative/dspark_components/dspark_sps_table.py @ 692c5f7d:
# load_sps_table_from_path, SpsCostTable / SpsAdditiveCostTable __post_init__, lookup,
# step_time, is_uninitialized_sps_table (msgspec: ints stay ints, no bools).


def _probes(name, xs):
    if not xs:
        raise EngineRejects(f"{name} requires at least one probe")
    if not all(_is_int(x) for x in xs):
        raise EngineRejects(f"{name} must be ints")
    if xs != sorted(set(xs)):
        raise EngineRejects(f"{name} must be strictly increasing")


def check_sglang(text: str) -> dict:
    doc = json.loads(text)
    if '"bias_seconds"' in text:
        for key in ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"):
            if key not in doc:
                raise EngineRejects(f"missing field {key}")
        for name, p, v in (
            ("bs_probes", doc["bs_probes"], doc["alpha_seconds"]),
            ("m_probes", doc["m_probes"], doc["theta_seconds"]),
        ):
            _probes(name, p)
            if len(p) != len(v):
                raise EngineRejects(f"{name} and its values must have equal length")
            if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in v):
                raise EngineRejects("finite floats")
        if not doc["bias_seconds"] > 0:
            raise EngineRejects("bias_seconds must be > 0")
        doc["_kind"] = "additive"
        return doc
    for key in ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"):
        if key not in doc:
            raise EngineRejects(f"missing field {key}")
    _probes("sample_batch_tokens", doc["sample_batch_tokens"])
    if len(doc["sample_batch_tokens"]) != len(doc["sample_steps_per_sec"]):
        raise EngineRejects("equal length")
    if (
        not _is_int(doc["max_batch_tokens"])
        or doc["max_batch_tokens"] < doc["sample_batch_tokens"][-1]
    ):
        raise EngineRejects("max_batch_tokens must be >= the largest probe")
    if len(doc["sample_batch_tokens"]) <= 1:
        raise EngineRejects("uninitialized (one probe): the planner would verify everything")
    if not all(isinstance(x, (int, float)) and x > 0 for x in doc["sample_steps_per_sec"]):
        raise EngineRejects("steps per second > 0")
    doc["_kind"] = "sps"
    return doc


def _interp_clamped(xs, ys, x):
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    return ys[lo] + (x - xs[lo]) / (xs[hi] - xs[lo]) * (ys[hi] - ys[lo])


def sglang_step_seconds(doc: dict, num_reqs: int, budget: int) -> float:
    if doc["_kind"] == "additive":
        return (
            doc["bias_seconds"]
            + _interp_clamped(doc["bs_probes"], doc["alpha_seconds"], float(num_reqs))
            + _interp_clamped(doc["m_probes"], doc["theta_seconds"], float(num_reqs + budget))
        )
    edges = doc["sample_batch_tokens"]
    idx = max(0, min(bisect.bisect_right(edges, num_reqs + budget) - 1, len(edges) - 1))
    return 1.0 / doc["sample_steps_per_sec"][idx]


# ----------------------------------------------------------------------- SGLang adaptive steps
# python/sglang/srt/speculative/adaptive_spec_params.py @ 015c8726: resolve_adaptive_strategy,
# _load_adaptive_config, resolve_candidate_steps_from_config, AdaptiveStepSlot.__init__;
# adaptive_step_router.py @ a12239f6: AdaptiveStepRouter.batch_size_key_for_batch; the server
# args' _init_adaptive_speculative_params (--speculative-num-steps in the candidates' union).


def check_sglang_adaptive(text: str, num_steps: int | None = None) -> dict:
    """Parse the config as SGLang does; returns ``{"slots": {bs: candidates}, "strategy",
    "num_steps"}`` (``num_steps``: ``--speculative-num-steps``, default the union's middle)."""
    cfg = json.loads(text)
    if not isinstance(cfg, dict):
        raise EngineRejects("speculative adaptive config must be a JSON object")
    strategy = cfg.get("strategy", "ema")
    if strategy not in ("ema", "throughput_aware"):
        raise EngineRejects("'strategy' must be 'ema' or 'throughput_aware'")
    slots = {}
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        if not isinstance(entry, dict):
            raise EngineRejects(f"BS {key}: entry must be an object")  # .get would raise
        steps = entry.get("candidate_steps")
        if (
            not isinstance(steps, list)
            or not steps
            or not all(isinstance(s, int) and s >= 0 for s in steps)
        ):
            raise EngineRejects(f"BS {key}: candidate_steps must be a list of non-negative ints")
        slots[int(key)] = sorted(set(steps))
    if not slots:
        raise EngineRejects("must contain at least one integer-string BS key")
    union = sorted({s for c in slots.values() for s in c})
    if num_steps is None:
        num_steps = union[len(union) // 2]
    if num_steps not in union:
        raise EngineRejects("--speculative-num-steps is not in the adaptive config candidate_steps")
    return {"slots": slots, "strategy": strategy, "num_steps": num_steps}


def sglang_adaptive_steps(parsed: dict, batch_size: int, cuda_graph_bs=None) -> int:
    """The steps the slot serving ``batch_size`` starts at (AdaptiveStepSlot.__init__ with
    initial_steps = --speculative-num-steps), after the router's CUDA-graph padding."""
    if cuda_graph_bs:
        graphs = sorted(cuda_graph_bs)
        i = bisect.bisect_left(graphs, batch_size)
        if i < len(graphs):
            batch_size = graphs[i]
    keys = sorted(parsed["slots"])
    cands = parsed["slots"][keys[max(0, bisect.bisect_right(keys, batch_size) - 1)]]
    n = parsed["num_steps"]
    return n if n in cands else cands[len(cands) // 2]
