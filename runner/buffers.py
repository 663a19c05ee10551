"""Static input buffers of a round: allocated once at the largest bucket, sliced per bucket.

This module owns :class:`StaticInputs`: for each named input a device buffer and a host staging
buffer (pinned on CUDA / NPU) of the largest size any bucket needs. All names live in one device
arena and one host arena (byte offsets in declaration order), so a round's inputs reach the
device in one or a few copies instead of one per name: ``put`` writes a numpy array into the
host buffer and returns the device buffer's prefix (stable address per name: what a captured
graph reads); ``flush`` then issues the non-blocking host-to-device copies of everything put
since the last flush, merged into contiguous runs. Staging costs ~20 us of host time per copy
launch on CUDA, and a round stages ~20 inputs: one copy instead of twenty is most of a round's
host preparation.
"""

from __future__ import annotations

import numpy as np
import torch

from speccal.runner.device import is_pinnable

_ALIGN = 64  # bytes between names: keeps every dtype view aligned


class StaticInputs:
    """Named device buffers with pinned host mirrors in one arena each.

    ``device_written`` names are also written by device code (between flushes); a merged copy
    never spans one of them unless it was put since the last flush. Every other name's device
    contents always equal its host mirror, so a copy may run over its stale tail.
    """

    def __init__(
        self,
        sizes: dict[str, tuple[int, torch.dtype]],
        device: torch.device,
        device_written: frozenset[str] = frozenset(),
    ):
        unknown = sorted(set(device_written) - set(sizes))
        if unknown:
            raise ValueError(f"device_written: unknown input names {unknown}")
        pin = is_pinnable(device)
        self.device = device
        self._span: dict[str, tuple[int, int]] = {}  # name -> (byte offset, capacity bytes)
        off = 0
        for name, (numel, dtype) in sizes.items():
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            self._span[name] = (off, nbytes)
            off += -(-nbytes // _ALIGN) * _ALIGN
        self._dev_arena = torch.zeros(max(off, 1), dtype=torch.uint8, device=device)
        self._host_arena = torch.zeros(max(off, 1), dtype=torch.uint8, pin_memory=pin)
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for name, (_, dtype) in sizes.items():
            o, nbytes = self._span[name]
            self.dev[name] = self._dev_arena[o : o + nbytes].view(dtype)
            self.host[name] = self._host_arena[o : o + nbytes].view(dtype)
        self._host_np = {n: t.numpy() for n, t in self.host.items()}  # no torch op per put
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # (name, shape) -> view
        # device-written byte ranges, sorted: a merged copy must not cross one it does not cover
        self._guarded = sorted(self._span[n] for n in device_written)
        self._dirty: dict[str, int] = {}  # name -> staged bytes since the last flush
        self.copies = 0  # host-to-device copies issued (tests, diagnostics)

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Stage ``array`` on the host; return the device view of the same shape.

        The device view holds the data only after :meth:`flush` (stream-ordered).
        """
        n = array.size
        host = self._host_np[name]
        host[:n] = array.reshape(-1)
        if n:
            self._dirty[name] = max(self._dirty.get(name, 0), n * host.itemsize)
        key = (name, array.shape)
        view = self._views.get(key)
        if view is None:  # shapes repeat per bucket: build each view once
            view = self._views[key] = self.dev[name][:n].view(array.shape)
        return view

    def runs(self) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` the next :meth:`flush` copies (merged dirty prefixes)."""
        segs = sorted((self._span[n][0], self._span[n][0] + b) for n, b in self._dirty.items())
        out: list[list[int]] = []
        for start, end in segs:
            if out and not any(out[-1][1] <= g0 < start for g0, _ in self._guarded):
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(a, b) for a, b in out]

    def flush(self) -> None:
        """Issue the non-blocking copies of everything put since the last flush."""
        for start, end in self.runs():
            self._dev_arena[start:end].copy_(self._host_arena[start:end], non_blocking=True)
            self.copies += 1
        self._dirty.clear()
