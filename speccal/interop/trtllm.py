"""TensorRT-LLM: ``draft_len_schedule`` of the speculative decoding config (PyTorch backend).

The exported file is YAML for ``trtllm-serve --extra_llm_api_options FILE`` (the LLM API's
options)::

    speculative_config:
      decoding_type: MTP
      max_draft_len: 3
      draft_len_schedule:
        2: 3
        8: 2

``draft_len_schedule`` maps batch sizes to draft lengths, read as "up to this key"
(``tensorrt_llm/_torch/speculative/utils.py``, ``get_draft_len_for_batch_size``: the value of
the first key ``>= batch size``; past the largest key the draft length is the implicit
``min_draft_len``, 0 for MTP-Eagle / Eagle3 one-model). Its validator
(``tensorrt_llm/llmapi/llm_args.py``, ``DecodingBaseConfig.validate_draft_len_schedule_and_sort``)
requires keys ``>= 1``, draft lengths ``>= 0`` and ``<= max_draft_len``, and the smallest key's
draft length equal to ``max_draft_len``; ``max_concurrency`` and ``draft_len_schedule`` are
mutually exclusive. speccal keys the schedule by request bucket (``(previous bucket, Bcap]``
runs ``Bcap``'s decision; TensorRT-LLM also adds every key to its CUDA-graph batch sizes,
``DecodeCudaGraphConfig._merge_schedule_keys``), merging neighbours with the same draft length
into the larger key. When a later bucket's best draft length exceeds the smallest bucket's, the
rule cannot express the decisions: speccal picks the ``max_draft_len`` (the smallest bucket's
value, later ones clamped to it) that loses the least predicted tokens/s, and the sidecar lists
every changed bucket.

Draft length 0 turns speculation off for that batch; MTP-Eagle and Eagle3 one-model keep the
drafter warm at 0 (no floor), other one-engine modes floor it at 1 (``min_runtime_draft_len``).
Vanilla MTP with more than one MTP module ignores ``draft_len_schedule``
(``update_spec_config_from_model_config``): use the MTP-Eagle path (one MTP module applied
``max_draft_len`` times, as speccal's draft head runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from speccal.base.errors import InputError
from speccal.interop.report import Rendered

ENGINE = "trtllm"
FORMAT = "draft_len_schedule"
DECODING_TYPE = "MTP"

MATCHED = [
    {
        "repo": "NVIDIA/TensorRT-LLM",
        "path": "tensorrt_llm/llmapi/llm_args.py",
        "functions": [
            "DecodingBaseConfig.draft_len_schedule",
            "DecodingBaseConfig.validate_draft_len_schedule_and_sort",
            "DecodingBaseConfig.validate_max_concurrency_and_draft_len_schedule_mutually_exclusive",
            "DecodeCudaGraphConfig._merge_schedule_keys",
        ],
        "commit": "0004396720054fd8e205cbf616f21f0b57c6b412",
    },
    {
        "repo": "NVIDIA/TensorRT-LLM",
        "path": "tensorrt_llm/_torch/speculative/utils.py",
        "functions": ["get_draft_len_for_batch_size", "update_spec_config_from_model_config"],
        "commit": "011d0933dcb5e592f5fa2626beaf42a96324c578",
    },
]

K0_MEANING = (
    "draft length 0: speculation off for that batch size (MTP-Eagle / Eagle3 one-model keep "
    "the drafter warm; other one-engine modes floor 0 at min_runtime_draft_len = 1); batch "
    "sizes above the largest key run the implicit 0"
)


def schedule(values: Mapping[int, int]) -> dict[int, int]:
    """``{key: draft_len}`` from ``{Bcap: k}``: equal neighbours merged into the larger key."""
    out: dict[int, int] = {}
    buckets = sorted(values)
    for i, b in enumerate(buckets):
        nxt = buckets[i + 1] if i + 1 < len(buckets) else None
        if nxt is None or values[nxt] != values[b]:
            out[b] = int(values[b])
    return out


def project(
    decisions: Mapping[int, int], tokens_per_s: Mapping[int, Mapping[int, float | None]]
) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """Decisions TensorRT-LLM can express (no later draft length above the smallest bucket's),
    losing the least mean relative tokens/s over the buckets; ``(values, changes)``."""
    buckets = sorted(decisions)
    first = buckets[0]
    if all(decisions[b] <= decisions[first] for b in buckets):
        return dict(decisions), []
    best = None
    for m in sorted({decisions[b] for b in buckets if decisions[b] > 0}):
        vals = {b: (m if b == first else min(decisions[b], m)) for b in buckets}
        loss = 0.0
        for b in buckets:
            top, got = tokens_per_s[b].get(decisions[b]), tokens_per_s[b].get(vals[b])
            if vals[b] == decisions[b]:
                continue
            if top is None or got is None:
                loss = float("inf")
                break
            loss += (top - got) / top
        if best is None or loss < best[0]:
            best = (loss, vals)
    vals = best[1]
    changes = [
        {
            "bcap": b,
            "best_k": int(decisions[b]),
            "exported_k": int(vals[b]),
            "tokens_per_s_lost_pct": None
            if tokens_per_s[b].get(vals[b]) is None
            else 100.0 * (1.0 - tokens_per_s[b][vals[b]] / tokens_per_s[b][decisions[b]]),
            "why": "draft_len_schedule[smallest key] must equal max_draft_len and bound every "
            "draft length",
        }
        for b in buckets
        if vals[b] != decisions[b]
    ]
    return vals, changes


def render(
    decisions: Mapping[int, int],
    tokens_per_s: Mapping[int, Mapping[int, float | None]],
    sidecar_name: str,
) -> Rendered:
    """The ``--extra_llm_api_options`` YAML for ``{Bcap: k}`` decisions."""
    vals, changes = project(decisions, tokens_per_s)
    sched = schedule(vals)
    max_draft_len = sched[min(sched)]
    if max_draft_len == 0:
        raise InputError(
            "schedule",
            dict(sorted(decisions.items())),
            "a draft length > 0 at some bucket (TensorRT-LLM takes max_draft_len from the "
            "smallest key; speculation pays nowhere here: serve without speculative decoding)",
        )
    doc = {
        "speculative_config": {
            "decoding_type": DECODING_TYPE,
            "max_draft_len": int(max_draft_len),
            FORMAT: sched,
        }
    }
    return Rendered(
        engine=ENGINE,
        format=FORMAT,
        text=to_yaml(doc, header=[f"written by speccal export; evidence: {sidecar_name}"]),
        document=doc,
        decisions={b: lookup(doc, b) for b in decisions},
        adjustments=changes,
        notes=[
            K0_MEANING,
            "use the MTP-Eagle path (one MTP module applied max_draft_len times): vanilla MTP "
            "with more than one module ignores draft_len_schedule",
            "draft_len_schedule excludes max_concurrency (mutually exclusive)",
        ],
    )


def lookup(doc: Mapping[str, Any], batch_size: int, min_draft_len: int = 0) -> int:
    """The draft length TensorRT-LLM runs at ``batch_size`` (first key ``>= batch_size``)."""
    sched = doc["speculative_config"][FORMAT]
    for key in sorted(sched):
        if key >= batch_size:
            return max(int(sched[key]), min_draft_len)
    return min_draft_len


def to_yaml(doc: Mapping[str, Any], header: Sequence[str] = (), indent: int = 0) -> str:
    """Block-style YAML of nested mappings of ints and plain strings (what this module writes)."""
    lines = [f"# {h}" for h in header] if indent == 0 else []
    pad = "  " * indent
    for key, value in doc.items():
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent=indent + 1).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {value}")
    return "\n".join(lines) + "\n"
