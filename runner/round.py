"""One speculative round: prepare (host), execute (device, no host sync), collect (the one sync).

This module owns :class:`RoundRunner`, the per-slot draft-extend state and the three phases of a
round over a physical batch of ``bcap`` request rows (``B`` real, the rest padding):

1. **draft extend** (first draft forward): each request's pending extend rows (the target hidden
   states of the tokens committed last round, paired with the next token) are written to the
   draft's KV and the last row predicts draft token 1;
2. **draft steps** 2..k: one row per request, feeding the head's own hidden state back;
3. **target verify**: rows ``[pending token, d_1 .. d_v]`` per request (``v = num_verify``),
   flattened and padded to ``G`` rows; logits are scattered to ``[bcap, k + 1, V]``;
4. **acceptance** (greedy / sample / synthetic / forced, ``speccal.runner.sampling``), and the
   draft context update: the emitted tokens and the target hidden states of the verify rows
   become the slot's next extend rows (valid ``accepted + 1``, known on the host after collect).

Verify lengths ``num_verify [bcap]`` (int64, with an int32 twin ``nv32``) are static inputs.
Either the host chooses them at prepare (``RoundPlan.verify_tokens``), or, under a verify
budget (``RoundInputs.budget_rows = G - B``, adaptive target verify), :meth:`RoundRunner.execute`
writes them on the device between the draft and the target part
(:meth:`RoundRunner.allocate_verify`, the rule of ``speccal.policy_rules.allocate_prefixes`` on this
round's draft scores), eager and captured graphs alike. The in-graph update reads them on the
device (token / metadata update kernels); the host update, after the one sync it makes for the
drafted tokens, derives its packed verify rows from them on the device
(:meth:`RoundRunner.derive_verify`). The target always runs ``G`` rows; rows past the allocation
are padding (sentinel KV slot, trash grid row). ``collect`` returns the allocation with the
round's other results.

Device state per slot (``num_slots = max bucket + 1``; the last is the trash slot of padding):
``ext_tokens [num_slots, w + 1]``, ``ext_hidden [num_slots, w + 1, hidden]``. Everything inside
:meth:`RoundRunner.execute` uses static shapes chosen on the host, masks and index tensors; no
``.item()``, ``.tolist()``, ``nonzero()`` or branch on tensor values.

One loop, any queue depth (docs/ARCHITECTURE.md draws it): :meth:`RoundRunner.prepare` stages
only facts that do not depend on the rounds in flight (``HostFacts``: slot indices, a real-row
mask, the block table grown for every queued round's worst case, the verify lengths) into one
of two pinned staging slots, in one merged copy; the rest is derived on the device from the
per-slot state ``slot_len`` (KV length ``L``) / ``slot_ext`` (pending extend rows), which
:meth:`RoundRunner.advance_slots` advances at the tail of the target graph
(:meth:`RoundRunner.derive_inputs` at the head of the draft graph, :meth:`RoundRunner.derive_verify`
for the host update's packed verify rows; the draft-extend grid always has ``R = w + 1`` rows).
Results are copied into the staging slot's pinned buffers as soon as the round is queued
(:meth:`RoundRunner.stage_outputs`); :meth:`RoundRunner.collect` waits only for that copy.

Token selection is a host flag per round (``RoundInputs.sampling``): argmax-only rounds gather
tokens, never a ``[bcap, k + 1, V]`` logits grid (in-graph: ``ops.verify_accept`` over the LM
head's argmax partials); the flag selects another captured graph, never a device read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from speccal.base.errors import UnsupportedError
from speccal.kernels import ops
from speccal.kernels._backend import interpreting, triton_available
from speccal.kernels.precompile import CompilePool, PrecompileReport, precompile
from speccal.runner import sampling
from speccal.runner.attention import AttnMeta
from speccal.runner.buffers import (
    HOST_ONLY,
    ROUND_GROUPS,
    ExtendRows,
    HostFacts,
    RequestRows,
    RoundScratch,
    StaticInputs,
    StepRows,
    VerifyRows,
    derived_shapes,
    round_layout,
)
from speccal.runner.device import is_pinnable, synchronize
from speccal.runner.graphs import GraphKey, GraphSet
from speccal.runner.kv_cache import SENTINEL_SLOT, KVCache
from speccal.runner.model import FUSED_HEAD_MAX_ROWS, TargetModel
from speccal.runner.mtp import MTPHead
from speccal.runner.path import ExecutionPath
from speccal.runner.request import Request
from speccal.runner.results import full_grid, grid_rows
from speccal.runner.verify_alloc import allocate_prefixes_device


@dataclass(kw_only=True)
class RoundInputs:
    """Host-chosen shapes and the named static buffers of one round (views per bucket)."""

    num_requests: int  # B
    bcap: int
    k: int  # draft steps (0 = plain decoding)
    g: int  # target rows
    num_ext_rows: int  # R of the draft-extend grid
    num_verify: np.ndarray | None  # [B] int64 host copy; None = allocated on device (budget)
    host: HostFacts  # staged by the host
    req: RequestRows  # derived on the device (derive_inputs)
    ext: ExtendRows  # ...
    step: StepRows  # ...
    ver: VerifyRows  # host update: derive_verify, staged drafts
    update: str = "host"  # target input update: "in_graph" (device kernels) | "host"
    sampling: str = "greedy"  # token selection: "greedy" (argmax only) | "sample" (host choice)
    budget_rows: int | None = None  # adaptive verify: draft rows inside G (``G - B``)
    # recurrent targets: every real request verifies all k drafts and G = bcap * (k + 1), so the
    # packed verify rows are the [bcap, k + 1] grid in order (padding requests' rows last):
    # the linear layers take them as they are, no row map (``grid_rows``)
    grid: bool = False
    stage: int = 0  # host staging slot (inputs and results) of this round
    done: object = None  # device event after the result copy (cuda), else None


@dataclass(kw_only=True)
class RoundOutputs:
    """Device results of :meth:`RoundRunner.execute`."""

    num_accepted: torch.Tensor  # [bcap] int64
    out_tokens: torch.Tensor  # [bcap, k + 1] int64
    draft_scores: torch.Tensor | None  # [bcap, k] float32
    num_verify: torch.Tensor | None = None  # [bcap] int64, drafts each request sent to the target


class RoundRunner:
    """Owns static buffers and slot state; runs rounds of the target + MTP head.

    ``precompile_workers``: processes that compile the captured graphs' Triton kernels before
    :meth:`capture` (``speccal.kernels.precompile``; None: one per CPU but one, 0: compile in-process
    during capture, one kernel after the other). ``precompile_report`` says what the last
    capture precompiled.
    """

    precompile_workers: int | None = None
    #: precompile workers started before the build reached capture (``Engine``), or None
    compile_pool: CompilePool | None = None

    def __init__(
        self,
        target: TargetModel,
        draft: MTPHead | None,
        kv: KVCache,
        *,
        draft_width: int,
        max_bucket: int,
        max_blocks_per_seq: int,
        acceptance: str,
        profile: torch.Tensor | None,
        generator: torch.Generator,
        device: torch.device,
        dtype: torch.dtype,
        path: ExecutionPath,
        max_model_len: int = 4096,
        state=None,
        score_informativeness: float = 0.0,
    ):
        # recurrent-state rows of a hybrid target (speccal.runner.hybrid_state.StateStrategy):
        # the verify forward reads / writes them, acceptance commits them; None: KV only
        self.state = state
        self.target = target
        self.draft = draft
        self.kv = kv
        self.w = draft_width
        self.max_bucket = max_bucket
        self.acceptance = acceptance
        self.profile = profile
        # synthetic acceptance: how much a draft's score says about its acceptance
        # (sampling.synthetic_draft_scores)
        self.score_informativeness = float(score_informativeness)
        self.generator = generator
        self.device = device
        self.block_size = kv.allocator.block_size
        # target layers with a KV cache (a hybrid target's linear layers have none), then the
        # draft layer
        num_layers = len(kv.layers) - (1 if draft is not None else 0)
        self.target_kv = kv.layers[:num_layers]
        self.draft_kv = kv.layers[num_layers] if draft is not None else None
        hidden = target.config.hidden_size
        self.num_slots = max_bucket + 1
        self.trash_slot = max_bucket
        w1 = draft_width + 1
        self.ext_tokens = torch.zeros(self.num_slots, w1, dtype=torch.int64, device=device)
        self.ext_hidden = torch.zeros(self.num_slots, w1, hidden, dtype=dtype, device=device)
        self.slot_temperature = torch.zeros(self.num_slots, device=device)
        self.slot_top_k = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.slot_top_p = torch.ones(self.num_slots, device=device)
        self.slot_min_p = torch.zeros(self.num_slots, device=device)
        self.step_rows = torch.arange(max_bucket, device=device)
        self.step_cu = torch.arange(max_bucket + 1, dtype=torch.int32, device=device)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.path = path
        self.static = path.graph_mode == "split"
        self.max_model_len = max_model_len
        self._plans: dict[tuple[int, int], object] = {}  # (bcap, rows) -> SplitPlan
        i64 = torch.int64
        layout = round_layout(max_bucket, draft_width, max_blocks_per_seq)
        self.inputs = StaticInputs(layout, device, device_written=frozenset(layout) - HOST_ONLY,
                                   num_host_slots=2)
        # per-slot device state: KV length L and pending extend rows
        # (``num_extend``) after the last round queued, advanced on the device from num_accepted
        self.slot_len = torch.zeros(self.num_slots, dtype=i64, device=device)
        self.slot_ext = torch.ones(self.num_slots, dtype=i64, device=device)
        self._stage = 0  # host staging slot of the next round
        # the device-derived groups per (bcap, k, g): the same views every round of a bucket
        # (stable addresses), so built once
        self._derived_views: dict[tuple[int, int, int], tuple] = {}
        pin = is_pinnable(device)
        self._host_drafts = torch.zeros(max_bucket * draft_width, dtype=i64, pin_memory=pin)
        # device scratch of the captured parts (largest bucket, viewed per round)
        self._scratch = RoundScratch.allocate(max_bucket, draft_width, device)
        # one pinned result buffer per staging slot, filled by a copy queued at the
        # end of execute (before the next round can overwrite the device outputs)
        self._out_tok = [
            torch.zeros(max_bucket * (w1 + 2), dtype=i64, pin_memory=pin) for _ in range(2)
        ]
        self._out_sc = [
            torch.zeros(max_bucket * draft_width, dtype=torch.float32, pin_memory=pin)
            for _ in range(2)
        ]
        self.graphs = GraphSet(device, generator) if self.static else None
        self.precompile_report: PrecompileReport | None = None

    # ------------------------------------------------------------------ capabilities

    def resolve_update(self, bcap: int, k: int, g: int) -> str:
        """Which target input path a round takes (the capability contract).

        ``in_graph`` only when the model declares ``supports_in_graph_input_update`` and
        ``requires_causal_chunked_prefill`` (causal packed verify rows), the kernels can run the
        packed layout (the ``triton`` backend; ``input_update="in_graph"`` forces the reference
        kernels elsewhere), and the shape is inside the validated ones (``g`` rows hold every
        request's ``k + 1`` rows or fewer, ``k <= w``, ``bcap <= max bucket``). Otherwise the
        host prepares the verify inputs.
        """
        caps = self.target.capabilities
        declared = caps.supports_in_graph_input_update and caps.requires_causal_chunked_prefill
        inside = 0 <= k <= self.w and 1 <= bcap <= self.max_bucket and 1 <= g <= bcap * (k + 1)
        mode = self.path.input_update
        if mode == "host" or not declared or not inside:
            if mode == "in_graph" and not (declared and inside):
                raise UnsupportedError(
                    f"input_update='in_graph' is outside the contract (declared={declared}, "
                    f"bcap={bcap}, k={k}, g={g}); use 'auto' to fall back"
                )
            return "host"
        if mode == "in_graph" or self.path.attention_backend == "triton":
            return "in_graph"
        return "host"

    def plan(self, bcap: int, rows: int = 1):
        """Static split-KV plan of a request bucket with ``rows`` query rows per request
        (decode and draft steps 1, verification k + 1; triton backend only, None otherwise)."""
        if self.path.attention_backend != "triton" or self.device.type != "cuda":
            return None
        key = (bcap, rows)
        if key not in self._plans:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            heads = self.target.config.num_key_value_heads
            self._plans[key] = ops.plan_splits(bcap, heads, sms, max_len=self.max_model_len,
                                               rows=rows, tune=self.path.kernels)
        return self._plans[key]

    def sampling_kind(self, batch: list[Request], k: int) -> str:
        """The round's token selection (``sampling.selection_kind``): ``greedy`` | ``sample``."""
        return sampling.selection_kind(self.acceptance, [r.params for r in batch], k)

    # ------------------------------------------------------------------ slot state

    def set_slot(self, req: Request, token: int, hidden: torch.Tensor) -> None:
        """After prefill: the slot's single extend row is (last prompt hidden, first token)."""
        s = req.slot
        self.ext_tokens[s, 0] = token
        self.ext_hidden[s, 0] = hidden
        p = req.params
        self.slot_temperature[s] = p.temperature
        self.slot_top_k[s] = p.top_k
        self.slot_top_p[s] = p.top_p
        self.slot_min_p[s] = p.min_p
        req.num_extend = 1
        self.slot_len[s] = req.num_computed
        self.slot_ext[s] = 1

    # ------------------------------------------------------------------ prepare

    def prepare(
        self,
        batch: list[Request],
        bcap: int,
        k: int,
        num_verify: np.ndarray | None,
        g: int,
        budget_rows: int | None = None,
        len_bound: np.ndarray | None = None,
    ) -> RoundInputs:
        """Host phase of a round: stage only facts that do not depend on the rounds still in
        flight (none at queue depth 0).

        ``len_bound [B]`` int64: an upper bound of each request's KV length ``L`` when this round
        runs (its host-known length plus ``k + 1`` per queued round it is in; None: no round in
        flight, the host-known lengths). The host stages the slot indices, the real-row mask
        ``is_real``, the block table (blocks allocated ahead for ``len_bound + k + 1`` positions:
        the worst case growth of every in-flight round) and the verify lengths (host-chosen, or
        zero placeholders the device allocation overwrites under a budget). Everything that depends
        on the outcome of the queued rounds (``ctx_lens``, ``pending_index``, the draft-extend rows
        ``ext_*``, the draft-step rows ``step_*``, ``ver_seq`` and the host path's packed verify
        rows) is derived on the device by :meth:`derive_inputs` from the per-slot state
        ``slot_len`` / ``slot_ext``, which the previous round advanced on the device after its
        acceptance.

        The draft-extend grid always has ``R = w + 1`` rows per request and ``bcap * (w + 1)``
        packed rows (the static layout of captured graphs: the host does not know the extend
        lengths). Inputs go into the other staging slot than the previous round's
        (:meth:`StaticInputs.use`); the caller must have collected the round staged there.
        """
        bs = self.block_size
        w1 = self.w + 1
        n = len(batch)
        if (num_verify is None) == (budget_rows is None):
            raise ValueError("prepare: exactly one of num_verify / budget_rows")
        self.inputs.use(self._stage)
        stage = self._stage
        self._stage = 1 - self._stage
        bound = np.zeros(bcap, dtype=np.int64)
        bound[:n] = ([r.num_computed for r in batch] if len_bound is None else len_bound)
        slots = np.array([r.slot for r in batch] + [self.trash_slot] * (bcap - n), dtype=np.int64)
        nv = np.zeros(bcap, dtype=np.int64)
        if num_verify is not None:
            nv[:n] = num_verify
        for b, r in enumerate(batch):
            self.kv.allocator.grow(r.blocks, int(bound[b]) + k + 1)
        width = self.max_blocks_per_seq
        if not self.static:
            width = min(width, max(1, -(-int(bound.max() + k + 1) // bs)))
        bt = np.zeros((bcap, width), dtype=np.int32)
        for b, r in enumerate(batch):
            bt[b, : len(r.blocks)] = r.blocks[:width]
        put = self.inputs.put
        host = HostFacts(
            is_real=put("host.is_real", (np.arange(bcap) < n).astype(np.int64)),
            block_table=put("host.block_table", bt),
            slot_index=put("host.slot_index", slots),
            num_verify=put("host.num_verify", nv),
            nv32=put("host.nv32", nv.astype(np.int32)),
        )
        self.inputs.flush()
        req, ext, step, ver = self._derived(bcap, k, g)
        update = self.resolve_update(bcap, k, g)
        kind = self.sampling_kind(batch, k)
        host_nv = None if num_verify is None else nv[:n].copy()
        r_ext = w1 if self.draft is not None and k > 0 else 1
        grid = self.state is not None and grid_rows(k, g, bcap, n, host_nv, budget_rows)
        return RoundInputs(num_requests=n, bcap=bcap, k=k, g=g, num_ext_rows=r_ext,
                           num_verify=host_nv, host=host, req=req, ext=ext, step=step, ver=ver,
                           update=update, sampling=kind, budget_rows=budget_rows, stage=stage,
                           grid=grid)

    def _derived(self, bcap: int, k: int, g: int) -> tuple:  # (req, ext, step, ver)
        """The device-derived groups of a bucket: views of the arena (stable addresses),
        built once per shape."""
        key = (bcap, k, g)
        got = self._derived_views.get(key)
        if got is None:
            dev = self.inputs.dev
            got = self._derived_views[key] = tuple(
                ROUND_GROUPS[group](**{
                    name: dev[f"{group}.{name}"][: math.prod(shape)].view(shape)
                    for name, shape in shapes.items()
                })
                for group, shapes in derived_shapes(bcap, self.w, k, g).items()
            )
        return got

    def _slot_of(self, bt, b, pos, real):  # [bcap, width], [N], [N], [N] bool -> [N] int64
        """KV slot of position ``pos`` of batch row ``b`` (sentinel where not ``real``)."""
        bs = self.block_size
        col = (pos // bs).clamp(0, bt.shape[1] - 1)
        s = bt[b, col].long() * bs + pos % bs
        return torch.where(real, s, SENTINEL_SLOT)

    def _packed(self, counts: torch.Tensor, num_rows: int):  # [bcap] int64 -> ([N], [N], [N], [bcap+1])
        """Packed row ``p < num_rows`` -> (request ``b``, index ``i`` inside it, valid), cu.

        ``counts[b]`` rows per request, concatenated; rows past the total are invalid (their
        ``b`` is clamped into range). ``searchsorted`` over the cumulative counts: static
        shapes, no host read.
        """
        bcap = counts.shape[0]
        cu = self._scratch.packed_cu[: bcap + 1]
        cu[:1].zero_()
        torch.cumsum(counts, 0, out=cu[1:])
        p = self._scratch.iota[:num_rows]
        b = torch.searchsorted(cu[1:], p, right=True).clamp(max=bcap - 1)
        return b, p - cu[b], p < cu[-1], cu

    def derive_inputs(self, x: RoundInputs) -> None:
        """On the device: the round's metadata from the per-slot state.

        Writes in place (stable addresses: captured graphs read them) what the host rule
        computes from ``num_computed`` (``L``) and ``num_extend`` (``E``; the rule is kept as
        the test reference, ``tests/runner/host_rule.py``), with ``L = slot_len[slot]`` and ``E = slot_ext[slot]`` for real rows and
        ``L = 0``, ``E = 1`` for padding rows (``is_real`` mask): ``ctx_lens``,
        ``pending_index``, the draft-extend rows (static layout ``R = w + 1``, packed rows past
        the total point at the trash state / sentinel slot / trash grid row), the draft-step
        rows and ``ver_seq``; the host update's packed verify rows come from
        :meth:`derive_verify` (they need ``G`` and, under a budget, the allocation). A few small
        torch ops; no ``.item()``, no branch on tensor values: ``graph_mode="split"`` captures
        them at the head of the draft graph (:meth:`capture`), eager rounds run them first.
        """
        h, req, e, st = x.host, x.req, x.ext, x.step
        bcap, k = x.bcap, x.k
        w1 = self.w + 1
        real = h.is_real.bool()  # [bcap]
        slots = h.slot_index  # [bcap]
        bt = h.block_table
        lens = torch.where(real, self.slot_len[slots], 0)  # [bcap] L
        ext = torch.where(real, self.slot_ext[slots], 1)  # [bcap] E
        req.ctx_lens.copy_(lens)
        req.pending_index.copy_(slots * w1 + ext - 1)
        if self.draft is not None and k > 0:
            r = w1
            b, i, valid, cu = self._packed(ext, bcap * w1)
            pos = lens[b] - ext[b] + i
            row_real = valid & real[b]
            e.slot.copy_(self._slot_of(bt, b, pos.clamp_min(0), row_real))
            e.row.copy_(torch.where(valid, b * r + (r - ext[b]) + i, bcap * r))
            e.index.copy_(torch.where(valid, slots[b] * w1 + i, self.trash_slot * w1))
            e.pos.copy_(torch.where(valid, pos.clamp_min(0), 0))
            e.cu.copy_(cu)
            e.seq.copy_(torch.where(real, lens, r))
            e.last.copy_(cu[1:] - 1)
            if k > 1:
                j = self._scratch.iota[1:k, None]  # [k - 1, 1]
                spos = lens[None, :] + j - 1  # draft step j + 1 writes position L + j - 1
                sreal = real[None, :].expand_as(spos)
                bb = self._scratch.iota[None, :bcap].expand_as(spos)
                st.pos.copy_(torch.where(sreal, spos, j - 1))
                st.slot.copy_(
                    self._slot_of(bt, bb.reshape(-1), spos.reshape(-1), sreal.reshape(-1))
                    .view(k - 1, bcap)
                )
                st.seq.copy_(torch.where(sreal, spos + 1, j))
        req.ver_seq.copy_(torch.where(real, lens + k + 1, k + 1))

    def derive_verify(self, x: RoundInputs) -> None:
        """Host-update rounds, on the device: packed verify rows (request ``b`` gets
        ``num_verify[b] + 1`` rows, padding requests none, padded to ``G`` rows on the sentinel
        slot / trash grid row) from the device ``num_verify`` (host-staged or allocated under a
        budget) and ``ctx_lens``."""
        h, v, bcap, k, g = x.host, x.ver, x.bcap, x.k, x.g
        real = h.is_real.bool()
        lens = x.req.ctx_lens.long()
        nrows = torch.where(real, h.num_verify + 1, 0)
        b, i, valid, _ = self._packed(nrows, g)
        grid = torch.where(valid, b * (k + 1) + i, 0)
        pos = torch.where(valid, lens[b] + i, 0)
        v.grid.copy_(grid)
        v.pos.copy_(pos)
        v.slot.copy_(self._slot_of(h.block_table, b, pos, valid))
        v.row.copy_(torch.where(valid, grid, bcap * (k + 1)))

    def advance_slots(self, x: RoundInputs, num_accepted: torch.Tensor) -> None:
        """On the device, right after acceptance: ``L += a + 1``, ``E = a + 1``
        per slot (``num_accepted [bcap]``; padding rows write the trash slot, never read)."""
        slots = x.host.slot_index
        a1 = num_accepted.long() + 1
        self.slot_len.index_copy_(0, slots, x.req.ctx_lens.long() + a1)
        self.slot_ext.index_copy_(0, slots, a1)

    def stage_outputs(self, out: RoundOutputs, x: RoundInputs) -> None:
        """Queue the copy of the round's results into its staging slot's pinned buffers now
        (the next round overwrites the device outputs) and record an event (cuda) that
        :meth:`collect` waits on."""
        bcap, k = x.bcap, x.k
        cols = [out.num_accepted[:, None], out.num_verify[:, None], out.out_tokens]
        packed = torch.cat(cols, dim=1).view(-1)
        self._out_tok[x.stage][: packed.numel()].copy_(packed, non_blocking=True)
        sc = out.draft_scores.reshape(-1).float()
        self._out_sc[x.stage][: bcap * k].copy_(sc, non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            x.done = ev

    def allocate_verify(self, x: RoundInputs, scores: torch.Tensor) -> None:
        """Adaptive verify, on the device: ``num_verify`` / ``nv32`` from ``scores [bcap, k]``.

        The rule of ``speccal.policy_rules.allocate_prefixes`` inside ``x.budget_rows`` draft rows
        (:func:`~speccal.runner.verify_alloc.allocate_prefixes_device`), written in place into
        the static inputs the target part reads. No host sync, no branch on tensor values.
        """
        nv = x.host.num_verify
        allocate_prefixes_device(scores, x.num_requests, x.budget_rows, out=nv)
        x.host.nv32.copy_(nv)

    # ------------------------------------------------------------------ execute

    def _row_params(self, slot_index: torch.Tensor) -> tuple:  # [bcap] -> 4 x [bcap]: t, k, p, min_p
        return (self.slot_temperature[slot_index], self.slot_top_k[slot_index],
                self.slot_top_p[slot_index], self.slot_min_p[slot_index])

    def _tiling(self, seq: torch.Tensor, plan):  # [B] int32 -> (num_splits, split_len) | None
        if plan is None:
            return None
        tiling = self._scratch.num_splits[: len(seq)], self._scratch.split_len[: len(seq)]
        ops.attention_tiling_update(seq, *tiling, plan, tune=self.path.kernels)
        return tiling

    def _draft_meta(self, slot, row, bt, seq, num_r, cu, plan) -> AttnMeta:
        if plan is None:  # torch backend: the [B, R] grid
            return AttnMeta(slot, row, bt, seq, num_r)
        return AttnMeta(slot, None, bt, seq, num_r, cu, self._tiling(seq, plan), plan)

    def draft_part(self, x: RoundInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft extend + ``k - 1`` steps: drafted tokens ``[bcap, k]`` and scores ``[bcap, k]``."""
        e, st, bcap, k = x.ext, x.step, x.bcap, x.k
        target, draft = self.target, self.draft
        hidden = self.ext_hidden.shape[-1]
        bt = x.host.block_table
        plan = self.plan(bcap)
        tok = self.ext_tokens.view(-1)[e.index]
        hid = self.ext_hidden.view(-1, hidden)[e.index]
        meta = self._draft_meta(e.slot, e.row, bt, e.seq, x.num_ext_rows, e.cu, plan)
        fb, normed = draft(target, hid, tok, e.pos, meta, self.draft_kv)
        fb, normed = fb[e.last], normed[e.last]
        drafts, scores = [], []
        for j in range(k):
            if j > 0:
                meta = self._draft_meta(st.slot[j - 1], self.step_rows[:bcap], bt, st.seq[j - 1],
                                        1, self.step_cu[: bcap + 1], plan)
                fb, normed = draft(target, fb, tok, st.pos[j - 1], meta, self.draft_kv)
            if getattr(draft, "tp", None) is not None:
                # TP: token and score from [bcap] reductions over the vocabulary shards
                tok, score = draft.greedy_draft(target, normed)
            else:
                logits = draft.logits(target, normed)  # [bcap, V]
                tok = logits.argmax(dim=-1)
                score = sampling.draft_token_probability(logits, tok)
            drafts.append(tok)
            scores.append(score)
        drafted = torch.stack(drafts, 1)
        if self.acceptance == "synthetic":  # the draft's probabilities are the round's cost; its
            # scores are those the acceptance will draw against
            return drafted, sampling.synthetic_draft_scores(
                self.profile, self.score_informativeness, self.generator,
                self._synthetic_scores(bcap, k))
        return drafted, torch.stack(scores, 1)

    def _synthetic_scores(self, bcap: int, k: int) -> torch.Tensor | None:  # [bcap, k]
        """Synthetic acceptance: the static buffer of the scores the draft part draws and the
        target part's acceptance draws against (None for the other modes)."""
        if self.acceptance != "synthetic":
            return None
        return self._scratch.synthetic_scores[: bcap * k].view(bcap, k)

    def target_part(self, x: RoundInputs, draft_tokens: torch.Tensor) -> RoundOutputs:
        """Verify input update, target forward, acceptance, slot-state update (no host sync).

        ``draft_tokens [bcap, k]``: the draft's output buffer (``in_graph``) or the host-staged
        copy ``x.ver.drafts`` (``host``).
        """
        facts, req, v, bcap, k, g = x.host, x.req, x.ver, x.bcap, x.k, x.g
        target = self.target
        hidden = self.ext_hidden.shape[-1]
        bt = facts.block_table
        # Greedy fast path (host flag): argmax of the packed rows, tokens gathered, no logits grid.
        fast = sampling.argmax_only(self.acceptance, k, x.sampling)
        grid_tok = grid_logits = None
        if x.update == "in_graph":
            kx = self.path.kernels
            sc = self._scratch
            ids, pos, slot = sc.ver_ids[:g], sc.ver_pos[:g], sc.ver_slot[:g]
            seq, cu = sc.ver_seq[:bcap], sc.ver_cu[: bcap + 1]
            src = sc.grid_src[: bcap * (k + 1)]  # grid -> packed row
            # the LM head's packed argmax keys (ops.ArgmaxKeys), zeroed by the metadata update
            keys = (sc.ver_keys[:g]
                    if fast and g <= FUSED_HEAD_MAX_ROWS and kx.gemv.argmax_keys else None)
            nv32 = facts.nv32
            # each request's pending token is gathered from the slot state inside the launch
            ops.verify_token_update(self.ext_tokens, draft_tokens, nv32, ids, pad_id=0,
                                    base_index=req.pending_index, tune=kx)
            # max_cu=g: padding requests past G get no rows
            ops.verify_metadata_update(
                nv32, req.ctx_lens, bt, self.block_size, pos, slot, seq, cu, k, grid_rows=src,
                max_cu=g, argmax_keys=keys, tune=kx,
            )
            plan = self.plan(bcap, k + 1)
            meta = AttnMeta(slot, None, bt, seq, k + 1, cu, self._tiling(seq, plan), plan)
            extra = () if self.state is None else self.state.verify_args(x, packed=cu)
            h = target(ids, pos, meta, self.target_kv, *extra)  # [G, hidden]
            if fast:
                # acceptance (greedy / forced / none at k = 0), emitted tokens and the slot state
                # in one launch that also finishes the LM head's argmax (its per-tile partials on
                # the fused kernels: no logits, no argmax launch); synthetic acceptance draws its
                # accepted lengths first (the same draws as verify_synthetic_tokens) and emits
                # them as forced lengths
                row_argmax = target.argmax_partials(h, keys)  # tokens, partials or keys
                nv = facts.num_verify
                if k > 0 and self.acceptance == "synthetic":
                    nv = sampling.synthetic_accepted_length(
                        self._synthetic_scores(bcap, k), self.generator, nv, bcap, k,
                        self.device)
                greedy = k > 0 and self.acceptance not in ("forced", "synthetic")
                num_accepted, out = ops.verify_accept(
                    row_argmax, src, draft_tokens, nv, facts.slot_index, h,
                    self.ext_tokens, self.ext_hidden, greedy=greedy, tune=kx,
                )
                if self.state is not None:  # the state after each request's accepted prefix
                    self.state.commit(x, num_accepted)
                return RoundOutputs(num_accepted=num_accepted, out_tokens=out, draft_scores=None,
                            num_verify=facts.num_verify)
            logits = target.logits(h)  # [G, V] float32
            grid_logits = logits[src].view(bcap, k + 1, -1)  # rows past num_verify: ignored
            grid_h = h[src].view(bcap, k + 1, hidden)
        else:
            pending = self.ext_tokens.view(-1)[req.pending_index]  # [bcap]
            grid_tokens = torch.cat([pending[:, None], draft_tokens], dim=1).view(-1)
            plan = self.plan(bcap, k + 1)
            seq = req.ver_seq
            meta = AttnMeta(
                v.slot, v.row, bt, seq, k + 1, None, self._tiling(seq, plan), plan
            )
            extra = () if self.state is None else self.state.verify_args(x)
            h = target(grid_tokens[v.grid], v.pos, meta, self.target_kv, *extra)
            # grid row -> packed row (the inverse of ver_row; padding rows land on the trash
            # grid row past the end): the grid is gathered, as the in-graph path does; grid rows
            # no packed row fills (past a request's num_verify, padding requests) point at row
            # 0 and are never read
            src = self._scratch.grid_src[: bcap * (k + 1) + 1]
            src.zero_()
            src.index_copy_(0, v.row, self._scratch.iota[:g])
            src = src[:-1]
            if fast:
                # argmax only: under TP from the shards' (max, index) keys, no logits gathered
                row_tok = (target.greedy_tokens(h) if getattr(target, "tp", None) is not None
                           else target.logits(h, upcast=False).argmax(dim=-1))  # [G]
                grid_tok = row_tok[src].view(bcap, k + 1)
            else:
                logits = target.logits(h)  # [G, V] float32
                grid_logits = logits[src].view(bcap, k + 1, -1)
            grid_h = h[src].view(bcap, k + 1, hidden)
        slot_index = facts.slot_index
        if fast:
            if k == 0:
                out = grid_tok.long()
                num_accepted = self._scratch.zero[:bcap]
            else:
                num_accepted, out = sampling.accept_tokens(
                    self.acceptance, draft_tokens, grid_tok, facts.num_verify,
                    self._synthetic_scores(bcap, k), self.generator)
        elif k == 0:
            out = sampling.sample_plain(grid_logits[:, 0], *self._row_params(slot_index),
                                        self.generator)[:, None]
            num_accepted = self._scratch.zero[:bcap]
        else:
            num_accepted, out = sampling.accept(
                self.acceptance, draft_tokens, grid_logits, facts.num_verify,
                self._row_params(slot_index), self._synthetic_scores(bcap, k), self.generator)
        if self.state is not None:  # the state after each request's accepted prefix
            self.state.commit(x, num_accepted)
        self.ext_tokens[slot_index, : k + 1] = out
        self.ext_hidden[slot_index, : k + 1] = grid_h
        return RoundOutputs(num_accepted=num_accepted, out_tokens=out, draft_scores=None,
                            num_verify=facts.num_verify)

    def _stage_drafts(self, x: RoundInputs, draft_tokens: torch.Tensor) -> None:
        """Fallback boundary: drafted tokens to the host (a sync), back into the target's input.

        With a verify budget the packed verify rows are derived on the device from the
        allocation (:meth:`derive_verify`) after it.
        """
        n = x.bcap * x.k
        host = self._host_drafts[:n]
        host.copy_(draft_tokens.reshape(-1), non_blocking=True)
        synchronize(self.device)
        self.inputs.put("ver.drafts", host.numpy().copy())
        self.inputs.flush()
        if x.budget_rows is not None:
            self.derive_verify(x)

    def capture(self, keys: list[GraphKey], make_inputs) -> None:
        """Capture every key (``GraphSet.capture_all``; ``make_inputs(key)`` stages warm-up
        inputs), a target key of ``sampling`` ``""`` as each of ``sampling.selection_kinds``."""
        keys = [replace(key, sampling=s) for key in keys
                for s in (sampling.selection_kinds(self.acceptance, key.k)
                          if key.part == "target" and not key.sampling else (key.sampling,))]
        # a recurrent target's full-grid verify shape in both row layouts (RoundInputs.grid)
        keys += [replace(key, grid=True) for key in keys
                 if self.state is not None and key.part == "target" and not key.grid
                 and full_grid(key.k, key.g, key.bcap)]
        def pre(forwards):
            return precompile(forwards, workers=self.precompile_workers, pool=self.compile_pool)
        with torch.inference_mode():
            report = self.graphs.capture_all(
                keys, lambda key, captured: self._graph_forward(key, make_inputs,
                                                                captured=captured),
                pre if self.will_precompile(self.device, self.path) else None)
        self.precompile_report = report or self.precompile_report
        synchronize(self.device)

    @classmethod
    def will_precompile(cls, device: torch.device, path: ExecutionPath) -> bool:
        """Whether :meth:`capture` compiles the graphs' Triton kernels in parallel first
        (``speccal.kernels.precompile``): CUDA, Triton ops on, not under the interpreter."""
        return (cls.precompile_workers != 0 and device.type == "cuda"
                and path.attention_backend == "triton" and path.kernels.backend != "reference"
                and triton_available() and not interpreting())

    def _graph_forward(self, key: GraphKey, make_inputs, *, captured: bool):
        """The forward a graph of ``key`` runs, over freshly staged warm-up inputs. ``captured``:
        an in-graph target reads its draft graph's captured output (else the staged drafts)."""
        x = make_inputs(key)
        if key.part == "draft":
            return lambda: self._draft_graph(x)
        x.sampling = key.sampling
        x.grid = key.grid
        drafts = x.ver.drafts
        if captured and key.update == "in_graph" and key.k > 0:
            drafts = self.graphs.outputs[GraphKey("draft", key.bcap, key.k)][0]
        return lambda: self._target_graph(x, drafts)

    def _draft_graph(self, x: RoundInputs):  # -> (drafts [bcap, k], scores [bcap, k])
        """What a draft graph runs: :meth:`derive_inputs`, then :meth:`draft_part`."""
        self.derive_inputs(x)
        return self.draft_part(x)

    def _target_graph(self, x: RoundInputs, draft_tokens: torch.Tensor) -> RoundOutputs:
        """What a target graph runs: :meth:`target_part`, then :meth:`advance_slots` from its
        ``num_accepted``; ``draft_tokens [bcap, k]``."""
        out = self.target_part(x, draft_tokens)
        self.advance_slots(x, out.num_accepted)
        return out

    @torch.inference_mode()
    def execute(self, x: RoundInputs) -> RoundOutputs:
        """Device phase: draft extend + k - 1 draft steps + verify + acceptance + state update.

        Eager and ``split`` graphs share the sequence: draft part, then (adaptive verify) the
        device allocation of :meth:`allocate_verify` on this round's scores, then (host update
        only) the fallback boundary's one sync, then the target part.

        The draft graph starts with :meth:`derive_inputs`
        (eager before the round when there is no draft part, ``k = 0``), the host update's
        verify rows are derived after the allocation (:meth:`derive_verify`), the target graph
        ends with :meth:`advance_slots`, and the result copy into the round's staging slot is
        queued last (:meth:`stage_outputs`, eager). No host sync on the in-graph path.
        """
        bcap, k = x.bcap, x.k
        if self.state is not None:  # host count of the state bytes this round's shape moves
            self.state.record(bcap, k)
        if self.graphs is not None and k > 0:
            drafts, scores = self.graphs.replay(GraphKey("draft", bcap, k))
        elif self.draft is not None and k > 0:
            drafts, scores = self._draft_graph(x)
        else:
            self.derive_inputs(x)
            drafts = self.ext_tokens.new_zeros(bcap, 0)
            scores = torch.zeros(bcap, 0, device=self.device)
        if x.budget_rows is not None:
            self.allocate_verify(x, scores)
        if x.update == "host" and x.budget_rows is None:
            self.derive_verify(x)  # (budget: after the allocation, in _stage_drafts)
        if x.update == "host" and k > 0:
            self._stage_drafts(x, drafts)
            drafts = x.ver.drafts
        if self.graphs is not None:
            key = GraphKey("target", bcap, k, x.g, x.update, x.sampling, x.grid)
            if key not in self.graphs:
                raise UnsupportedError(f"no captured target graph for {key}")
            out = self.graphs.replay(key)
        else:
            out = self._target_graph(x, drafts)
        out = replace(out, draft_scores=scores)
        self.stage_outputs(out, x)
        return out

    # ------------------------------------------------------------------ collect

    def collect(self, x: RoundInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The one sync: accepted ``[B]``, verify lengths ``[B]`` (the device allocation under
        a budget), out tokens ``[B, k + 1]``, draft scores ``[B, k]``.

        Waits for the copy :meth:`stage_outputs` queued at the end of the round (its event on
        cuda, a device sync elsewhere) and reads the round's staging slot.
        """
        bcap, k = x.bcap, x.k
        if x.done is not None:
            x.done.synchronize()
        else:
            synchronize(self.device)
        tok = self._out_tok[x.stage][: bcap * (k + 3)].numpy().reshape(bcap, k + 3)
        tok = tok[: x.num_requests].copy()
        sc = self._out_sc[x.stage][: bcap * k].numpy().reshape(bcap, k)
        sc = sc[: x.num_requests].copy()
        return tok[:, 0], tok[:, 1], tok[:, 2:], sc
