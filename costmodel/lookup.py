"""Lookups on a cost table: the one owner of what a table answers at ``(Bcap, G, kv_length, k)``.

``k`` is the round's draft forwards. A target_verify table's rounds all run ``k = w`` and its
fits do not depend on it (``k`` may be left out); a draft_step table whose fit keeps the
draft-forward term (``speccal.costmodel.additive``: ``k_term``; sps: one curve per ``k``) needs
it, and a lookup without it, or at a ``k`` it did not measure, is uncalibrated.

:class:`TableLookup` is built once from a ``speccal.costmodel.table_schema.CostTable`` and holds
plain numpy arrays and lists only (no pydantic objects), so replay can call it 10^6 times:

- A table with a KV model (``kv_model``, three or more contexts: ``speccal.costmodel.kv``) is
  priced by it at the exact KV length anywhere in its calibrated span, between and inside the
  intervals; outside the span, or at a Bcap / G that is not one of its levels or not captured, it
  is uncalibrated. ``TableLookup(table, kv_aware=False)`` answers with the per-interval fits only
  (each constant over its interval), which is what a table without a KV model always does.
- :meth:`TableLookup.reason`: why a point is uncalibrated, or None. Uncalibrated: KV length
  outside every context interval (inclusive bounds); Bcap not a calibrated request bucket; G not
  a captured target bucket of that Bcap in the table's geometry; additive: G not a calibrated
  level (no interpolation of categorical levels); sps: G outside the measured range.
- :meth:`TableLookup.fitted`: what the fits predict, vectorised and broadcasting (NaN where
  uncalibrated); :meth:`TableLookup.surface`: the same with every cell whose fitted cost is not
  positive set to NaN (a step cost is physical: a policy dividing by a negative cost would prefer
  exactly the cell the fit got wrong). The surface is what policies and replay price rounds with.
- :meth:`TableLookup.cost_ms`: one cell as a :class:`CostLookup` (NaN and the reason when
  uncalibrated); :meth:`TableLookup.nonpositive_cells`: the cells the fits price at <= 0 ms.
- The fitted models' own primitives: :func:`level_lookup` (categorical levels of the additive
  model) and :func:`sps_interp` (linear in ms between measured G, never extrapolated).
- :func:`evaluate`: any cost function ``f(bcap, g, kv) -> ms`` at padded buckets, NaN where a
  bucket is 0 (no captured bucket holds the batch) - the guard the policies' cost model uses.
- The one memoising option, :class:`LookupMemo` with the :func:`memoised` method decorator:
  without a KV model a table's cost depends on the KV length only through which context
  intervals hold it (a fit is constant over its interval), so scalar answers keyed by
  ``(integer arguments, intervals holding kv)`` are exact; with one the key holds the KV length
  itself, and :meth:`TableLookup.kv_line` gives the answer as a line in KV (the KV model is
  linear in it), so the policies' cost model keeps one line per batch size and prices a decoding
  batch's moving KV on it with the surface's own operations (``speccal.policy.CostModel``). The
  live policy loop plans each round from the memo in microseconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the table module imports this one
    from speccal.costmodel.table_schema import CostTable

#: Entries an exact-KV memo holds before it starts over (:class:`LookupMemo`).
MAX_EXACT_ENTRIES = 4096

#: Reason a lookup gives for a cell whose fitted cost is zero or negative (not a physical cost).
NOT_POSITIVE = "fitted cost not positive"


def k_term_of(n_delta: int) -> str:
    """The draft-forward term's form from its number of parameters (0, 1 or one per Bcap)."""
    return "none" if n_delta == 0 else "shared" if n_delta == 1 else "per_bcap"


def k_reason(k_levels: list[int] | None, k: Any, what: str) -> str | None:
    """Why ``k`` is not priced by a ``what`` (``fit``, ``KV model``) pricing ``k_levels``
    separately, or None (it is, or the ``what`` does not depend on k)."""
    if k_levels is None:
        return None
    if k is None:
        return (f"k (the round's draft forwards) is needed: this draft_step {what} prices "
                f"k = {k_levels} separately")
    if int(k) not in k_levels:
        return f"k {k} is not a calibrated draft step count (calibrated: {k_levels})"
    return None


def k_part(k_term: str, delta: np.ndarray, bcap_levels: np.ndarray, bcap: np.ndarray,
           k: np.ndarray | None, g: np.ndarray | None = None) -> np.ndarray | float:
    """``(k - 1) * delta`` of the additive forms (0 for ``none``; NaN where ``k`` is missing,
    or ``bcap`` is not a level of a per-Bcap term); the ``*_rows`` forms add
    ``delta[-1] * g / (k + 1)`` (the requests one verify serves; ``g`` required)."""
    if k_term == "none":
        return 0.0
    if k is None:
        return np.full(np.shape(bcap), np.nan)
    kk = np.asarray(k, dtype=np.float64)
    extra = kk - 1.0
    base = k_term.removesuffix("_rows")
    rows = 0.0
    if base != k_term:
        if g is None:
            raise ValueError(f"k_part: k_term {k_term!r} needs g")
        rows = delta[-1] * np.asarray(g, dtype=np.float64) / (kk + 1.0)
        delta = delta[:-1]
    if base == "shared":
        return extra * delta[0] + rows
    return extra * level_lookup(bcap, bcap_levels, delta) + rows


def n_delta(k_term: str, n_bcap_levels: int) -> int:
    """Parameters of a draft-forward term: ``delta_ms``'s length."""
    base = {"none": 0, "shared": 1, "per_bcap": n_bcap_levels}[k_term.removesuffix("_rows")]
    return base + (k_term.endswith("_rows"))


class CostLookup(NamedTuple):
    """Answer of a one-cell lookup: NaN cost and a reason when uncalibrated."""

    cost_ms: float
    calibrated: bool
    reason: str | None


def level_lookup(values: np.ndarray, levels: np.ndarray, params: np.ndarray) -> np.ndarray:
    """``params[i]`` where ``values == levels[i]``; NaN where a value is not a level."""
    values = np.asarray(values, dtype=np.float64)
    idx_c = np.clip(np.searchsorted(levels, values), 0, len(levels) - 1)
    return np.where(levels[idx_c] == values, params[idx_c], np.nan)


def sps_interp(g: np.ndarray, g_levels: np.ndarray, cost_ms: np.ndarray) -> np.ndarray:
    """Linear-in-ms interpolation of ``cost_ms`` over ``g_levels``; NaN outside the range."""
    g = np.asarray(g, dtype=np.float64)
    out = np.interp(g, g_levels, cost_ms)
    out[(g < g_levels[0]) | (g > g_levels[-1])] = np.nan
    return out


def sps_curves(g: np.ndarray, k: np.ndarray | None, g_levels: np.ndarray, cost_ms: np.ndarray,
               k_levels: np.ndarray | None) -> np.ndarray:
    """:func:`sps_interp` on the curve of each row's ``k`` (``k_levels`` parallel to
    ``g_levels``: one curve per k); one curve for every row when ``k_levels`` is None. NaN at a
    ``k`` without a curve (or no ``k`` given for a per-k fit)."""
    g = np.asarray(g, dtype=np.float64)
    if k_levels is None:
        return sps_interp(g, g_levels, cost_ms)
    out = np.full(g.shape, np.nan)
    if k is None:
        return out
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), g.shape)
    for kk in np.unique(k_levels):
        at = k == kk
        if at.any():
            cur = k_levels == kk
            out[at] = sps_interp(g[at], g_levels[cur], cost_ms[cur])
    return out


class _Fit(NamedTuple):
    """One context interval's model as plain arrays (``g_levels`` as a list for messages)."""

    lo: float
    hi: float
    kind: str  # "additive" or "sps"
    bcap_levels: list[int]
    g_levels: list[int]
    arrays: tuple
    measured: frozenset[tuple[int, int]]
    context_index: int
    k_levels: list[int] | None  # the k the fit prices (None: it does not depend on k)

    def g_range(self, k: Any) -> list[int]:
        """The sps G levels of the curve of ``k`` (all levels without per-k curves)."""
        ks = self.arrays[3]
        if ks is None:
            return self.g_levels
        return [g for g, kk in zip(self.g_levels, ks.tolist(), strict=True) if kk == int(k)]


class TableLookup:
    """Every lookup on one cost table (see the module docstring for the rules).

    Parameters
    ----------
    table : a ``CostTable``; its fits and geometry are copied into numpy arrays here.
    """

    def __init__(self, table: CostTable, *, kv_aware: bool = True):
        rows = table.geometry_block.target_rows
        self.target_rows: dict[int, list[int]] = {int(b): list(gs) for b, gs in rows.items()}
        self._gmax = max((max(v) for v in rows.values() if v), default=0) + 1
        self._legal = np.array(
            sorted(b * self._gmax + g for b, gs in self.target_rows.items() for g in gs),
            dtype=np.float64,
        )
        fits = []
        for f in table.fits:
            if f.model == "additive":
                p = f.additive
                arrays = (
                    float(p.bias_ms),
                    np.asarray(p.bcap_levels, dtype=np.float64),
                    np.asarray(p.alpha_ms, dtype=np.float64),
                    np.asarray(p.g_levels, dtype=np.float64),
                    np.asarray(p.theta_ms, dtype=np.float64),
                    p.k_term,
                    np.asarray(p.delta_ms, dtype=np.float64),
                )
                k_levels = sorted({w.k for w in f.windows}) if p.delta_ms else None
            else:
                p = f.sps
                arrays = (
                    np.asarray(p.bcap_levels, dtype=np.float64),
                    np.asarray(p.g_levels, dtype=np.float64),
                    np.asarray(p.cost_ms, dtype=np.float64),
                    None if p.k is None else np.asarray(p.k, dtype=np.float64),
                )
                k_levels = None if p.k is None else sorted(set(p.k))
            fits.append(
                _Fit(
                    float(f.min_kv_length),
                    float(f.max_kv_length),
                    f.model,
                    list(p.bcap_levels),
                    list(p.g_levels),
                    arrays,
                    frozenset((pt.bcap, pt.g) for pt in f.diagnostics.points),
                    f.context_index,
                    k_levels,
                )
            )
        self._fits = tuple(fits)
        self.model = table.model
        kvm = table.kv_model if kv_aware else None
        #: The KV model (``speccal.costmodel.kv.KVCostModel`` rebuilt from the table) or None.
        self._kv = None
        #: Inclusive KV span the KV model prices (None: the per-interval fits answer).
        self.kv_span: tuple[float, float] | None = None
        #: The k a KV model with a draft-forward term prices (None: it does not depend on k).
        self._kv_k: list[int] | None = None
        if kvm is not None:
            self._kv = kvm.estimator()
            self.kv_span = (float(kvm.min_kv_length), float(kvm.max_kv_length))
            self._kv_k = kvm.k_levels()
        #: Inclusive KV bounds of each context interval, in the table's order.
        self.intervals: tuple[tuple[float, float], ...] = tuple((f.lo, f.hi) for f in fits)

    # -- scalar answers
    def _fit_for(self, kv_length: float) -> _Fit | None:
        for f in self._fits:
            if f.lo <= kv_length <= f.hi:
                return f
        return None

    @property
    def depends_on_k(self) -> bool:
        """Whether the answer depends on ``k`` (a draft_step fit with a draft-forward term)."""
        if self._kv is not None:
            return self._kv_k is not None
        return any(f.k_levels is not None for f in self._fits)

    def reason(self, bcap: int, g: int, kv_length: float, k: int | None = None) -> str | None:
        """Why ``(bcap, g, kv_length, k)`` is structurally uncalibrated, or None (it has a fit).

        The positivity of the fitted value is :meth:`cost_ms`'s concern. With a KV model the
        KV span, its levels and the captured buckets decide (:meth:`_kv_reason`).
        """
        if self._kv is not None:
            return self._kv_reason(bcap, g, kv_length, k)
        fit = self._fit_for(kv_length)
        if fit is None:
            spans = [[int(f.lo), int(f.hi)] for f in self._fits]
            return f"kv_length {kv_length} outside every calibrated context interval {spans}"
        if bcap not in fit.bcap_levels:
            return f"bcap {bcap} is not a calibrated request bucket (calibrated: {fit.bcap_levels})"
        rows = self.target_rows.get(bcap, [])
        if g not in rows:
            return f"g {g} is not a captured target bucket of bcap {bcap} (captured: {rows})"
        why = k_reason(fit.k_levels, k, "fit")
        if why is not None:
            return why
        if fit.kind == "additive":
            if g not in fit.g_levels:
                return f"g {g} is not a calibrated target bucket (calibrated: {fit.g_levels})"
            return None
        levels = fit.g_range(k)
        if not levels[0] <= g <= levels[-1]:
            at = "" if fit.k_levels is None else f" of k {k}"
            return (f"g {g} is outside the calibrated range{at} [{levels[0]}, {levels[-1]}] "
                    "(no extrapolation)")
        return None

    def _kv_reason(self, bcap: int, g: int, kv_length: float, k: int | None) -> str | None:
        lo, hi = self.kv_span
        if not lo <= kv_length <= hi:
            return (
                f"kv_length {kv_length} outside the calibrated KV span [{int(lo)}, {int(hi)}] "
                "(no extrapolation)"
            )
        bl, gl = self._kv.bcap_levels_.tolist(), self._kv.g_levels_.tolist()
        if bcap not in bl:
            return f"bcap {bcap} is not a calibrated request bucket (calibrated: {bl})"
        rows = self.target_rows.get(bcap, [])
        if g not in rows:
            return f"g {g} is not a captured target bucket of bcap {bcap} (captured: {rows})"
        if g not in gl:
            return f"g {g} is not a calibrated target bucket (calibrated: {gl})"
        return k_reason(self._kv_k, k, "KV model")

    def cost_ms(self, bcap: int, g: int, kv_length: float, k: int | None = None) -> CostLookup:
        """Full-step cost in ms at ``(bcap, g)`` and ``kv_length``, or an uncalibrated answer.

        Reasons: those of :meth:`reason`, or ``"fitted cost not positive"`` with the predicted
        value.
        """
        why = self.reason(bcap, g, kv_length, k)
        if why is not None:
            return CostLookup(math.nan, False, why)
        value = float(self.fitted(bcap, g, kv_length, k))
        if not value > 0:
            at = "" if k is None else f", k {k}"
            return CostLookup(
                math.nan,
                False,
                f"{NOT_POSITIVE} ({value:.3f} ms at bcap {bcap}, g {g}{at}): the {self.model} "
                "fit is not physical here",
            )
        return CostLookup(value, True, None)

    def nonpositive_cells(self) -> list[dict[str, Any]]:
        """Calibrated cells where a fit predicts a step cost ``<= 0`` ms, per context interval.

        Every captured ``(bcap, g)`` of the geometry that would otherwise be calibrated is
        checked (a fit is constant over its KV interval), at every ``k`` a k-dependent fit
        prices. Returns one dict per cell: ``context_index, min_kv_length, max_kv_length, bcap,
        g, k`` (None for a fit that does not depend on it), ``cost_ms, measured``.
        """
        cells = []
        for f in self._fits:
            ks = self._kv_k if self._kv is not None else f.k_levels
            for b in f.bcap_levels:
                for g in self.target_rows.get(b, []):
                    for k in ks or (None,):
                        if self.reason(b, g, f.lo, k) is not None:
                            continue
                        # A KV model is linear in kv: its least cost on the interval is at an end.
                        value = float(min(self.fitted(b, g, f.lo, k),
                                          self.fitted(b, g, f.hi, k)))
                        if not value > 0:
                            cells.append({
                                "context_index": f.context_index,
                                "min_kv_length": int(f.lo),
                                "max_kv_length": int(f.hi),
                                "bcap": b,
                                "g": g,
                                "k": k,
                                "cost_ms": value,
                                "measured": (b, g) in f.measured,
                            })
        return cells

    # -- vectorised answers
    def fitted(self, bcap: Any, g: Any, kv_length: Any, k: Any = None) -> np.ndarray:
        """What the fits predict in ms, broadcasting the arguments; NaN where uncalibrated
        (``k`` None: NaN wherever the fit depends on k)."""
        b, gg, kv, kk = np.broadcast_arrays(
            np.asarray(bcap, dtype=np.float64),
            np.asarray(g, dtype=np.float64),
            np.asarray(kv_length, dtype=np.float64),
            np.asarray(np.nan if k is None else k, dtype=np.float64),
        )
        have_k = k is not None
        if self._kv is not None:
            base, per_token = self.kv_line(b, gg, kk if have_k else None)
            out = np.array(base + per_token * kv, dtype=np.float64)
            out[(kv < self.kv_span[0]) | (kv > self.kv_span[1])] = np.nan
            return out if out.ndim else out[()]
        out = np.full(b.shape, np.nan)
        for f in self._fits:
            m = (kv >= f.lo) & (kv <= f.hi)
            if f.k_levels is not None:
                m &= np.isin(kk, f.k_levels)
            if not m.any():
                continue
            bm, gm, km = b[m], gg[m], (kk[m] if have_k else None)
            if f.kind == "additive":
                bias, bl, alpha, gl, theta, k_term, delta = f.arrays
                out[m] = (bias + level_lookup(bm, bl, alpha) + level_lookup(gm, gl, theta)
                          + k_part(k_term, delta, bl, bm, km, gm))
            else:
                bl, gl, cost, ks = f.arrays
                covered = level_lookup(bm, bl, np.zeros(len(bl)))  # 0 if calibrated, else NaN
                out[m] = sps_curves(gm, km, gl, cost, ks) + covered
        out[~self._captured(b, gg)] = np.nan
        return out if out.ndim else out[()]

    def _captured(self, b: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Whether each ``(b, g)`` is a captured target bucket of its Bcap in the geometry."""
        if not len(self._legal):
            return np.zeros(np.shape(b), dtype=bool)
        key = b * self._gmax + g
        idx = np.clip(np.searchsorted(self._legal, key), 0, len(self._legal) - 1)
        return self._legal[idx] == key

    def kv_line(self, bcap: Any, g: Any, k: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """The KV model's answer as a line in KV, ``(base, per_token)`` broadcast over
        ``(bcap, g, k)``: :meth:`fitted` is ``base + per_token * kv`` inside :attr:`kv_span`
        (NaN outside it), with the same operations, so a caller holding the line of a batch
        state prices every KV identically. NaN where the point is uncalibrated at every KV
        (not a level, not captured, a k the model does not price). Only for a table with a KV
        model (:attr:`kv_span` not None)."""
        if self._kv is None:
            raise ValueError("kv_line: this lookup has no KV model (kv_span is None)")
        b, gg, kk = np.broadcast_arrays(
            np.asarray(bcap, dtype=np.float64),
            np.asarray(g, dtype=np.float64),
            np.asarray(np.nan if k is None else k, dtype=np.float64),
        )
        base, per_token = self._kv.line_at(b, gg, None if k is None else kk)
        base = np.array(base, dtype=np.float64)
        off = ~self._captured(b, gg)
        if self._kv_k is not None:
            off |= ~np.isin(kk, self._kv_k)
        base[off] = np.nan
        return base, np.asarray(per_token, dtype=np.float64)

    def surface(self, bcap: Any, g: Any, kv_length: Any, k: Any = None) -> np.ndarray:
        """:meth:`fitted` with cells whose fitted cost is not positive as NaN (uncalibrated)."""
        out = _positive(np.asarray(self.fitted(bcap, g, kv_length, k), dtype=np.float64))
        return out if out.ndim else out[()]

    def surface_on_line(self, line: tuple[np.ndarray, np.ndarray], kv_length: float
                        ) -> np.ndarray:
        """:meth:`surface` at one KV length from a :meth:`kv_line` (the span, the fitted value,
        then positivity: the surface's own operations, so the same values)."""
        base, per_token = line
        lo, hi = self.kv_span
        if not lo <= kv_length <= hi:
            return np.full(np.shape(base), np.nan)
        return _positive(base + per_token * kv_length)

    def memo(self) -> LookupMemo:
        """A fresh exact memo for scalar lookups on this table (keyed by the exact KV length
        when a KV model prices it)."""
        return LookupMemo(self.intervals, exact_kv=self._kv is not None)


def _positive(cost: np.ndarray) -> np.ndarray:
    """``cost`` with every value that is not positive as NaN (NaN stays NaN): a step cost is
    physical."""
    return np.where(cost > 0, cost, np.nan)


def evaluate(
    cost: Callable[..., np.ndarray],
    bcap: Any,
    g: Any,
    kv_length: Any,
    k: Any = None,
) -> np.ndarray:
    """``cost`` at padded buckets, broadcasting; NaN where ``bcap`` or ``g`` is 0 (no bucket).

    ``cost`` is only called on the points that have both buckets (a table's
    :meth:`TableLookup.surface` or any ``f(bcap, g, kv) -> ms`` with NaN = uncalibrated);
    ``k``, the rounds' draft forwards, is passed on as a fourth argument when given.
    """
    b, gg, kv, kk = np.broadcast_arrays(
        np.asarray(bcap, dtype=np.int64),
        np.asarray(g, dtype=np.int64),
        np.asarray(kv_length, dtype=np.float64),
        np.asarray(0 if k is None else k, dtype=np.int64),
    )
    ok = (b > 0) & (gg > 0)
    out = np.full(b.shape, np.nan)
    if ok.any():
        args = (b[ok], gg[ok], kv[ok]) + (() if k is None else (kk[ok],))
        out[ok] = np.asarray(cost(*args), dtype=np.float64)
    return out


class LookupMemo:
    """Exact memo of scalar lookups on one table (see the module docstring for the key).

    Parameters
    ----------
    intervals : inclusive ``(min_kv_length, max_kv_length)`` of the table's context intervals.
    exact_kv : key on the KV length itself (a KV-aware table's cost moves with every token);
        such a memo is cleared when it holds :data:`MAX_EXACT_ENTRIES` answers, so a live run
        whose KV grows every round keeps a bounded memo.
    """

    def __init__(self, intervals: Sequence[tuple[float, float]], *, exact_kv: bool = False):
        self.intervals = tuple((float(lo), float(hi)) for lo, hi in intervals)
        self.exact_kv = exact_kv
        self._values: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self._values)

    def key(self, name: str, ints: Sequence[Any], kv_length: Any = None) -> tuple | None:
        """The memo key, or None when an argument is not a scalar (integral for ``ints``)."""
        parts: list[Any] = [name]
        for x in ints:
            x = scalar(x)
            if x is None or not float(x).is_integer():
                return None
            parts.append(int(x))
        if kv_length is not None:
            kv = scalar(kv_length)
            if kv is None:
                return None
            kv = float(kv)
            if self.exact_kv:
                parts.append(kv)
            else:
                parts.append(tuple(lo <= kv <= hi for lo, hi in self.intervals))
        return tuple(parts)

    def get(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """The memoised value of ``key`` (computed once); arrays are returned as copies."""
        if key not in self._values:
            if self.exact_kv and len(self._values) >= MAX_EXACT_ENTRIES:
                self._values.clear()
            self._values[key] = compute()
        return _copy(self._values[key])


_SCALARS = (int, float, np.integer, np.floating)


def scalar(x: Any) -> int | float | None:
    """``x`` as a Python number when it is a real scalar (0-d arrays too), else None."""
    if isinstance(x, _SCALARS) and not isinstance(x, bool):
        return x
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf":
        return x.item()
    return None


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value


def memoised(name: str, *, kv: bool):
    """Method decorator: memoise on ``self.memo`` (a :class:`LookupMemo`, or None = off).

    The method's positional arguments are integer scalars, followed by a KV length when ``kv``;
    an array argument, or any keyword argument, bypasses the memo (such calls compute directly).
    """

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            memo = self.memo
            if memo is None or kwargs or not args:
                return method(self, *args, **kwargs)
            key = memo.key(name, args[:-1], args[-1]) if kv else memo.key(name, args)
            if key is None:
                return method(self, *args)
            return memo.get(key, lambda: method(self, *args))

        return wrapper

    return decorate
