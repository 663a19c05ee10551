"""Recurrent-state consistency under speculation: two strategies behind one interface.

This module owns the state rows of a hybrid target's linear-attention layers while the engine
serves it (:class:`StateStrategy`), the prefill that fills them (:meth:`StateStrategy.prefill`)
and the accounting of the state bytes each round moves (:class:`StateTraffic`). A recurrent
state cannot be rolled back like a KV cache (a rejected draft's KV rows are simply overwritten
later; a state that absorbed it is wrong), so verification must not destroy the committed
state. The strategies (:data:`STATE_STRATEGIES`, ``EngineConfig.state_strategy``):

``scratch_swap`` (the InfiniLM seed's mechanism)
    Each request slot owns two state rows, a committed one and a scratch one, named through
    the device tables ``row_of [num_slots]`` / ``scratch_of [num_slots]``. Verification reads
    the committed row and writes the state after its last verified row into the scratch row.
    Full acceptance (``accepted == num_verify``) swaps the two table entries: O(1), no state
    bytes. Partial acceptance replays the accepted prefix (the pending token and the accepted
    drafts, ``accepted + 1`` rows) from the committed row, in place, with the explicit batch
    shape ``[bcap, k + 1]`` of the round (fully accepted requests take zero valid rows, which
    leaves their state untouched). The replay is per linear layer and needs no model forward:
    a layer's inputs do not depend on its own state, so the inputs the verify computed for the
    accepted rows (its conv input, conv output, decay and write strength, saved during the
    verify) are the prefix's; the replay reruns only the conv window gather and the delta
    rule from the committed row (``GatedDeltaNet.replay``). No weights are read again.

``snapshots`` (vLLM-style)
    Each slot owns a ring of ``w + 2`` state rows, one of them committed
    (``ring_pos [num_slots]``). Verification writes the state after every verified position
    ``i`` straight into ring row ``committed + 1 + i`` (the recurrence runs row by row; no
    final state is written); acceptance selects the row of the accepted length by moving the
    committed index ``accepted + 1`` rows on: O(1), no state copy. Memory: ``w + 2`` rows per
    slot instead of 2; traffic: ``k + 1`` state writes per request-round where scratch-swap
    writes one and replays (one more read and write, plus the saved inputs). On the ``fla``
    path the recurrence of the verify runs row by row (``fla``'s fused kernel returns only the
    final state) where scratch-swap's may take the fused kernel; on the fused path
    (``KernelConfig.linear_attention.impl == "fused"``) one launch stores every row's state
    under both strategies, and the bytes recorded per round (:class:`StateTraffic`) are the
    same.

Plain decoding (``k = 0``) reads and writes the committed row in place under both.

Everything a round runs here is device work with shapes the host chose (``bcap``, ``k``):
gathers and ``index_copy_`` through the slot tables, ``torch.where`` on the accepted lengths,
no ``.item()``, no host read, no branch on tensor values, so it can sit inside the captured
target graph. Padding requests point at the trash slot; their rows all read and write the
same trash rows with identical values.

State layout: ``LinearState`` rows (``speccal.runner.linear_attention``), per linear layer
``conv [rows, conv_dim, kernel - 1]`` and ``ssm [rows, v_heads, k_dim, v_dim]`` float32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass

import torch

from speccal.base.errors import InputError
from speccal.base.vocab import STATE_STRATEGIES
from speccal.runner.hybrid import HybridModel
from speccal.runner.kv_cache import KVCache
from speccal.runner.linear_attention import LinearState, StateMeta, grid_sources
from speccal.runner.prefill import prefill as prefill_request
from speccal.runner.request import Request


@dataclass(frozen=True)
class StateTraffic:
    """State bytes one round moves over its ``bcap`` request rows (the static shape run).

    ``read`` / ``written``: state-row bytes read and written (verification, replay, snapshot
    rows); ``index_bytes``: slot-table bytes written (swap, ring index); ``saved_inputs``:
    the verified rows' layer inputs a replay needs, written by the verify and read back by the
    replay (both counted).
    """

    read: int = 0
    written: int = 0
    index_bytes: int = 0
    saved_inputs: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written + self.index_bytes + self.saved_inputs

    def __add__(self, other: StateTraffic) -> StateTraffic:
        return StateTraffic(self.read + other.read, self.written + other.written,
                            self.index_bytes + other.index_bytes,
                            self.saved_inputs + other.saved_inputs)


class StateStrategy(ABC):
    """State rows of every request slot and their handling around a round.

    Parameters
    ----------
    target : HybridModel
    num_slots : request slots, the trash slot (the last) included.
    draft_width : ``w``: a round verifies at most ``w + 1`` rows per request.
    max_bucket : the largest physical batch ``bcap``.
    dtype : conv-state dtype (the model's); the delta-rule state is float32.
    """

    name = ""

    def __init__(self, target: HybridModel, *, num_slots: int, draft_width: int,
                 max_bucket: int, dtype: torch.dtype, device: torch.device):
        self.target = target
        self.num_slots = num_slots
        self.w = draft_width
        self.max_bucket = max_bucket
        self.device = device
        per = self._rows_per_slot()
        self.state: LinearState = target.new_state(num_slots * per, dtype, device)
        self.bytes_per_row = self.state.bytes_per_slot()
        # committed state row of each slot (device table: rounds read it without the host);
        # slot s owns rows s * per .. s * per + per - 1
        self.row_of = torch.arange(num_slots, dtype=torch.int64, device=device) * per
        # packed row numbers 0 .. G - 1 of the largest round (read only: a captured verify
        # forward views it, nothing allocates there)
        self._iota = torch.arange(max_bucket * (draft_width + 1), dtype=torch.int64,
                                  device=device)
        # the grid's source rows (StateMeta.grid_source), written per verify forward; the last
        # cell is the trash cell padding rows scatter into
        self._cells = torch.zeros(max_bucket * (draft_width + 1) + 1, dtype=torch.int64,
                                  device=device)
        self.num_rounds = 0
        self.traffic = StateTraffic()  # accumulated over rounds (host, from the shapes)

    def _rows_per_slot(self) -> int:
        """State rows each slot owns (the committed one and the strategy's others)."""
        return 1

    # ------------------------------------------------------------------ host side

    def round_traffic(self, bcap: int, k: int) -> StateTraffic:
        """State bytes a round over ``bcap`` request rows with ``k`` draft steps moves."""
        s = self.bytes_per_row * bcap
        if k == 0:  # plain decode: the committed row, in place
            return StateTraffic(read=s, written=s)
        return self._spec_traffic(bcap, k, s)

    @abstractmethod
    def _spec_traffic(self, bcap: int, k: int, s: int) -> StateTraffic:
        """A speculative round's traffic (``s``: one state row per request of the bucket)."""

    def record(self, bcap: int, k: int) -> StateTraffic:
        """Count one round (called by the round runner's host phase; graphs replay too)."""
        t = self.round_traffic(bcap, k)
        self.traffic = self.traffic + t
        self.num_rounds += 1
        return t

    def reset_traffic(self) -> None:
        self.traffic = StateTraffic()
        self.num_rounds = 0

    def reset_slot(self, slot: int) -> None:
        """A new request in ``slot`` starts from zero state (its committed row)."""
        self.state.reset_rows(self.row_of[slot : slot + 1])

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, req: Request, target: HybridModel, draft, kv: KVCache, *, chunk: int,
                generator: torch.Generator, device: torch.device,
                hidden_out: list[torch.Tensor] | None = None,
                states_at: Collection[int] = (),
                states_out: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
                ) -> tuple[int, torch.Tensor]:
        """Chunked prefill of ``req`` into its committed state row, the full-attention layers'
        KV and the head's KV; returns the first token and the last prompt hidden ``[hidden]``.

        The layout of ``speccal.runner.prefill.prefill`` (chunk ``[p0, p1)`` runs the target on
        positions ``p0 .. p1 - 1`` and the head on ``p0 - 1 .. p1 - 2``), with the chunked
        delta rule carrying the state between chunks, on the torch backend
        (``speccal.runner.path.prefill_path``) as the dense prefill. ``hidden_out``: as
        ``prefill``'s. ``states_at``: prompt lengths after which the state row is copied into
        ``states_out[length]`` (per linear layer ``(conv [C, K - 1], ssm [Hv, Dk, Dv])``; a
        chunk ends at each of them), what a prompt source admits prefixes with.
        """
        self.reset_slot(req.slot)
        rows = self.row_of[req.slot : req.slot + 1]
        num_kv = target.num_kv_layers
        wanted = {int(n) for n in states_at}

        def target_chunk(ids, pos, meta, p0, p1):
            smeta = StateMeta(rows, rows, p1 - p0, is_chunked=True)
            h = target(ids, pos, meta, kv.layers[:num_kv], smeta, self.state)
            if states_out is not None and p1 in wanted:
                states_out[p1] = [(c[0], s[0]) for c, s in self.state.snapshot(rows)]
            return h

        return prefill_request(req, target, draft, kv, chunk=chunk, generator=generator,
                               device=device, num_kv_layers=num_kv, target_chunk=target_chunk,
                               hidden_out=hidden_out, cuts=wanted)

    def admit_states(self, slots: torch.Tensor,
                     states: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Set the committed state rows of ``slots [M]`` (int64, device) to ``states`` (one
        ``prefill`` ``states_out`` entry per slot): a prompt source's admission."""
        per_layer = [(torch.stack([st[i][0] for st in states]),
                      torch.stack([st[i][1] for st in states]))
                     for i in range(len(self.state.layers))]
        self.state.restore(self.row_of[slots], per_layer)

    # ------------------------------------------------------------------ the round (device)

    def verify_args(self, x, packed: torch.Tensor | None = None) -> tuple[StateMeta, LinearState]:
        """The ``(state_meta, state)`` pair of the verify forward over the packed rows.

        ``x``: the round's inputs (``speccal.runner.round.RoundInputs``: ``host.slot_index
        [bcap]``, ``host.num_verify [bcap]``, and for the host update ``ver.row [G]`` into the
        ``[bcap, k + 1]`` grid). ``packed``: the
        in-graph update's ``cu_q_lens [bcap + 1]`` (int32, written on the device); the grid
        row of each packed row is then derived from it here, on the device.
        """
        bcap, k, slots = x.bcap, x.k, x.host.slot_index
        rows = self.row_of[slots]
        ver_row = x.ver.row
        if k == 0 and ver_row.shape[0] == bcap:
            # plain decode: one row per request (padding requests' included, into the trash
            # slot), so the packed rows already are the [bcap, 1] grid, in order, and every
            # row is real: no grid scatter and gather, no masks, in every linear layer
            return StateMeta(rows, rows, 1), self.state
        num_valid = x.host.num_verify + 1  # [bcap]: pending token + verified drafts
        if x.grid:  # the packed rows are the [bcap, k + 1] grid in order: no row map
            return self._verify_meta(slots, bcap, k, rows, num_valid, None), self.state
        iota = self._iota[: ver_row.shape[0]]
        grid = ver_row if packed is None else _grid_rows(packed, k + 1, iota)
        if k == 0:
            meta = StateMeta(rows, rows, 1, num_valid, row_index=grid)
        else:
            meta = self._verify_meta(slots, bcap, k, rows, num_valid, grid)
        meta.grid_source = grid_sources(grid, iota, self._cells[: bcap * (k + 1) + 1])
        return meta, self.state

    @abstractmethod
    def _verify_meta(self, slots, bcap, k, rows, num_valid, grid) -> StateMeta:
        """The verify forward's rows of request slots ``slots [bcap]``: read ``rows [bcap]``,
        ``num_valid [bcap]`` real rows, ``grid [G]``: each packed row's cell of the
        ``[bcap, k + 1]`` grid (None: the packed rows are the grid, ``RoundInputs.grid``)."""

    def commit(self, x, num_accepted: torch.Tensor) -> None:
        """After acceptance: make each slot's committed row the state after its accepted
        prefix (``num_accepted [bcap]``: drafts accepted, the pending token comes first)."""
        if x.k > 0:
            self._commit(x.host.slot_index, x.host.num_verify, x.bcap, x.k,
                         num_accepted.long())

    @abstractmethod
    def _commit(self, slots, num_verify, bcap, k, num_accepted) -> None:
        """The committed rows of ``slots [bcap]`` after acceptance (``num_accepted [bcap]`` int64), on device."""


class ScratchSwapStrategy(StateStrategy):
    """Committed + scratch row per slot; swap on full acceptance; replay on partial."""

    name = "scratch_swap"

    def _rows_per_slot(self) -> int:
        return 2

    def __init__(self, target: HybridModel, **kw):
        super().__init__(target, **kw)
        self.scratch_of = self.row_of + 1
        dtype = self.state.layers[0][0].dtype
        self.saves = self.state.replay_buffers(self.max_bucket, self.w + 1, dtype,
                                               target.config.linear)
        # saved inputs per request and verified position, over every linear layer
        self.save_bytes_per_row = self.saves.bytes_per_cell()

    def _spec_traffic(self, bcap, k, s):
        # verify: read the committed row, write the scratch row and the saved inputs; swap:
        # two table entries per request; replay (every request of the bucket: the accepted
        # prefix, or zero rows): read the committed row and the saved inputs, write the row
        saved = self.save_bytes_per_row * bcap * (k + 1)
        return StateTraffic(read=2 * s, written=2 * s, index_bytes=2 * 8 * bcap,
                            saved_inputs=2 * saved)

    def _verify_meta(self, slots, bcap, k, rows, num_valid, grid):
        scratch = self.scratch_of[slots]
        return StateMeta(rows, scratch, k + 1, num_valid, row_index=grid,
                         replay_saves=self.saves.views(bcap, k + 1))

    def _commit(self, slots, num_verify, bcap, k, num_accepted):
        row, scratch = self.row_of[slots], self.scratch_of[slots]
        is_full = num_accepted == num_verify  # [bcap]
        committed = torch.where(is_full, scratch, row)
        self.row_of.index_copy_(0, slots, committed)
        self.scratch_of.index_copy_(0, slots, torch.where(is_full, row, scratch))
        # partial acceptance: the pending token and the accepted drafts, replayed in place
        # from the committed row (zero rows where the swap already committed)
        num_valid = torch.where(is_full, 0, num_accepted + 1)
        for mixer, layer, save in zip(self.target.linear_mixers(), self.state.layers,
                                      self.saves.views(bcap, k + 1), strict=True):
            mixer.replay(layer, committed, num_valid, save)


class SnapshotStrategy(StateStrategy):
    """A ring of ``w + 2`` rows per slot; verify writes the state after each position into
    the ring's other rows; acceptance moves the committed index to the accepted one."""

    name = "snapshots"

    def _rows_per_slot(self) -> int:
        return self.w + 2

    def __init__(self, target: HybridModel, **kw):
        super().__init__(target, **kw)
        ring = self._rows_per_slot()
        self.base = torch.arange(self.num_slots, dtype=torch.int64, device=self.device) * ring
        self.ring_pos = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self.offsets = torch.arange(1, self.w + 2, dtype=torch.int64, device=self.device)

    def _spec_traffic(self, bcap, k, s):
        # verify: read the committed row, write k + 1 snapshot rows; accept: two table entries
        return StateTraffic(read=s, written=(k + 1) * s, index_bytes=2 * 8 * bcap)

    def _snapshot_rows(self, slots: torch.Tensor, k: int) -> torch.Tensor:  # [bcap] -> [bcap, k+1]
        """Ring rows after the committed one: position ``i`` goes ``i + 1`` rows further."""
        ring = self._rows_per_slot()
        pos = (self.ring_pos[slots][:, None] + self.offsets[None, : k + 1]) % ring
        return self.base[slots][:, None] + pos

    def _verify_meta(self, slots, bcap, k, rows, num_valid, grid):
        snap = self._snapshot_rows(slots, k)
        return StateMeta(rows, None, k + 1, num_valid, row_index=grid, snapshot_rows=snap)

    def _commit(self, slots, num_verify, bcap, k, num_accepted):
        pos = (self.ring_pos[slots] + 1 + num_accepted) % self._rows_per_slot()
        self.ring_pos.index_copy_(0, slots, pos)
        self.row_of.index_copy_(0, slots, self.base[slots] + pos)


_CLASSES = {c.name: c for c in (ScratchSwapStrategy, SnapshotStrategy)}


def make_strategy(name: str, target: HybridModel, **kw) -> StateStrategy:
    """The :data:`STATE_STRATEGIES` entry ``name`` over ``target``'s state rows."""
    if name not in _CLASSES:
        raise InputError("state_strategy", name, f"one of {', '.join(STATE_STRATEGIES)}")
    return _CLASSES[name](target, **kw)


def _grid_rows(cu_q_lens: torch.Tensor, num_r: int, p: torch.Tensor) -> torch.Tensor:
    """Packed row ``p [G]`` (int64, ``0 .. G - 1``) -> its ``[B, R]`` grid cell ``b * R + i``
    (rows of request ``b`` are ``cu[b] .. cu[b + 1]``); rows past ``cu[B]`` -> the trash cell
    ``B * R``. [G] int64, by ``searchsorted``: static shapes, no host read."""
    cu = cu_q_lens.long()
    num_b = cu.shape[0] - 1
    b = torch.searchsorted(cu[1:], p, right=True).clamp(max=num_b - 1)
    return torch.where(p < cu[-1], b * num_r + p - cu[b], num_b * num_r)
