"""The cost-table file: save, load (with migration and compatibility checks), parse, JSON Schema.

A table file is one JSON document of ``speccal.costmodel.table_schema`` (schema version 5; the
JSON Schema of every version is committed under ``tables/schema/cost_table.vN.schema.json``).
Files are written canonically (sorted keys, ``allow_nan=False``) and atomically, so save -> load
-> save is byte-identical. Saving always writes the latest version. Building a table from
measurements is ``speccal.costmodel.table_build``.

Loading migrates older documents forward, one version at a time (:data:`MIGRATIONS`):

- no ``schema_version`` (legacy, unversioned) -> 1: a missing ``draft_width`` means 7, a missing
  geometry is rebuilt from the fits, a missing provenance is marked unknown;
- 1 -> 2: the execution path was never recorded: ``attention_backend`` and ``input_update``
  become ``unknown``, ``kernels`` ``{"digest": "unknown", "config": null}`` (loading such a table
  against a running config warns that its kernel configuration is unknown);
- 2 -> 3: fits without a draft-forward term (:func:`migrate_v2`);
- 3 -> 4: unchanged (version 4 adds the KV model's ``shared_rows`` slope, :func:`migrate_v3`);
- 4 -> 5: unchanged (version 5 adds the optional ``kv_spread`` block, :func:`migrate_v4`);
- 5 -> 6: the ``kv_spread`` block's ``context_index`` moves into each point (version 6 measures
  spread points per context, :func:`migrate_v5`).

``provenance.migrated_from`` names the oldest version a document came from (``legacy``, ``v1``).
A newer version is refused with ``SchemaError``; so are unreadable JSON, unknown or missing keys,
NaN or Infinity anywhere, unphysical measured values (a negative bias, non-positive window times
or sps costs) and internally inconsistent content. With ``expect`` the compatibility metadata is
checked (``speccal.costmodel.compat``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from speccal import __version__
from speccal.base.atomic import read_bytes, write_json_atomic
from speccal.base.errors import GridError, InputError, SchemaError
from speccal.base.geometry import MAX_REQUEST_BUCKETS, Geometry, default_target_rows
from speccal.costmodel.compat import UNKNOWN_EXECUTION, Compatibility, check_compatibility
from speccal.costmodel.grid import check_contexts
from speccal.costmodel.kv import KV_FORMS, NEEDS_K
from speccal.costmodel.lookup import n_delta
from speccal.costmodel.measurements import STEP_MS_RTOL, check_shapes
from speccal.costmodel.table_schema import SCHEMA_VERSION, CostTable, validate_block

LEGACY_DRAFT_WIDTH = 7
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "tables" / "schema"


def schema_path(version: int = SCHEMA_VERSION) -> Path:
    """The committed JSON Schema file of table ``version``."""
    return SCHEMA_DIR / f"cost_table.v{version}.schema.json"


SCHEMA_PATH = schema_path()


def save_table(table: CostTable, path: str | os.PathLike) -> Path:
    """Write ``table`` atomically as canonical JSON (the latest schema version)."""
    return write_json_atomic(path, table.to_json_dict())


def load_table(
    path: str | os.PathLike,
    expect: Compatibility | Mapping[str, Any] | None = None,
    *,
    runtime_versions: Mapping[str, str | None] | None = None,
) -> CostTable:
    """Read, migrate and validate a cost table; check it against ``expect`` when given.

    Parameters
    ----------
    path : the table file.
    expect : compatibility metadata of the running config (``Engine.compatibility()``).
    runtime_versions : ``speccal_version``/``torch_version``/``driver_version`` of the running
        process for the performance-only check; default: this speccal and the imported torch.

    Raises
    ------
    SchemaError
        Missing, empty, truncated or non-JSON file; unknown or missing keys; a newer
        ``schema_version``; internally inconsistent content.
    CompatibilityError
        A semantic mismatch with ``expect`` (names expected and found values).

    Warns
    -----
    CompatibilityWarning
        A performance-only mismatch with ``expect``.
    """
    p = Path(path)
    try:
        raw = read_bytes(p, "table")  # refuses a FIFO or device, which would block or never end
    except InputError as exc:
        raise SchemaError(
            "table", str(p), f"a readable cost table file ({exc.hint or exc.expected})"
        ) from None
    table = parse_table(raw, source=str(p))
    if expect is not None:
        versions = runtime_versions
        if versions is None:
            torch = sys.modules.get("torch")
            versions = {
                "speccal_version": __version__,
                "torch_version": getattr(torch, "__version__", None),
            }
        check_compatibility(
            expect,
            table.compatibility,
            expected_versions=versions,
            found_versions=table.provenance.versions(),
            source=f"table {p.name}",
        )
    return table


def parse_table(raw: bytes | str, source: str = "table") -> CostTable:
    """Parse table bytes (see :func:`load_table`), migrating older documents forward."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        raise SchemaError(source, "empty file", "a JSON cost table")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            source,
            f"invalid JSON at line {exc.lineno} column {exc.colno}",
            f"a complete JSON cost table ({exc.msg})",
        ) from None
    if not isinstance(doc, dict):
        raise SchemaError(source, type(doc).__name__, "a JSON object")
    if "schema_version" not in doc:
        doc = migrate_legacy(doc, source)
    version = doc["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SchemaError(f"{source}: schema_version", version, "a positive integer")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{source}: schema_version",
            version,
            f"<= {SCHEMA_VERSION}: written by a newer speccal; upgrade speccal to read it",
        )
    while doc["schema_version"] < SCHEMA_VERSION:
        doc = MIGRATIONS[doc["schema_version"]](doc, source)
    table = validate_block(CostTable, doc, source, SchemaError, strict=True)
    _check_consistent(table, source)
    return table


def migrate_legacy(doc: dict, source: str = "table") -> dict:
    """Migrate an unversioned (legacy) table document to schema version 1 (then see
    :data:`MIGRATIONS`).

    A legacy table is laid out like version 1 without ``schema_version``; ``draft_width`` may be
    absent anywhere (read as width 7, as the xLLM seed specifies), ``geometry`` and
    ``provenance`` may be absent (geometry is rebuilt from the fitted levels with the split-graph
    legal buckets; provenance is marked unknown).
    """
    doc = json.loads(json.dumps(doc))  # deep copy of plain JSON
    compat = doc.get("compatibility")
    if not isinstance(compat, dict):
        raise SchemaError(f"{source}: compatibility", compat, "a compatibility object")
    w = compat.get("draft_width", LEGACY_DRAFT_WIDTH)
    compat["draft_width"] = w
    cal = doc.get("calibration")
    if isinstance(cal, dict):
        cal.setdefault("draft_width", w)
    if "geometry" not in doc:
        fits = doc.get("fits") or []
        bcaps: set[int] = set()
        gs: set[int] = set()
        for f in fits:
            params = f.get("additive") or f.get("sps") or {}
            bcaps.update(int(b) for b in params.get("bcap_levels", []))
            gs.update(int(g) for g in params.get("g_levels", []))
        if not bcaps:
            raise SchemaError(f"{source}: fits", "no bcap levels", "fits with bcap_levels")
        legal = default_target_rows(sorted(bcaps), int(w))
        # a measured G joins the buckets of every Bcap that can run it ([Bcap, Bcap * (w + 1)])
        rows = {
            b: sorted(set(legal[b]) | {g for g in gs if b <= g <= b * (int(w) + 1)})
            for b in sorted(bcaps)
        }
        doc["geometry"] = Geometry(
            draft_width=int(w), request_buckets=tuple(sorted(bcaps)), target_rows=rows
        ).to_dict()
    else:
        doc["geometry"].setdefault("draft_width", w)
    if "provenance" not in doc:
        doc["provenance"] = {"speccal_version": "unknown", "created": "unknown"}
    doc["provenance"]["migrated_from"] = "legacy"
    doc["schema_version"] = 1
    return doc


def migrate_v1(doc: dict, source: str = "table") -> dict:
    """Migrate a schema version 1 document to version 2: the execution path becomes unknown.

    Version 1 recorded no ``attention_backend``, ``input_update`` or kernel configuration; a v1
    document that has one of them is malformed and refused.
    """
    doc = json.loads(json.dumps(doc))
    compat = doc.get("compatibility")
    if not isinstance(compat, dict):
        raise SchemaError(f"{source}: compatibility", compat, "a compatibility object")
    for key, value in UNKNOWN_EXECUTION.items():
        if key in compat:
            raise SchemaError(
                f"{source}: compatibility.{key}",
                compat[key],
                "no such key in a schema version 1 table (added in version 2)",
            )
        compat[key] = json.loads(json.dumps(value))
    prov = doc.get("provenance")
    if isinstance(prov, dict):
        prov["migrated_from"] = prov.get("migrated_from") or "v1"
    doc["schema_version"] = 2
    return doc


def migrate_v2(doc: dict, source: str = "table") -> dict:
    """Migrate a schema version 2 document to version 3: fits without a draft-forward term.

    Version 3 adds the draft-forward term of draft_step fits (``k_term``, ``delta_ms``; sps: one
    curve per ``k``) and each point's ``k`` / ``num_requests``. A version 2 fit has no term
    (``k_term`` ``none``, one sps curve): it prices every cell exactly as before. Each point's
    ``k`` and ``num_requests`` are read from its windows (a version 2 point held one ``k``).
    """
    doc = json.loads(json.dumps(doc))
    fits = doc.get("fits")
    for i, fit in enumerate(fits if isinstance(fits, list) else ()):
        if not isinstance(fit, dict):
            continue
        for block, keys in (("additive", ("k_term", "delta_ms", "k_selection")), ("sps", ("k",))):
            params = fit.get(block)
            for key in keys if isinstance(params, dict) else ():
                if key in params:
                    raise SchemaError(f"{source}: fits.{i}.{block}.{key}", params[key],
                                      "no such key in a schema version 2 table (added in "
                                      "version 3)")
        shapes: dict[tuple, dict] = {}
        for w in fit.get("windows") or ():
            if isinstance(w, dict):
                got = shapes.setdefault((w.get("bcap"), w.get("g")), {"k": w.get("k"),
                                                                     "num_requests": 0})
                got["num_requests"] = max(got["num_requests"], w.get("num_requests") or 0)
        diag = fit.get("diagnostics")
        for p in (diag.get("points") or ()) if isinstance(diag, dict) else ():
            got = shapes.get((p.get("bcap"), p.get("g"))) if isinstance(p, dict) else None
            if got is not None:
                p.setdefault("k", got["k"])
                p.setdefault("num_requests", got["num_requests"] or None)
    prov = doc.get("provenance")
    if isinstance(prov, dict):
        prov["migrated_from"] = prov.get("migrated_from") or "v2"
    doc["schema_version"] = 3
    return doc


#: ``{version: migrate to version + 1}``; :func:`parse_table` applies them in order.
def migrate_v3(doc: dict, source: str = "table") -> dict:
    """Migrate a schema version 3 document to version 4: nothing to change.

    Version 4 adds the requests a verify serves, ``G / (k + 1)``, to draft_step models: the KV
    model's ``shared_rows`` slope (``speccal.costmodel.kv``) and the additive fits'
    ``shared_rows`` / ``per_bcap_rows`` draft-forward terms (``speccal.costmodel.additive``),
    which a version 3 reader refuses; every version 3 table prices exactly as before.
    """
    doc = json.loads(json.dumps(doc))
    kvm = doc.get("kv_model")
    if isinstance(kvm, dict) and kvm.get("kv_term") == "shared_rows":
        raise SchemaError(f"{source}: kv_model.kv_term", "shared_rows",
                          "a slope form of schema version 3 (shared_rows was added in 4)")
    fits = doc.get("fits")
    for i, fit in enumerate(fits if isinstance(fits, list) else ()):
        add = fit.get("additive") if isinstance(fit, dict) else None
        term = add.get("k_term") if isinstance(add, dict) else None
        if isinstance(term, str) and term.endswith("_rows"):
            raise SchemaError(f"{source}: fits.{i}.additive.k_term", term,
                              "a draft-forward term of schema version 3 (the rows forms were "
                              "added in 4)")
    return _stamped(doc, 3)


def _stamped(doc: dict, version: int) -> dict:
    """``doc`` moved from ``version`` to the next one, naming ``version`` as its origin unless
    it came from an older one (``provenance.migrated_from``)."""
    prov = doc.get("provenance")
    if isinstance(prov, dict):
        prov["migrated_from"] = prov.get("migrated_from") or f"v{version}"
    doc["schema_version"] = version + 1
    return doc


def migrate_v4(doc: dict, source: str = "table") -> dict:
    """Migrate a schema version 4 document to version 5: nothing to change.

    Version 5 adds the optional ``kv_spread`` block (``speccal.costmodel.spread``: what a
    round's spread of KV lengths costs past its mean-KV price), which a version 4 reader
    refuses; a version 4 table has none and prices exactly as before.
    """
    doc = json.loads(json.dumps(doc))
    if "kv_spread" in doc:
        raise SchemaError(f"{source}: kv_spread", "present",
                          "no kv_spread block in a schema version 4 table (added in 5)")
    return _stamped(doc, 4)


def migrate_v5(doc: dict, source: str = "table") -> dict:
    """Migrate a schema version 5 document to version 6: the ``kv_spread`` block's one
    ``context_index`` moves into each of its points.

    Version 6 measures the spread points at every context and prices the term by the round's
    mean KV between them (``speccal.costmodel.spread``); a version 5 table's points, all at one
    context, price every KV alike, as before. A version 5 reader refuses a version 6 block.
    """
    doc = json.loads(json.dumps(doc))
    block = doc.get("kv_spread")
    if isinstance(block, dict):
        if "context_index" not in block:
            raise SchemaError(f"{source}: kv_spread.context_index", None,
                              "the context of a schema version 5 spread block")
        ci = block.pop("context_index")
        points = block.get("points")
        for p in points if isinstance(points, list) else ():
            if isinstance(p, dict):
                p.setdefault("context_index", ci)
    return _stamped(doc, 5)


MIGRATIONS: dict[int, Callable[[dict, str], dict]] = {1: migrate_v1, 2: migrate_v2,
                                                       3: migrate_v3, 4: migrate_v4,
                                                       5: migrate_v5}


def _check_consistent(t: CostTable, source: str) -> None:
    w = t.compatibility.draft_width
    for name, value in (
        ("calibration.draft_width", t.calibration.draft_width),
        ("geometry.draft_width", t.geometry_block.draft_width),
    ):
        if value != w:
            raise SchemaError(f"{source}: {name}", value, f"compatibility.draft_width = {w}")
    try:
        check_contexts(
            {f.context_index: (f.prefill_tokens, f.min_kv_length, f.max_kv_length) for f in t.fits}
        )
    except GridError as exc:
        raise SchemaError(f"{source}: fits", exc.value, exc.expected) from None
    for i, f in enumerate(t.fits):
        where = f"{source}: fits.{i}"
        if f.min_kv_length > f.max_kv_length:
            raise SchemaError(
                f"{where}.min_kv_length", f.min_kv_length, f"<= max_kv_length {f.max_kv_length}"
            )
        if f.model != t.calibration.model:
            raise SchemaError(
                f"{where}.model", f.model, f"calibration.model = {t.calibration.model!r}"
            )
        params = f.additive if f.model == "additive" else f.sps
        other = f.sps if f.model == "additive" else f.additive
        if params is None or other is not None:
            raise SchemaError(
                f"{where}.{f.model}", None, f"exactly the {f.model!r} parameter block"
            )
        if f.model == "additive":
            pairs = (("bcap_levels", "alpha_ms"), ("g_levels", "theta_ms"))
        else:
            pairs = (("g_levels", "cost_ms"),)
        for lv, val in pairs:
            a, b = getattr(params, lv), getattr(params, val)
            if f.model == "sps" and f.sps.k is not None:
                continue  # one curve per k: checked by _check_k_term
            if len(a) == 0 or len(a) != len(b) or a != sorted(set(a)):
                raise SchemaError(
                    f"{where}.{f.model}.{lv}", a, f"ascending distinct levels, one {val} each"
                )
        if f.model == "sps" and not f.sps.bcap_levels:
            raise SchemaError(f"{where}.sps.bcap_levels", [], "the request buckets measured")
        _check_k_term(t, f, where)
    _check_geometry(t, source)
    _check_windows(t, source)
    _check_routing(t, source)
    _check_predictions(t, source)
    if t.kv_model is not None:
        _check_kv_model(t, source)
    if t.kv_spread is not None:
        _check_kv_spread(t, source)


def _check_kv_spread(t: CostTable, source: str) -> None:
    """Each spread point at a context of the fits, at most one per context and bucket."""
    contexts = {f.context_index for f in t.fits}
    seen: set[tuple[int, int]] = set()
    for i, p in enumerate(t.kv_spread.points):
        where = f"{source}: kv_spread.points.{i}"
        if p.context_index not in contexts:
            raise SchemaError(f"{where}.context_index", p.context_index,
                              f"one of the fits' contexts {sorted(contexts)}")
        if (p.context_index, p.bcap) in seen:
            raise SchemaError(f"{where}.bcap", p.bcap,
                              f"at most one point per bucket at context {p.context_index}")
        seen.add((p.context_index, p.bcap))


def _check_k_term(t: CostTable, f: Any, where: str) -> None:
    """A draft-forward term only in draft_step tables, with one delta per its form; a per-k
    sps fit's ``k`` parallel to ``g_levels``, each curve ascending in G."""
    if f.model == "additive":
        p = f.additive
        want = n_delta(p.k_term, len(p.bcap_levels))
        if len(p.delta_ms) != want:
            raise SchemaError(f"{where}.additive.delta_ms", p.delta_ms,
                              f"{want} value(s) for k_term {p.k_term!r}")
        if p.k_term != "none" and t.calibration.mode != "draft_step":
            raise SchemaError(f"{where}.additive.k_term", p.k_term,
                              "'none' in a target_verify table (every round runs k = w)")
        return
    p = f.sps
    if p.k is None:
        return
    if t.calibration.mode != "draft_step":
        raise SchemaError(f"{where}.sps.k", p.k, "null in a target_verify table (one curve)")
    if len(p.k) != len(p.g_levels) or len(p.cost_ms) != len(p.g_levels):
        raise SchemaError(f"{where}.sps.k", p.k,
                          f"one k per G level ({len(p.g_levels)}), parallel to cost_ms")
    curves: dict[int, list[int]] = {}
    for g, k in zip(p.g_levels, p.k, strict=True):
        curves.setdefault(k, []).append(g)
    for k, gs in curves.items():
        if gs != sorted(set(gs)):
            raise SchemaError(f"{where}.sps.g_levels", gs,
                              f"ascending distinct G levels on the curve of k {k}")


#: Relative tolerance between a stored prediction and the stored parameters' own (JSON keeps
#: every float exactly; the slack only covers the order of floating-point additions).
PREDICTION_RTOL = 1e-9


def _check_geometry(t: CostTable, source: str) -> None:
    """The geometry is one a runner can capture (``speccal.base.geometry``): ascending distinct
    request buckets (at most ``MAX_REQUEST_BUCKETS``), each with ascending distinct target
    buckets in ``[Bcap, Bcap * (w + 1)]`` including full width; what the calibration block says
    it sampled lies inside it."""
    geo, w, where = t.geometry_block, t.compatibility.draft_width, f"{source}: geometry"
    buckets = geo.request_buckets
    if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
        raise SchemaError(
            f"{where}.request_buckets", buckets, "ascending distinct integers >= 1, at least one"
        )
    if len(buckets) > MAX_REQUEST_BUCKETS:
        raise SchemaError(
            f"{where}.request_buckets", len(buckets), f"at most {MAX_REQUEST_BUCKETS} buckets"
        )
    if sorted(geo.target_rows) != buckets:
        raise SchemaError(
            f"{where}.target_rows", sorted(geo.target_rows), f"one key per request bucket {buckets}"
        )
    for b in buckets:
        gs, full = geo.target_rows[b], b * (w + 1)
        if gs != sorted(set(gs)) or not gs or gs[0] < b or gs[-1] != full:
            raise SchemaError(
                f"{where}.target_rows.{b}",
                gs,
                f"ascending distinct target buckets in [{b}, {full}] (Bcap .. Bcap * (w + 1), "
                f"w = {w}) ending at full width {full}",
            )
    cal = t.calibration
    for b in cal.request_buckets:
        if b not in geo.target_rows:
            raise SchemaError(
                f"{source}: calibration.request_buckets",
                cal.request_buckets,
                f"captured request buckets (geometry: {buckets})",
            )
    for b, gs in cal.target_graph_rows.items():
        extra = [g for g in gs if g not in geo.target_rows.get(b, ())]
        if extra:
            raise SchemaError(
                f"{source}: calibration.target_graph_rows.{b}",
                gs,
                f"captured target buckets of Bcap {b} (geometry: "
                f"{list(geo.target_rows.get(b, ()))})",
            )
    if geo.kv_capacity_tokens and geo.kv_capacity_tokens % geo.block_size:
        raise SchemaError(
            f"{where}.kv_capacity_tokens",
            geo.kv_capacity_tokens,
            f"a multiple of block_size {geo.block_size}",
        )


def _check_windows(t: CostTable, source: str) -> None:
    """Every raw window is one the table's geometry and mode can produce, and its ``step_ms``
    is ``1000 * elapsed_s / window_steps`` (the rule of ``speccal.costmodel.measurements``)."""
    geo, w = t.geometry_block, t.compatibility.draft_width
    for i, f in enumerate(t.fits):
        for j, win in enumerate(f.windows):
            where = f"{source}: fits.{i}.windows.{j}"
            expected = 1000.0 * win.elapsed_s / win.window_steps
            if not math.isclose(win.step_ms, expected, rel_tol=STEP_MS_RTOL, abs_tol=0.0):
                raise SchemaError(
                    f"{where}.step_ms",
                    win.step_ms,
                    f"1000 * elapsed_s / window_steps = {expected!r}",
                )
            if win.g not in geo.target_rows.get(win.bcap, ()):
                raise SchemaError(
                    f"{where}.g" if win.bcap in geo.target_rows else f"{where}.bcap",
                    win.g if win.bcap in geo.target_rows else win.bcap,
                    f"a captured shape (geometry.target_rows: "
                    f"{ {b: list(g) for b, g in geo.target_rows.items()} })",
                )
        if not f.windows:
            continue
        df = pd.DataFrame([win.model_dump() for win in f.windows]).assign(
            context_index=f.context_index
        )
        try:
            check_shapes(df, t.calibration.mode, w)
        except InputError as exc:
            raise SchemaError(
                f"{source}: fits.{i}.windows: {exc.field.removeprefix('measurements.')}",
                exc.value,
                exc.expected,
                hint=exc.hint,
            ) from None


def _check_routing(t: CostTable, source: str) -> None:
    """Windows and points count routed experts exactly when ``calibration.routing`` says what
    they count: every window within ``[top_k, experts]``, every point the mean of its windows."""
    routing = t.calibration.routing
    for i, f in enumerate(t.fits):
        per_point: dict[tuple[int, int, int], list[float]] = {}
        for j, win in enumerate(f.windows):
            where, v = f"{source}: fits.{i}.windows.{j}.experts_activated", win.experts_activated
            if routing is None:
                if v is not None:
                    raise SchemaError(where, v, "absent: the table has no calibration.routing "
                                      "(a dense target's table counts no experts)")
                continue
            if v is None or not routing.top_k <= v <= routing.experts:
                raise SchemaError(
                    where, "missing" if v is None else v,
                    f"a mean in [top_k, experts] = [{routing.top_k}, {routing.experts}] "
                    "(calibration.routing)")
            per_point.setdefault((win.bcap, win.g, win.k), []).append(v)
        for j, p in enumerate(f.diagnostics.points):
            where, v = f"{source}: fits.{i}.diagnostics.points.{j}.experts_activated", \
                p.experts_activated
            if routing is None:
                if v is not None:
                    raise SchemaError(where, v, "absent: the table has no calibration.routing")
                continue
            vals = per_point.get((p.bcap, p.g, p.k))
            want = None if not vals else float(np.mean(vals))
            if v is None or want is None or not _close(v, want):
                raise SchemaError(where, "missing" if v is None else v,
                                  f"the mean of the point's windows ({want!r})")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=PREDICTION_RTOL, abs_tol=1e-9)


def _check_predictions(t: CostTable, source: str) -> None:
    """The stored predictions are the stored parameters' own: a parameter edited after the fit
    (or a prediction) disagrees with them at some point."""
    for i, f in enumerate(t.fits):
        pts = [p for p in f.diagnostics.points if p.predicted_ms is not None]
        if not pts:
            continue
        est = f.estimator()
        if any(p.k is None for p in pts):  # migrated from version 2: no term needs k
            X = np.array([[p.bcap, p.g] for p in pts], dtype=np.float64)
        else:
            X = np.array([[p.bcap, p.g, p.k] for p in pts], dtype=np.float64)
        pred = est.predict(X)
        for j, (p, v) in enumerate(zip(pts, pred, strict=True)):
            if not _close(p.predicted_ms, float(v)):
                raise SchemaError(
                    f"{source}: fits.{i}.{f.model}",
                    f"predicted_ms {p.predicted_ms!r} at Bcap {p.bcap}, G {p.g}",
                    f"parameters that predict the stored points ({float(v)!r} ms from "
                    f"fits.{i}.{f.model}; fits.{i}.diagnostics.points.{j} says otherwise: the "
                    "table was edited after its fit)",
                )


def _check_kv_model(t: CostTable, source: str) -> None:
    """The KV model spans exactly the contexts and has one parameter per level."""
    kv, where = t.kv_model, f"{source}: kv_model"
    span = (min(f.min_kv_length for f in t.fits), max(f.max_kv_length for f in t.fits))
    if (kv.min_kv_length, kv.max_kv_length) != span:
        raise SchemaError(
            f"{where}.min_kv_length..max_kv_length",
            [kv.min_kv_length, kv.max_kv_length],
            f"the contexts' span {list(span)}",
        )
    if len(t.fits) < 3:
        raise SchemaError(f"{where}", f"{len(t.fits)} contexts", "three or more context intervals")
    for lv, val in (("bcap_levels", "alpha_ms"), ("g_levels", "theta_ms")):
        a, b = getattr(kv, lv), getattr(kv, val)
        if len(a) == 0 or len(a) != len(b) or a != sorted(set(a)):
            raise SchemaError(f"{where}.{lv}", a, f"ascending distinct levels, one {val} each")
    axis, per_level = KV_FORMS[kv.kv_term]
    want = (len(kv.bcap_levels) if axis == "bcap" else len(kv.g_levels)) if per_level else 1
    if len(kv.beta_ms) != want:
        raise SchemaError(
            f"{where}.beta_ms", kv.beta_ms, f"{want} value(s) for kv_term {kv.kv_term!r}"
        )
    if kv.kv_term in NEEDS_K and t.calibration.mode != "draft_step":
        raise SchemaError(f"{where}.kv_term", kv.kv_term,
                          "a slope over G or Bcap (the rows axis G / (k + 1) needs the "
                          "draft_step rounds' k)")
    want = {"none": 0, "shared": 1, "per_bcap": len(kv.bcap_levels)}[kv.k_term]
    if len(kv.delta_ms) != want:
        raise SchemaError(f"{where}.delta_ms", kv.delta_ms,
                          f"{want} value(s) for k_term {kv.k_term!r}")
    bad = kv.nonpositive_cells(t.geometry_block.target_rows)
    if bad:
        b, g, x, cost = bad[0]
        raise SchemaError(
            f"{where}",
            f"{cost:.6g} ms at Bcap {b}, G {g}, KV {x}",
            "a model pricing every calibrated cell above 0 ms over its span "
            f"[{kv.min_kv_length}, {kv.max_kv_length}] ({len(bad)} cell end(s) are not)",
        )


def json_schema() -> dict:
    """The JSON Schema of the current table version (committed as :data:`SCHEMA_PATH`)."""
    return CostTable.model_json_schema(mode="serialization", by_alias=True)


def write_json_schema(path: str | os.PathLike = SCHEMA_PATH) -> Path:
    """Regenerate the committed JSON Schema file (run after changing the table models)."""
    return write_json_atomic(path, json_schema())
