"""The cost-table document (schema version 6): its pydantic blocks.

Owns the in-memory shape of a table; what it answers at a cell is
``speccal.costmodel.lookup`` (reached through :meth:`CostTable.lookup`), building one from
measurements is ``speccal.costmodel.table_build``, reading and writing the file (and migrating
older versions) is ``speccal.costmodel.table``. The document (JSON Schema committed under
``tables/schema/cost_table.v6.schema.json``)::

    {"schema_version": 6,
     "calibration": {...effective config: model, draft_width, mode, request_buckets,
                     target_graph_rows, contexts, warmup_steps, window_steps,
                     windows_per_point, token_seed, policy, sources, threads,
                     quality: {gate bounds, held-out error seen, flagged and re-measured
                               points, machine load, override used} | null,
                     timing: {loop, windows, device_windows, wall_over_device median/max,
                              device_step_ms_median} | null,
                     routing: {source, experts, top_k, layers} | absent (dense targets)},
     "compatibility": {...see speccal.costmodel.compat: identity, topology and the measured
                       program: graph_mode, attention_backend, input_update, kernels, loop},
     "geometry": {...speccal.base.geometry.Geometry.to_dict()},
     "fits": [{context_index, prefill_tokens, min_kv_length, max_kv_length, model, combine,
               "additive": {bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, reference,
                            k_term, delta_ms, k_selection}
                 or "sps": {g_levels, cost_ms, bcap_levels, k},
               "windows": [raw measured windows, so the table can be refitted; a routed
                           target's carry experts_activated, as do its points],
               "diagnostics": {residuals, leave_one_point_out, leave_one_g_out, points}}],
     "kv_model": {kv_term, k_term, delta_ms, min/max_kv_length, bias_ms, bcap_levels, alpha_ms, g_levels,
                  theta_ms, beta_ms, selected_by, residuals, leave_one_point_out,
                  leave_one_context_out, per_context, candidates, points} | absent
                 (three or more contexts only: see KVModelBlock),
     "kv_spread": {layout, points: [{context_index, bcap, g, k, mean_kv_length,
                   calibrated_excess, spread_excess, calibrated_ms, spread_ms,
                   slope_ms_per_token, windows}]} | absent (speccal.costmodel.spread),
     "provenance": {speccal_version, created, command, python_version, torch_version,
                    driver_version, migrated_from,
                    timings: {compile_capture_s, transition_s, warmup_s, sampling_s} | null}}

Costs are in milliseconds per full step. Every number is finite (``allow_inf_nan=False``) and
every measured quantity physical: the additive bias (the cost of the reference cell) is not
negative, sps costs and window times are positive. :meth:`CostTable.cost_ms` answers one cell
(NaN and a reason when uncalibrated); :meth:`CostTable.cost_surface` is the vectorised numpy
form. :func:`validate_block` turns a pydantic validation failure into a domain error.
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError

from speccal import __version__
from speccal.base.atomic import dumps_json
from speccal.base.geometry import Geometry
from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.compat import Compatibility, pydantic_message
from speccal.costmodel.kv import NEEDS_K, KVCostModel
from speccal.costmodel.lookup import CostLookup, TableLookup
from speccal.costmodel.measurements import validate_measurements
from speccal.costmodel.sps import SPSCostModel

SCHEMA_VERSION = 6


#: A request-bucket key of a ``{Bcap: [G, ...]}`` map: JSON object keys are strings, so the
#: key alone is parsed from its text even when a document is validated strictly.
BucketKey = Annotated[int, Strict(False)]


class _Strict(BaseModel):
    # NaN and Infinity are refused everywhere (JSON has neither; Python's json reads both).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------- calibration config block


class ContextInterval(_Strict):
    prefill_tokens: int = Field(ge=0)
    min_kv_length: int = Field(ge=0)
    max_kv_length: int = Field(ge=0)


class PolicyConfig(_Strict):
    """Adaptive-draft-step policy block (defaults from the xLLM seed)."""

    window_size: int = Field(default=20, ge=1)
    update_interval: int = Field(default=5, ge=1)
    switch_min_gain: float = Field(default=0.05, ge=0.0, lt=1.0)


class LoadBlock(_Strict):
    """The machine load a calibration saw (``speccal.calibrate.machine``); None = unknown."""

    cpu_count: int | None = Field(default=None, ge=1)
    affinity_cpus: int | None = Field(default=None, ge=1)
    loadavg_before: list[Annotated[float, Field(ge=0)]] | None = None  # 1, 5, 15 min
    loadavg_after: list[Annotated[float, Field(ge=0)]] | None = None
    gpu_utilization_pct_before: float | None = Field(default=None, ge=0, le=100)
    gpu_utilization_pct_after: float | None = Field(default=None, ge=0, le=100)


class PointSpread(_Strict):
    """One point the quality gate flagged: the window spread of each of its rounds."""

    context_index: int = Field(ge=0)
    bcap: int = Field(ge=1)
    g: int = Field(ge=1)
    k: int = Field(ge=0)
    spread_pct: list[Annotated[float, Field(ge=0)] | None]  # per round; round 0 = first windows
    # the last round the fit uses: it pools rounds 0..kept_round (tables calibrated before
    # 2026-12-02: the quietest round, fitted alone)
    kept_round: int = Field(ge=0)
    noisy: bool  # every round is above max_spread_pct


class QualityBlock(_Strict):
    """The quality gate of the calibration run (``speccal.calibrate.gate``).

    Bounds (``max_spread_pct``: (max - min) / median of a round of windows; ``max_heldout_pct``:
    ``heldout_metric`` of the fit), what was seen (``heldout_pct`` of ``model``, the worst context;
    None when no point could be held out), ``window_spread_pct_max`` (the largest spread among
    the rounds the fit uses), the points flagged noisy with their re-measurements, the machine
    load, and whether the table was written past the bound because the user said so
    (``override_used``; ``accept_noisy`` is the flag as given).
    """

    max_spread_pct: float = Field(gt=0)
    max_heldout_pct: float = Field(gt=0)
    remeasure_rounds: int = Field(ge=0)
    heldout_metric: Literal["leave_one_point_out.mean_abs_pct"] = "leave_one_point_out.mean_abs_pct"
    model: Literal["additive", "sps"]
    heldout_pct: float | None = Field(default=None, ge=0)
    window_spread_pct_max: float | None = Field(default=None, ge=0)
    passed: bool
    accept_noisy: bool = False
    override_used: bool = False
    flagged_points: list[PointSpread] = Field(default_factory=list)
    remeasured_windows: int = Field(default=0, ge=0)
    load: LoadBlock = Field(default_factory=LoadBlock)
    sources: dict[str, str] = Field(default_factory=dict)


class LoopTimingBlock(_Strict):
    """How the windows of a calibration run were timed (``speccal.calibrate.timing``).

    ``loop``: the engine's round loop (``pipelined``: round ``n + 1`` queued while ``n`` runs;
    ``synchronous``: host and device work in series). ``windows``: windows the fit uses;
    ``device_windows``: those with a device span (CUDA events; 0 on cpu). Over those,
    the median and largest ``wall_over_device`` (wall total over device span of a window) and
    the median device span per round (``device_step_ms_median``); None without device spans.
    ``clock``: how each window was timed (``speccal.calibrate.timing.CLOCKS``: ``wall``, or
    ``cpu_probe``: each round's thread CPU time over a speed probe's, priced at the probe's
    reference ``probe_ref_ms``); tables from before it was recorded read ``wall``.
    """

    loop: Literal["pipelined", "synchronous"]
    clock: Literal["wall", "cpu_probe"] = "wall"
    probe_ref_ms: float | None = Field(default=None, gt=0)
    windows: int = Field(ge=0)
    device_windows: int = Field(ge=0)
    wall_over_device_median: float | None = Field(default=None, gt=0)
    wall_over_device_max: float | None = Field(default=None, gt=0)
    device_step_ms_median: float | None = Field(default=None, gt=0)


class StateTrafficBlock(_Strict):
    """Recurrent-state bytes one round moves over a bucket of ``bcap`` requests with ``k`` draft
    steps, under the table's state strategy (``speccal.runner.hybrid_state.StateTraffic``:
    state rows read and written, slot-table bytes, the verified rows' saved inputs)."""

    bcap: int = Field(ge=1)
    k: int = Field(ge=0)
    read: int = Field(ge=0)
    written: int = Field(ge=0)
    index_bytes: int = Field(ge=0)
    saved_inputs: int = Field(ge=0)

    @property
    def total(self) -> int:
        return self.read + self.written + self.index_bytes + self.saved_inputs


class RoutingBlock(_Strict):
    """How a routed-expert (MoE) target routed while it was calibrated.

    ``source`` says what drove the routers: ``random_tokens``, the synthetic prompts'
    uniformly random token ids (and the tokens the target emits from them), which spread the
    router's rows over the experts much as a load-balanced model's do; a workload whose tokens
    concentrate on fewer experts runs fewer of them per round than the table measured.
    ``experts`` routed experts per layer, ``top_k`` chosen per row, ``layers`` routed layers of
    the target (the MTP head's routed layer, where it has one, is not counted). The counts
    themselves are per window (``fits[i].windows[j].experts_activated``) and per point
    (``fits[i].diagnostics.points[j].experts_activated``): the distinct experts a round
    activated per routed layer, the mean over the layers and rounds, in ``[top_k, experts]``.
    """

    source: Literal["random_tokens"] = "random_tokens"
    experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    layers: int = Field(ge=1)


class CalibrationConfig(_Strict):
    """The effective calibration config a table was measured with (defaults filled in).

    ``sources`` maps each key to where its value came from (free-form; ``speccal.calibrate``
    writes ``default``/``file``/``flag``/``run``; a table built from bare rows writes
    ``default``, ``measurements``, ``compatibility`` or ``caller``). ``threads`` is torch's
    intra-op thread count during measurement, ``quality`` the run's quality gate and ``timing``
    how its windows were timed (:class:`LoopTimingBlock`), all None for a table no calibration
    run measured (a bare fit, a migrated older table). ``prompts`` says how each window's
    synthetic prompts reached the KV cache: ``kv_copy`` (copied from one prefilled source
    sequence, ``Engine.set_prompt_source``; a hybrid target's recurrent state too, kept after
    each prompt length) or ``prefill`` (each prompt prefilled); None for tables from before it
    was recorded. ``state_traffic``: a hybrid target's
    recurrent-state bytes per round for every captured bucket and ``k`` (computed from the
    model's state shapes and the strategy; their time is inside the measured costs), None for a
    target without recurrent state or a table from before it was recorded. ``routing``: a
    routed-expert target's routing during the calibration (:class:`RoutingBlock`), None for a
    dense target (absent from the file, as ``state_traffic``).
    """

    model: Literal["additive", "sps"] = "additive"
    draft_width: int = Field(ge=1)
    mode: Literal["draft_step", "target_verify"] = "draft_step"
    request_buckets: list[int]
    target_graph_rows: dict[BucketKey, list[int]]
    contexts: list[ContextInterval]
    warmup_steps: int = Field(default=8, ge=0)
    window_steps: int = Field(default=32, ge=1)
    windows_per_point: int = Field(default=3, ge=1)
    token_seed: int = 1
    policy: PolicyConfig | None = None
    sources: dict[str, str] = Field(default_factory=dict)
    threads: int | None = Field(default=None, ge=1)
    quality: QualityBlock | None = None
    timing: LoopTimingBlock | None = None
    prompts: Literal["kv_copy", "prefill"] | None = None
    state_traffic: list[StateTrafficBlock] | None = None
    routing: RoutingBlock | None = None


class GeometryBlock(_Strict):
    draft_width: int = Field(ge=1)
    request_buckets: list[int]
    target_rows: dict[BucketKey, list[int]]
    kv_capacity_tokens: int = Field(default=0, ge=0)
    max_model_len: int = Field(default=0, ge=0)
    block_size: int = Field(default=16, ge=1)


# ---------------------------------------------------------------- fits


class ErrorBlock(_Strict):
    n_evaluated: int = Field(ge=0)
    n_skipped: int = Field(ge=0)
    mae_ms: float | None
    rmse_ms: float | None
    max_abs_ms: float | None
    mean_abs_pct: float | None
    max_abs_pct: float | None


KTerm = Literal["none", "shared", "per_bcap", "shared_rows", "per_bcap_rows"]


class KTermCandidate(_Strict):
    """Held-out errors of one draft-forward term the selection compared (version 3)."""

    k_term: KTerm
    leave_one_point_out: ErrorBlock
    partly_filled: ErrorBlock  # leave-one-point-out on the points with num_requests < bcap


class KTermSelection(_Strict):
    """How a draft_step fit's draft-forward term was chosen
    (``speccal.costmodel.diagnostics.select_additive``)."""

    selected_by: Literal["partly_filled", "leave_one_point_out", "fewest_parameters"]
    candidates: list[KTermCandidate]


class AdditiveParams(_Strict):
    """``bias + alpha(Bcap) + theta(G) + (k - 1) * delta`` (``speccal.costmodel.additive``;
    ``delta_ms`` empty for ``k_term`` ``none``, one value for ``shared``, one per Bcap level
    for ``per_bcap``; the ``*_rows`` forms (schema version 4) append ``rho``, ms per request a
    verify serves, ``G / (k + 1)``)."""

    bias_ms: float = Field(ge=0)  # the cost of the reference cell: a measured step cost
    bcap_levels: list[int]
    alpha_ms: list[float]
    g_levels: list[int]
    theta_ms: list[float]
    reference: Literal["smallest_bcap_and_g"] = "smallest_bcap_and_g"
    k_term: KTerm = "none"
    delta_ms: list[float] = Field(default_factory=list)
    k_selection: KTermSelection | None = None  # draft_step fits of several k only


class SPSParams(_Strict):
    """One curve over G, or one per ``k`` (``k`` parallel to ``g_levels``: the curve of ``k``
    is the levels where ``k`` equals it, each ascending in G)."""

    g_levels: list[int]
    cost_ms: list[Annotated[float, Field(gt=0)]]
    bcap_levels: list[int]  # coverage: request buckets the curve was measured with
    k: list[int] | None = None


class Window(_Strict):
    """One raw measured window (the context columns live on the enclosing fit)."""

    bcap: int = Field(ge=1)
    num_requests: int = Field(ge=1)
    g: int = Field(ge=1)
    k: int = Field(ge=0)
    window_index: int = Field(ge=0)
    window_steps: int = Field(ge=1)
    elapsed_s: float = Field(gt=0)
    step_ms: float = Field(gt=0)
    mean_kv_length: float = Field(ge=0)
    # routed-expert targets only (absent otherwise): the window's mean distinct experts per
    # routed layer and round (CalibrationConfig.routing)
    experts_activated: float | None = Field(default=None, gt=0)


class PointBlock(_Strict):
    bcap: int = Field(ge=1)
    g: int = Field(ge=1)
    k: int | None = Field(default=None, ge=0)  # None: migrated from version 2
    num_requests: int | None = Field(default=None, ge=1)  # the most requests of its windows
    n_windows: int = Field(ge=1)
    step_ms: float = Field(gt=0)
    spread_ms: float = Field(ge=0)
    predicted_ms: float | None
    residual_ms: float | None
    residual_pct: float | None
    lopo_ms: float | None
    logo_ms: float | None
    # routed-expert targets only (absent otherwise): the mean of its windows' experts_activated
    experts_activated: float | None = Field(default=None, gt=0)


class DiagnosticsBlock(_Strict):
    residuals: ErrorBlock
    leave_one_point_out: ErrorBlock
    leave_one_g_out: ErrorBlock
    points: list[PointBlock]


class KVContextErrors(_Strict):
    """The KV model's errors on one context interval's points."""

    context_index: int = Field(ge=0)
    residuals: ErrorBlock
    leave_one_point_out: ErrorBlock


class KVCandidate(_Strict):
    """Held-out errors of one slope form the selection compared."""

    kv_term: Literal["shared", "per_g", "shared_bcap", "per_bcap", "shared_rows"]
    k_term: KTerm = "none"
    leave_one_context_out: ErrorBlock
    leave_one_point_out: ErrorBlock


class KVPoint(_Strict):
    """One combined point of the KV fit (median of its windows at their mean KV)."""

    context_index: int = Field(ge=0)
    bcap: int = Field(ge=1)
    g: int = Field(ge=1)
    k: int | None = Field(default=None, ge=0)
    kv_length: float = Field(ge=0)
    step_ms: float = Field(gt=0)
    predicted_ms: float
    lopo_ms: float | None
    loco_ms: float | None


class SpreadPointBlock(_Strict):
    """One request bucket's spread point at one context against its calibrated point (same
    context, Bcap, G, k and mean KV; ``speccal.costmodel.spread``). ``*_excess``: the windows'
    mean of the longest request's KV minus the mean KV; ``*_ms``: median step time of the
    windows."""

    context_index: int = Field(ge=0)
    bcap: int = Field(ge=2)
    g: int = Field(ge=1)
    k: int = Field(ge=1)
    mean_kv_length: float = Field(ge=0)
    calibrated_excess: float = Field(ge=0)
    spread_excess: float = Field(ge=0)
    calibrated_ms: float = Field(gt=0)
    spread_ms: float = Field(gt=0)
    slope_ms_per_token: float = Field(ge=0)
    windows: int = Field(ge=1)


class KVSpreadBlock(_Strict):
    """The KV spread term (schema version 5, per context since 6; ``speccal.costmodel.spread``):
    a round at mean KV ``m`` is priced ``cost(m) + slope(m, Bcap) * max(0, (max KV - m) -
    calibrated_excess(m, Bcap))``, slope and excess linear in ``m`` between a bucket's points
    (at most one per context and bucket, measured with ``layout``)."""

    layout: Literal["two_level"]
    points: list[SpreadPointBlock] = Field(min_length=1)



class KVModelBlock(_Strict):
    """The KV-aware model over every context (``speccal.costmodel.kv``), present only in tables
    of three or more context intervals with a connected (Bcap, G) grid.

    ``cost = bias + alpha(Bcap) + theta(G) + beta(x) * x * kv`` for ``kv`` in
    ``[min_kv_length, max_kv_length]`` (the calibrated span: the smallest and largest bound of the
    contexts), ``x`` = G (``shared``, ``per_g``), Bcap (``shared_bcap``, ``per_bcap``) or, in
    draft_step tables, the requests a verify serves, ``G / (k + 1)`` (``shared_rows``: priced
    only with the round's ``k``);
    ``beta_ms`` has one value (the shared forms) or one per level of ``x`` (``per_g``: per G
    level, ``per_bcap``: per Bcap level), in ms per unit of ``x`` and KV token. ``bias_ms`` is the
    reference cell's cost extrapolated to KV 0 and may be any finite number.
    """

    kv_term: Literal["shared", "per_g", "shared_bcap", "per_bcap", "shared_rows"]
    combine: Literal["median", "mean"] = "median"
    reference: Literal["smallest_bcap_and_g"] = "smallest_bcap_and_g"
    min_kv_length: int = Field(ge=0)
    max_kv_length: int = Field(ge=0)
    bias_ms: float
    bcap_levels: list[int]
    alpha_ms: list[float]
    g_levels: list[int]
    theta_ms: list[float]
    beta_ms: list[float] = Field(min_length=1)
    k_term: Literal["none", "shared", "per_bcap"] = "none"  # as in AdditiveParams (no rows:
    # the KV model's rows axis is kv_term shared_rows)
    delta_ms: list[float] = Field(default_factory=list)
    selected_by: Literal["leave_one_context_out", "leave_one_point_out", "fewest_parameters"]
    residuals: ErrorBlock
    leave_one_point_out: ErrorBlock
    leave_one_context_out: ErrorBlock
    per_context: list[KVContextErrors]
    candidates: list[KVCandidate]
    points: list[KVPoint]

    def nonpositive_cells(
        self, target_rows: dict[int, list[int]] | Any
    ) -> list[tuple[int, int, int, float]]:
        """``(bcap, g, kv_length, cost_ms)`` wherever the model prices a cell the lookup
        answers (a level pair whose G is captured for that Bcap) at ``<= 0`` ms somewhere in the
        span. The cost is linear in KV, so the span's two ends are checked."""
        est = self.estimator()
        ks = self.k_levels() or [None]
        out = []
        for b in self.bcap_levels:
            captured = set(target_rows.get(b, ()))
            for g in self.g_levels:
                if g not in captured:
                    continue
                for kv in (self.min_kv_length, self.max_kv_length):
                    for k in ks:
                        cost = float(est.predict_at([b], [g], [kv], None if k is None else [k])[0])
                        if not cost > 0:
                            out.append((b, g, kv, cost))
        return out

    def k_levels(self) -> list[int] | None:
        """The draft forwards the model prices (its points' k), or None when it does not
        depend on k (no draft-forward term, a slope over Bcap or G)."""
        if self.k_term == "none" and self.kv_term not in NEEDS_K:
            return None
        return sorted({p.k for p in self.points if p.k is not None})

    def estimator(self):
        """Rebuild the fitted :class:`~speccal.costmodel.kv.KVCostModel` from the arrays."""
        return KVCostModel.from_params(
            self.bias_ms,
            self.bcap_levels,
            self.alpha_ms,
            self.g_levels,
            self.theta_ms,
            self.beta_ms,
            self.delta_ms,
            kv_term=self.kv_term,
            combine=self.combine,
            k_term=self.k_term,
        )


class ContextFit(_Strict):
    context_index: int = Field(ge=0)
    prefill_tokens: int = Field(ge=0)
    min_kv_length: int = Field(ge=0)
    max_kv_length: int = Field(ge=0)
    model: Literal["additive", "sps"]
    combine: Literal["median", "mean"] = "median"
    additive: AdditiveParams | None = None
    sps: SPSParams | None = None
    windows: list[Window]
    diagnostics: DiagnosticsBlock

    def estimator(self) -> AdditiveCostModel | SPSCostModel:
        """Rebuild the fitted sklearn estimator from the stored parameters."""
        if self.model == "additive":
            p = self.additive
            return AdditiveCostModel.from_params(
                p.bias_ms, p.bcap_levels, p.alpha_ms, p.g_levels, p.theta_ms,
                combine=self.combine, k_term=p.k_term, delta_ms=p.delta_ms,
            )
        p = self.sps
        return SPSCostModel.from_params(p.g_levels, p.cost_ms, combine=self.combine, k=p.k)

    def bcap_levels(self) -> list[int]:
        return (self.additive or self.sps).bcap_levels


class TimingsBlock(_Strict):
    """Wall time of the calibrating process, in s (a resumed run's earlier windows not included).

    ``compile_capture_s``: building the runner (model load, kernel compiles, graph capture and
    their warm-up forwards); ``transition_s``: each window's prefill and first round;
    ``warmup_s``: the warm-up rounds before each window; ``sampling_s``: the timed windows,
    re-measured ones included.
    """

    compile_capture_s: float = Field(ge=0)
    transition_s: float = Field(ge=0)
    warmup_s: float = Field(ge=0)
    sampling_s: float = Field(ge=0)


class Provenance(_Strict):
    speccal_version: str
    created: str
    command: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    driver_version: str | None = None
    migrated_from: str | None = None
    timings: TimingsBlock | None = None  # a calibration run's; None for a bare fit

    @classmethod
    def now(
        cls,
        command: str | None = None,
        timings: TimingsBlock | dict[str, float] | None = None,
        **versions: str | None,
    ) -> Provenance:
        """Provenance of a table built now by this process (torch version only if imported);
        ``timings``: a calibration run's (:class:`TimingsBlock`)."""
        torch = sys.modules.get("torch")
        return cls(
            speccal_version=__version__,
            created=datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
            command=command,
            python_version=platform.python_version(),
            torch_version=versions.pop("torch_version", None)
            or getattr(torch, "__version__", None),
            timings=timings,
            **versions,
        )

    def versions(self) -> dict[str, str | None]:
        return {
            "speccal_version": self.speccal_version,
            "torch_version": self.torch_version,
            "driver_version": self.driver_version,
        }


# ---------------------------------------------------------------- the table


class CostTable(_Strict):
    """A versioned, immutable-by-convention cost table (see module docstring for layout)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    schema_version: Literal[6] = SCHEMA_VERSION
    calibration: CalibrationConfig
    compatibility: Compatibility
    # Stored under the JSON key "geometry"; the attribute name leaves ``geometry()`` free for the
    # method returning ``speccal.base.geometry.Geometry`` (the package contract).
    geometry_block: GeometryBlock = Field(alias="geometry")
    fits: list[ContextFit] = Field(min_length=1)
    # Optional (absent in single-context tables and in tables written before it existed).
    kv_model: KVModelBlock | None = None
    # Optional (version 5: calibrations that measured spread points; ``speccal.costmodel.spread``).
    kv_spread: KVSpreadBlock | None = None
    provenance: Provenance

    _lookup: TableLookup | None = PrivateAttr(default=None)

    # -- identity
    @property
    def mode(self) -> str:
        """``draft_step`` (points at G = Bcap*(k+1)) or ``target_verify`` (trimmed verify budget)."""
        return self.calibration.mode

    @property
    def model(self) -> str:
        return self.calibration.model

    @property
    def draft_width(self) -> int:
        return self.compatibility.draft_width

    def geometry(self) -> Geometry:
        """The captured geometry the table was calibrated on (``speccal.base.geometry.Geometry``)."""
        return Geometry.from_dict(self.geometry_block.model_dump())

    # -- lookup (the rules live in speccal.costmodel.lookup)
    def lookup(self) -> TableLookup:
        """The table's :class:`~speccal.costmodel.lookup.TableLookup`, built once and cached."""
        if self._lookup is None:
            self._lookup = TableLookup(self)
        return self._lookup

    def fit_for(self, kv_length: float) -> ContextFit | None:
        """The fit whose context interval holds ``kv_length`` (inclusive), or None."""
        for f in self.fits:
            if f.min_kv_length <= kv_length <= f.max_kv_length:
                return f
        return None

    def cost_surface(self):
        """A vectorised ``f(bcap, g, kv_length) -> ndarray`` of ms (NaN = uncalibrated).

        :meth:`TableLookup.surface <speccal.costmodel.lookup.TableLookup.surface>`: arguments
        broadcast; a cell whose fitted cost is not positive is NaN (uncalibrated).
        """
        return self.lookup().surface

    def cost_ms(self, bcap: int, g: int, kv_length: float, k: int | None = None) -> CostLookup:
        """Full-step cost in ms at ``(bcap, g)`` and ``kv_length``, or an explicit uncalibrated answer.

        :meth:`TableLookup.cost_ms <speccal.costmodel.lookup.TableLookup.cost_ms>` (reasons:
        KV length outside every context interval; Bcap not a calibrated request bucket; G not a
        captured target bucket of that Bcap; G not a calibrated level (additive) or outside the
        measured G range (sps); a draft_step fit with a draft-forward term asked without the
        round's ``k`` or at a ``k`` it did not measure; ``"fitted cost not positive"``, with the
        predicted value).
        """
        return self.lookup().cost_ms(bcap, g, kv_length, k)

    def nonpositive_cells(self) -> list[dict[str, Any]]:
        """Calibrated cells where a fit predicts a step cost ``<= 0`` ms, per context interval.

        See :meth:`TableLookup.nonpositive_cells
        <speccal.costmodel.lookup.TableLookup.nonpositive_cells>` for the dict layout.
        """
        # A fresh lookup, not the cache: build_table calls this, and a cached lookup would make
        # the new table compare unequal to the same table parsed back from its JSON.
        return TableLookup(self).nonpositive_cells()

    # -- data
    def measurements(self) -> pd.DataFrame:
        """The raw measured windows of every fit as a measurement DataFrame (for refitting)."""
        rows = []
        for f in self.fits:
            for w in f.windows:
                rows.append(
                    {
                        "context_index": f.context_index,
                        "prefill_tokens": f.prefill_tokens,
                        "min_kv_length": f.min_kv_length,
                        "max_kv_length": f.max_kv_length,
                        **w.model_dump(exclude_none=True),  # experts_activated: routed only
                        "warmup_steps": self.calibration.warmup_steps,
                        "mode": self.calibration.mode,
                    }
                )
        return validate_measurements(pd.DataFrame(rows))

    def to_json_dict(self) -> dict:
        doc = self.model_dump(mode="json", by_alias=True)
        for name in ("kv_model", "kv_spread"):
            if doc.get(name) is None:
                # Absent, not null: a table without the block keeps the bytes it had before
                # the block existed.
                doc.pop(name, None)
        if doc["calibration"].get("state_traffic") is None:  # likewise: only hybrid targets
            doc["calibration"].pop("state_traffic", None)
        if doc["calibration"].get("routing") is None:  # likewise: only routed-expert targets
            doc["calibration"].pop("routing", None)
        for fit in doc["fits"]:
            for item in (*fit["windows"], *fit["diagnostics"]["points"]):
                if item.get("experts_activated") is None:
                    item.pop("experts_activated", None)
        return doc

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no NaN), exactly what :func:`save_table` writes."""
        return dumps_json(self.to_json_dict())


def validate_block(cls, doc, source: str, error, *, strict: bool = False):
    """``cls.model_validate(doc)``, raising ``error(field, value, expected)`` on the first problem.

    ``strict``: validate ``doc`` (plain JSON values) as the JSON document it came from, with
    pydantic's strict mode: a number is a JSON number (not ``true``, not ``"1.5"``), an integer
    a JSON integer (not ``2.0``); what a file is read with.
    """
    try:
        if strict:
            return cls.model_validate_json(json.dumps(doc, allow_nan=True), strict=True)
        return cls.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise error(f"{source}: {loc}", err.get("input"), "no such key (unknown key)") from None
        if err["type"] == "missing":
            raise error(f"{source}: {loc}", "missing", "a required key") from None
        raise error(f"{source}: {loc}", err.get("input"), pydantic_message(err)) from None
