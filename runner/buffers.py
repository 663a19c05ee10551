"""Static input buffers of a round: allocated once at the largest bucket, sliced per bucket.

This module owns the named groups a round reads (:class:`HostFacts`, :class:`RequestRows`,
:class:`ExtendRows`, :class:`StepRows`, :class:`VerifyRows`: frozen, keyword-only, a shape next to
every field; the captured parts' device scratch, :class:`RoundScratch`), their arena layout
(:func:`round_layout`, :func:`derived_shapes`) and
:class:`StaticInputs`: for each named input a device buffer and a host staging
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

from dataclasses import dataclass

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


# ------------------------------------------------------------------------- named round buffers
#
# A round's static inputs, grouped by what they describe. Each group is a frozen set of views
# into the one device arena of :class:`StaticInputs` (stable addresses: captured graphs read
# them), allocated at the largest bucket by :func:`round_layout` and viewed per bucket (shapes in
# the comments: ``bcap`` request rows, ``w`` the draft width, ``k`` draft steps, ``g`` target
# rows, ``width`` block-table columns). Arena names are ``<group>.<field>``.


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """What the host stages each round (adjacent in the arena: one merged copy)."""

    is_real: torch.Tensor  # [bcap] int64: 1 on the B real rows, 0 on padding rows
    block_table: torch.Tensor  # [bcap, width] int32: KV blocks, allocated ahead
    slot_index: torch.Tensor  # [bcap] int64: request slot (the trash slot on padding rows)
    num_verify: torch.Tensor  # [bcap] int64: drafts sent to the target (device-written
    #                           under a verify budget)
    nv32: torch.Tensor  # [bcap] int32: twin of num_verify for the kernels


@dataclass(frozen=True, kw_only=True)
class RequestRows:
    """Per-request facts derived on the device from the slot state."""

    ctx_lens: torch.Tensor  # [bcap] int32: KV length L before the round (0 on padding)
    pending_index: torch.Tensor  # [bcap] int64: flat extend-state row of the pending token
    ver_seq: torch.Tensor  # [bcap] int32: KV length after verification, L + k + 1


@dataclass(frozen=True, kw_only=True)
class ExtendRows:
    """The draft-extend forward: ``R = w + 1`` grid rows per request, packed."""

    index: torch.Tensor  # [bcap * (w + 1)] int64: flat extend-state row of each packed row
    pos: torch.Tensor  # [bcap * (w + 1)] int64: its position
    slot: torch.Tensor  # [bcap * (w + 1)] int64: its draft KV slot (sentinel past the total)
    row: torch.Tensor  # [bcap * (w + 1)] int64: its cell of the [bcap, R] grid (+ trash row)
    cu: torch.Tensor  # [bcap + 1] int32: packed row offsets per request
    seq: torch.Tensor  # [bcap] int32: draft KV length after the extend
    last: torch.Tensor  # [bcap] int64: each request's last packed row


@dataclass(frozen=True, kw_only=True)
class StepRows:
    """Draft steps 2..k: one row per request and step."""

    pos: torch.Tensor  # [k - 1, bcap] int64: position written by step j + 1
    slot: torch.Tensor  # [k - 1, bcap] int64: its draft KV slot
    seq: torch.Tensor  # [k - 1, bcap] int32: draft KV length after the step


@dataclass(frozen=True, kw_only=True)
class VerifyRows:
    """The host update's packed verify rows (the in-graph update writes its own, in scratch)."""

    grid: torch.Tensor  # [g] int64: cell of the [bcap, k + 1] grid each packed row reads
    pos: torch.Tensor  # [g] int64: its position
    slot: torch.Tensor  # [g] int64: its KV slot (sentinel on padding rows)
    row: torch.Tensor  # [g] int64: its grid cell, padding on the trash cell bcap * (k + 1)
    drafts: torch.Tensor  # [bcap, k] int64: drafted tokens staged back from the host


#: the groups of the arena, in arena order after the host facts
ROUND_GROUPS = {"host": HostFacts, "req": RequestRows, "ext": ExtendRows, "step": StepRows,
                "ver": VerifyRows}


def round_layout(max_bucket: int, draft_width: int,
                 max_blocks_per_seq: int) -> dict[str, tuple[int, torch.dtype]]:
    """Arena name -> (elements, dtype) of every round buffer at the largest bucket.

    The host facts come first (adjacent: one merged copy per round); every field of every group
    in :data:`ROUND_GROUPS` has exactly one entry (a test checks).
    """
    b, rows = max_bucket, max_bucket * (draft_width + 1)
    i64, i32 = torch.int64, torch.int32
    return {
        "host.is_real": (b, i64), "host.block_table": (b * max_blocks_per_seq, i32),
        "host.slot_index": (b, i64), "host.num_verify": (b, i64), "host.nv32": (b, i32),
        "req.ctx_lens": (b, i32), "req.pending_index": (b, i64), "req.ver_seq": (b, i32),
        "ext.index": (rows, i64), "ext.pos": (rows, i64), "ext.slot": (rows, i64),
        "ext.row": (rows, i64), "ext.cu": (b + 1, i32), "ext.seq": (b, i32),
        "ext.last": (b, i64),
        # k - 1 <= w steps of b rows each
        "step.pos": (rows, i64), "step.slot": (rows, i64), "step.seq": (rows, i32),
        "ver.grid": (rows, i64), "ver.pos": (rows, i64), "ver.slot": (rows, i64),
        "ver.row": (rows, i64), "ver.drafts": (b * draft_width, i64),
    }


def derived_shapes(bcap: int, draft_width: int, k: int,
                   g: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """Group -> field -> shape of the device-derived buffers of one bucket (the views of
    :func:`round_layout`'s capacity a round of ``bcap`` rows, ``k`` steps, ``g`` target rows
    reads)."""
    rows = bcap * (draft_width + 1)
    steps = (max(k - 1, 0), bcap)
    return {
        "req": {"ctx_lens": (bcap,), "pending_index": (bcap,), "ver_seq": (bcap,)},
        "ext": {"index": (rows,), "pos": (rows,), "slot": (rows,), "row": (rows,),
                "cu": (bcap + 1,), "seq": (bcap,), "last": (bcap,)},
        "step": {"pos": steps, "slot": steps, "seq": steps},
        "ver": {"grid": (g,), "pos": (g,), "slot": (g,), "row": (g,), "drafts": (bcap, k)},
    }


@dataclass(frozen=True, kw_only=True)
class RoundScratch:
    """Device scratch of the captured parts, sized at the largest bucket and viewed per round
    (nothing inside a captured region allocates; a test checks). Rows: the target's ``g``
    (<= ``bcap * (k + 1)``) and the draft extend's ``bcap * (w + 1)``, plus the trash grid row.
    """

    iota: torch.Tensor  # [rows + 1] int64: 0 .. rows (read only)
    zero: torch.Tensor  # [max bucket] int64: zeros (read only; k = 0 accepted lengths)
    ver_ids: torch.Tensor  # [g] int64: in-graph update's verify input tokens
    ver_pos: torch.Tensor  # [g] int64: ... their positions
    ver_slot: torch.Tensor  # [g] int64: ... their KV slots
    ver_seq: torch.Tensor  # [bcap] int32: ... KV length after the round
    ver_cu: torch.Tensor  # [bcap + 1] int32: ... packed row offsets
    ver_keys: torch.Tensor  # [g] int64: ... the LM head's packed argmax keys
    grid_src: torch.Tensor  # [bcap * (k + 1) + 1] int64: grid row -> packed row
    packed_cu: torch.Tensor  # [bcap + 1] int64: RoundRunner._packed's cumulative counts
    num_splits: torch.Tensor  # [bcap] int32: split-KV tiling of one attention call
    split_len: torch.Tensor  # [bcap] int32: ... keys per split
    synthetic_scores: torch.Tensor  # [bcap * k] float32: the scores synthetic acceptance uses

    @classmethod
    def allocate(cls, max_bucket: int, draft_width: int, device: torch.device) -> RoundScratch:
        rows = max_bucket * (draft_width + 1)
        i64, i32 = torch.int64, torch.int32
        b = max(max_bucket, 1)
        sizes = {"ver_ids": (rows, i64), "ver_pos": (rows, i64), "ver_slot": (rows, i64),
                 "ver_seq": (b, i32), "ver_cu": (b + 1, i32), "ver_keys": (rows, i64),
                 "grid_src": (rows + 1, i64), "packed_cu": (rows + 1, i64),
                 "num_splits": (b, i32), "split_len": (b, i32),
                 "synthetic_scores": (b * draft_width, torch.float32)}
        return cls(iota=torch.arange(rows + 1, dtype=i64, device=device),
                   zero=torch.zeros(b, dtype=i64, device=device),
                   **{name: torch.zeros(numel, dtype=dtype, device=device)
                      for name, (numel, dtype) in sizes.items()})


#: names only the host writes; every other name is also written by device code (the verify
#: lengths under a budget, everything derived from the slot state)
HOST_ONLY = frozenset({"host.is_real", "host.block_table", "host.slot_index"})
