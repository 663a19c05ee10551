"""Acceptance traces: in-memory layout, validation, and parquet / JSONL files.

Two kinds of trace (full description in ``docs/TRACES.md``):

- **rounds** (:class:`RoundTrace`): one record per speculative round as it ran. Per round ``r``:
  ``num_requests[r]`` (B), ``kv_length[r]`` (mean KV length), ``k[r]`` (draft forwards run),
  ``phase[r]`` (index into ``meta["phases"]``), optionally ``plan_kv_length[r]`` (the mean KV
  length the plan of round ``r`` saw: recorded by the live runner, whose host knows the KV only
  as of the rounds it has collected; replay decides on it) and ``kv_max_length[r]`` (the
  longest request's KV length: how far the batch's KV spreads past the mean it is priced at,
  :meth:`RoundTrace.kv_spread`); per request of the round, flattened
  over rounds
  in round order (``cu_requests`` ``[R + 1]`` are the offsets): ``accepted [N]`` (accepted drafts,
  ``0..k``) and ``draft_scores [N, w]`` (draft probability of each selected token; NaN at
  positions ``>= k``). Replaying other ``k`` needs rounds recorded at full width (``k == w``):
  accepted length under ``k'`` is then ``min(accepted, k')``.
- **tokens** (:class:`TokenTrace`): the per-token acceptance matrix for exact counterfactual
  greedy replay, recorded by drafting from every output position. One record per (request,
  output position ``t``): ``request``, ``position``, ``kv_length`` and ``accept [T, w]`` (whether
  the depth-``d`` draft proposed from ``t`` matches the target), ``draft_scores [T, w]``. A round
  starting at ``t`` with ``k`` drafts accepts the leading run of ``accept[t, :k]``.

Files: parquet (one row per round / per token, list columns, the header JSON in the schema
metadata key ``speccal.trace``) or JSONL (first line ``{"speccal_trace": header}``, then one
object per row, NaN written as null). Both are written atomically. Pure numpy/pandas/pyarrow.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speccal.base.atomic import write_bytes_atomic
from speccal.base.errors import InputError, SchemaError

SCHEMA_VERSION = 1
KINDS = ("rounds", "tokens")
META_KEY = b"speccal.trace"


@dataclass(frozen=True, eq=False)
class RoundTrace:
    """Round-level trace (see module docstring for the layout)."""

    draft_width: int
    num_requests: np.ndarray  # [R] int64
    kv_length: np.ndarray  # [R] float64
    k: np.ndarray  # [R] int64
    accepted: np.ndarray  # [N] int64, N = sum(num_requests)
    draft_scores: np.ndarray | None = None  # [N, w] float32, NaN beyond k
    phase: np.ndarray | None = None  # [R] int64; default all 0
    meta: dict[str, Any] = field(default_factory=dict)
    plan_kv_length: np.ndarray | None = None  # [R] float64: the KV each round's plan saw
    kv_max_length: np.ndarray | None = None  # [R] float64: the longest request's KV length

    def __post_init__(self) -> None:
        w = int(self.draft_width)
        if w < 1:
            raise SchemaError("draft_width", self.draft_width, "an integer >= 1")
        nreq = _int_array("num_requests", self.num_requests, 1)
        r = nreq.size
        kv = np.asarray(self.kv_length, dtype=np.float64).reshape(-1)
        if kv.size != r or not np.isfinite(kv).all() or (kv < 0).any():
            raise SchemaError("kv_length", kv.size, f"{r} finite values >= 0, one per round")
        k = _int_array("k", self.k, 1, size=r)
        if (k > w).any():
            raise SchemaError("k", int(k.max()), f"values in 1..draft_width={w}")
        acc = _int_array("accepted", self.accepted, 0, size=int(nreq.sum()))
        kk = np.repeat(k, nreq)
        if (acc > kk).any():
            i = int(np.argmax(acc > kk))
            raise SchemaError("accepted", int(acc[i]), f"<= k={int(kk[i])} (request row {i})")
        phase = (
            np.zeros(r, dtype=np.int64)
            if self.phase is None
            else _int_array("phase", self.phase, 0, size=r)
        )
        object.__setattr__(self, "draft_width", w)
        object.__setattr__(self, "num_requests", nreq)
        object.__setattr__(self, "kv_length", kv)
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "accepted", acc)
        object.__setattr__(self, "phase", phase)
        if self.plan_kv_length is not None:
            pkv = np.asarray(self.plan_kv_length, dtype=np.float64).reshape(-1)
            if pkv.size != r or not np.isfinite(pkv).all() or (pkv < 0).any():
                raise SchemaError("plan_kv_length", pkv.size,
                                  f"{r} finite values >= 0, one per round")
            object.__setattr__(self, "plan_kv_length", pkv)
        if self.kv_max_length is not None:
            mx = np.asarray(self.kv_max_length, dtype=np.float64).reshape(-1)
            if mx.size != r or not np.isfinite(mx).all():
                raise SchemaError("kv_max_length", mx.size, f"{r} finite values, one per round")
            low = mx < kv * (1.0 - 1e-9)
            if low.any():
                i = int(np.argmax(low))
                raise SchemaError("kv_max_length", float(mx[i]),
                                  f">= the round's mean kv_length {kv[i]:g} (round {i})")
            object.__setattr__(self, "kv_max_length", mx)
        if self.draft_scores is not None:
            s = np.asarray(self.draft_scores, dtype=np.float32)
            if s.shape != (acc.size, w):
                raise SchemaError("draft_scores", s.shape, f"shape [N={acc.size}, w={w}]")
            drafted = np.arange(w)[None, :] < kk[:, None]
            bad = drafted & ~((s >= 0) & (s <= 1))
            if bad.any():
                i = int(np.argmax(bad.any(axis=1)))
                raise SchemaError(
                    "draft_scores", s[i].tolist(), "probabilities in [0, 1] at drafted positions"
                )
            object.__setattr__(self, "draft_scores", s)
        object.__setattr__(self, "meta", dict(self.meta))

    @property
    def num_rounds(self) -> int:
        return int(self.num_requests.size)

    @property
    def cu_requests(self) -> np.ndarray:
        """Offsets ``[R + 1]`` of each round's requests in the flattened arrays."""
        return np.concatenate(([0], np.cumsum(self.num_requests)))

    @property
    def decision_kv(self) -> np.ndarray:
        """``[R]`` the mean KV length each round's plan decided on: ``plan_kv_length`` when
        the trace recorded it (the live runner does: its host knows the KV only as of the
        rounds it has collected, two rounds behind on the pipelined loop), else ``kv_length``
        (a trace from elsewhere: the KV after the round is the best it says)."""
        return self.kv_length if self.plan_kv_length is None else self.plan_kv_length

    def kv_spread(self) -> dict[str, float] | None:
        """How far each round's longest request sat past the mean KV its round is priced at:
        the median and 90th percentile of ``kv_max_length / kv_length`` over the rounds and the
        share of rounds past 1.5x (%); None when the trace did not record the longest."""
        if self.kv_max_length is None or self.num_rounds == 0:
            return None
        ratio = self.kv_max_length / np.maximum(self.kv_length, 1.0)
        return {"median_max_over_mean": float(np.median(ratio)),
                "p90_max_over_mean": float(np.percentile(ratio, 90)),
                "rounds_past_1_5x_pct": float(100.0 * np.mean(ratio > 1.5))}

    @property
    def full_width(self) -> bool:
        """True when every round drafted ``w`` tokens (counterfactual ``k`` replay is exact)."""
        return bool((self.k == self.draft_width).all())

    def survival_counts(self) -> np.ndarray:
        """``H [R, w]``: requests of each round whose first ``i + 1`` drafts were accepted."""
        w = self.draft_width
        rid = np.repeat(np.arange(self.num_rounds), self.num_requests)
        flat = rid * (w + 1) + np.minimum(self.accepted, w)
        hist = np.bincount(flat, minlength=self.num_rounds * (w + 1)).reshape(
            self.num_rounds, w + 1
        )
        # requests with a >= i + 1 = reverse cumulative sum of the histogram from a = i + 1.
        return np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]

    def padded(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rounds ``[start, stop)`` as ``(accepted [R, Bmax], scores [R, Bmax, w])``.

        Padding rows have ``accepted = 0`` and score 0. Scores are NaN-free (NaN -> 0).
        """
        if self.draft_scores is None:
            raise InputError(
                "trace.draft_scores", None, "per-request draft scores (adaptive verify replay)"
            )
        stop = self.num_rounds if stop is None else stop
        nreq = self.num_requests[start:stop]
        cu = self.cu_requests
        lo, hi = int(cu[start]), int(cu[stop])
        bmax = int(nreq.max()) if nreq.size else 0
        rid = np.repeat(np.arange(nreq.size), nreq)
        col = np.arange(hi - lo) - np.repeat(cu[start:stop] - lo, nreq)
        acc = np.zeros((nreq.size, bmax), dtype=np.int64)
        acc[rid, col] = self.accepted[lo:hi]
        sc = np.zeros((nreq.size, bmax, self.draft_width), dtype=np.float32)
        sc[rid, col] = np.nan_to_num(self.draft_scores[lo:hi], nan=0.0)
        return acc, sc


@dataclass(frozen=True, eq=False)
class TokenTrace:
    """Token-level acceptance matrix (see module docstring for the layout)."""

    draft_width: int
    request: np.ndarray  # [T] int64
    position: np.ndarray  # [T] int64
    kv_length: np.ndarray  # [T] int64
    accept: np.ndarray  # [T, w] bool
    draft_scores: np.ndarray | None = None  # [T, w] float32
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        w = int(self.draft_width)
        if w < 1:
            raise SchemaError("draft_width", self.draft_width, "an integer >= 1")
        req = _int_array("request", self.request, 0)
        t = req.size
        pos = _int_array("position", self.position, 0, size=t)
        kv = _int_array("kv_length", self.kv_length, 0, size=t)
        acc = np.asarray(self.accept).astype(bool)
        if acc.shape != (t, w):
            raise SchemaError("accept", acc.shape, f"shape [T={t}, w={w}]")
        order = np.lexsort((pos, req))
        if not (order == np.arange(t)).all():
            raise SchemaError("position", "unsorted", "rows sorted by (request, position)")
        first = np.concatenate(([True], req[1:] != req[:-1]))
        expect = np.arange(t) - np.maximum.accumulate(np.where(first, np.arange(t), 0))
        if (pos != expect).any():
            i = int(np.argmax(pos != expect))
            raise SchemaError(
                "position", int(pos[i]), f"{int(expect[i])} (positions 0, 1, 2, ... per request)"
            )
        for name, arr in (("request", req), ("position", pos), ("kv_length", kv), ("accept", acc)):
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "draft_width", w)
        if self.draft_scores is not None:
            s = np.asarray(self.draft_scores, dtype=np.float32)
            if s.shape != (t, w) or not ((s >= 0) & (s <= 1)).all():
                raise SchemaError(
                    "draft_scores", s.shape, f"[T={t}, w={w}] probabilities in [0, 1]"
                )
            object.__setattr__(self, "draft_scores", s)
        object.__setattr__(self, "meta", dict(self.meta))

    @property
    def match_length(self) -> np.ndarray:
        """``[T]`` leading accepted depths from each position (accepted length at ``k = w``)."""
        return np.cumprod(self.accept, axis=1).sum(axis=1)


Trace = RoundTrace | TokenTrace


# --------------------------------------------------------------------------------------------
# Builders (used by the recorder: plain arrays in, a validated trace out)
# --------------------------------------------------------------------------------------------


class RoundTraceBuilder:
    """Accumulates rounds (from ``RoundResult`` fields) into a :class:`RoundTrace`."""

    def __init__(self, draft_width: int):
        self.draft_width = int(draft_width)
        self._b: list[int] = []
        self._kv: list[float] = []
        self._k: list[int] = []
        self._acc: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._plan_kv: list[float | None] = []
        self._kv_max: list[float] = []

    def add(self, k: int, accepted: Any, draft_scores: Any, kv_lengths: Any,
            plan_kv_length: float | None = None) -> None:
        """One round: ``accepted [B]``, ``draft_scores [B, k]``, ``kv_lengths [B]``, and the
        mean KV the round's plan saw (recorded only when every round gives it)."""
        acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
        if acc.size == 0:
            return
        self._plan_kv.append(None if plan_kv_length is None else float(plan_kv_length))
        sc = np.full((acc.size, self.draft_width), np.nan, dtype=np.float32)
        sc[:, :k] = np.asarray(draft_scores, dtype=np.float32).reshape(acc.size, k)
        self._b.append(acc.size)
        self._kv.append(float(np.mean(kv_lengths)))
        self._kv_max.append(float(np.max(kv_lengths)))
        self._k.append(int(k))
        self._acc.append(acc)
        self._scores.append(sc)

    def __len__(self) -> int:
        return len(self._b)

    def build(self, meta: dict[str, Any] | None = None) -> RoundTrace:
        w = self.draft_width
        return RoundTrace(
            draft_width=w,
            num_requests=np.asarray(self._b, dtype=np.int64),
            kv_length=np.asarray(self._kv, dtype=np.float64),
            k=np.asarray(self._k, dtype=np.int64),
            accepted=np.concatenate(self._acc) if self._acc else np.zeros(0, dtype=np.int64),
            draft_scores=np.concatenate(self._scores)
            if self._scores
            else np.zeros((0, w), np.float32),
            meta=meta or {},
            plan_kv_length=None if not self._plan_kv or None in self._plan_kv
            else np.asarray(self._plan_kv, dtype=np.float64),
            kv_max_length=np.asarray(self._kv_max, dtype=np.float64),
        )


class TokenTraceBuilder:
    """Accumulates per-position drafts (accepted run + scores from position ``t``)."""

    def __init__(self, draft_width: int):
        self.draft_width = int(draft_width)
        self._rows: list[tuple[int, int, int, int, np.ndarray]] = []

    def add(
        self, request: int, position: int, kv_length: int, match_length: int, draft_scores: Any
    ) -> None:
        """Depths ``< match_length`` matched the target; depth ``match_length`` did not (if ``< w``)."""
        sc = np.asarray(draft_scores, dtype=np.float32).reshape(self.draft_width)
        self._rows.append((int(request), int(position), int(kv_length), int(match_length), sc))

    def build(self, meta: dict[str, Any] | None = None) -> TokenTrace:
        rows = sorted(self._rows, key=lambda r: (r[0], r[1]))
        w = self.draft_width
        match = np.array([r[3] for r in rows], dtype=np.int64)
        return TokenTrace(
            draft_width=w,
            request=np.array([r[0] for r in rows], dtype=np.int64),
            position=np.array([r[1] for r in rows], dtype=np.int64),
            kv_length=np.array([r[2] for r in rows], dtype=np.int64),
            accept=np.arange(w)[None, :] < match[:, None],
            draft_scores=np.stack([r[4] for r in rows]) if rows else np.zeros((0, w), np.float32),
            meta=meta or {},
        )


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def header(trace: Trace) -> dict[str, Any]:
    """The JSON header stored with a trace file."""
    kind = "rounds" if isinstance(trace, RoundTrace) else "tokens"
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "draft_width": trace.draft_width,
        "has_scores": trace.draft_scores is not None,
        "meta": trace.meta,
    }


def trace_summary(trace: Trace, path: Path, elapsed_s: float) -> dict[str, Any]:
    """What ``speccal trace`` reports of a trace it wrote at ``path``: its kind (``rounds`` or
    ``tokens``), draft width, records (rounds, or token rows), seconds taken and ``meta``."""
    rounds = isinstance(trace, RoundTrace)
    return {
        "path": str(path),
        "kind": "rounds" if rounds else "tokens",
        "draft_width": trace.draft_width,
        "records": int(trace.num_rounds if rounds else trace.request.size),
        "elapsed_s": round(elapsed_s, 3),
        "meta": trace.meta,
    }


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write a trace atomically; the format follows the suffix (``.parquet`` or ``.jsonl``)."""
    path = Path(path)
    fmt = _format(path)
    data = _to_parquet(trace) if fmt == "parquet" else _to_jsonl(trace)
    return write_bytes_atomic(path, data)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace written by :func:`save_trace` (or by hand, per TRACES.md)."""
    path = Path(path)
    if not path.is_file():
        raise InputError("trace", str(path), "an existing .parquet or .jsonl trace file")
    fmt = _format(path)
    try:
        return _from_parquet(path) if fmt == "parquet" else _from_jsonl(path)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise SchemaError(
            "trace", str(path), f"a valid speccal trace ({type(exc).__name__}: {exc})"
        ) from None


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    raise InputError("trace", str(path), "a file ending in .parquet or .jsonl")


def _check_header(h: Any) -> dict[str, Any]:
    if not isinstance(h, dict):
        raise SchemaError("header", h, "a JSON object")
    v = h.get("schema_version")
    if not isinstance(v, int) or v < 1:
        raise SchemaError("schema_version", v, "an integer >= 1")
    if v > SCHEMA_VERSION:
        raise SchemaError("schema_version", v, f"<= {SCHEMA_VERSION} (written by a newer speccal)")
    if h.get("kind") not in KINDS:
        raise SchemaError("kind", h.get("kind"), f"one of {list(KINDS)}")
    if not isinstance(h.get("draft_width"), int):
        raise SchemaError("draft_width", h.get("draft_width"), "an integer")
    return h


def _to_parquet(trace: Trace) -> bytes:
    w = trace.draft_width
    if isinstance(trace, RoundTrace):
        offsets = pa.array(trace.cu_requests.astype(np.int64))
        cols = {
            "round": pa.array(np.arange(trace.num_rounds, dtype=np.int64)),
            "num_requests": pa.array(trace.num_requests),
            "kv_length": pa.array(trace.kv_length),
            "k": pa.array(trace.k),
            "phase": pa.array(trace.phase),
            "accepted": pa.LargeListArray.from_arrays(offsets, pa.array(trace.accepted)),
        }
        for name in ("plan_kv_length", "kv_max_length"):
            if getattr(trace, name) is not None:
                cols[name] = pa.array(getattr(trace, name))
        if trace.draft_scores is not None:
            cols["draft_scores"] = pa.LargeListArray.from_arrays(
                pa.array(offsets.to_numpy() * w),
                pa.array(trace.draft_scores.reshape(-1), from_pandas=False),
            )
    else:
        offsets = pa.array(np.arange(trace.request.size + 1, dtype=np.int64) * w)
        cols = {
            "request": pa.array(trace.request),
            "position": pa.array(trace.position),
            "kv_length": pa.array(trace.kv_length),
            "accept": pa.LargeListArray.from_arrays(offsets, pa.array(trace.accept.reshape(-1))),
        }
        if trace.draft_scores is not None:
            cols["draft_scores"] = pa.LargeListArray.from_arrays(
                offsets, pa.array(trace.draft_scores.reshape(-1))
            )
    table = pa.table(cols).replace_schema_metadata(
        {META_KEY: json.dumps(header(trace), allow_nan=False)}
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _from_parquet(path: Path) -> Trace:
    table = pq.read_table(path)
    md = table.schema.metadata or {}
    if META_KEY not in md:
        raise SchemaError("trace", str(path), f"parquet schema metadata key {META_KEY.decode()!r}")
    h = _check_header(json.loads(md[META_KEY]))
    w = h["draft_width"]

    def flat(name: str, dtype) -> np.ndarray:
        if name not in table.column_names:
            raise SchemaError("trace", str(path), f"a column {name!r}")
        col = table.column(name).combine_chunks()
        return col.flatten().to_numpy(zero_copy_only=False).astype(dtype)

    def plain(name: str, dtype) -> np.ndarray:
        if name not in table.column_names:
            raise SchemaError("trace", str(path), f"a column {name!r}")
        return table.column(name).to_numpy().astype(dtype)

    scores = flat("draft_scores", np.float32).reshape(-1, w) if h["has_scores"] else None
    if h["kind"] == "rounds":
        return RoundTrace(
            draft_width=w,
            num_requests=plain("num_requests", np.int64),
            kv_length=plain("kv_length", np.float64),
            k=plain("k", np.int64),
            phase=plain("phase", np.int64),
            accepted=flat("accepted", np.int64),
            draft_scores=scores,
            meta=h.get("meta", {}),
            plan_kv_length=plain("plan_kv_length", np.float64)
            if "plan_kv_length" in table.column_names else None,
            kv_max_length=plain("kv_max_length", np.float64)
            if "kv_max_length" in table.column_names else None,
        )
    return TokenTrace(
        draft_width=w,
        request=plain("request", np.int64),
        position=plain("position", np.int64),
        kv_length=plain("kv_length", np.int64),
        accept=flat("accept", bool).reshape(-1, w),
        draft_scores=scores,
        meta=h.get("meta", {}),
    )


def _nan_to_none(rows: np.ndarray) -> list:
    return [[None if np.isnan(v) else float(v) for v in row] for row in rows]


def _to_jsonl(trace: Trace) -> bytes:
    lines = [json.dumps({"speccal_trace": header(trace)}, allow_nan=False, sort_keys=True)]
    if isinstance(trace, RoundTrace):
        cu = trace.cu_requests
        for r in range(trace.num_rounds):
            row = {
                "round": r,
                "num_requests": int(trace.num_requests[r]),
                "kv_length": float(trace.kv_length[r]),
                "k": int(trace.k[r]),
                "phase": int(trace.phase[r]),
                "accepted": trace.accepted[cu[r] : cu[r + 1]].tolist(),
            }
            for name in ("plan_kv_length", "kv_max_length"):
                if getattr(trace, name) is not None:
                    row[name] = float(getattr(trace, name)[r])
            if trace.draft_scores is not None:
                row["draft_scores"] = _nan_to_none(trace.draft_scores[cu[r] : cu[r + 1]])
            lines.append(json.dumps(row, allow_nan=False))
    else:
        for i in range(trace.request.size):
            row = {
                "request": int(trace.request[i]),
                "position": int(trace.position[i]),
                "kv_length": int(trace.kv_length[i]),
                "accept": trace.accept[i].astype(int).tolist(),
            }
            if trace.draft_scores is not None:
                row["draft_scores"] = [float(v) for v in trace.draft_scores[i]]
            lines.append(json.dumps(row, allow_nan=False))
    return ("\n".join(lines) + "\n").encode()


def _from_jsonl(path: Path) -> Trace:
    with open(path, encoding="utf-8") as fh:
        first = fh.readline()
        try:
            h = _check_header(json.loads(first).get("speccal_trace"))
        except (json.JSONDecodeError, AttributeError):
            raise SchemaError("trace", str(path), 'a first line {"speccal_trace": {...}}') from None
        rows = []
        for n, line in enumerate(fh, start=2):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SchemaError(f"line {n}", line[:60], f"a JSON object ({exc.msg})") from None
    w = h["draft_width"]

    def scores_of(rs: list[dict]) -> np.ndarray | None:
        if not h["has_scores"]:
            return None
        vals = [
            [np.nan if v is None else v for v in row]
            for r in rs
            for row in _rows(r["draft_scores"])
        ]
        return np.asarray(vals, dtype=np.float32).reshape(-1, w)

    if h["kind"] == "rounds":
        return RoundTrace(
            draft_width=w,
            num_requests=np.array([r["num_requests"] for r in rows], dtype=np.int64),
            kv_length=np.array([r["kv_length"] for r in rows], dtype=np.float64),
            k=np.array([r["k"] for r in rows], dtype=np.int64),
            phase=np.array([r.get("phase", 0) for r in rows], dtype=np.int64),
            accepted=np.array([a for r in rows for a in r["accepted"]], dtype=np.int64),
            draft_scores=scores_of(rows),
            meta=h.get("meta", {}),
            plan_kv_length=_optional_column(rows, "plan_kv_length", np.float64),
            kv_max_length=_optional_column(rows, "kv_max_length", np.float64),
        )
    return TokenTrace(
        draft_width=w,
        request=np.array([r["request"] for r in rows], dtype=np.int64),
        position=np.array([r["position"] for r in rows], dtype=np.int64),
        kv_length=np.array([r["kv_length"] for r in rows], dtype=np.int64),
        accept=np.array([r["accept"] for r in rows], dtype=bool).reshape(-1, w),
        draft_scores=None
        if not h["has_scores"]
        else np.array([r["draft_scores"] for r in rows], dtype=np.float32).reshape(-1, w),
        meta=h.get("meta", {}),
    )


def _optional_column(rows: list[dict], name: str, dtype) -> np.ndarray | None:
    """An optional per-row field: on every row, or on none (None)."""
    have = [name in r for r in rows]
    if not any(have):
        return None
    if not all(have):
        raise SchemaError(name, f"on {sum(have)} of {len(rows)} rows", "on every row or none")
    return np.array([r[name] for r in rows], dtype=dtype)


def _rows(x: Any) -> list:
    if not isinstance(x, list):
        raise SchemaError("draft_scores", x, "a list of per-request score lists")
    return x


def _int_array(name: str, values: Any, minimum: int, size: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 and not (arr.ndim == 0 and size is None):
        arr = arr.reshape(-1)
    arr = arr.reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.mod(arr, 1) == 0):
            raise SchemaError(name, arr[:5].tolist(), "integers")
    arr = arr.astype(np.int64)
    if size is not None and arr.size != size:
        raise SchemaError(name, f"{arr.size} values", f"{size} values")
    if arr.size and arr.min() < minimum:
        raise SchemaError(name, int(arr.min()), f"integers >= {minimum}")
    return arr
