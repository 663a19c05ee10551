"""A torch-model-free engine on a fake clock, for tests of the quality gate and the progress output.

``FakeEngine`` honours the calls ``speccal.calibrate`` makes of ``Engine`` (geometry,
compatibility, reset, add_request, step, synchronize) and prices every round exactly: a round at
(Bcap, G) advances the ``FakeClock`` by ``cost_ms(Bcap, G)`` times the factor of the window it is
in, so a window's step time is known to the last digit and one point can be made noisy on
purpose. The n-th window measured of a point (counted from its transition) gets
``factors[(bcap, g)][n]`` (1.0 past the end of the list).

With ``routing`` (a ``Routing``) the fake is a routed-expert target: round ``n`` of a window at
G rows reports, per routed layer ``l``, ``fake_experts(routing, g, l, n)`` distinct experts (a
known truth, different per layer and round, so a mean over either is visible).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from speccal.base.geometry import Geometry
from speccal.base.runner_face import BuildReport, Routing
from speccal.calibrate.pipeline import calibrate
from speccal.costmodel.compat import make_compatibility

#: An exactly additive truth (ms): bias + alpha(Bcap) + theta(G).
BIAS_MS = 2.0
ALPHA_MS = {1: 0.0, 2: 1.0}
THETA_MS = {1: 0.0, 2: 0.2, 3: 0.35, 4: 0.5, 6: 1.0, 8: 1.5}

#: Five points, Bcap 1 at G {2, 4} and Bcap 2 at G {2, 4, 8} (full width added by the grid):
#: connected through G 2 and 4, so four of them can be held out (G 8 is the only Bcap 2 point
#: of its level).
CONFIG = {
    "request_buckets": [1, 2],
    "target_graph_rows": {"1": [2], "2": [2, 4]},
    "contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 128}],
    "warmup_steps": 1,
    "window_steps": 4,
    "windows_per_point": 3,
}
POINTS = ((1, 2), (1, 4), (2, 2), (2, 4), (2, 8))
STEPS_PER_WINDOW = 1 + 1 + 4  # transition + warmup + window


class FakeClock:
    """Seconds that move only when a fake round runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_experts(routing: Routing, g: int, layer: int, round_index: int) -> int:
    """Distinct experts a fake round at ``g`` rows activates in routed layer ``layer``: top_k
    per row up to every expert, less one on odd (layer + round)."""
    full = min(routing.experts, routing.top_k * g)
    return max(routing.top_k, full - (layer + round_index) % 2)


@dataclass
class FakeResult:
    num_requests: int
    bcap: int
    g: int
    k: int
    kv_lengths: list[int]
    round_index: int
    experts_activated: tuple[int, ...] = ()


@dataclass
class FakeEngine:
    clock: FakeClock
    factors: Mapping[tuple[int, int], Sequence[float]] = field(default_factory=dict)
    extra_ms: Mapping[tuple[int, int], float] = field(default_factory=dict)  # non-additive part
    spread_ms_per_token: float = 0.0  # ms per token the longest request runs past the mean KV
    device_kind: str = "cpu"
    stop_after_windows: int | None = None  # raise KeyboardInterrupt at that window's transition
    build_s: float = 0.0  # real seconds the "compile/capture" takes
    routing: Routing | None = None  # a routed-expert target (module docstring)

    def __post_init__(self) -> None:
        if self.build_s:
            time.sleep(self.build_s)
        self.geometry = Geometry(
            draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=4096, max_model_len=256
        )
        self.loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=64))
        self.vocab_size = 64
        self.device = None  # no torch device: the wall clock times its windows
        self.supports_prompt_source = False
        self.description = "fake engine"
        self.steps = 0
        self.windows = 0
        self.threads_seen: set[int] = set()
        self._kv: list[int] = []
        self._fresh = False
        self._factor = 1.0
        self._seen: dict[tuple[int, int], int] = {}
        self.round_index = 0

    def compatibility(self) -> dict:
        return make_compatibility(
            draft_width=3,
            architecture="fake",
            fingerprint="fake:0",
            dtype="float32",
            graph_mode="eager",
            attention_backend="torch",
            input_update="host",
            device_kind=self.device_kind,
            device_name="fake-device",
            loop="synchronous",
        )

    def build_report(self) -> BuildReport:
        return BuildReport(timings={"total_s": self.build_s})

    def set_prompt_source(self, tokens, lengths=None) -> None:
        raise AssertionError("the fake engine fills prompts by prefill")

    def runtime_versions(self) -> dict:
        return {"speccal_version": "test", "torch_version": "test", "driver_version": None}

    def reset(self) -> None:
        self._kv = []
        self._fresh = True
        self.round_index = 0

    def drain(self) -> list:
        return []  # a synchronous loop: nothing queued

    def add_request(self, prompt, params) -> int:
        self._kv.append(len(prompt))
        return len(self._kv) - 1

    def synchronize(self) -> None:
        pass

    def cost_ms(self, bcap: int, g: int) -> float:
        return BIAS_MS + ALPHA_MS[bcap] + THETA_MS[g] + self.extra_ms.get((bcap, g), 0.0)

    def step(self, plan) -> FakeResult:
        bcap = len(self._kv)
        verify = plan.verify_tokens or (plan.num_draft_steps,) * bcap
        g = sum(v + 1 for v in verify)
        if self._fresh:  # a transition: the next window of this point starts
            if self.stop_after_windows is not None and self.windows >= self.stop_after_windows:
                raise KeyboardInterrupt
            n = self._seen.get((bcap, g), 0)
            self._seen[(bcap, g)] = n + 1
            listed = self.factors.get((bcap, g), ())
            self._factor = listed[n] if n < len(listed) else 1.0
            self._fresh = False
            self.windows += 1
        self.steps += 1
        self.threads_seen.add(torch.get_num_threads())
        excess = max(self._kv) - sum(self._kv) / bcap
        self.clock.now += (self.cost_ms(bcap, g) * self._factor
                           + self.spread_ms_per_token * excess) / 1000.0
        self._kv = [kv + v + 1 for kv, v in zip(self._kv, verify, strict=True)]
        self.round_index += 1
        n = self.round_index - 1
        experts = () if self.routing is None else tuple(
            fake_experts(self.routing, g, layer, n) for layer in range(self.routing.layers))
        return FakeResult(bcap, bcap, g, plan.num_draft_steps, list(self._kv), n, experts)


def fake(**kw):
    """``engine_factory`` for ``calibrate`` building a ``FakeEngine(**kw)``: ``.last`` is the
    engine it built, ``.clock`` the clock to pass as ``calibrate(clock=...)``."""
    clock = FakeClock()

    def make(opts):
        make.last = FakeEngine(clock, device_kind=opts.device.split(":")[0], **kw)
        return make.last

    make.last = None
    make.clock = clock
    return make


def patch_cli(monkeypatch, make) -> None:
    """``speccal calibrate`` (the CLI) on the fake engine ``make`` and its clock."""
    monkeypatch.setattr(
        "speccal.calibrate.pipeline.calibrate",
        functools.partial(calibrate, engine_factory=make, clock=make.clock),
    )
