"""vLLM: dynamic speculative decoding, ``num_speculative_tokens_per_batch_size``.

The exported file is the ``--speculative-config`` JSON object::

    {"method": "mtp", "num_speculative_tokens": w,
     "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 8, 3]]}

Each entry ``[bs_lo, bs_hi, K]`` holds for the inclusive batch-size range ``[bs_lo, bs_hi]``
(``vllm/v1/spec_decode/dynamic/utils.py``, ``validate_and_normalize_dynamic_sd_schedule`` and
``build_dynamic_sd_schedule_lookup``): integers, ``0 < bs_lo <= bs_hi``, ``K >= 0``, ranges
sorted and not overlapping, the first starting at 1; a gap between ranges and every batch size
past the last range take the previous range's ``K``; every ``K`` is clamped to
``num_speculative_tokens`` (which must be ``> 0``). speccal writes one range per decision key
(``(previous key, key]``), merging neighbours with the same ``K``, so the ranges cover
``1 .. largest key`` without gaps.

``K = 0`` is vLLM's "no draft tokens": the scheduler schedules none, but the proposer still runs
its first (prefill) forward to keep the drafter's KV cache in sync
(``vllm/v1/spec_decode/llm_base_proposer.py``, ``propose``); a ``K = 0`` step therefore costs
more than a plain decode step, which is why speccal prices it only from a measurement
(``--k0-ms``, measured in vLLM at ``K = 0``, or ``k = 0`` windows of the table). vLLM turns the
schedule off when data parallelism is on (``--data-parallel-size > 1``: each rank would pick its
own ``K``), so a table measured with ``dp > 1`` is refused.

speccal keys the schedule by logical batch size (``export`` scores every ``B = 1 .. largest
bucket``, each priced at its own ``G = pad(B * (k + 1))``), so a range may end inside a bucket.

:func:`caveats` lists what vLLM does with the schedule where that changes the decision (each
``{id, applies, changes, sources}``; docs/INTEROP.md): its batch size counts prefill chunks;
Model Runner V2, the default for dense models, ignores a ``K < w``; Model Runner V1 honours it
on PIECEWISE CUDA graphs; ``K = 0`` still runs one drafter forward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from speccal.base.errors import InputError
from speccal.interop.report import Rendered

ENGINE = "vllm"
FORMAT = "num_speculative_tokens_per_batch_size"
METHOD = "mtp"

#: The engine code this module matches (docs/INTEROP.md).
MATCHED = [
    {
        "repo": "vllm-project/vllm",
        "path": "vllm/v1/spec_decode/dynamic/utils.py",
        "functions": [
            "validate_and_normalize_dynamic_sd_schedule",
            "build_dynamic_sd_schedule_lookup",
        ],
        "commit": "a6f6bb1d3c1707ede85d03a7c7d47a105a1873fc",
    },
    {
        "repo": "vllm-project/vllm",
        "path": "vllm/config/speculative.py",
        "functions": ["SpeculativeConfig.num_speculative_tokens_per_batch_size"],
        "commit": "002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443",
    },
    {
        "repo": "vllm-project/vllm",
        "path": "vllm/v1/spec_decode/llm_base_proposer.py",
        "functions": ["SpecDecodeBaseProposer.propose (K = 0)"],
        "commit": "82720b1ed4712ddebb597acdbcff752db48a76c1",
    },
]

K0_MEANING = (
    "K = 0: the scheduler schedules no draft tokens, but the proposer still runs one drafter "
    "forward per step to keep the drafter KV cache in sync; batch sizes past the last range "
    "take the last range's K"
)


#: Selects the model runner (``vllm/envs.py``); ``0`` forces Model Runner V1.
MRV1_ENV = "VLLM_USE_V2_MODEL_RUNNER=0"


def caveats(schedule: list[list[int]], draft_width: int, k0_ms: bool) -> list[dict[str, Any]]:
    """vLLM's behaviours that change what the schedule does, each with ``applies`` for it.

    ``schedule``: the ``[[bs_lo, bs_hi, K], ...]`` entries written; ``k0_ms``: whether ``K = 0``
    was priced from ``--k0-ms``.
    """
    ks = {int(e[2]) for e in schedule}
    below = any(k < draft_width for k in ks)
    k0 = 0 in ks
    return [
        {
            "id": "batch_size_counts_prefill",
            "applies": True,
            "changes": "vLLM looks the schedule up at len(num_scheduled_tokens): every scheduled "
            "request, prefill chunks included; speccal's batch size counts decoding requests "
            "only, so a step that also schedules prefill chunks runs the K of a larger batch "
            "size than speccal priced",
            "sources": [
                "vllm/v1/core/sched/scheduler.py Scheduler.schedule: "
                "dynamic_sd_lookup[len(num_scheduled_tokens)]"
            ],
        },
        {
            "id": "mrv2_ignores_k",
            "applies": below,
            "changes": "Model Runner V2 (the default for dense models since vllm#44443) ignores "
            f"the scheduler's K for MTP / EAGLE (#51510; fixes #51575, #57053 open): every "
            f"step drafts num_speculative_tokens = {draft_width}, so the ranges with K < "
            f"{draft_width} do nothing there; run Model Runner V1 ({MRV1_ENV}) for the "
            "schedule to take effect",
            "sources": ["#44443", "#51510", "#51575", "#57053"],
        },
        {
            "id": "mrv1_piecewise",
            "applies": below,
            "changes": "Model Runner V1 honours the schedule but runs dynamic speculative "
            "decoding on PIECEWISE CUDA graphs: calibrate the table under the same graph mode, "
            "or its prices (and this schedule) are for graphs vLLM does not run",
            "sources": ["docs/features/speculative_decoding/dynamic_speculative_decoding.md"],
        },
        {
            "id": "k0_drafter_forward",
            "applies": k0,
            "changes": "K = 0 still runs one drafter forward a step (#49548, #53416: 4-11 % a "
            "step), so K = 0 is priced only from --k0-ms (a K = 0 step measured in vLLM)"
            + ("" if k0_ms else "; without --k0-ms K = 0 is never chosen"),
            "sources": ["#49548", "#53416", "vllm/v1/spec_decode/llm_base_proposer.py"],
        },
    ]


def entries(decisions: Mapping[int, int]) -> list[list[int]]:
    """``[[bs_lo, bs_hi, K], ...]`` from ``{Bcap: K}``: one range per bucket, equal neighbours
    merged."""
    out: list[list[int]] = []
    lo = 1
    for bcap in sorted(decisions):
        k = int(decisions[bcap])
        if out and out[-1][2] == k:
            out[-1][1] = bcap
        else:
            out.append([lo, bcap, k])
        lo = bcap + 1
    return out


def render(
    decisions: Mapping[int, int], draft_width: int, topology_dp: Any, k0_ms: bool = False
) -> Rendered:
    """The ``--speculative-config`` JSON for ``{B: K}`` decisions of a width-``w`` table (keys:
    batch sizes or buckets, each the last batch size of its range); ``k0_ms``: ``K = 0`` was
    priced from ``--k0-ms``."""
    if isinstance(topology_dp, int) and topology_dp > 1:
        raise InputError(
            "table.compatibility.topology.dp",
            topology_dp,
            "1 (vLLM disables num_speculative_tokens_per_batch_size under data parallelism)",
        )
    doc = {
        "method": METHOD,
        "num_speculative_tokens": int(draft_width),
        FORMAT: entries(decisions),
    }
    notes = [
        K0_MEANING,
        f"batch sizes above {max(decisions)} (the table's largest batch size) take K = "
        f"{doc[FORMAT][-1][2]} (vLLM carries the last range forward; speccal has no price "
        "there)",
        "merge these keys into your own --speculative-config (model, etc.); method 'mtp' "
        "assumes the target's own MTP head",
    ]
    return Rendered(
        engine=ENGINE,
        format=FORMAT,
        text=to_json(doc),
        document=doc,
        decisions={b: lookup(doc, b) for b in decisions},
        adjustments=[],
        notes=notes,
        caveats=caveats(doc[FORMAT], draft_width, k0_ms),
    )


def to_json(doc: Mapping[str, Any]) -> str:
    """The config as JSON, one key per line and each schedule entry on one line."""
    items = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in doc.items()]
    return "{\n" + ",\n".join(items) + "\n}\n"


def lookup(doc: Mapping[str, Any], batch_size: int) -> int:
    """The ``K`` vLLM runs at ``batch_size`` for this config (its dense-lookup rule)."""
    cap = int(doc["num_speculative_tokens"])
    k = None
    for lo, hi, kk in sorted(doc[FORMAT]):
        if lo <= batch_size:
            k = kk
        if lo <= batch_size <= hi:
            break
    if k is None:
        raise InputError("batch_size", batch_size, "a batch size >= 1")
    return min(cap, int(k))
