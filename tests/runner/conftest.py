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
