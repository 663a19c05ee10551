"""Acceptance measured in other engines -> :class:`~speccal.interop.acceptance.Acceptance`.

Formats (docs/INTEROP.md cites the engine code each rule is read from):

- ``vllm-metrics``: a scrape of vLLM's ``/metrics`` (Prometheus text). Counters
  ``vllm:spec_decode_num_drafts`` (speculative steps), ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos{position="i"}`` (steps
  whose first ``i + 1`` drafts were all accepted; ``SpecDecodingStats.observe_draft``), each
  served with the ``_total`` suffix. The per-position counters are survival counts, so the
  histogram of accepted lengths is exact: ``n_j = c_{j-1} - c_j`` (``c_{-1}`` = drafts,
  ``c_w = 0``). Series of several engines (DP ranks) are summed; several ``model_name`` values
  need ``model_name``. ``since`` (an earlier scrape) is subtracted, so a window of serving can
  be imported.
- ``vllm-requests``: vLLM's per-request spec-decode stats: a response, a list of responses or
  JSON lines, or the stats objects themselves. Merged vLLM (#48915, ``--per-request-spec-decode-
  metrics summary|detailed``) puts them at the response's top-level ``metrics.
  speculative_decoding``: ``acceptance_histogram`` a dense list (index = accepted drafts),
  ``acceptance_histogram_by_draft_length`` one such list per draft length, ``detailed`` adds
  ``per_step_accepted`` / ``per_step_drafted`` in order. The legacy (pre-merge) shape, per-choice
  ``speculative_decoding_stats`` with a sparse ``{accepted: steps}`` histogram
  (``--per-request-spec-decode-stats``), is still read, full width only; the source's
  ``shape`` says which was read. Full-width steps are exact; steps of several draft lengths (a
  dynamic-K schedule) are estimated per position from the by-draft-length counts
  (``speccal.interop.acceptance.prefix_from_draft_lengths``, product-limit).
- ``profile``: a ``speculation_profile.json`` (NVIDIA Model Optimizer's specdec_bench):
  ``acceptance_length_histogram`` (keyed by acceptance *length*, bonus token included: length
  ``L`` = ``L - 1`` drafts accepted) when present, else ``marginal_accept_rates`` (prefix
  acceptance), else ``conditional_accept_rates``.
- ``csv``: one row per (request, step): ``accepted`` (required), ``drafted``, ``round``,
  ``kv_length``, ``request`` (optional).

Every other format must describe full-width steps (``num_draft_tokens == steps * w``): counts
of shortened drafts (dynamic K, structured-output truncation) are censored past the short
draft and are refused, as ``speccal replay`` refuses ``k < w`` rounds; a ``/metrics`` scrape of
a dynamic-K deployment is refused with a message naming the per-request route. A bad file is one
``InputError`` naming the field, the value and what was expected.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from speccal.base.atomic import read_text
from speccal.base.errors import InputError
from speccal.interop.acceptance import (
    MAX_ROWS,
    PROFILE_ROWS,
    Acceptance,
    from_draft_lengths,
    from_histogram,
    from_prefix,
    histogram_from_survival,
)
from speccal.interop.prometheus import Sample, counter_samples, parse_exposition

FORMATS = ("vllm-metrics", "vllm-requests", "profile", "csv")

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: vLLM per-request stats: accepted-draft histograms per draft length (dynamic K).
BY_DRAFT_LENGTH = "acceptance_histogram_by_draft_length"
#: Labels that tell engines (ranks) of one model apart; their series are summed.
ENGINE_LABELS = ("engine",)
#: speculation_profile.json schema major version this reader knows.
PROFILE_SCHEMA_MAJOR = 1


def detect_format(path: Path, text: str) -> str:
    """The format of a file: by suffix (``.csv``, ``.prom``/``.txt``), else by content."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".prom", ".txt", ".metrics"):
        return "vllm-metrics"
    head = text.lstrip()[:1]
    if head in ("{", "["):
        if "speculative_decoding_stats" in text or '"acceptance_histogram"' in text:
            return "vllm-requests"
        return "profile"
    if "spec_decode_num_drafts" in text:
        return "vllm-metrics"
    raise InputError(
        "acceptance file",
        str(path),
        f"one of the formats {', '.join(FORMATS)} (or pass the format)",
        hint="name it .csv or .prom, or give --format",
    )


def read_acceptance(
    path: str | os.PathLike,
    fmt: str = "auto",
    *,
    draft_width: int | None = None,
    since: str | os.PathLike | None = None,
    model_name: str | None = None,
    max_rows: int = MAX_ROWS,
    profile_rows: int = PROFILE_ROWS,
    seed: int = 0,
    field: str = "acceptance",
) -> Acceptance:
    """Read one acceptance file (see module docstring for the formats and rules)."""
    p = Path(path)
    text = read_text(p, field)
    if not text.strip():
        raise InputError(field, str(p), "a non-empty acceptance file", hint="the file is empty")
    if fmt == "auto":
        fmt = detect_format(p, text)
    if fmt not in FORMATS:
        raise InputError("--format", fmt, f"auto or one of {', '.join(FORMATS)}")
    if since is not None and fmt != "vllm-metrics":
        raise InputError("--since", str(since), "only with the vllm-metrics format (a scrape)")
    if draft_width is not None and draft_width < 1:
        raise InputError("--draft-width", draft_width, "an integer >= 1")
    source = {
        "format": fmt,
        "file": p.name,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    if fmt == "vllm-metrics":
        base = read_text(Path(since), "--since") if since is not None else None
        acc = vllm_metrics(
            text, since=base, model_name=model_name, source=source, max_rows=max_rows, seed=seed
        )
    elif fmt == "vllm-requests":
        acc = vllm_requests(text, source=source, max_rows=max_rows, seed=seed)
    elif fmt == "profile":
        acc = speculation_profile(
            text, source=source, max_rows=max_rows, rows=profile_rows, seed=seed
        )
    else:
        acc = accepted_csv(text, draft_width=draft_width, source=source)
    if draft_width is not None and acc.draft_width != draft_width:
        raise InputError(
            "--draft-width", draft_width, f"the file's draft width ({acc.draft_width})"
        )
    return acc


# --------------------------------------------------------------------------------------------
# vLLM /metrics
# --------------------------------------------------------------------------------------------


def _count(value: float, field: str) -> int:
    if not math.isfinite(value) or value < 0 or value != round(value):
        raise InputError(field, value, "a counter value: a finite integer >= 0")
    return int(round(value))


def _series(samples: list[Sample], name: str, model_name: str | None) -> dict[tuple, int]:
    """``{position label or None: summed count}`` of one counter, over engines."""
    found = counter_samples(samples, name)
    models = sorted({s.label("model_name") for s in found if s.label("model_name") is not None})
    if model_name is not None:
        found = [s for s in found if s.label("model_name") == model_name]
    elif len(models) > 1:
        raise InputError(
            f"vllm-metrics: {name} model_name", models, "one model (pass --model-name NAME)"
        )
    out: dict[tuple, int] = {}
    for s in found:
        key = (s.label("position"),)
        field = f"vllm-metrics: {s.name}{{{','.join(f'{k}={v!r}' for k, v in s.labels)}}}"
        out[key] = out.get(key, 0) + _count(s.value, field)
    return out


def _vllm_counts(text: str, model_name: str | None, field: str) -> dict[str, Any]:
    samples = parse_exposition(text, field)
    counts: dict[str, Any] = {}
    for key, name in (
        ("drafts", VLLM_DRAFTS),
        ("draft_tokens", VLLM_DRAFT_TOKENS),
        ("accepted", VLLM_ACCEPTED),
    ):
        s = _series(samples, name, model_name)
        if not s:
            raise InputError(
                f"{field}: {name}_total",
                "missing",
                "vLLM's spec-decode counters (a /metrics scrape of a speculative server)",
            )
        counts[key] = sum(s.values())
    per = _series(samples, VLLM_PER_POS, model_name)
    if not per:
        raise InputError(f"{field}: {VLLM_PER_POS}_total", "missing", "one series per position")
    positions = []
    for (pos,) in per:
        if pos is None or not pos.isdigit():
            raise InputError(f"{field}: {VLLM_PER_POS} position", pos, "a label position=0, 1, ...")
        positions.append(int(pos))
    w = max(positions) + 1
    missing = sorted(set(range(w)) - set(positions))
    if missing:
        raise InputError(
            f"{field}: {VLLM_PER_POS} position",
            sorted(positions),
            f"every position 0..{w - 1}",
            hint=f"missing {missing}",
        )
    counts["per_pos"] = np.array([per[(str(i),)] for i in range(w)], dtype=np.int64)
    return counts


def vllm_metrics(
    text: str,
    *,
    since: str | None = None,
    model_name: str | None = None,
    source: dict[str, Any] | None = None,
    max_rows: int = MAX_ROWS,
    seed: int = 0,
) -> Acceptance:
    """A scrape of vLLM's ``/metrics`` (minus the earlier scrape ``since``) -> Acceptance."""
    field = "vllm-metrics"
    c = _vllm_counts(text, model_name, field)
    if since is not None:
        b = _vllm_counts(since, model_name, "--since")
        if b["per_pos"].size != c["per_pos"].size:
            raise InputError(
                "--since", b["per_pos"].size, f"the same positions ({c['per_pos'].size})"
            )
        for key in ("drafts", "draft_tokens", "accepted", "per_pos"):
            diff = np.asarray(c[key]) - np.asarray(b[key])
            if (diff < 0).any():
                raise InputError(
                    f"--since: {key}",
                    np.asarray(b[key]).tolist(),
                    f"<= the later scrape's {np.asarray(c[key]).tolist()} (a counter went "
                    "down: the server restarted between the scrapes)",
                )
            c[key] = diff if key == "per_pos" else int(diff)
    drafts, tokens, accepted, per = c["drafts"], c["draft_tokens"], c["accepted"], c["per_pos"]
    w = int(per.size)
    _check_counts(
        field, drafts, tokens, accepted, per, w, names=_VLLM_NAMES, short_hint=_SCRAPE_SHORT
    )
    hist = histogram_from_survival(drafts, per)
    src = {
        **(source or {}),
        "engine": "vllm",
        "model_name": model_name,
        "num_drafts": int(drafts),
        "num_draft_tokens": int(tokens),
        "num_accepted_tokens": int(accepted),
        "num_accepted_tokens_per_pos": per.tolist(),
        "since": since is not None,
    }
    return from_histogram(hist, source=src, max_rows=max_rows, seed=seed)


#: Why a scrape of a dynamic-K deployment is refused, and the route that imports it.
_SCRAPE_SHORT = (
    "steps drafted fewer than num_speculative_tokens (a dynamic-K schedule, "
    "num_speculative_tokens_per_batch_size, or structured output): the counters do not say "
    "which positions each step verified. Import the per-request stats instead: serve with "
    "--per-request-spec-decode-metrics summary|detailed and run speccal import RESPONSES.json "
    "--format vllm-requests (metrics.speculative_decoding with " + BY_DRAFT_LENGTH + " or "
    "per_step_drafted)"
)

_VLLM_NAMES = {
    "drafts": f"{VLLM_DRAFTS}_total",
    "tokens": f"{VLLM_DRAFT_TOKENS}_total",
    "accepted": f"{VLLM_ACCEPTED}_total",
    "per_pos": f"{VLLM_PER_POS}_total",
}


def _check_counts(
    field: str,
    drafts: int,
    tokens: int,
    accepted: int,
    per: np.ndarray,
    w: int,
    names,
    short_hint: str = "shorter drafts (dynamic K, structured output) leave the deeper positions "
    "unobserved; import acceptance measured at a fixed K",
) -> None:
    """The identities every counter set of full-width steps satisfies."""
    if drafts <= 0:
        raise InputError(f"{field}: {names['drafts']}", drafts, "at least one speculative step")
    if accepted > tokens:
        raise InputError(
            f"{field}: {names['accepted']}",
            accepted,
            f"<= the drafted tokens {names['tokens']} = {tokens} (accepted > drafted)",
        )
    if tokens != drafts * w:
        raise InputError(
            f"{field}: {names['tokens']}",
            tokens,
            f"steps x draft width = {drafts} x {w} = {drafts * w} (every step drafted at full "
            "width)",
            hint=short_hint,
        )
    if per[0] > drafts:
        raise InputError(
            f"{field}: {names['per_pos']}[0]",
            int(per[0]),
            f"<= the steps {names['drafts']} = {drafts} (accepted > drafted)",
        )
    rises = np.flatnonzero(np.diff(per) > 0)
    if rises.size:
        i = int(rises[0]) + 1
        raise InputError(
            f"{field}: {names['per_pos']}[{i}]",
            int(per[i]),
            f"<= position {i - 1}'s count {int(per[i - 1])} (a draft is accepted only after "
            "every earlier one)",
        )
    if int(per.sum()) != accepted:
        raise InputError(
            f"{field}: {names['accepted']}",
            accepted,
            f"the sum of the per-position counts ({int(per.sum())})",
        )


# --------------------------------------------------------------------------------------------
# vLLM per-request stats
# --------------------------------------------------------------------------------------------


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


def _int(obj: dict, key: str, field: str, minimum: int = 0) -> int:
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
    k = _int(s, "num_spec_tokens", f, 1)
    if w is not None and k != w:
        raise InputError(f"{f}.num_spec_tokens", k, f"the first request's {w}")
    w = k
    if shape == SHAPE_MERGED:
        hist = _dense(s.get("acceptance_histogram"), w, f"{f}.acceptance_histogram")
    else:
        hist = _sparse(s.get("acceptance_histogram"), w, f"{f}.acceptance_histogram")
    steps = _int(s, "num_spec_steps", f)
    if steps != int(hist.sum()):
        raise InputError(f"{f}.num_spec_steps", steps, f"the histogram's {int(hist.sum())}")
    acc = _int(s, "num_accepted_draft_tokens", f)
    tokens = _int(s, "num_draft_tokens", f)
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


# --------------------------------------------------------------------------------------------
# speculation_profile.json
# --------------------------------------------------------------------------------------------


def _rates(doc: dict, key: str, w: int) -> np.ndarray | None:
    v = doc.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != w:
        raise InputError(
            f"profile.{key}",
            v if not isinstance(v, list) else f"{len(v)} values",
            f"{w} rates (num_speculative_tokens), one per draft position",
        )
    try:
        arr = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"profile.{key}", v, "numbers") from None
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr > 1).any():
        raise InputError(f"profile.{key}", v, "rates in [0, 1]")
    return arr


def speculation_profile(
    text: str,
    *,
    source: dict[str, Any] | None = None,
    max_rows: int = MAX_ROWS,
    rows: int = PROFILE_ROWS,
    seed: int = 0,
) -> Acceptance:
    """A ``speculation_profile.json`` -> Acceptance (see module docstring)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError("profile", text[:40], f"a JSON object ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise InputError("profile", type(doc).__name__, "a JSON object")
    version = str(doc.get("schema_version", ""))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) > PROFILE_SCHEMA_MAJOR:
        raise InputError(
            "profile.schema_version", doc.get("schema_version"), f"{PROFILE_SCHEMA_MAJOR}.x"
        )
    if doc.get("measured") is not True:
        raise InputError(
            "profile.measured", doc.get("measured"), "true (a stub profile holds no measurement)"
        )
    method = doc.get("verification_method", "longest_prefix")
    if method != "longest_prefix":
        raise InputError(
            "profile.verification_method",
            method,
            "longest_prefix (block verification has no accepted-prefix distribution)",
        )
    w = _int(doc, "num_speculative_tokens", "profile", 1)
    src = {
        **(source or {}),
        "engine": "speculation_profile",
        "method": doc.get("method"),
        "accept_length_model": doc.get("accept_length_model"),
        "target_model": doc.get("target_model"),
        "draft_checkpoint": doc.get("draft_checkpoint"),
        "measurement_conditions": doc.get("measurement_conditions"),
    }
    marginal = _rates(doc, "marginal_accept_rates", w)
    conditional = _rates(doc, "conditional_accept_rates", w)
    if marginal is not None and conditional is not None:
        implied = np.cumprod(conditional)
        # Both are published rounded to 6 digits; products of rounded rates drift a little.
        if np.abs(implied - marginal).max() > 1e-4:
            i = int(np.argmax(np.abs(implied - marginal)))
            raise InputError(
                f"profile.conditional_accept_rates[{i}]",
                float(conditional[i]),
                f"consistent with marginal_accept_rates (their product to position {i} is "
                f"{implied[i]:.6f}, the marginal {marginal[i]:.6f})",
            )
    raw = doc.get("acceptance_length_histogram")
    if raw:
        if not isinstance(raw, dict):
            raise InputError("profile.acceptance_length_histogram", raw, "an object {length: n}")
        hist = np.zeros(w + 1, dtype=np.int64)
        for key, count in raw.items():
            if not str(key).isdigit() or not 1 <= int(key) <= w + 1:
                raise InputError(
                    "profile.acceptance_length_histogram",
                    key,
                    f"acceptance lengths 1..{w + 1} (drafts accepted + the bonus token)",
                )
            if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
                raise InputError(
                    f"profile.acceptance_length_histogram[{key}]", count, "a count >= 0"
                )
            if count != int(count):
                raise InputError(f"profile.acceptance_length_histogram[{key}]", count, "a count")
            hist[int(key) - 1] += int(count)
        if hist.sum() == 0:
            raise InputError("profile.acceptance_length_histogram", raw, "at least one step")
        if marginal is not None:
            implied = np.cumsum(hist[::-1])[::-1][1:] / hist.sum()
            if np.abs(implied - marginal).max() > 5e-6:
                i = int(np.argmax(np.abs(implied - marginal)))
                raise InputError(
                    f"profile.marginal_accept_rates[{i}]",
                    float(marginal[i]),
                    f"the histogram's {implied[i]:.6f}",
                )
        return from_histogram(hist, source=src, max_rows=max_rows, seed=seed)
    if marginal is None and conditional is not None:
        marginal = np.cumprod(conditional)
        key = "conditional_accept_rates"
    else:
        key = "marginal_accept_rates"
    if marginal is None:
        raise InputError(
            "profile",
            "no rates",
            "acceptance_length_histogram, marginal_accept_rates or conditional_accept_rates",
        )
    return from_prefix(marginal, source=src, rows=rows, seed=seed, field=f"profile.{key}")


# --------------------------------------------------------------------------------------------
# CSV of accepted lengths
# --------------------------------------------------------------------------------------------


def accepted_csv(
    text: str, *, draft_width: int | None = None, source: dict[str, Any] | None = None
) -> Acceptance:
    """One row per (request, step): ``accepted``; optional ``drafted``, ``round``,
    ``kv_length``, ``request``."""
    try:
        df = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise InputError("csv", text[:40], f"a CSV file with a header ({exc})") from None
    if "accepted" not in df.columns:
        raise InputError(
            "csv.columns",
            None,
            "a column accepted (drafts accepted per request and step)",
            found=", ".join(map(str, df.columns)) or "no columns",
        )
    if len(df) == 0:
        raise InputError("csv", "0 rows", "at least one step")

    def ints(col: str, minimum: int) -> np.ndarray:
        vals = pd.to_numeric(df[col], errors="coerce")
        arr = vals.to_numpy(dtype=float, na_value=np.nan)
        bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (arr < minimum)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"csv.{col}[row {i}]", df[col].iloc[i], f"an integer >= {minimum}")
        return arr.astype(np.int64)

    accepted = ints("accepted", 0)
    if "drafted" in df.columns:
        drafted = ints("drafted", 1)
        w = int(drafted.max())
        if draft_width is not None:
            w = draft_width
        short = drafted != w
        if short.any():
            i = int(np.flatnonzero(short)[0])
            raise InputError(
                f"csv.drafted[row {i}]",
                int(drafted[i]),
                f"{w} (full width) in every row",
                hint="shorter drafts leave the deeper positions unobserved",
            )
        over = accepted > drafted
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise InputError(
                f"csv.accepted[row {i}]",
                int(accepted[i]),
                f"<= drafted ({int(drafted[i])}) (accepted > drafted)",
            )
    elif draft_width is None:
        raise InputError("--draft-width", None, "the draft width (the CSV has no drafted column)")
    else:
        w = draft_width
        over = accepted > w
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise InputError(
                f"csv.accepted[row {i}]",
                int(accepted[i]),
                f"<= draft width {w} (accepted > drafted)",
            )
    round_ids = ints("round", 0) if "round" in df.columns else None
    kv = None
    if "kv_length" in df.columns:
        kvv = pd.to_numeric(df["kv_length"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
        bad = ~np.isfinite(kvv) | (kvv < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"csv.kv_length[row {i}]", df["kv_length"].iloc[i], "a number >= 0")
        kv = kvv
    src = {**(source or {}), "engine": "csv", "rounds_recorded": round_ids is not None}
    return Acceptance(
        draft_width=w, accepted=accepted, round_ids=round_ids, kv_length=kv, source=src
    )
