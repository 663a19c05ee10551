"""Compatibility metadata of a cost table and the check of a table against a running config.

The metadata is the plain dict the runner produces (``Engine.compatibility()``, layout in
``docs/TABLES.md``), validated here as a pydantic model with ``extra="forbid"``. Since table
schema version 2 it records the measured program: ``graph_mode``, ``attention_backend``,
``input_update`` and ``kernels = {"digest", "config"}``, where ``config`` is the runner's kernel
configuration as a nested JSON object (groups such as ``pdl``, ``gemv``, ``attention``) and
``digest`` is :func:`kernel_digest` of it (``"unknown"``, with ``config`` null, for a table
migrated from version 1).

Which differences refuse a table and which only warn (``expected`` = running config, ``found`` =
table):

- **semantic** (refused with ``CompatibilityError`` naming every expected vs found value):
  ``draft_width``, ``model.*`` (architecture, weight fingerprint, dtype, quantization),
  ``topology.tp``, ``topology.dp``, ``topology.world_size`` (compared where both sides know
  it: a table or engine that never recorded it is decided by ``tp`` and ``dp``, whose product
  it is), ``graph_mode``, ``device.kind``, ``attention_backend``
  (another attention kernel family is another program), ``state_strategy`` (how a hybrid
  target's recurrent state is kept consistent under rejected drafts, ``scratch_swap`` or
  ``snapshots``: another round with other state traffic; ``none`` for targets without
  recurrent state, the value of every table measured before the field existed). An ``attention_backend`` recorded as
  ``unknown`` on either side (a migrated version 1 table) only warns.
- **performance-only** (``CompatibilityWarning``): ``device.name``, ``topology.devices`` (every
  rank's device name in world-rank order; a differing list names the differing ranks; unknown
  on either side, or one rank on both, is silent: ``device.name`` covers rank 0),
  ``input_update`` (in-graph
  or host metadata update: the same round, another launch schedule), the kernel configuration
  (a digest mismatch names every differing field of the two configs by dotted key,
  ``gemv.panel: table=X running=Y``; a configuration recorded as unknown on either side says
  so), ``verification_mode`` (see :func:`verification_mismatch`), ``loop`` (the round loop
  the costs were measured with, ``pipelined`` or ``synchronous``: see :func:`loop_mismatch`)
  and the provenance versions (speccal, torch, driver).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from speccal.base.digest import DIGEST_CHARS, canonical_json, json_digest
from speccal.base.errors import CompatibilityError, InputError, show

SEMANTIC_FIELDS = (
    "draft_width",
    "model.architecture",
    "model.fingerprint",
    "model.dtype",
    "model.quantization",
    "topology.tp",
    "topology.dp",
    "graph_mode",
    "device.kind",
    "state_strategy",
)
PERFORMANCE_FIELDS = ("device.name", "input_update")
VERSION_FIELDS = ("speccal_version", "torch_version", "driver_version")
UNKNOWN = "unknown"
#: Verification modes whose acceptance is decided by the plan or a profile, not by the model's
#: outputs: the ones calibration measures with. They and ``greedy`` run the target's argmax
#: token path; only ``sample`` (temperature > 0) adds the sampling work.
MEASUREMENT_MODES = ("forced", "synthetic")
#: What a table that never recorded its execution path (schema version 1) says about it.
UNKNOWN_EXECUTION: dict[str, Any] = {
    "attention_backend": UNKNOWN,
    "input_update": UNKNOWN,
    "kernels": {"digest": UNKNOWN, "config": None},
}


#: What a table no runner measured records about the run (``make_compatibility(**UNKNOWN_RUN)``):
#: a bare fit knows neither topology, graph mode nor device, and invents none of them.
UNKNOWN_RUN: dict[str, Any] = {
    "tp": UNKNOWN,
    "dp": UNKNOWN,
    "graph_mode": UNKNOWN,
    "device_kind": UNKNOWN,
}


class SpeccalWarning(UserWarning):
    """Base class of warnings speccal emits on purpose."""


class CompatibilityWarning(SpeccalWarning):
    """A table loaded against a config that differs only in performance-relevant metadata."""


class _Absent:
    """Marks a kernel-config key one side does not have (distinct from a JSON null)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


# ---------------------------------------------------------------- kernel configuration


def kernel_digest(config: Mapping[str, Any]) -> str:
    """The digest of a kernel configuration (``speccal.base.digest.json_digest``: sha256 of its
    canonical JSON, first 16 hex chars), the same function ``KernelConfig.digest`` uses.

    The runner records ``{"digest": kernel_digest(config), "config": config}``; tables are
    compared by digest.

    Raises
    ------
    InputError
        ``config`` is not a JSON object of finite scalars, lists and objects.
    """
    if not isinstance(config, Mapping):
        raise InputError("kernels.config", type(config).__name__, "a JSON object (dict)")
    return json_digest(dict(config), "kernels.config")


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects to dotted keys (``{"gemv": {"panel": 8}}`` -> ``{"gemv.panel": 8}``).

    Lists and scalars are leaves; an empty object is a leaf too (so ``{"norm": {}}`` differs
    from a config without ``norm``).
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def diff_kernel_configs(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every dotted field where two kernel configs differ: ``[(field, a_value, b_value)]``.

    Sorted by field; a key one side lacks is :data:`ABSENT` on that side.
    """
    fa, fb = flatten_config(a), flatten_config(b)
    return [
        (k, fa.get(k, ABSENT), fb.get(k, ABSENT))
        for k in sorted(set(fa) | set(fb))
        if fa.get(k, ABSENT) != fb.get(k, ABSENT)
    ]


# ---------------------------------------------------------------- the metadata model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelIdentity(_Strict):
    architecture: str
    fingerprint: str
    dtype: str
    quantization: str


class Topology(_Strict):
    """Tensor and data parallel sizes; ``unknown`` where no runner recorded them (a bare fit).

    ``world_size`` (``tp * dp``) and ``devices`` (every rank's device name, world-rank order)
    are recorded by every run since they exist (``Engine.compatibility``: one rank, its
    device; ``DistributedEngine.compatibility``: the whole world); a table older than them (or
    a bare fit) leaves them ``unknown``, which is not written.
    """

    tp: Annotated[int, Field(ge=1)] | Literal["unknown"]
    dp: Annotated[int, Field(ge=1)] | Literal["unknown"]
    world_size: Annotated[int, Field(ge=1)] | Literal["unknown"] = UNKNOWN
    devices: list[str] | Literal["unknown"] = UNKNOWN

    @field_validator("tp", "dp", "world_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        # before the union, so a bad size reads as one rule, not one error per union branch
        if value != UNKNOWN and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError("an integer >= 1 or 'unknown'")
        return value

    @field_validator("world_size")
    @classmethod
    def _product(cls, value: Any, info: ValidationInfo) -> Any:
        tp, dp = info.data.get("tp"), info.data.get("dp")
        if value != UNKNOWN and isinstance(tp, int) and isinstance(dp, int) and value != tp * dp:
            raise ValueError(f"tp * dp = {tp} * {dp} = {tp * dp} (or 'unknown')")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _names(cls, value: Any, info: ValidationInfo) -> Any:
        if value == UNKNOWN:
            return value
        if not isinstance(value, list) or not value or not all(
            isinstance(n, str) and n for n in value
        ):
            raise ValueError("a non-empty list of device names (one per rank) or 'unknown'")
        world = info.data.get("world_size")
        if isinstance(world, int) and len(value) != world:
            raise ValueError(f"{world} device names (world_size), one per rank")
        return value

    @model_serializer(mode="wrap")
    def _omit_unknown_ranks(self, handler):
        """``world_size`` / ``devices`` are written only where a run recorded them, so a
        one-rank table is byte-identical to one written before the fields existed."""
        out = handler(self)
        for name in ("world_size", "devices"):
            if out.get(name) == UNKNOWN:
                out.pop(name)
        return out


class DeviceInfo(_Strict):
    kind: Literal["cpu", "cuda", "npu", "unknown"]
    name: str


class KernelsInfo(_Strict):
    """The kernel configuration measured: ``digest`` = :func:`kernel_digest` of ``config``.

    ``config`` null means unknown (a table migrated from version 1); then ``digest`` is
    ``"unknown"``.
    """

    config: dict[str, Any] | None  # validated before ``digest``, which is checked against it
    digest: str = Field(pattern=rf"^([0-9a-f]{{{DIGEST_CHARS}}}|{UNKNOWN})$")

    @field_validator("digest")
    @classmethod
    def _digest_matches_config(cls, digest: str, info: ValidationInfo) -> str:
        if "config" not in info.data:
            return digest  # the config itself was refused; that error is reported
        config = info.data["config"]
        want = UNKNOWN if config is None else kernel_digest(config)
        if digest != want:
            raise ValueError(
                f"{want!r}: kernel_digest of the recorded config ('unknown' exactly when the "
                "config is null)"
            )
        return digest

    @property
    def known(self) -> bool:
        return self.config is not None


class Compatibility(_Strict):
    """What a cost table is valid for (see module docstring for semantic vs performance)."""

    draft_width: int = Field(ge=1)
    model: ModelIdentity
    topology: Topology
    graph_mode: Literal["eager", "split", "unified", "unknown"]
    attention_backend: Literal["torch", "triton", "unknown"]
    input_update: Literal["in_graph", "host", "unknown"]
    kernels: KernelsInfo
    verification_mode: Literal["greedy", "sample", "synthetic", "forced"]
    device: DeviceInfo
    #: The engine's round loop (``EngineConfig.pipeline``); ``unknown`` for a table measured
    #: before the loop was recorded (migrated or bare-fit tables).
    loop: Literal["pipelined", "synchronous", "unknown"] = UNKNOWN
    #: The recurrent-state strategy of a hybrid target (``EngineConfig.state_strategy``);
    #: ``none`` for targets without recurrent state (every table older than the field).
    state_strategy: Literal["scratch_swap", "snapshots", "none", "unknown"] = "none"

    @model_serializer(mode="wrap")
    def _omit_no_state(self, handler):
        """``state_strategy`` is written only where a target has recurrent state, so a dense
        target's table is byte-identical to one written before the field existed."""
        out = handler(self)
        if out.get("state_strategy") == "none":
            out.pop("state_strategy")
        return out


def as_compatibility(
    value: Compatibility | Mapping[str, Any], field: str = "compatibility"
) -> Compatibility:
    """Validate a dict (e.g. ``Engine.compatibility()``) into :class:`Compatibility`.

    Raises ``InputError`` naming the first bad key.
    """
    if isinstance(value, Compatibility):
        return value
    if not isinstance(value, Mapping):
        raise InputError(field, type(value).__name__, "a compatibility object (dict)")
    try:
        return Compatibility.model_validate(dict(value))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{field}.{loc}" if loc else field
        if err["type"] == "missing":
            raise InputError(where, "missing", "a required key") from None
        raise InputError(where, err.get("input"), pydantic_message(err)) from None


def pydantic_message(err: Mapping[str, Any]) -> str:
    """A pydantic error's message without its ``Value error, `` prefix."""
    return str(err["msg"]).removeprefix("Value error, ")


def make_compatibility(
    *,
    draft_width: int,
    architecture: str = UNKNOWN,
    fingerprint: str = UNKNOWN,
    dtype: str = UNKNOWN,
    quantization: str = UNKNOWN,
    tp: int | str = 1,
    dp: int | str = 1,
    world_size: int | str = UNKNOWN,
    devices: list[str] | str = UNKNOWN,
    graph_mode: str = "split",
    attention_backend: str = UNKNOWN,
    input_update: str = UNKNOWN,
    kernel_config: Mapping[str, Any] | None = None,
    verification_mode: str = "forced",
    device_kind: str = "cpu",
    device_name: str = UNKNOWN,
    loop: str = UNKNOWN,
    state_strategy: str = "none",
) -> dict[str, Any]:
    """A complete, validated compatibility dict for a table no runner measured.

    For a bare ``speccal fit``, synthetic scenarios, benches and tests; a real run records
    ``Engine.compatibility()``. Every identity defaults to ``unknown``, so a table built with
    the defaults is refused against any real engine (it fails closed). ``kernel_config`` None
    records the kernels as unknown; otherwise the digest is :func:`kernel_digest` of it.
    ``tp``, ``dp``, ``graph_mode`` and ``device_kind`` accept ``unknown`` too (what a bare
    ``speccal fit`` records: :data:`UNKNOWN_RUN`); a semantic field recorded as unknown differs
    from every running config's value, so such a table is refused, naming the field.
    ``world_size`` and ``devices`` (rank order) default to unknown (not written): nothing
    about the run is invented.
    """
    if kernel_config is None:
        kernels = dict(UNKNOWN_EXECUTION["kernels"])
    else:
        digest = kernel_digest(kernel_config)  # refuses what JSON cannot hold
        # Through JSON, so tuples become the lists a saved table holds (same digest).
        kernels = {"digest": digest, "config": json.loads(canonical_json(dict(kernel_config)))}
    doc = {
        "draft_width": draft_width,
        "model": {
            "architecture": architecture,
            "fingerprint": fingerprint,
            "dtype": dtype,
            "quantization": quantization,
        },
        "topology": {"tp": tp, "dp": dp, "world_size": world_size, "devices": devices},
        "graph_mode": graph_mode,
        "attention_backend": attention_backend,
        "input_update": input_update,
        "kernels": kernels,
        "verification_mode": verification_mode,
        "device": {"kind": device_kind, "name": device_name},
        "loop": loop,
        "state_strategy": state_strategy,
    }
    return as_compatibility(doc).model_dump(mode="json")


# ---------------------------------------------------------------- comparison


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Mismatch:
    """One differing field: ``expected`` is the running config, ``found`` the table's value.

    ``detail`` says more where the two values alone do not (the differing kernel-config fields).
    """

    field: str
    expected: Any
    found: Any
    semantic: bool
    detail: str | None = None

    def __str__(self) -> str:
        text = f"{self.field}: expected {show(self.expected)}, found {show(self.found)}"
        return f"{text} ({self.detail})" if self.detail else text


def verification_mismatch(expected: str, found: str) -> Mismatch | None:
    """The verification-mode difference worth a warning, or None.

    ``greedy``, ``forced`` and ``synthetic`` verification all run the target's argmax token path
    (``speccal.runner.round``); ``forced`` and ``synthetic`` only decide acceptance from the plan
    or a profile instead of the outputs, which is how calibration measures every grid shape. So a
    table measured with any of the three loads silently into every run, sampled runs included
    (the sampling work at temperature > 0 is outside every calibrated table, by design, as in the
    seeds). Only a table measured with ``sample`` verification holds sampling work that a run
    on the argmax path does not do: it warns when the running mode is not ``sample``.
    """
    if expected == found or found != "sample":
        return None
    return Mismatch(
        "verification_mode",
        expected,
        found,
        False,
        "the table's costs include sampling work this run does not do",
    )


def loop_mismatch(expected: str, found: str) -> Mismatch | None:
    """The round-loop difference worth a warning, or None.

    A pipelined round costs about its device time, a synchronous one its host work on top
    (1.39-1.50x on the H200, bench/RESULTS.md): the same program, another price per round, so a
    mismatch is performance-only. ``unknown`` on either side (a table measured before the loop
    was recorded) is silent: nothing to compare.
    """
    if expected == found or UNKNOWN in (expected, found):
        return None
    return Mismatch(
        "loop",
        expected,
        found,
        False,
        f"costs measured with the {found} round loop, this run uses the {expected} one",
    )


def topology_mismatches(expected: Topology, found: Topology) -> list[Mismatch]:
    """The rank-layout differences beyond ``tp`` / ``dp`` (which are in :data:`SEMANTIC_FIELDS`).

    ``world_size`` is semantic where both sides know it; ``devices`` performance-only, naming
    each rank whose device differs (another count of ranks: every rank past the shorter list).
    ``unknown`` on either side is not compared (a table older than the fields, a bare fit):
    ``tp`` and ``dp`` decide the layout, ``device.name`` rank 0's device; nor are two one-rank
    lists (``device.name`` already names that device: one warning, not two).
    """
    out = []
    if UNKNOWN not in (expected.world_size, found.world_size) and (
        expected.world_size != found.world_size
    ):
        out.append(Mismatch("topology.world_size", expected.world_size, found.world_size, True))
    e, f = expected.devices, found.devices
    if UNKNOWN not in (e, f) and e != f and not len(e) == len(f) == 1:
        ranks = [r for r in range(max(len(e), len(f)))
                 if r >= len(e) or r >= len(f) or e[r] != f[r]]
        detail = "; ".join(
            f"rank {r}: table={f[r] if r < len(f) else '<absent>'} "
            f"running={e[r] if r < len(e) else '<absent>'}"
            for r in ranks
        )
        out.append(Mismatch("topology.devices", e, f, False, detail))
    return out


def kernels_mismatch(expected: KernelsInfo, found: KernelsInfo) -> Mismatch | None:
    """A warning for differing kernel configurations (naming the fields), or None."""
    if not (expected.known and found.known):
        side = " and ".join(
            s for s, k in (("table", found.known), ("running config", expected.known)) if not k
        )
        return Mismatch(
            "kernels",
            expected.digest,
            found.digest,
            False,
            f"kernel configuration recorded as unknown ({side}): costs may be of other kernels",
        )
    if expected.digest == found.digest:
        return None
    fields = "; ".join(
        f"{k}: table={_show(t)} running={_show(r)}"
        for k, t, r in diff_kernel_configs(found.config, expected.config)
    )
    return Mismatch("kernels.digest", expected.digest, found.digest, False, fields)


def _show(value: Any) -> str:
    return repr(value) if value is ABSENT else canonical_json(value)


def compare(
    expected: Compatibility,
    found: Compatibility,
    *,
    expected_versions: Mapping[str, str | None] | None = None,
    found_versions: Mapping[str, str | None] | None = None,
) -> list[Mismatch]:
    """Every field where the table (``found``) differs from the running config (``expected``).

    Versions are compared only where both sides know them (None means unknown).
    """
    out = [
        Mismatch(f, _get(expected, f), _get(found, f), True)
        for f in SEMANTIC_FIELDS
        if _get(expected, f) != _get(found, f)
    ]
    out += topology_mismatches(expected.topology, found.topology)
    if expected.attention_backend != found.attention_backend:
        known = UNKNOWN not in (expected.attention_backend, found.attention_backend)
        out.append(
            Mismatch(
                "attention_backend",
                expected.attention_backend,
                found.attention_backend,
                known,
                None if known else "recorded as unknown: costs may be of another backend",
            )
        )
    out += [
        Mismatch(f, _get(expected, f), _get(found, f), False)
        for f in PERFORMANCE_FIELDS
        if _get(expected, f) != _get(found, f)
    ]
    for extra in (
        kernels_mismatch(expected.kernels, found.kernels),
        verification_mismatch(expected.verification_mode, found.verification_mode),
        loop_mismatch(expected.loop, found.loop),
    ):
        if extra is not None:
            out.append(extra)
    ev, fv = expected_versions or {}, found_versions or {}
    for f in VERSION_FIELDS:
        a, b = ev.get(f), fv.get(f)
        if a is not None and b is not None and a != b:
            out.append(Mismatch(f"provenance.{f}", a, b, False))
    return out


def check_compatibility(
    expected: Compatibility | Mapping[str, Any],
    found: Compatibility,
    *,
    expected_versions: Mapping[str, str | None] | None = None,
    found_versions: Mapping[str, str | None] | None = None,
    source: str = "table",
) -> list[Mismatch]:
    """Refuse semantic mismatches, warn on performance-only ones; return all mismatches.

    Raises
    ------
    CompatibilityError
        Naming every semantic field with its expected and found value.

    Warns
    -----
    CompatibilityWarning
        Naming every performance-only difference (one warning).
    """
    exp = as_compatibility(expected, "expect")
    diffs = compare(exp, found, expected_versions=expected_versions, found_versions=found_versions)
    semantic = [d for d in diffs if d.semantic]
    if semantic:
        raise CompatibilityError(
            f"{source}: {semantic[0].field}",
            semantic[0].found,
            f"{show(semantic[0].expected)} (semantic mismatch; cost measured for another program)",
            hint="; ".join(str(d) for d in semantic),
        )
    perf = [d for d in diffs if not d.semantic]
    if perf:
        warnings.warn(
            f"{source} differs in performance-only metadata (costs may be off): "
            + "; ".join(str(d) for d in perf),
            CompatibilityWarning,
            stacklevel=3,
        )
    return diffs
