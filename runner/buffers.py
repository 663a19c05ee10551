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

Double buffering (pipelined rounds, ``num_host_slots=2``): the host arena exists once per
staging slot and :meth:`StaticInputs.use` selects the slot ``put`` / ``flush`` work on. The host
prepares round ``n + 1`` into the other slot than round ``n``'s, so it never overwrites pinned
memory a queued (non-blocking) copy of round ``n`` may still read. The device arena stays one:
captured graphs read fixed addresses, and its copies are stream-ordered after the work of the
rounds queued before them. A slot is reusable once the round staged in it two rounds ago was
collected (the engine collects round ``n - 1`` before it prepares round ``n + 1``).
"""

from __future__ import annotations

import numpy as np
import torch

from speccal.base.memory import check_fits, host_memory_available
from speccal.runner.device import check_memory, is_pinnable

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
        num_host_slots: int = 1,
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
        if not isinstance(num_host_slots, int) or num_host_slots < 1:
            raise ValueError(f"num_host_slots: {num_host_slots!r}, need an integer >= 1")
        # sized by the largest bucket: refuse before allocating what cannot fit
        value = "the largest request bucket"
        if device.type == "cpu":
            check_fits(off * (1 + num_host_slots), host_memory_available(),
                       field="static round buffers", value=value, what="device and host arenas")
        else:
            check_memory(device, off, field="static round buffers", value=value,
                         what="device arena")
            check_fits(off * num_host_slots, host_memory_available(),
                       field="static round buffers", value=value, what="pinned host arenas")
        self._dev_arena = torch.zeros(max(off, 1), dtype=torch.uint8, device=device)
        self.num_host_slots = num_host_slots
        self._host_arenas = [
            torch.zeros(max(off, 1), dtype=torch.uint8, pin_memory=pin)
            for _ in range(num_host_slots)
        ]
        self.dev: dict[str, torch.Tensor] = {}
        self._hosts: list[dict[str, torch.Tensor]] = [{} for _ in range(num_host_slots)]
        for name, (_, dtype) in sizes.items():
            o, nbytes = self._span[name]
            self.dev[name] = self._dev_arena[o : o + nbytes].view(dtype)
            for arena, host in zip(self._host_arenas, self._hosts, strict=True):
                host[name] = arena[o : o + nbytes].view(dtype)
        # no torch op per put
        self._hosts_np = [{n: t.numpy() for n, t in h.items()} for h in self._hosts]
        self.slot = 0
        self._host_arena = self._host_arenas[0]
        self.host = self._hosts[0]
        self._host_np = self._hosts_np[0]
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # (name, shape) -> view
        # device-written byte ranges, sorted: a merged copy must not cross one it does not cover
        self._guarded = sorted(self._span[n] for n in device_written)
        self._dirty: dict[str, int] = {}  # name -> staged bytes since the last flush
        self.copies = 0  # host-to-device copies issued (tests, diagnostics)

    def use(self, slot: int) -> None:
        """Select the host staging slot later ``put`` / ``flush`` calls work on.

        Anything put but not flushed must be flushed first (a staged run belongs to one slot).
        """
        if not 0 <= slot < self.num_host_slots:
            raise ValueError(f"staging slot {slot} outside [0, {self.num_host_slots})")
        if self._dirty:
            raise RuntimeError("StaticInputs.use: flush the staged inputs before switching slots")
        self.slot = slot
        self._host_arena = self._host_arenas[slot]
        self.host = self._hosts[slot]
        self._host_np = self._hosts_np[slot]

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
