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
    from_histogram,
    from_prefix,
    histogram_from_survival,
)
from speccal.interop.prometheus import Sample, counter_samples, parse_exposition
from speccal.interop.vllm_requests import (  # noqa: F401 (SHAPES: re-exported)
    BY_DRAFT_LENGTH,
    SHAPE_LEGACY,
    SHAPE_MERGED,
    SHAPES,
    int_field,
    vllm_requests,
)

FORMATS = ("vllm-metrics", "vllm-requests", "profile", "csv")

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: vLLM per-request stats: accepted-draft histograms per draft length (dynamic K).
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
    w = int_field(doc, "num_speculative_tokens", "profile", 1)
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
