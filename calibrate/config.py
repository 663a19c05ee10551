"""Calibration configuration: the JSON boundary, the user's explicit values and the effective config.

Three layers, each the single source of the values it holds:

- ``parse_config_file`` / ``parse_config_obj`` read a calibration JSON in either xLLM shape, unchanged:
  the adaptive-draft-step file ``{"version": 1, "policy": {...}, "calibration": {...}}`` or the bare
  calibration object ``{"model": "additive", "request_buckets": [...], "contexts": [...], ...}``.
  Every part is optional; unknown keys and wrong types are refused naming the key (pydantic,
  ``extra="forbid"``, strict types).
- ``UserConfig`` holds only what the user gave explicitly, each value tagged with where it came from
  (``file`` or ``flag``; a flag overrides the file).
- ``resolve_config(user, geometry)`` fills every missing value from the documented
  defaults (SPEC section 4 and the xLLM adaptive speculative decoding document) against the warmed
  runner's geometry and returns a frozen ``CalibrationConfig`` whose ``sources`` say, per key, whether
  the value is a ``default``, came from the ``file``, a ``flag`` or the ``run`` (draft width). A
  default that had to be shrunk to fit says why in ``notes``.

Data layout of ``CalibrationConfig.to_dict()`` (stored in the journal header and the cost table)::

    {"model": "additive", "mode": "target_verify", "draft_width": 3,
     "request_buckets": [1, 2, 4], "target_graph_rows": {"1": [1, 2, 3, 4], ...},
     "contexts": [{"prefill_tokens": 2048, "min_kv_length": 1, "max_kv_length": 4096}],
     "warmup_steps": 8, "window_steps": 32, "windows_per_point": 3, "token_seed": 1,
     "policy": {"window_size": 20, "update_interval": 5, "switch_min_gain": 0.05}}

The adaptive window count (``min_windows_per_point``, ``early_stop_spread_pct``; the rule is
``speccal.calibrate.gate.EarlyStop``) is not part of ``to_dict()``, which is the cost table's
``calibration`` block: ``windows_dict()`` reports it (the journal header, ``--json``'s effective
configuration), the table's ``calibration.sources`` names its source and every fitted point
records the windows it got (``n_windows``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from speccal.base.atomic import read_text
from speccal.base.errors import InputError
from speccal.base.geometry import MAX_REQUEST_BUCKETS, Geometry
from speccal.base.vocab import POLICY_DEFAULTS
from speccal.calibrate.feasibility import (
    DEFAULT_LEVELS,
    check_buckets_captured,
    default_contexts,
    reserve_tokens,
)
from speccal.costmodel.grid import check_contexts

MODELS = ("additive", "sps")
MODES = ("target_verify", "draft_step")

# Defaults, exactly as SPEC section 4 and the xLLM document state them.
DEFAULT_MODEL = "additive"
DEFAULT_PREFILL_TOKENS = 2048
DEFAULT_MIN_KV_LENGTH = 1
DEFAULT_MAX_KV_LENGTH = 4096
DEFAULT_WARMUP_STEPS = 8
DEFAULT_WINDOW_STEPS = 32
DEFAULT_WINDOWS_PER_POINT = 3
DEFAULT_TOKEN_SEED = 1
DEFAULT_WINDOW_SIZE = POLICY_DEFAULTS["window_size"]
DEFAULT_UPDATE_INTERVAL = POLICY_DEFAULTS["update_interval"]
DEFAULT_SWITCH_MIN_GAIN = POLICY_DEFAULTS["switch_min_gain"]
#: Windows every point gets before the adaptive rule may stop it: the spread needs two.
MIN_ADAPTIVE_WINDOWS = 2

#: Where a device kind's defaults differ from the seeds' (the source of each is ``default
#: (KIND)``). cpu: a CPU round's time moves with the machine (``speccal.calibrate.timing``: even
#: read by the probe clock one round's cost has ~14 % jitter and a window's ~5 % on a shared
#: 2-vCPU VM), so a point needs a few hundred rounds spread over the run for a ~2 % median, and
#: the additive model's leave-one-point-out error is ~1.3x the points' noise on the default
#: grid (each G level is measured at one to three Bcaps). The seeds' design (3 windows of 32
#: rounds after 8 warm-up rounds, 96 rounds a point) at four KV levels took 3-7 minutes there
#: and refused its table at 10-17 % held-out. One context interval (SPEC section 4's default)
#: of 19 points x 6 windows of 24 rounds after 2 warm-up rounds (156 rounds a point, windows
#: spread over the run) took 25-28 s beside another busy process, at 0.5-1.7 % held-out
#: (bench/RESULTS.md). Eager CPU rounds need no long warm-up: nothing is captured or tuned.
#: cuda: 2 warm-up rounds after each window's transition instead of 8 (the graphs are captured
#: and warmed at build; a transition copies KV and runs one round at the point's shape, and the
#: pipeline is full after one more). On the H200 the widened default grid (136 points, 411
#: windows) spent 11 s in warm-up rounds; with 2 it took 88.9 / 90.0 s cold against 95.1 /
#: 96.6 s on the same kind of host, and its tables priced the grid within -0.14 / -0.19 %
#: (median signed difference) of the 8-round tables' median (bench/RESULTS.md).
#: cuda, adaptive window count (``min_windows_per_point``, ``early_stop_spread_pct``;
#: ``speccal.calibrate.gate.EarlyStop``): every point is measured with 2 windows, and only a
#: point whose two windows are more than 1 % apart gets its third. On the H200 every point's
#: last round of three windows spread <= 2.43 % (<= 0.45-0.78 % in the two runs above), so
#: almost every point stops at two and a third of the 411 windows and their transitions
#: (~25 ms each) are saved; two windows within 1 % put their mean within 0.5 % of either,
#: well inside the gate's 3 % spread. cpu keeps a fixed count: six windows of ~5 % CV
#: spread 14-20 %, so an early stop would rarely fire and would cost accuracy where it did.
KIND_DEFAULTS: dict[str, dict[str, int | float]] = {
    "cpu": {"warmup_steps": 2, "window_steps": 24, "windows_per_point": 6, "context_levels": 1},
    "cuda": {"warmup_steps": 2, "min_windows_per_point": 2, "early_stop_spread_pct": 1.0,
             "kv_spread": True},
}

# Every key the effective configuration reports a source for, in print order.
KEYS = (
    "model",
    "mode",
    "draft_width",
    "request_buckets",
    "target_graph_rows",
    "contexts",
    "warmup_steps",
    "window_steps",
    "windows_per_point",
    "min_windows_per_point",
    "early_stop_spread_pct",
    "kv_spread",
    "token_seed",
    "policy.window_size",
    "policy.update_interval",
    "policy.switch_min_gain",
)
SOURCES = ("default", "file", "flag", "run")


# ---------------------------------------------------------------------------------------------
# In-memory config (frozen, validated on construction)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextInterval:
    """One context interval: synthetic prompts of at most ``prefill_tokens`` tokens whose KV lengths
    stay inside ``[min_kv_length, max_kv_length]`` (inclusive) during measurement.

    Synthetic prompt lengths are midpoint quantiles of ``[min_kv_length, prefill_tokens]``
    (``speccal.calibrate.driver.prompt_lengths``), so ``prefill_tokens`` must be at least
    ``min_kv_length``.
    """

    prefill_tokens: int
    min_kv_length: int
    max_kv_length: int

    def __post_init__(self) -> None:
        _check_int("prefill_tokens", self.prefill_tokens, 1)
        _check_int("min_kv_length", self.min_kv_length, 1)
        _check_int("max_kv_length", self.max_kv_length, 1)
        if self.max_kv_length < self.min_kv_length:
            raise InputError(
                "max_kv_length",
                self.max_kv_length,
                f"an integer >= min_kv_length={self.min_kv_length}",
            )
        if self.prefill_tokens < self.min_kv_length:
            raise InputError(
                "prefill_tokens",
                self.prefill_tokens,
                f"an integer >= min_kv_length={self.min_kv_length}",
                hint="synthetic prompts start inside the KV interval",
            )

    def to_dict(self) -> dict[str, int]:
        return {
            "prefill_tokens": self.prefill_tokens,
            "min_kv_length": self.min_kv_length,
            "max_kv_length": self.max_kv_length,
        }


@dataclass(frozen=True)
class PolicyConfig:
    """The adaptive-draft-step policy block (carried into the table; calibration does not use it)."""

    window_size: int = DEFAULT_WINDOW_SIZE
    update_interval: int = DEFAULT_UPDATE_INTERVAL
    switch_min_gain: float = DEFAULT_SWITCH_MIN_GAIN

    def __post_init__(self) -> None:
        _check_int("policy.window_size", self.window_size, 1)
        _check_int("policy.update_interval", self.update_interval, 1)
        if not (isinstance(self.switch_min_gain, (int, float)) and 0 <= self.switch_min_gain < 1):
            raise InputError("policy.switch_min_gain", self.switch_min_gain, "a number in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_size": self.window_size,
            "update_interval": self.update_interval,
            "switch_min_gain": float(self.switch_min_gain),
        }


@dataclass(frozen=True)
class CalibrationConfig:
    """The effective calibration configuration: every value resolved, with its source.

    Attributes
    ----------
    model : ``additive`` or ``sps``.
    mode : ``target_verify`` (draft runs full width ``w``; G is the trimmed verify budget) or
        ``draft_step`` (each candidate ``k`` measured on its own points, ``G = Bcap * (k + 1)``).
    draft_width : ``w``, the run's ``num_speculative_tokens``.
    request_buckets : physical draft request buckets ``Bcap`` to sample, ascending.
    target_graph_rows : per ``Bcap``, the target row buckets ``G`` to sample, ascending.
    contexts : non-overlapping context intervals, in the order given.
    warmup_steps, window_steps, windows_per_point : rounds before measuring, rounds per window,
        windows per grid point (the most a point's first round takes).
    min_windows_per_point : None (every point gets ``windows_per_point``) or the windows every
        point gets first (2 .. ``windows_per_point``); a point whose spread over them is within
        ``early_stop_spread_pct`` keeps that many, the others get the rest
        (``speccal.calibrate.gate.EarlyStop``).
    early_stop_spread_pct : the early stop's spread bound (%); None: the gate's
        ``max_spread_pct``. The gate's bound caps it either way.
    token_seed : seed of the synthetic prompt token ids.
    policy : adaptive-draft-step policy block.
    sources : key (see ``KEYS``) -> ``default`` | ``file`` | ``flag`` | ``run``.
    notes : key -> why a default differs from its documented value (e.g. shrunk to fit).
    partly_filled : draft_step only, ``(Bcap, G, k, B)``: the shapes a partly filled bucket
        runs (``B`` < ``Bcap`` requests, ``G = pad(B * (k + 1))`` not a full batch's G;
        ``speccal.base.geometry.Geometry.draft_step_shapes``) whose G is among
        ``target_graph_rows``, each measured with ``B`` requests. Derived from the engine's
        geometry by :func:`resolve` (not part of :meth:`to_dict`: the rows and the geometry
        determine it).
    kv_spread : measure the spread points after the grid (``speccal.calibrate.grid.spread_points``:
        one per request bucket >= 2, half the requests short and half long at a calibrated
        point's mean KV), for the table's KV spread term (``speccal.costmodel.spread``). On by
        default on CUDA, off on the CPU (its rounds' noise is larger than the effect).
    """

    model: str
    mode: str
    draft_width: int
    request_buckets: tuple[int, ...]
    target_graph_rows: Mapping[int, tuple[int, ...]]
    contexts: tuple[ContextInterval, ...]
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    window_steps: int = DEFAULT_WINDOW_STEPS
    windows_per_point: int = DEFAULT_WINDOWS_PER_POINT
    token_seed: int = DEFAULT_TOKEN_SEED
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    min_windows_per_point: int | None = None
    early_stop_spread_pct: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)
    partly_filled: tuple[tuple[int, int, int, int], ...] = ()
    kv_spread: bool = False

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise InputError("model", self.model, f"one of {', '.join(MODELS)}")
        if self.mode not in MODES:
            raise InputError("mode", self.mode, f"one of {', '.join(MODES)}")
        _check_int("draft_width", self.draft_width, 1)
        buckets = tuple(self.request_buckets)
        if (
            not buckets
            or list(buckets) != sorted(set(buckets))
            or any(not isinstance(b, int) or b < 1 for b in buckets)
        ):
            raise InputError(
                "request_buckets", list(buckets), "a non-empty list of distinct integers >= 1"
            )
        if len(buckets) > MAX_REQUEST_BUCKETS:
            raise InputError(
                "request_buckets", len(buckets), f"at most {MAX_REQUEST_BUCKETS} buckets"
            )
        object.__setattr__(self, "request_buckets", buckets)
        rows = {int(b): tuple(sorted(set(self.target_graph_rows.get(b, ())))) for b in buckets}
        for b, gs in rows.items():
            if not gs:
                raise InputError(f"target_graph_rows[{b}]", [], "at least one target row bucket")
        object.__setattr__(self, "target_graph_rows", rows)
        contexts = tuple(self.contexts)
        if not contexts:
            raise InputError("contexts", [], "at least one context interval")
        check_no_overlap(contexts)
        object.__setattr__(self, "contexts", contexts)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_int("window_steps", self.window_steps, 1)
        _check_int("windows_per_point", self.windows_per_point, 1)
        check_early_stop(
            self.min_windows_per_point, self.early_stop_spread_pct, self.windows_per_point
        )
        _check_int("token_seed", self.token_seed, 0)
        if not isinstance(self.kv_spread, bool):
            raise InputError("kv_spread", self.kv_spread, "true or false")
        kinds = tuple(f"default ({kind})" for kind in KIND_DEFAULTS)
        bad = {k: v for k, v in self.sources.items()
               if k not in KEYS or v not in SOURCES + kinds}
        if bad:
            raise InputError("sources", bad, f"keys among {KEYS} and sources among {SOURCES}")
        object.__setattr__(self, "sources", dict(self.sources))
        object.__setattr__(self, "notes", dict(self.notes))
        shapes = tuple(sorted(tuple(int(x) for x in s) for s in self.partly_filled))
        for b, g, k, n in shapes:
            if (self.mode != "draft_step" or b not in rows or g not in rows[b]
                    or not 1 <= k <= self.draft_width or not 1 <= n < b
                    or not n * (k + 1) <= g < b * (k + 1)):
                raise InputError(
                    "partly_filled", [b, g, k, n],
                    "draft_step shapes (Bcap, G, k, B) with B < Bcap requests, k in 1..w and "
                    "B * (k + 1) <= G < Bcap * (k + 1), G among target_graph_rows[Bcap]")
        object.__setattr__(self, "partly_filled", shapes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (no sources): what identifies this calibration."""
        return {
            "model": self.model,
            "mode": self.mode,
            "draft_width": self.draft_width,
            "request_buckets": list(self.request_buckets),
            "target_graph_rows": {str(b): list(g) for b, g in self.target_graph_rows.items()},
            "contexts": [c.to_dict() for c in self.contexts],
            "warmup_steps": self.warmup_steps,
            "window_steps": self.window_steps,
            "windows_per_point": self.windows_per_point,
            "token_seed": self.token_seed,
            "policy": self.policy.to_dict(),
        }

    @property
    def adaptive_windows(self) -> bool:
        """Whether a point may stop before ``windows_per_point`` windows (``EarlyStop``)."""
        return (self.min_windows_per_point is not None
                and self.min_windows_per_point < self.windows_per_point)

    def windows_dict(self) -> dict[str, Any]:
        """The window-count rule as JSON (not in ``to_dict``: module docstring)."""
        return {
            "windows_per_point": self.windows_per_point,
            "min_windows_per_point": self.min_windows_per_point,
            "early_stop_spread_pct": self.early_stop_spread_pct,
        }


def check_early_stop(
    min_windows: Any, spread_pct: Any, windows_per_point: int
) -> None:
    """Refuse an adaptive window count no run can use, naming the key.

    ``min_windows_per_point`` is None or an integer in ``2 .. windows_per_point`` (the spread
    needs two windows; ``windows_per_point`` itself means a fixed count);
    ``early_stop_spread_pct`` is None or a finite percentage > 0, and only comes with an
    adaptive count (alone it would be silently unused).
    """
    if min_windows is not None and (
        isinstance(min_windows, bool) or not isinstance(min_windows, int)
        or not MIN_ADAPTIVE_WINDOWS <= min_windows <= windows_per_point
    ):
        raise InputError(
            "min_windows_per_point", min_windows,
            f"an integer in {MIN_ADAPTIVE_WINDOWS}..windows_per_point={windows_per_point}",
            hint="the spread that decides a point's windows needs two; windows_per_point "
            "itself gives every point the same count",
        )
    if spread_pct is None:
        return
    if isinstance(spread_pct, bool) or not (
        isinstance(spread_pct, (int, float)) and math.isfinite(spread_pct) and spread_pct > 0
    ):
        raise InputError("early_stop_spread_pct", spread_pct, "a finite percentage > 0, e.g. 1")
    if min_windows is None or min_windows >= windows_per_point:
        raise InputError(
            "early_stop_spread_pct", spread_pct,
            f"given with min_windows_per_point < windows_per_point={windows_per_point}",
            hint=f"min_windows_per_point is {min_windows}: every point gets "
            f"{windows_per_point} windows, so no early stop applies",
        )


def check_no_overlap(contexts: tuple[ContextInterval, ...]) -> None:
    """Refuse context intervals whose KV ranges overlap (inclusive bounds)."""
    check_contexts(
        {i: (c.prefill_tokens, c.min_kv_length, c.max_kv_length) for i, c in enumerate(contexts)}
    )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(name, value, f"an integer >= {minimum}")


# ---------------------------------------------------------------------------------------------
# JSON boundary (pydantic, extra="forbid", strict types)
# ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContextModel(_Strict):
    prefill_tokens: StrictInt
    min_kv_length: StrictInt
    max_kv_length: StrictInt


class PolicyModel(_Strict):
    window_size: StrictInt | None = None
    update_interval: StrictInt | None = None
    switch_min_gain: StrictFloat | StrictInt | None = None


class CalibrationModel(_Strict):
    """The bare calibration object (every key optional)."""

    model: Literal["additive", "sps"] | None = None
    draft_width: StrictInt | None = None
    request_buckets: list[StrictInt] | None = Field(default=None, min_length=1)  # or absent
    # Either {"<Bcap>": [G, ...]} per bucket, or one list of G applied to every request bucket
    # (each bucket keeps the values that are legal for it).
    target_graph_rows: dict[str, list[StrictInt]] | list[StrictInt] | None = None
    contexts: list[ContextModel] | None = None
    warmup_steps: StrictInt | None = None
    window_steps: StrictInt | None = None
    windows_per_point: StrictInt | None = None
    min_windows_per_point: StrictInt | None = None
    early_stop_spread_pct: StrictFloat | StrictInt | None = None
    kv_spread: StrictBool | None = None
    token_seed: StrictInt | None = None


class AdaptiveStepFileModel(_Strict):
    """The adaptive-draft-step file: ``{"version": 1, "policy": {...}, "calibration": {...}}``."""

    version: Literal[1] | None = None
    policy: PolicyModel | None = None
    calibration: CalibrationModel | None = None


_WRAPPER_KEYS = frozenset(AdaptiveStepFileModel.model_fields)


@dataclass(frozen=True)
class ParsedFile:
    """A parsed calibration JSON: which shape it had and its (partial) contents."""

    shape: str  # "adaptive_draft_step" | "calibration"
    calibration: CalibrationModel
    policy: PolicyModel | None


def parse_config_obj(obj: Any, *, source: str = "config") -> ParsedFile:
    """Validate a decoded JSON value in either accepted shape.

    A top-level object with any of ``version`` / ``policy`` / ``calibration`` is the
    adaptive-draft-step shape (then every other top-level key is refused); otherwise it is the bare
    calibration object.
    """
    if not isinstance(obj, dict):
        raise InputError(source, obj, "a JSON object")
    try:
        if _WRAPPER_KEYS & obj.keys():
            wrapped = AdaptiveStepFileModel.model_validate(obj)
            return ParsedFile(
                shape="adaptive_draft_step",
                calibration=wrapped.calibration or CalibrationModel(),
                policy=wrapped.policy,
            )
        return ParsedFile(
            shape="calibration", calibration=CalibrationModel.model_validate(obj), policy=None
        )
    except ValidationError as exc:
        raise _input_error(exc, source) from None


def parse_config_file(path: str | Path) -> ParsedFile:
    """Read and validate a calibration JSON file (see ``parse_config_obj``)."""
    p = Path(path)
    text = read_text(p, "--config")  # missing, a directory, unreadable, not UTF-8: InputError
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            "--config", str(p), "valid JSON", hint=f"line {exc.lineno}: {exc.msg}"
        ) from None
    return parse_config_obj(obj, source=str(p))


def _input_error(exc: ValidationError, source: str) -> InputError:
    err = exc.errors()[0]
    loc = ".".join(
        str(x)
        for x in err["loc"]
        if not str(x).startswith(("int", "float", "list[", "dict[", "literal["))
    )
    if err["type"] == "extra_forbidden":
        return InputError(loc, err["input"], "no such key (unknown keys are refused)", hint=source)
    if err["type"] == "missing":
        return InputError(loc, None, "a value (this key is required)", hint=source)
    expected = err["msg"].removeprefix("Input should be ").removeprefix("input should be ")
    return InputError(loc or "<root>", err.get("input"), expected, hint=source)


# ---------------------------------------------------------------------------------------------
# Explicit user values and resolution against the runner's geometry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserConfig:
    """Values the user set explicitly: ``values[key] = (value, source)`` with source file|flag.

    Keys are those of ``KEYS``; ``contexts`` holds a tuple of ``ContextInterval``;
    ``target_graph_rows`` a dict ``{Bcap: [G...]}`` or a list of G.
    """

    values: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    shape: str | None = None  # shape of the config file, if any

    @classmethod
    def build(
        cls, parsed: ParsedFile | None = None, flags: Mapping[str, Any] | None = None
    ) -> UserConfig:
        """Merge a parsed file and CLI flags (a flag wins; ``None`` flags are ignored)."""
        values: dict[str, tuple[Any, str]] = {}
        if parsed is not None:
            cal = parsed.calibration
            for key in (
                "model",
                "draft_width",
                "request_buckets",
                "target_graph_rows",
                "warmup_steps",
                "window_steps",
                "windows_per_point",
                "min_windows_per_point",
                "early_stop_spread_pct",
                "kv_spread",
                "token_seed",
            ):
                v = getattr(cal, key)
                if v is not None:
                    values[key] = (v, "file")
            if cal.contexts is not None:
                values["contexts"] = (
                    tuple(
                        _context(
                            c.prefill_tokens, c.min_kv_length, c.max_kv_length, f"contexts[{i}]"
                        )
                        for i, c in enumerate(cal.contexts)
                    ),
                    "file",
                )
            if parsed.policy is not None:
                for key in ("window_size", "update_interval", "switch_min_gain"):
                    v = getattr(parsed.policy, key)
                    if v is not None:
                        values[f"policy.{key}"] = (v, "file")
        for key, v in (flags or {}).items():
            if key not in KEYS:
                raise InputError("flag", key, f"one of {KEYS}")
            if v is not None:
                values[key] = (v, "flag")
        return cls(values=values, shape=parsed.shape if parsed else None)

    def get(self, key: str) -> tuple[Any, str] | None:
        return self.values.get(key)


def _context(prefill: int, lo: int, hi: int, where: str) -> ContextInterval:
    try:
        return ContextInterval(prefill, lo, hi)
    except InputError as exc:
        raise InputError(f"{where}.{exc.field}", exc.value, exc.expected, hint=exc.hint) from None


def resolve_config(
    user: UserConfig, geometry: Geometry, *, device_kind: str | None = None
) -> CalibrationConfig:
    """Fill every value the user did not set from the documented defaults against ``geometry``.

    Parameters
    ----------
    user : explicit values (file / flag).
    geometry : the warmed runner's captured geometry; its ``draft_width`` is the run's
        ``num_speculative_tokens``.
    device_kind : the run's device kind; a kind in :data:`KIND_DEFAULTS` takes its window
        design and context levels from there (source ``default (KIND)``), any other (or None)
        the seeds' defaults.

    Returns
    -------
    CalibrationConfig with ``sources`` for every key. The default context is shrunk to fit the
    model context and the KV capacity (``notes['contexts']`` says how); explicit values are not
    checked here (``feasibility.check_feasible`` does that, before any sampling).
    """
    sources: dict[str, str] = {}
    notes: dict[str, str] = {}

    kind_defaults = KIND_DEFAULTS.get(device_kind or "", {})

    def pick(key: str, default: Any) -> Any:
        got = user.get(key)
        if got is None:
            if key in kind_defaults:
                sources[key] = f"default ({device_kind})"
                return kind_defaults[key]
            sources[key] = "default"
            return default
        sources[key] = got[1]
        return got[0]

    model = pick("model", DEFAULT_MODEL)
    # The adaptive-draft-step file shape means the user calibrates per candidate k.
    mode_default = "draft_step" if user.shape == "adaptive_draft_step" else "target_verify"
    mode = pick("mode", mode_default)
    if sources["mode"] == "default" and user.shape == "adaptive_draft_step":
        notes["mode"] = "draft_step because the config file has the adaptive-draft-step shape"

    w = geometry.draft_width
    got = user.get("draft_width")
    if got is not None and got[0] != w:
        raise InputError(
            "draft_width",
            got[0],
            f"the run's num_speculative_tokens={w}",
            hint=f"draft_width from the {got[1]} must match the runner; change --draft-width instead",
        )
    sources["draft_width"] = "run"

    buckets = tuple(sorted(set(pick("request_buckets", geometry.request_buckets))))
    if sources["request_buckets"] == "default":
        notes["request_buckets"] = (
            "every bucket the engine captured (its default: the device's served set, "
            "speccal.base.geometry.SERVED_REQUEST_BUCKETS, as bench and generate)")
    check_buckets_captured(buckets, geometry)
    rows_in = pick("target_graph_rows", None)
    if rows_in is None:
        # Every legal captured target bucket of each request bucket, full width included.
        rows = {
            b: tuple(g for g in geometry.target_rows.get(b, ()) if b <= g <= b * (w + 1))
            for b in buckets
        }
        if mode == "draft_step":
            # full batches (G = Bcap * (k + 1)) and the G partly filled batches pad to
            rows = {b: tuple(sorted({g for g, _, _ in geometry.draft_step_shapes(b)}))
                    for b in rows}
    elif isinstance(rows_in, Mapping):
        rows = {}
        for key, gs in rows_in.items():
            try:
                b = int(key)
            except (TypeError, ValueError):
                raise InputError(
                    "target_graph_rows", key, "request bucket keys written as integers"
                ) from None
            if b not in buckets:
                raise InputError(
                    f"target_graph_rows[{b}]",
                    list(gs),
                    f"a key among request_buckets {list(buckets)}",
                )
            rows[b] = tuple(gs)
        missing = [b for b in buckets if b not in rows]
        if missing:
            raise InputError(
                "target_graph_rows",
                sorted(rows),
                f"an entry for every request bucket (missing {missing})",
            )
    else:
        wanted = sorted(set(rows_in))
        rows = {
            b: tuple(g for g in wanted if g in geometry.target_rows.get(b, ())) for b in buckets
        }
        unused = [g for g in wanted if not any(g in gs for gs in rows.values())]
        if unused:
            raise InputError(
                "target_graph_rows",
                unused,
                "target row buckets captured for at least one request bucket",
                hint=f"captured: { {b: list(geometry.target_rows.get(b, ())) for b in buckets} }",
            )
    # Full width is always sampled: the full-width admission fallback needs it and it links the
    # additive grid through shared G values.
    rows = {b: tuple(sorted(set(gs) | {b * (w + 1)})) for b, gs in rows.items()}

    warmup = pick("warmup_steps", DEFAULT_WARMUP_STEPS)
    steps = pick("window_steps", DEFAULT_WINDOW_STEPS)
    windows = pick("windows_per_point", DEFAULT_WINDOWS_PER_POINT)
    for name, v, lo in (
        ("warmup_steps", warmup, 0),
        ("window_steps", steps, 1),
        ("windows_per_point", windows, 1),
    ):
        _check_int(name, v, lo)
    min_windows, early_stop = _early_stop(pick, windows, sources, notes)

    contexts = pick("contexts", None)
    if contexts is None:
        reserve = reserve_tokens(warmup, steps, windows, w)
        levels, why = default_contexts(
            geometry,
            max(buckets),
            reserve,
            prefill_tokens=DEFAULT_PREFILL_TOKENS,
            min_kv_length=DEFAULT_MIN_KV_LENGTH,
            max_kv_length=DEFAULT_MAX_KV_LENGTH,
            levels=kind_defaults.get("context_levels", DEFAULT_LEVELS),
        )
        contexts = tuple(ContextInterval(*ctx) for ctx in levels)
        if len(levels) > 1:
            spans = ", ".join(f"{lo}-{hi}" for _, lo, hi in levels)
            why = (f"{why}; " if why else "") + (
                f"{len(levels)} geometric KV levels ({spans}) so the table prices context"
            )
        elif "context_levels" in kind_defaults:
            why = (f"{why}; " if why else "") + (
                f"{device_kind}: one interval (calibrate.config.KIND_DEFAULTS; give explicit "
                "contexts for a KV-aware table)"
            )
        if why:
            notes["contexts"] = why
    partly = ()
    if mode == "draft_step":
        partly = tuple((b, g, k, n) for b in buckets
                       for g, k, n in geometry.draft_step_shapes(b)
                       if n < b and g in rows[b])
    policy = PolicyConfig(
        window_size=pick("policy.window_size", DEFAULT_WINDOW_SIZE),
        update_interval=pick("policy.update_interval", DEFAULT_UPDATE_INTERVAL),
        switch_min_gain=pick("policy.switch_min_gain", DEFAULT_SWITCH_MIN_GAIN),
    )
    return CalibrationConfig(
        model=model,
        mode=mode,
        draft_width=w,
        request_buckets=buckets,
        target_graph_rows=rows,
        contexts=tuple(contexts),
        warmup_steps=warmup,
        window_steps=steps,
        windows_per_point=windows,
        token_seed=pick("token_seed", DEFAULT_TOKEN_SEED),
        policy=policy,
        min_windows_per_point=min_windows,
        early_stop_spread_pct=early_stop,
        sources=sources,
        notes=notes,
        partly_filled=partly,
        kv_spread=bool(pick("kv_spread", False)),
    )


def _early_stop(
    pick: Any, windows: int, sources: dict[str, str], notes: dict[str, str]
) -> tuple[int | None, float | None]:
    """``(min_windows_per_point, early_stop_spread_pct)`` of ``resolve_config``: explicit values
    as given (checked by ``check_early_stop``); a device kind's default rule is dropped, with a
    note, where ``windows_per_point`` leaves no window to save (a default must not refuse a run)."""
    min_windows = pick("min_windows_per_point", None)
    bound = pick("early_stop_spread_pct", None)
    if bound is not None and not isinstance(bound, bool) and isinstance(bound, int):
        bound = float(bound)
    if (min_windows is not None and sources["min_windows_per_point"].startswith("default")
            and min_windows >= windows):
        notes["min_windows_per_point"] = (
            f"none: windows_per_point={windows} leaves no window for the early stop to save")
        min_windows = None
    if (bound is not None and sources["early_stop_spread_pct"].startswith("default")
            and (min_windows is None or min_windows >= windows)):
        bound = None  # the kind's bound of a rule the run does not use
    check_early_stop(min_windows, bound, windows)
    return min_windows, bound
