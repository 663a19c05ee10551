"""What calibration and the live runs need of a runner: the face they type against.

This module owns :class:`Runner` (a ``Protocol``: ``speccal.runner.engine.Engine`` implements
it, and so do the tests' fake engines) and :class:`BuildReport`, so that ``speccal.calibrate``
never probes an engine with ``getattr`` / ``hasattr`` or reaches into its runner. Torch-free:
``device`` is typed ``Any`` (a ``torch.device``, or None for a runner without one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from speccal.base.geometry import Geometry


@dataclass(frozen=True)
class BuildReport:
    """How a runner was built: phase seconds (``load_s``, ``graphs_s``, ..., ``total_s``), what
    its capture precompiled (``PrecompileReport.to_dict()``; None off CUDA / Triton), graphs
    captured and their capture seconds, and the recurrent-state traffic per round shape of a
    hybrid target (None for a KV-only target)."""

    timings: Mapping[str, float] = field(default_factory=dict)
    precompile: Mapping[str, Any] | None = None
    graphs: int = 0
    capture_s: float = 0.0
    state_traffic: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Routing:
    """The routed-expert (MoE) layers of a runner's target: ``layers`` routed layers, each
    choosing ``top_k`` of ``experts`` per row. Each of its rounds reports, per routed layer, the
    distinct experts the round activated (``RoundResult.experts_activated``)."""

    experts: int
    top_k: int
    layers: int


@runtime_checkable
class Runner(Protocol):
    """A runner calibration drives (``speccal.calibrate``) and live runs plan rounds on."""

    geometry: Geometry
    description: str  # one line: model, dtype, device
    device: Any  # torch.device, or None
    vocab_size: int  # token ids of synthetic prompts are drawn below it
    round_index: int  # rounds queued so far
    supports_prompt_source: bool  # set_prompt_source fills prompts by KV copy
    routing: Routing | None  # the target's routed-expert layers; None: a dense target

    def compatibility(self) -> dict[str, Any]: ...

    def runtime_versions(self) -> dict[str, str | None]: ...

    def build_report(self) -> BuildReport: ...

    def reset(self) -> None: ...

    def add_request(self, prompt_ids: Sequence[int], params: Any = None) -> int: ...

    def step(self, plan: Any) -> Any: ...

    def drain(self) -> list[Any]: ...

    def synchronize(self) -> None: ...

    def set_prompt_source(self, tokens: Sequence[int] | None,
                          lengths: Sequence[int] | None = None) -> None: ...
