"""SGLang: the EAGLE / MTP adaptive-steps config (``--speculative-adaptive-config``).

SGLang's adaptive speculative decoding (``--speculative-adaptive``; EAGLE / EAGLE3 with
``topk = 1``) reads one JSON object (``python/sglang/srt/speculative/adaptive_spec_params.py``,
``_load_adaptive_config``)::

    {"strategy": "ema",
     "1": {"candidate_steps": [3]}, "3": {"candidate_steps": [2]}, "5": {"candidate_steps": [1]}}

Every key made of digits is a batch-size slot and must hold ``candidate_steps``, a non-empty
list of integers ``>= 0`` (draft forwards per step; ``0`` turns drafting off); other keys are
top-level knobs merged into every slot (``strategy``: ``ema`` or ``throughput_aware``; the EMA
controller's ``ema_alpha``, ``update_interval``, ``warmup_batches``, ``up_hysteresis``,
``down_hysteresis``, ``ceiling_coeff``). A batch of ``b`` requests is padded up to the next
captured CUDA-graph batch size, then served by the slot with the largest key ``<=`` that size
(the smallest slot below every key; ``adaptive_step_router.py``,
``AdaptiveStepRouter.batch_size_key_for_batch``): keys are lower bounds. Within its slot the EMA
controller moves between the candidates as acceptance moves; ``--speculative-num-steps`` must
be one of the union of candidates (default: its middle element).

speccal writes one slot per request bucket, keyed by the first batch size the bucket serves
(``previous bucket + 1``), with the bucket's best ``k`` as its only candidate, so the controller
holds the step count speccal priced (equal neighbours merged into the smaller key). With
CUDA graphs captured at speccal's buckets, padding lands in the same slot; batch sizes past the
largest bucket keep the last slot's ``k``. This needs a ``draft_step`` table (points at
``G = Bcap * (k + 1)``: ``k`` draft forwards priced directly, which is what a step count per
batch size runs); a ``target_verify`` table prices trimmed verify budgets with the draft at full
width (SGLang's DSpark planner: ``--to sglang``) and is refused. ``k = 0`` is priced only from a
measurement, as for vLLM.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from typing import Any

from speccal.base.errors import InputError
from speccal.interop.report import Rendered

ENGINE = "sglang"
FORMAT = "speculative_adaptive_config"
STRATEGY = "ema"

MATCHED = [
    {
        "repo": "sgl-project/sglang",
        "path": "python/sglang/srt/speculative/adaptive_spec_params.py",
        "functions": [
            "_load_adaptive_config",
            "resolve_adaptive_strategy",
            "resolve_candidate_steps_from_config",
            "AdaptiveStepSlot.__init__",
            "AdaptiveSpeculativeParams._route",
            "adaptive_unsupported_reason",
        ],
        "commit": "015c872628e328b530880bcf95ae91222604b225",
    },
    {
        "repo": "sgl-project/sglang",
        "path": "python/sglang/srt/speculative/adaptive_step_router.py",
        "functions": ["AdaptiveStepRouter.batch_size_key_for_batch"],
        "commit": "a12239f6ac74d804d169ee5d3cfed3c49fa7162c",
    },
]

K0_MEANING = (
    "0 steps: the slot's batches run without drafting (SGLang's zero-step candidate); batch "
    "sizes above the largest key keep the last slot's steps"
)


def slots(decisions: Mapping[int, int]) -> dict[int, int]:
    """``{lower-bound batch size: steps}`` from ``{Bcap: k}``: a slot per bucket at
    ``previous bucket + 1``, equal neighbours merged into the smaller key."""
    out: dict[int, int] = {}
    prev = 0
    last = None
    for bcap in sorted(decisions):
        k = int(decisions[bcap])
        if k != last:
            out[prev + 1] = k
            last = k
        prev = bcap
    return out


def render(decisions: Mapping[int, int], topology_dp: Any) -> Rendered:
    """The ``--speculative-adaptive-config`` JSON for ``{Bcap: k}`` decisions."""
    if isinstance(topology_dp, int) and topology_dp > 1:
        raise InputError(
            "table.compatibility.topology.dp",
            topology_dp,
            "1 (SGLang's adaptive steps are not synchronized across DP ranks)",
        )
    if not decisions or all(int(k) == 0 for k in decisions.values()):
        raise InputError(
            "schedule",
            dict(sorted(decisions.items())),
            "steps > 0 at some bucket (speculation pays nowhere here: serve without "
            "speculative decoding)",
        )
    table = slots(decisions)
    doc: dict[str, Any] = {"strategy": STRATEGY}
    for key, k in table.items():
        doc[str(key)] = {"candidate_steps": [k]}
    union = sorted(set(table.values()))
    notes = [
        K0_MEANING,
        "serve with --speculative-adaptive --speculative-adaptive-config FILE "
        "(--speculative-algorithm EAGLE or EAGLE3, --speculative-eagle-topk 1); "
        f"--speculative-num-steps, if given, must be one of {union}",
        "SGLang falls back to static steps (with a warning) under attention DP, multi-layer "
        "EAGLE, two-batch overlap or pdmux",
        "one candidate per slot: the EMA controller holds the step count speccal priced; "
        "a batch is padded to its CUDA-graph batch size before the slot is chosen, so capture "
        "graphs at the table's buckets",
        f"batch sizes above {max(decisions)} (the table's largest bucket) keep "
        f"{table[max(table)]} steps (speccal has no price there)",
    ]
    return Rendered(
        engine=ENGINE,
        format=FORMAT,
        text=to_json(doc),
        document=doc,
        decisions={b: lookup(doc, b, sorted(decisions)) for b in decisions},
        adjustments=[],
        notes=notes,
    )


def to_json(doc: Mapping[str, Any]) -> str:
    """The config as JSON, one key (slot) per line."""
    items = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in doc.items()]
    return "{\n" + ",\n".join(items) + "\n}\n"


def lookup(doc: Mapping[str, Any], batch_size: int, cuda_graph_bs: Sequence[int] = ()) -> int:
    """The steps SGLang runs at ``batch_size``: padded to a CUDA-graph size, then the slot with
    the largest key ``<=`` it (the smallest slot below every key); its only candidate."""
    keys = sorted(int(k) for k in doc if str(k).isdigit())
    graphs = sorted(cuda_graph_bs)
    b = batch_size
    i = bisect.bisect_left(graphs, b)
    if i < len(graphs):
        b = graphs[i]
    key = keys[max(0, bisect.bisect_right(keys, b) - 1)]
    steps = sorted(set(doc[str(key)]["candidate_steps"]))
    return int(steps[len(steps) // 2]) if len(steps) > 1 else int(steps[0])
