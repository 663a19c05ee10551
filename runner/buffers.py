"""Static input buffers of a round: allocated once at the largest bucket, sliced per bucket.

This module owns :class:`StaticInputs`: for each named input a device buffer and a host staging
buffer (pinned on CUDA / NPU) of the largest size any bucket needs. ``put`` writes a numpy array
into the host buffer and issues one non-blocking host-to-device copy into the device buffer's
prefix, returning that prefix (stable address per name: what a captured graph reads).
"""

from __future__ import annotations

import numpy as np
import torch

from speccal.runner.device import is_pinnable


class StaticInputs:
    """Named device buffers with pinned host mirrors."""

    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device):
        pin = is_pinnable(device)
        self.device = device
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for name, (numel, dtype) in sizes.items():
            self.dev[name] = torch.zeros(numel, dtype=dtype, device=device)
            self.host[name] = torch.zeros(numel, dtype=dtype, pin_memory=pin)

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Stage ``array`` and return the device view of the same shape (copy is async)."""
        n = array.size
        host = self.host[name][:n]
        host.numpy()[:] = array.reshape(-1)
        dev = self.dev[name][:n]
        dev.copy_(host, non_blocking=True)
        return dev.view(array.shape)
