"""``speccal export``: a cost table (+ measured acceptance) -> an engine's file + its sidecar.

Steps (docs/INTEROP.md):

1. load the table (``speccal.costmodel.table.load_table``) and the acceptance: a round trace
   (``--trace``, full width), or a profile (``--profile``: an engine file read by
   ``speccal.interop.importers``, or ``marginal:p1,p2,...`` / ``conditional:q1,q2,...``);
2. score every request bucket (``speccal.interop.schedule``): tokens/s of every ``k``, the best;
   for vLLM also every logical batch size ``B = 1 .. largest bucket`` (its schedule is keyed by
   batch size: the best ``k`` per ``B``, merged into ranges, with evidence per range and the
   gain over running each bucket's ``k`` at all its batch sizes);
3. render the engine's file (``vllm``, ``trtllm``, ``sglang-adaptive``: the schedule, from a
   ``draft_step`` table; ``sglang``: the table itself, from a ``target_verify`` table) and price the whole workload
   under what the file makes the engine run vs every single fixed ``k``: the trace's own rounds,
   or, for a profile, the same number of rounds at every bucket;
4. write the file and its sidecar (``speccal.interop.report``), both atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speccal.base.atomic import read_bytes, write_json_atomic, write_text_atomic
from speccal.base.errors import InputError
from speccal.costmodel.table import load_table
from speccal.interop import sglang, sglang_adaptive, trtllm, vllm
from speccal.interop.acceptance import from_prefix
from speccal.interop.importers import FORMATS, read_acceptance
from speccal.interop.pricing import heldout, pricing_block
from speccal.interop.report import Rendered, bucket_rows, sidecar
from speccal.interop.schedule import (
    compare_per_bucket,
    equal_time_workload,
    parse_k0_ms,
    per_bucket_k,
    ranges,
    rebatch,
    score_batch_sizes,
    score_buckets,
    workload_runs,
    zero_cost,
)
from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.trace import RoundTrace, load_trace

ENGINES = ("vllm", "trtllm", "sglang", "sglang-adaptive")
_MODULES = {"vllm": vllm, "trtllm": trtllm, "sglang": sglang, "sglang-adaptive": sglang_adaptive}
#: The table mode each engine's file describes.
ENGINE_MODE = {
    "vllm": "draft_step",
    "trtllm": "draft_step",
    "sglang": "target_verify",
    "sglang-adaptive": "draft_step",
}
#: The kinds of an inline ``--profile KIND:r1,r2,...``.
INLINE_KINDS = ("marginal", "conditional")
#: What ``--profile`` takes (its help and its refusal).
PROFILE_FORMS = (
    "an engine file (vLLM /metrics scrape, vLLM per-request stats, speculation_profile.json, "
    "CSV of accepted lengths), marginal:p1,p2,... or conditional:q1,q2,..."
)


@dataclass(frozen=True)
class ExportRequest:
    """What to export (the CLI's options)."""

    table: Path
    engine: str
    out: Path
    trace: Path | None = None
    profile: str | None = None
    profile_format: str = "auto"
    k0_ms: str | None = None
    num_requests: int | None = None
    kv_length: float | None = None
    sidecar: Path | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InputError("--to", self.engine, " or ".join(ENGINES))
        if self.trace is not None and self.profile is not None:
            raise InputError(
                "--trace/--profile", f"{self.trace} and {self.profile}", "at most one of them"
            )
        if self.profile_format not in ("auto", *FORMATS):
            raise InputError("--format", self.profile_format, f"auto or {', '.join(FORMATS)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise InputError("--num-requests", self.num_requests, "an integer >= 1")
        if self.kv_length is not None and not self.kv_length >= 0:
            raise InputError("--kv-length", self.kv_length, "a number >= 0")
        if self.sidecar_path == self.out:
            raise InputError("--sidecar", str(self.sidecar_path), "a path other than --out")

    @property
    def sidecar_path(self) -> Path:
        return self.sidecar if self.sidecar is not None else sidecar_path(self.out)


def sidecar_path(out: Path) -> Path:
    """``OUT`` with the suffix ``.speccal.json`` (``vllm.json`` -> ``vllm.speccal.json``)."""
    return (
        out.with_suffix(".speccal.json")
        if out.suffix
        else out.with_name(out.name + ".speccal.json")
    )


@dataclass(frozen=True, eq=False)
class ExportResult:
    out: Path
    sidecar: Path
    rendered: Rendered
    report: dict[str, Any]


def check_profile(text: str | None) -> None:
    """Refuse a ``--profile`` that is neither a file nor an inline profile, naming the forms
    and a hint (an inline profile's rates are checked when it is read)."""
    if text is None or os.path.exists(text):
        return
    head, sep, rest = text.partition(":")
    if head in INLINE_KINDS and rest.strip():
        return
    if sep and head in INLINE_KINDS:
        hint = f"{head}: needs its rates, one per position"
    elif sep and head.isidentifier():
        hint = f"no profile kind {head!r}; the kinds are {' and '.join(INLINE_KINDS)}"
    elif _numbers(text):
        hint = f"name the rates' kind: marginal:{text} (prefix acceptance) or conditional:{text}"
    else:
        hint = "no such file"
    raise InputError("--profile", text, PROFILE_FORMS, hint=hint)


def _numbers(text: str) -> bool:
    try:
        return all(float(x) >= 0 for x in text.split(","))
    except ValueError:
        return False


def _inline_profile(text: str, kind: str) -> np.ndarray:
    try:
        vals = np.array([float(x) for x in text.split(",") if x.strip()])
    except ValueError:
        raise InputError("--profile", f"{kind}:{text}", "comma-separated rates") from None
    if vals.size == 0 or not np.isfinite(vals).all() or (vals < 0).any() or (vals > 1).any():
        raise InputError("--profile", f"{kind}:{text}", "rates in [0, 1], one per position")
    return vals if kind == "marginal" else np.cumprod(vals)


def acceptance_trace(req: ExportRequest, table: Any) -> tuple[RoundTrace, dict[str, Any]] | None:
    """The acceptance as a round trace, and its sidecar block (None without acceptance)."""
    buckets = table.geometry().request_buckets
    kv = req.kv_length if req.kv_length is not None else float(table.fits[0].prefill_tokens)
    b = req.num_requests or int(buckets[-1])
    if req.trace is not None:
        tr = load_trace(req.trace)
        if not isinstance(tr, RoundTrace):
            raise InputError(
                "--trace",
                str(req.trace),
                "a round trace (kind rounds)",
                hint="speccal trace --kind tokens --rounds-out writes one next to the matrix",
            )
        kind, path = "trace", str(req.trace)
    elif req.profile is not None:
        head, _, rest = req.profile.partition(":")
        if head in ("marginal", "conditional") and rest:
            acc = from_prefix(
                _inline_profile(rest, head),
                source={"format": f"inline {head}", "text": req.profile},
                field="--profile",
            )
        else:
            acc = read_acceptance(req.profile, req.profile_format, field="--profile")
        tr = acc.to_trace(b, kv)
        kind, path = "profile", req.profile
    else:
        return None
    prefix = tr.survival_counts().sum(axis=0) / tr.accepted.size
    return tr, {
        "kind": kind,
        "path": path,
        "draft_width": tr.draft_width,
        "rounds": tr.num_rounds,
        "requests": int(tr.accepted.size),
        "kv_length": [float(tr.kv_length.min()), float(tr.kv_length.max())],
        "prefix_acceptance": prefix.tolist(),
        "source": tr.meta.get("source"),
        "meta": tr.meta,
    }


def equal_rounds(trace: RoundTrace, buckets: list[int]) -> RoundTrace:
    """The same number of rounds at every bucket (a profile has no batch sizes of its own)."""
    parts = [rebatch(trace, b) for b in buckets]
    r = min(p.num_rounds for p in parts)
    cut = [
        (p.num_requests[:r], p.kv_length[:r], p.accepted[: r * b])
        for p, b in zip(parts, buckets, strict=True)
    ]
    return RoundTrace(
        draft_width=trace.draft_width,
        num_requests=np.concatenate([c[0] for c in cut]),
        kv_length=np.concatenate([c[1] for c in cut]),
        k=np.full(r * len(buckets), trace.draft_width, dtype=np.int64),
        accepted=np.concatenate([c[2] for c in cut]),
        meta={**trace.meta, "workload": f"{r} rounds at each bucket {buckets}"},
    )


def run_export(req: ExportRequest) -> ExportResult:
    """Export ``req.table`` to ``req.engine`` (see module docstring); writes two files."""
    table_bytes = read_bytes(req.table, "table")
    table = load_table(req.table)
    engine = _MODULES[req.engine]
    need = ENGINE_MODE[req.engine]
    if table.mode != need:
        other = "sglang" if need == "draft_step" else "vllm, trtllm or sglang-adaptive"
        raise InputError(
            "table.mode",
            table.mode,
            f"{need} for --to {req.engine}",
            hint=f"calibrate with --mode {need}, or export this table --to {other}",
        )
    k0 = parse_k0_ms(req.k0_ms, tuple(table.geometry().request_buckets))
    # vLLM's K = 0 step runs a drafter forward speccal's k = 0 windows do not: --k0-ms only
    zero = zero_cost(table, k0, table_k0=req.engine != "vllm")
    cost = CostModel.from_table(table)
    acc = acceptance_trace(req, table)
    if acc is None and req.engine != "sglang":
        raise InputError(
            "--trace/--profile", None, f"the acceptance to schedule for (--to {req.engine})"
        )
    scores = []
    workload_trace = None
    if acc is not None:
        trace, _ = acc
        scores = score_buckets(cost, trace, zero)
        buckets = [s.bcap for s in scores]
        # a profile has no batch sizes: equal rounds per bucket for the replayed (sglang) workload
        workload_trace = trace if req.trace is not None else equal_rounds(trace, buckets)
    held = heldout(table)
    sidecar_file = req.sidecar_path
    workload = speccal_workload = None
    range_rows = per_bucket = None
    if req.engine == "sglang":
        kv = req.kv_length
        if kv is None:
            kv = float(np.mean(acc[0].kv_length)) if acc else float(table.fits[0].prefill_tokens)
        rendered = sglang.render(table, kv, sidecar_file.name)
        priced_kv: float | tuple[float, float] = kv
        if workload_trace is not None:
            workload = _verify_workload(workload_trace, cost)
    else:
        kvs = acc[0].kv_length
        priced_kv = (float(np.min(kvs)), float(np.max(kvs)))
        decisions = {s.bcap: s.best_k for s in scores}
        by_batch = req.engine == "vllm"
        if by_batch:
            batch_scores = score_batch_sizes(cost, trace, zero)
            bucket_k = per_bucket_k(cost, decisions, len(batch_scores))
            decisions = {s.bcap: s.best_k for s in batch_scores}
            rendered = vllm.render(
                decisions, table.draft_width, table.compatibility.topology.dp, k0_ms=bool(k0)
            )
            range_rows = ranges(cost, batch_scores, rendered.decisions)
            per_bucket = compare_per_bucket(batch_scores, rendered.decisions, bucket_k)
        elif req.engine == "sglang-adaptive":
            rendered = sglang_adaptive.render(decisions, table.compatibility.topology.dp)
        else:
            rendered = trtllm.render(
                decisions, {s.bcap: s.tokens_per_s for s in scores}, sidecar_file.name
            )
        if req.trace is not None:
            workload = workload_runs(
                workload_trace, cost, rendered.decisions, zero, per_batch_size=by_batch
            )
            if rendered.decisions != decisions:
                speccal_workload = workload_runs(
                    workload_trace, cost, decisions, zero, per_batch_size=by_batch
                )
        else:
            workload = equal_time_workload(scores, rendered.decisions)
            if rendered.decisions != decisions:
                speccal_workload = equal_time_workload(scores, decisions)
    text = rendered.text
    report = sidecar(
        rendered=rendered,
        file_name=req.out.name,
        file_bytes=text.encode("utf-8"),
        table=table,
        table_path=str(req.table),
        table_bytes=table_bytes,
        acceptance=None if acc is None else acc[1],
        buckets=bucket_rows(scores, rendered.decisions, held["pct"]),
        workload=workload,
        speccal_workload=speccal_workload,
        matched=engine.MATCHED,
        k0_meaning=engine.K0_MEANING,
        heldout_block=held,
        pricing=pricing_block(table, priced_kv),
        ranges=range_rows,
        per_bucket=per_bucket,
    )
    write_text_atomic(req.out, text, field="--out")
    write_json_atomic(sidecar_file, report, field="--sidecar")
    return ExportResult(out=req.out, sidecar=sidecar_file, rendered=rendered, report=report)


def _verify_workload(trace: RoundTrace, cost: CostModel) -> dict[str, Any]:
    """The budget planner's analogue (speccal adaptive-verify) vs every fixed verify budget."""
    policies = ("adaptive-verify",) if trace.draft_scores is not None else ()
    d = replay(trace, cost, ReplayConfig(policies=policies)).to_dict()
    fixed = {p["name"]: p.get("tokens_per_s") for p in d["policies"] if p["kind"] == "fixed"}
    out = {
        "rounds": d["rounds"],
        "best_fixed": d["best_fixed"],
        "fixed_tokens_per_s": fixed,
        "adaptive_policy": policies[0] if policies else None,
        "adaptive_tokens_per_s": None,
        "adaptive_gain_vs_best_fixed_pct": None,
    }
    for p in d["policies"]:
        if p["name"] == "adaptive-verify":
            out["adaptive_tokens_per_s"] = p.get("tokens_per_s")
            out["adaptive_gain_vs_best_fixed_pct"] = p.get("gain_vs_best_fixed_pct")
    if not policies:
        out["note"] = "the acceptance has no per-request draft scores: no adaptive-verify replay"
    return out
