"""vLLM's per-request spec-decode stats -> :class:`~speccal.interop.acceptance.Acceptance`
(the ``vllm-requests`` format of ``speccal.interop.importers``, whose docstring describes the
shapes read: the merged ``metrics.speculative_decoding`` and the legacy per-choice
``speculative_decoding_stats``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.interop.acceptance import (
    MAX_ROWS,
    PROFILE_ROWS,
    Acceptance,
    from_draft_lengths,
    from_histogram,
)

BY_DRAFT_LENGTH = "acceptance_histogram_by_draft_length"

#: Where a response carries the per-request stats, and the histogram layout of each place.
SHAPE_MERGED = "metrics.speculative_decoding"
SHAPE_LEGACY = "choices[].speculative_decoding_stats"
SHAPES = {
    SHAPE_MERGED: "vLLM as merged (#48915, --per-request-spec-decode-metrics): top-level "
    "metrics.speculative_decoding, dense-list histograms",
    SHAPE_LEGACY: "pre-merge vLLM (--per-request-spec-decode-stats): per-choice "
    "speculative_decoding_stats, sparse {accepted: steps} histogram",
}


def _stats_objects(text: str, field: str) -> list[tuple[str, dict]]:
    """``(shape, stats)`` of every per-request stats object of a response / list / JSON-lines
    file: ``metrics.speculative_decoding`` (merged vLLM), ``speculative_decoding_stats``
    (legacy), or bare stats objects (shape by histogram layout: list merged, dict legacy)."""
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        docs = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{field}: line {n}", line[:60], f"JSON ({exc.msg})") from None
    out: list[tuple[str, dict]] = []

    def stats(shape: str, obj: Any) -> None:
        if obj is None:  # n > 1, or speculation off for the request
            return
        if not isinstance(obj, dict):
            raise InputError(f"{field}: {shape}", type(obj).__name__, "a stats object")
        out.append((shape, obj))

    def walk(obj: Any) -> None:
        if isinstance(obj, list):
            for x in obj:
                walk(x)
        elif isinstance(obj, dict):
            metrics = obj.get("metrics")
            if "acceptance_histogram" in obj and "num_spec_steps" in obj:
                layout = isinstance(obj["acceptance_histogram"], list)
                out.append((SHAPE_MERGED if layout else SHAPE_LEGACY, obj))
            elif isinstance(metrics, dict) and "speculative_decoding" in metrics:
                stats(SHAPE_MERGED, metrics["speculative_decoding"])
            elif "speculative_decoding_stats" in obj:
                stats(SHAPE_LEGACY, obj["speculative_decoding_stats"])
            else:
                for key in ("choices", "data"):
                    if key in obj:
                        walk(obj[key])

    walk(docs)
    if not out:
        raise InputError(
            field,
            "no metrics.speculative_decoding (nor legacy speculative_decoding_stats)",
            "responses of a vLLM server run with --per-request-spec-decode-metrics summary or "
            "detailed (metrics.speculative_decoding; n = 1 requests)",
        )
    shapes = sorted({shape for shape, _ in out})
    if len(shapes) > 1:
        raise InputError(field, shapes, "one shape per file (merged or legacy vLLM)")
    return out


def int_field(obj: dict, key: str, field: str, minimum: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{field}.{key}", v, f"an integer >= {minimum}")
    return v


def _dense(raw: Any, w: int, field: str, length: int | None = None) -> np.ndarray:
    """A dense ``[w + 1]`` count list (index = accepted drafts); a shorter list of ``length``
    entries is zero-padded."""
    n = w + 1 if length is None else length
    if not isinstance(raw, list) or len(raw) not in {n, w + 1}:
        raise InputError(
            field,
            raw if not isinstance(raw, list) else f"{len(raw)} entries",
            f"a dense list of {w + 1} step counts (index j = j drafts accepted)",
        )
    for j, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(f"{field}[{j}]", v, "an integer >= 0")
    out = np.zeros(w + 1, dtype=np.int64)
    out[: len(raw)] = raw
    return out


def _sparse(raw: Any, w: int, field: str) -> np.ndarray:
    if not isinstance(raw, dict):
        raise InputError(field, raw, "an object {accepted: steps}")
    hist = np.zeros(w + 1, dtype=np.int64)
    for key, count in raw.items():
        if not str(key).isdigit() or int(key) > w:
            raise InputError(field, key, f"keys 0..num_spec_tokens={w} (accepted)")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InputError(f"{field}[{key}]", count, "an integer >= 0")
        hist[int(key)] += count
    return hist


def _by_draft_length(raw: Any, w: int, field: str) -> np.ndarray:
    """``counts[d, a]`` from ``acceptance_histogram_by_draft_length``: a list indexed by draft
    length ``d = 0..w`` (or an object keyed by it) of dense histograms (``d + 1`` or ``w + 1``
    entries; none above ``d``)."""
    if isinstance(raw, list):
        if len(raw) != w + 1:
            raise InputError(field, f"{len(raw)} entries", f"one histogram per draft length 0..{w}")
        items = list(enumerate(raw))
    elif isinstance(raw, dict):
        items = []
        for key, v in raw.items():
            if not str(key).isdigit() or int(key) > w:
                raise InputError(field, key, f"draft lengths 0..num_spec_tokens={w}")
            items.append((int(key), v))
    else:
        raise InputError(field, raw, "a list (or object) of histograms by draft length")
    counts = np.zeros((w + 1, w + 1), dtype=np.int64)
    for d, h in items:
        if h is None:
            continue
        row = _dense(h, w, f"{field}[{d}]", length=d + 1)
        if row[d + 1 :].any():
            a = int(np.flatnonzero(row[d + 1 :])[0]) + d + 1
            raise InputError(
                f"{field}[{d}][{a}]", int(row[a]), f"0 (a step that drafted {d} accepts <= {d})"
            )
        counts[d] += row
    return counts


def _request_stats(shape: str, s: dict, w: int | None, f: str) -> dict[str, Any]:
    """One request's stats, checked: ``w``, ``hist``, ``counts`` (``[d, a]``, None when only
    full-width steps) and ``steps`` (per-step accepted in order, None without detailed)."""
    k = int_field(s, "num_spec_tokens", f, 1)
    if w is not None and k != w:
        raise InputError(f"{f}.num_spec_tokens", k, f"the first request's {w}")
    w = k
    if shape == SHAPE_MERGED:
        hist = _dense(s.get("acceptance_histogram"), w, f"{f}.acceptance_histogram")
    else:
        hist = _sparse(s.get("acceptance_histogram"), w, f"{f}.acceptance_histogram")
    steps = int_field(s, "num_spec_steps", f)
    if steps != int(hist.sum()):
        raise InputError(f"{f}.num_spec_steps", steps, f"the histogram's {int(hist.sum())}")
    acc = int_field(s, "num_accepted_draft_tokens", f)
    tokens = int_field(s, "num_draft_tokens", f)
    if acc != int((hist * np.arange(w + 1)).sum()):
        raise InputError(
            f"{f}.num_accepted_draft_tokens",
            acc,
            f"the histogram's accepted drafts ({int((hist * np.arange(w + 1)).sum())})",
        )
    if acc > tokens:
        raise InputError(
            f"{f}.num_accepted_draft_tokens",
            acc,
            f"<= num_draft_tokens = {tokens} (accepted > drafted)",
        )
    counts = None
    if shape == SHAPE_MERGED and s.get(BY_DRAFT_LENGTH) is not None:
        counts = _by_draft_length(s[BY_DRAFT_LENGTH], w, f"{f}.{BY_DRAFT_LENGTH}")
        if not (counts.sum(axis=0) == hist).all():
            raise InputError(
                f"{f}.{BY_DRAFT_LENGTH}",
                counts.sum(axis=0).tolist(),
                f"summed over draft lengths, acceptance_histogram {hist.tolist()}",
            )
        drafted = int((counts.sum(axis=1) * np.arange(w + 1)).sum())
        if drafted != tokens:
            raise InputError(
                f"{f}.num_draft_tokens", tokens, f"the drafts {BY_DRAFT_LENGTH} counts ({drafted})"
            )
    rows = None
    if "per_step_accepted" in s:
        pa, pd_ = s.get("per_step_accepted"), s.get("per_step_drafted")
        if not isinstance(pa, list) or not isinstance(pd_, list) or len(pa) != steps:
            raise InputError(
                f"{f}.per_step_accepted",
                None if not isinstance(pa, list) else f"{len(pa)} steps",
                f"{steps} steps (num_spec_steps), with per_step_drafted beside it",
            )
        try:
            arr = np.asarray(pa, dtype=np.int64).reshape(-1)
            dr = np.asarray(pd_, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            raise InputError(f"{f}.per_step_accepted", pa[:8], "integers") from None
        if shape == SHAPE_LEGACY and (dr.shape != arr.shape or (dr != w).any()):
            raise InputError(
                f"{f}.per_step_drafted", pd_[:8], f"{w} (full width) at every step (legacy shape)"
            )
        if dr.shape != arr.shape or (dr < 0).any() or (dr > w).any():
            raise InputError(f"{f}.per_step_drafted", pd_[:8], f"one draft length 0..{w} per step")
        if (arr > dr).any() or (arr < 0).any():
            j = int(np.flatnonzero((arr > dr) | (arr < 0))[0])
            raise InputError(
                f"{f}.per_step_accepted[{j}]", int(arr[j]), f"0..per_step_drafted ({int(dr[j])})"
            )
        if not (np.bincount(arr, minlength=w + 1) == hist).all():
            raise InputError(
                f"{f}.per_step_accepted", pa[:8], "the steps acceptance_histogram counts"
            )
        if int(dr.sum()) != tokens:
            raise InputError(
                f"{f}.num_draft_tokens", tokens, f"the sum of per_step_drafted ({int(dr.sum())})"
            )
        pairs = np.zeros((w + 1, w + 1), dtype=np.int64)
        np.add.at(pairs, (dr, arr), 1)
        if counts is not None and not (pairs == counts).all():
            raise InputError(
                f"{f}.per_step_drafted", pd_[:8], f"the steps {BY_DRAFT_LENGTH} counts"
            )
        counts = pairs
        rows = arr
    full = tokens == steps * w
    if counts is not None and not counts[:w].any():
        counts = None  # every step drafted w: the exact full-width path
    if counts is None and not full:
        hint = (
            f"serve with --per-request-spec-decode-metrics detailed, or a vLLM that reports "
            f"{BY_DRAFT_LENGTH}, so speccal can tell which positions were verified"
            if shape == SHAPE_MERGED
            else "the legacy shape has no draft lengths: import acceptance measured at a "
            "fixed K, or the merged shape (metrics.speculative_decoding)"
        )
        raise InputError(
            f"{f}.num_draft_tokens",
            tokens,
            f"steps x draft width = {steps} x {w} = {steps * w} (full-width steps), or draft "
            f"lengths ({BY_DRAFT_LENGTH} or per_step_drafted)",
            hint=hint,
        )
    if counts is None:
        counts_full = np.zeros((w + 1, w + 1), dtype=np.int64)
        counts_full[w] = hist
    else:
        counts_full = counts
    variable = counts is not None
    return {
        "w": w,
        "hist": hist,
        "counts": counts_full,
        "variable": variable,
        "rows": None if variable else rows,
    }


def vllm_requests(
    text: str,
    *,
    source: dict[str, Any] | None = None,
    max_rows: int = MAX_ROWS,
    seed: int = 0,
) -> Acceptance:
    """vLLM per-request spec-decode stats -> Acceptance (see module docstring).

    Full-width steps only: exact (every step in order with ``detailed``, else the pooled
    histogram). Steps of several draft lengths (a dynamic-K schedule; merged shape only): the
    product-limit estimate over the pooled ``counts[d, a]``
    (:func:`~speccal.interop.acceptance.from_draft_lengths`).
    """
    field = "vllm-requests"
    objs = _stats_objects(text, field)
    shape = objs[0][0]
    w = None
    parsed = []
    for i, (_, s) in enumerate(objs):
        r = _request_stats(shape, s, w, f"{field}[{i}]")
        w = r["w"]
        parsed.append(r)
    assert w is not None
    src = {
        **(source or {}),
        "engine": "vllm",
        "shape": shape,
        "shape_read": SHAPES[shape],
        "requests": len(parsed),
    }
    counts = sum(r["counts"] for r in parsed)
    if int(counts.sum()) == 0:
        raise InputError(field, "0 steps", "at least one speculative step")
    if any(r["variable"] for r in parsed):
        rows = min(max_rows, max(PROFILE_ROWS, int(counts.sum())))
        return from_draft_lengths(
            counts,
            source={**src, "detailed": False, "draft_lengths": "variable"},
            rows=rows,
            seed=seed,
            field=f"{field}.{BY_DRAFT_LENGTH}",
        )
    src["draft_lengths"] = "full width"
    steps_per_request = [r["rows"] for r in parsed]
    if all(a is not None for a in steps_per_request):
        # Detailed stats: every step in order, requests interleaved as concurrent decoding
        # runs them (step s of every live request, then step s + 1).
        longest = max(a.size for a in steps_per_request)
        grid = np.full((len(parsed), longest), -1, dtype=np.int64)
        for r, a in enumerate(steps_per_request):
            grid[r, : a.size] = a
        rows = grid.T.reshape(-1)
        rows = rows[rows >= 0]
        return Acceptance(draft_width=w, accepted=rows, source={**src, "detailed": True})
    hist_total = sum(r["hist"] for r in parsed)
    return from_histogram(
        hist_total, source={**src, "detailed": False}, max_rows=max_rows, seed=seed
    )
