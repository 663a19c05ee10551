"""Captured round graphs: the bucket keys, capture (largest first, one shared pool) and replay.

This module owns :class:`GraphKey` (the one dispatcher key of a captured forward) and
:class:`GraphSet`, which captures a callable over static buffers after one warm-up call and
replays it. A round in ``graph_mode="split"`` replays two graphs: the draft graph of
``GraphKey("draft", bcap, k)`` (draft extend + ``k - 1`` steps, drafted tokens and scores in
its output buffers) and the target graph of ``GraphKey("target", bcap, k, g, update, sampling)``
(the in-graph verify input update when ``update == "in_graph"``, the target forward, acceptance
and the slot-state update). The target graph reads the draft graph's output tensors in place, so
between the two replays there is no host work on the fast path. Under a verify budget (adaptive
target verify) the device allocation of the verify lengths runs eagerly between the two replays
(a few small kernels on the same stream, no host sync), writing the ``num_verify`` / ``nv32``
static inputs the target graph reads; the captured graphs do not change.

``sampling`` is the host's per-round choice of token selection (``speccal.runner.sampling.selection_kind``):
``greedy`` when every request of the batch is greedy (argmax only: no filters, no sort over the
vocabulary), ``sample`` otherwise (the normal sampler / rejection sampler). Both variants of a
target key are captured at warmup where the choice changes the graph (plain decoding, and
``acceptance="sample"``); elsewhere only ``greedy`` (``speccal.runner.sampling.selection_kinds``).

NPU: ``torch_npu.npu.NPUGraph`` / ``torch_npu.npu.graph`` are used the same way when the device
is ``npu``. That path is thin and **untested** here (no NPU on the CI or bench machines).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speccal.base.errors import UnsupportedError


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured forward: ``part`` is ``draft`` or ``target``; ``g``/``update``/``sampling``/
    ``grid`` target only (``sampling``: ``greedy`` | ``sample``; ``""`` = not chosen, expanded at
    capture; ``grid``: a recurrent target's verify rows are the ``[bcap, k + 1]`` grid in order,
    ``RoundInputs.grid``)."""

    part: str
    bcap: int
    k: int
    g: int = 0
    update: str = ""
    sampling: str = ""
    grid: bool = False

    @property
    def size(self) -> tuple[int, int, int]:
        """Sort key: capture the largest buckets first (they set the pool's high-water mark)."""
        return (self.bcap, self.g, self.k)


def _graph_api(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle
    if device.type == "npu":  # pragma: no cover - untested: no NPU here
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise UnsupportedError(f"graph_mode='split' on npu needs torch_npu: {exc}") from exc
        npu = torch.npu
        return npu.NPUGraph, npu.graph, npu.graph_pool_handle
    raise UnsupportedError(
        f"graph_mode='split' needs a cuda (or npu) device, not {device.type!r}; use 'eager'"
    )


class GraphSet:
    """Captured graphs by :class:`GraphKey`, all in one memory pool."""

    def __init__(self, device: torch.device, generator: torch.Generator | None = None):
        self.device = device
        self._graph_cls, self._graph_ctx, pool_handle = _graph_api(device)
        self.pool = pool_handle()
        self.generator = generator
        self.graphs: dict[GraphKey, object] = {}
        self.outputs: dict[GraphKey, object] = {}
        self.capture_s = 0.0  # wall time of every capture (its warm-up call included)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.graphs

    def capture(self, key: GraphKey, fn: Callable[[], object]) -> object:
        """Warm up ``fn`` once (Triton compiles, allocator settles), then capture it."""
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
        graph = self._graph_cls()
        gen = self.generator
        if (
            gen is not None
            and gen.device.type == self.device.type
            and hasattr(graph, "register_generator_state")
        ):
            graph.register_generator_state(gen)
        with self._graph_ctx(graph, pool=self.pool):
            out = fn()
        self.graphs[key] = graph
        self.outputs[key] = out
        self.capture_s += time.perf_counter() - t0
        return out

    def capture_all(self, keys: list[GraphKey],
                    forward: Callable[[GraphKey, bool], Callable[[], object]],
                    precompile: Callable[[list[Callable[[], object]]], object] | None = None,
                    ) -> object:
        """Capture every key not yet captured: drafts first (target graphs read their
        outputs), each part largest first. ``forward(key, captured)`` is the callable a graph
        of ``key`` runs (``captured``: the capture's own, else a dry run); ``precompile``, when
        given, gets every key's dry run before the first capture (parallel Triton compiles)
        and its answer is returned (None without it)."""
        order = sorted(keys, key=lambda q: (q.part != "draft", [-v for v in q.size]))
        order = list(dict.fromkeys(key for key in order if key not in self))
        report = None
        if precompile is not None:
            report = precompile([lambda key=key: forward(key, False)() for key in order])
        for key in order:
            self.capture(key, forward(key, True))
        return report

    def replay(self, key: GraphKey) -> object:
        """Launch the captured graph; returns its (static) output tensors."""
        self.graphs[key].replay()
        return self.outputs[key]
