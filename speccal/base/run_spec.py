"""The run's options, one torch-free frozen value: :class:`RunSpec`.

The CLI builds one from its flags (``speccal run`` / ``generate`` / ``bench``, ``speccal
calibrate``, ``speccal trace``); ``speccal.runner.engine_config.from_spec`` is the one
conversion into the engine's ``EngineConfig`` (the path served on the device unless the spec
names a graph mode / attention backend, the loop as a queue depth, the TP path). Values are
checked here against the run's vocabulary (``speccal.base.vocab``), each error naming the
command-line flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speccal.base.errors import InputError
from speccal.base.vocab import ACCEPTANCE_MODES, LOOPS, STATE_STRATEGIES


@dataclass(frozen=True)
class RunSpec:
    """What a command runs the engine with (None: the engine's or the device's default)."""

    model: str
    device: str = "cpu"
    dtype: str | None = None
    draft_width: int | None = None
    request_buckets: tuple[int, ...] | None = None
    max_model_len: int | None = None
    seed: int = 0
    acceptance: str = "greedy"
    acceptance_profile: tuple[float, ...] | None = None
    score_informativeness: float = 0.0  # synthetic acceptance: what a draft's score says
    speculative: bool = True
    loop: str = "pipelined"  # LOOPS: pipelined = queue depth 1, synchronous = 0
    state_strategy: str = "scratch_swap"
    graph_mode: str | None = None
    attention_backend: str | None = None
    kernels: Mapping[str, Any] | None = None  # KernelConfig.from_dict's input
    prefill_chunk: int | None = None
    tp: int = 1  # tensor-parallel ranks (> 1: eager graphs and the torch backend by default)
    extra: Mapping[str, Any] = field(default_factory=dict)  # more EngineConfig fields, by name

    def __post_init__(self) -> None:
        for flag, value, allowed in (
            ("--loop", self.loop, LOOPS),
            ("--state-strategy", self.state_strategy, STATE_STRATEGIES),
            ("--acceptance", self.acceptance, ACCEPTANCE_MODES),
        ):
            if value not in allowed:
                raise InputError(flag, value, " or ".join(allowed))
        # graph_mode / attention_backend: checked by the runner's ExecutionPath (its message
        # names the field and lists GRAPH_MODES / the backends)
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise InputError("tp", self.tp, "an integer >= 1")
        if self.request_buckets is not None:
            object.__setattr__(self, "request_buckets", tuple(self.request_buckets))
        if self.acceptance_profile is not None:
            object.__setattr__(self, "acceptance_profile", tuple(self.acceptance_profile))

    @property
    def pipelined(self) -> bool:
        return self.loop == "pipelined"
