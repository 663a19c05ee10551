"""Runner tests: one intra-op CPU thread (tiny shapes; OpenMP spinning on a loaded 2-core box
made them ~50x slower), restored after each test module."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fused_on_cpu():
    """A factory of execution paths whose modules take the fused (Triton) layer code on CPU
    tensors, every op then running its pure-torch reference: the launch plan of the fused
    path, checked without a GPU. ``fused_on_cpu(kernels)`` -> an ExecutionPath."""
    from speccal.kernels.config import DEFAULT_KERNELS
    from speccal.runner.path import ExecutionPath

    class _FusedOnCpu(ExecutionPath):
        def fused(self, x):
            return True

    def make(kernels=DEFAULT_KERNELS):
        return _FusedOnCpu(kernels=kernels)

    return make
