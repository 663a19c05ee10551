"""Compatibility metadata of a cost table and the check of a table against a running config.

The metadata is the plain dict the runner produces (``Engine.compatibility()``, layout in
``docs/ARCHITECTURE.md``), validated here as a pydantic model with ``extra="forbid"``.

Which differences refuse a table and which only warn:

- **semantic** (refused with ``CompatibilityError`` naming every expected vs found value):
  ``draft_width``, ``model.*`` (architecture, weight fingerprint, dtype, quantization),
  ``topology.tp``, ``topology.dp``, ``graph_mode``, ``device.kind``. A cost measured under any of
  these is a cost of a different program.
- **performance-only** (``CompatibilityWarning``): ``device.name``, ``verification_mode`` (the
  seeds calibrate with a greedy or forced target and serve sampled targets: the extra sampling
  work is not in the table, but the shapes are the same), and the provenance versions
  (speccal, torch, driver).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from speccal.base.errors import CompatibilityError, InputError

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
)
PERFORMANCE_FIELDS = ("device.name", "verification_mode")
VERSION_FIELDS = ("speccal_version", "torch_version", "driver_version")


class SpeccalWarning(UserWarning):
    """Base class of warnings speccal emits on purpose."""


class CompatibilityWarning(SpeccalWarning):
    """A table loaded against a config that differs only in performance-relevant metadata."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelIdentity(_Strict):
    architecture: str
    fingerprint: str
    dtype: str
    quantization: str


class Topology(_Strict):
    tp: int = Field(ge=1)
    dp: int = Field(ge=1)


class DeviceInfo(_Strict):
    kind: Literal["cpu", "cuda", "npu"]
    name: str


class Compatibility(_Strict):
    """What a cost table is valid for (see module docstring for semantic vs performance)."""

    draft_width: int = Field(ge=1)
    model: ModelIdentity
    topology: Topology
    graph_mode: Literal["eager", "split", "unified"]
    verification_mode: Literal["greedy", "sample", "synthetic", "forced"]
    device: DeviceInfo


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
        raise InputError(f"{field}.{loc}", err.get("input"), err["msg"]) from None


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Mismatch:
    """One differing field: ``expected`` is the running config, ``found`` the table's value."""

    field: str
    expected: Any
    found: Any
    semantic: bool

    def __str__(self) -> str:
        return f"{self.field}: expected {self.expected!r}, found {self.found!r}"


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
    out += [
        Mismatch(f, _get(expected, f), _get(found, f), False)
        for f in PERFORMANCE_FIELDS
        if _get(expected, f) != _get(found, f)
    ]
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
    """
    exp = as_compatibility(expected, "expect")
    diffs = compare(exp, found, expected_versions=expected_versions, found_versions=found_versions)
    semantic = [d for d in diffs if d.semantic]
    if semantic:
        raise CompatibilityError(
            f"{source}: {semantic[0].field}",
            semantic[0].found,
            f"{semantic[0].expected!r} (semantic mismatch; cost measured for another program)",
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
