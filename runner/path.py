"""The measured program as one value: :class:`ExecutionPath` (graph mode, attention backend,
input update, kernel configuration).

An engine is built from one ``ExecutionPath`` (``EngineConfig.path``); the round runner and every
model module that dispatches on it (:class:`PathBound`) hold that engine's value, bound once at
construction by :func:`bind_path`, so two engines with different paths in one process each run
their own kernels. Nothing here reads the environment; ``compatibility()`` is what a cost table
records of it (``speccal.costmodel.compat``: the attention backend is refused on mismatch, the
kernel digest warns naming the fields that differ).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.vocab import GRAPH_MODES
from speccal.kernels._backend import triton_available
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.runner.device import default_execution_path

ATTENTION_BACKENDS = ("torch", "triton")
INPUT_UPDATES = ("auto", "in_graph", "host")

__all__ = ["ATTENTION_BACKENDS", "ExecutionPath", "GRAPH_MODES", "INPUT_UPDATES", "KernelConfig",
           "PathBound", "SKINNY_ROWS",
           "bind_path", "prefill_path", "rebound", "served_path"]


#: Rows the split-K Triton GEMV serves (its tuned range: decode and verify rows); more rows
#: (prefill chunks) take cuBLAS.
SKINNY_ROWS = 64


@dataclass(frozen=True)
class ExecutionPath:
    """Which program an engine runs.

    Attributes
    ----------
    graph_mode : ``eager`` or ``split`` (a captured draft graph per (Bcap, k) and target graph per
        (Bcap, k, G); CUDA / NPU only).
    attention_backend : ``torch`` (the pure-torch reference attention and dense ops) or ``triton``
        (``speccal.kernels``: the fused decode / verify layer on CUDA tensors).
    input_update : ``auto`` | ``in_graph`` | ``host``: how the target's verify inputs are built
        (``RoundRunner.resolve_update``).
    kernels : the kernel configuration every ``speccal.kernels.ops`` call of this engine takes.
    """

    graph_mode: str = "eager"
    attention_backend: str = "torch"
    input_update: str = "auto"
    kernels: KernelConfig = field(default_factory=lambda: DEFAULT_KERNELS)

    def __post_init__(self) -> None:
        if self.graph_mode not in GRAPH_MODES:
            raise InputError("graph_mode", self.graph_mode, f"one of {', '.join(GRAPH_MODES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InputError("attention_backend", self.attention_backend,
                             f"one of {', '.join(ATTENTION_BACKENDS)}")
        if self.input_update not in INPUT_UPDATES:
            raise InputError("input_update", self.input_update,
                             f"one of {', '.join(INPUT_UPDATES)}")
        if not isinstance(self.kernels, KernelConfig):
            raise InputError("kernels", type(self.kernels).__name__, "a KernelConfig")

    def check_device(self, device: torch.device) -> None:
        """Refuse a path the device cannot run (never a silent fallback)."""
        if self.graph_mode == "split" and device.type not in ("cuda", "npu"):
            raise UnsupportedError(
                f"graph_mode='split' captures CUDA/NPU graphs; device {device.type!r} runs 'eager'")
        if self.attention_backend == "triton":
            if device.type != "cuda":
                raise UnsupportedError(
                    f"attention_backend='triton' runs on CUDA devices; device {device.type!r} "
                    "runs 'torch'")
            if not triton_available():
                raise UnsupportedError(
                    "attention_backend='triton' needs the triton package (pip install triton, or "
                    "the [cuda] extra); use --attention-backend torch")

    def fused(self, x: torch.Tensor) -> bool:
        """Whether ops on ``x`` take the fused Triton kernels (``triton`` backend, CUDA tensor)."""
        return self.attention_backend == "triton" and x.is_cuda

    def with_(self, **changes) -> ExecutionPath:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {"graph_mode": self.graph_mode, "attention_backend": self.attention_backend,
                "input_update": self.input_update, "kernels": self.kernels.to_dict()}


def served_path(device: str, kernels: KernelConfig = DEFAULT_KERNELS) -> ExecutionPath:
    """The path a deployment on ``device`` (``cpu``, ``cuda[:N]``, ``npu[:N]``) serves with
    (``device.default_execution_path``: split graphs + Triton on CUDA), with ``kernels``."""
    graph_mode, backend = default_execution_path(device)
    return ExecutionPath(graph_mode, backend, "auto", kernels)


class PathBound:
    """Mixin of the model modules that dispatch on the engine's :class:`ExecutionPath`.

    ``path`` starts as the eager reference path (so a module built on its own runs the
    pure-torch code) and is replaced by :func:`bind_path` when an engine adopts the model.
    """

    path: ExecutionPath

    def _init_path(self) -> None:
        self.path = _REFERENCE

    @property
    def kx(self) -> KernelConfig:
        """This module's kernel configuration (``path.kernels``), passed to every op."""
        return self.path.kernels


_REFERENCE = ExecutionPath()


def bind_path(module: nn.Module, path: ExecutionPath) -> None:
    """Give every :class:`PathBound` submodule of ``module`` (itself included) ``path``."""
    for m in module.modules():
        if isinstance(m, PathBound):
            m.path = path


def prefill_path(path: ExecutionPath) -> ExecutionPath:
    """The path eager prefill chunks run on: ``path`` with the torch backend (cuBLAS products,
    torch attention). The Triton kernels are built and tuned for decode / verify rows; a prompt's
    tail chunk has any row count up to the chunk size, and on Triton each new count compiled a
    new specialization on first use (most of a cold calibration's warm-up, H200)."""
    return path if path.attention_backend == "torch" else path.with_(attention_backend="torch")


@contextmanager
def rebound(modules: list[nn.Module | None], path: ExecutionPath) -> Iterator[None]:
    """Bind ``path`` to every :class:`PathBound` submodule of ``modules`` for the block, then
    give each its own path back (an eager, host-driven block only: captured graphs never read
    ``path``)."""
    saved = [(m, m.path) for mod in modules if mod is not None for m in mod.modules()
             if isinstance(m, PathBound)]
    for m, _ in saved:
        m.path = path
    try:
        yield
    finally:
        for m, p in saved:
            m.path = p
