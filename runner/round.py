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

Device state per slot (``num_slots = max bucket + 1``; the last is the trash slot of padding):
``ext_tokens [num_slots, w + 1]``, ``ext_hidden [num_slots, w + 1, hidden]``. Everything inside
:meth:`RoundRunner.execute` uses static shapes chosen on the host, masks and index tensors; no
``.item()``, ``.tolist()``, ``nonzero()`` or branch on tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from speccal.runner import sampling
from speccal.runner.attention import AttnMeta
from speccal.runner.buffers import StaticInputs
from speccal.runner.device import is_pinnable, synchronize
from speccal.runner.kv_cache import SENTINEL_SLOT, KVCache
from speccal.runner.model import TargetModel
from speccal.runner.mtp import MTPHead
from speccal.runner.request import Request


@dataclass
class RoundInputs:
    """Host-chosen shapes and staged device tensors of one round."""

    num_requests: int  # B
    bcap: int
    k: int  # draft steps (0 = plain decoding)
    g: int  # target rows
    num_ext_rows: int  # R of the draft-extend grid
    num_verify: np.ndarray  # [B] int64 (host copy)
    t: dict  # name -> device tensor


@dataclass
class RoundOutputs:
    """Device results of :meth:`RoundRunner.execute`."""

    num_accepted: torch.Tensor  # [bcap] int64
    out_tokens: torch.Tensor  # [bcap, k + 1] int64
    draft_scores: torch.Tensor  # [bcap, k] float32


class RoundRunner:
    """Owns static buffers and slot state; runs rounds of the target + MTP head."""

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
    ):
        self.target = target
        self.draft = draft
        self.kv = kv
        self.w = draft_width
        self.max_bucket = max_bucket
        self.acceptance = acceptance
        self.profile = profile
        self.generator = generator
        self.device = device
        self.block_size = kv.allocator.block_size
        num_layers = target.config.num_hidden_layers
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
        rows = max_bucket * w1
        i64, i32 = torch.int64, torch.int32
        self.inputs = StaticInputs(
            {
                "ext_index": (rows, i64),
                "ext_pos": (rows, i64),
                "ext_slot": (rows, i64),
                "ext_row": (rows, i64),
                "ext_seq": (max_bucket, i32),
                "ext_last": (max_bucket, i64),
                "step_pos": (rows, i64),
                "step_slot": (rows, i64),
                "step_seq": (rows, i32),
                "pending_index": (max_bucket, i64),
                "ver_grid": (rows, i64),
                "ver_pos": (rows, i64),
                "ver_slot": (rows, i64),
                "ver_row": (rows, i64),
                "ver_seq": (max_bucket, i32),
                "num_verify": (max_bucket, i64),
                "slot_index": (max_bucket, i64),
                "block_table": (max_bucket * max_blocks_per_seq, i32),
            },
            device,
        )
        pin = is_pinnable(device)
        self._host_tokens = torch.zeros(max_bucket * (w1 + 1), dtype=i64, pin_memory=pin)
        self._host_scores = torch.zeros(
            max_bucket * draft_width, dtype=torch.float32, pin_memory=pin
        )

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

    # ------------------------------------------------------------------ prepare

    def prepare(
        self, batch: list[Request], bcap: int, k: int, num_verify: np.ndarray, g: int
    ) -> RoundInputs:
        """Host phase: allocate KV, compute positions / slots / indices, stage them (async)."""
        bs = self.block_size
        w1 = self.w + 1
        n = len(batch)
        lens = np.array([r.num_computed for r in batch] + [0] * (bcap - n), dtype=np.int64)  # L
        num_ext = np.array([r.num_extend for r in batch] + [1] * (bcap - n), dtype=np.int64)
        slots = np.array([r.slot for r in batch] + [self.trash_slot] * (bcap - n), dtype=np.int64)
        nv = np.zeros(bcap, dtype=np.int64)
        nv[:n] = num_verify
        for r in batch:
            self.kv.allocator.grow(r.blocks, r.num_computed + k + 1)
        width = max(1, -(-int(lens.max() + k + 1) // bs))
        bt = np.zeros((bcap, width), dtype=np.int32)
        for b, r in enumerate(batch):
            bt[b, : len(r.blocks)] = r.blocks[:width]

        def slot_of(b: np.ndarray, pos: np.ndarray, is_real: np.ndarray) -> np.ndarray:
            s = bt[b, pos // bs].astype(np.int64) * bs + pos % bs
            return np.where(is_real, s, SENTINEL_SLOT)

        is_req = np.arange(bcap) < n
        t = {"block_table": self.inputs.put("block_table", bt)}
        t["slot_index"] = self.inputs.put("slot_index", slots)
        t["pending_index"] = self.inputs.put("pending_index", slots * w1 + num_ext - 1)
        r_ext = 1
        if self.draft is not None and k > 0:
            r_ext = int(num_ext.max())
            b_idx = np.repeat(np.arange(bcap), num_ext)
            cu = np.concatenate([[0], np.cumsum(num_ext)])
            i_idx = np.arange(cu[-1]) - cu[b_idx]
            pos = lens[b_idx] - num_ext[b_idx] + i_idx
            real = is_req[b_idx]
            t["ext_index"] = self.inputs.put("ext_index", slots[b_idx] * w1 + i_idx)
            t["ext_pos"] = self.inputs.put("ext_pos", np.maximum(pos, 0))
            t["ext_slot"] = self.inputs.put("ext_slot", slot_of(b_idx, np.maximum(pos, 0), real))
            t["ext_row"] = self.inputs.put(
                "ext_row", b_idx * r_ext + (r_ext - num_ext[b_idx]) + i_idx
            )
            t["ext_seq"] = self.inputs.put(
                "ext_seq", np.where(is_req, lens, r_ext).astype(np.int32)
            )
            t["ext_last"] = self.inputs.put("ext_last", cu[1:] - 1)
            if k > 1:
                j = np.arange(1, k)[:, None]  # draft step j + 1 writes position L + j - 1
                spos = lens[None, :] + j - 1
                bb = np.broadcast_to(np.arange(bcap), spos.shape)
                real = np.broadcast_to(is_req, spos.shape)
                t["step_pos"] = self.inputs.put("step_pos", np.where(real, spos, j - 1))
                t["step_slot"] = self.inputs.put("step_slot", slot_of(bb, spos, real))
                t["step_seq"] = self.inputs.put(
                    "step_seq", np.where(real, spos + 1, j).astype(np.int32)
                )
        # target verify rows: request b has nv[b] + 1 rows (padding requests: none)
        nrows = np.where(is_req, nv + 1, 0)
        b_idx = np.repeat(np.arange(bcap), nrows)
        cu = np.concatenate([[0], np.cumsum(nrows)])
        i_idx = np.arange(cu[-1]) - cu[b_idx]
        pad = g - len(b_idx)
        real = np.concatenate([is_req[b_idx], np.zeros(pad, bool)])
        grid = np.concatenate([b_idx * (k + 1) + i_idx, np.zeros(pad, np.int64)])
        pos = np.concatenate([lens[b_idx] + i_idx, np.zeros(pad, np.int64)])
        bpad = np.concatenate([b_idx, np.zeros(pad, np.int64)])
        t["ver_grid"] = self.inputs.put("ver_grid", grid)
        t["ver_pos"] = self.inputs.put("ver_pos", pos)
        t["ver_slot"] = self.inputs.put("ver_slot", slot_of(bpad, pos, real))
        t["ver_row"] = self.inputs.put(
            "ver_row", np.where(np.arange(g) < len(b_idx), grid, bcap * (k + 1))
        )
        t["ver_seq"] = self.inputs.put(
            "ver_seq", np.where(is_req, lens + k + 1, k + 1).astype(np.int32)
        )
        t["num_verify"] = self.inputs.put("num_verify", nv)
        return RoundInputs(n, bcap, k, g, r_ext, nv[:n].copy(), t)

    # ------------------------------------------------------------------ execute

    def _accept(
        self, draft_tokens, logits, nv, slot_index
    ):  # [bcap,k], [bcap,k+1,V], [bcap], [bcap]
        mode = self.acceptance
        if mode == "greedy":
            return sampling.verify_greedy(draft_tokens, logits, num_verify=nv)
        if mode == "forced":
            return sampling.verify_forced(draft_tokens, logits, num_verify=nv)
        if mode == "synthetic":
            return sampling.verify_synthetic(
                draft_tokens, logits, self.profile, self.generator, num_verify=nv
            )
        return sampling.verify_rejection(
            draft_tokens,
            logits,
            self.slot_temperature[slot_index],
            self.slot_top_k[slot_index],
            self.slot_top_p[slot_index],
            self.slot_min_p[slot_index],
            self.generator,
            num_verify=nv,
        )

    @torch.inference_mode()
    def execute(self, x: RoundInputs) -> RoundOutputs:
        """Device phase: draft extend + k - 1 draft steps + verify + acceptance + state update."""
        t, bcap, k = x.t, x.bcap, x.k
        target, draft = self.target, self.draft
        hidden = self.ext_hidden.shape[-1]
        bt = t["block_table"]
        drafts, scores = [], []
        if draft is not None and k > 0:
            tok = self.ext_tokens.view(-1)[t["ext_index"]]
            hid = self.ext_hidden.view(-1, hidden)[t["ext_index"]]
            meta = AttnMeta(t["ext_slot"], t["ext_row"], bt, t["ext_seq"], x.num_ext_rows)
            fb, normed = draft(target, hid, tok, t["ext_pos"], meta, self.draft_kv)
            fb, normed = fb[t["ext_last"]], normed[t["ext_last"]]
            for j in range(k):
                if j > 0:
                    meta = AttnMeta(
                        t["step_slot"][j - 1], self.step_rows[:bcap], bt, t["step_seq"][j - 1], 1
                    )
                    fb, normed = draft(target, fb, tok, t["step_pos"][j - 1], meta, self.draft_kv)
                logits = draft.logits(target, normed)  # [bcap, V]
                tok = logits.argmax(dim=-1)
                drafts.append(tok)
                scores.append(sampling.draft_token_probability(logits, tok))
        draft_tokens = torch.stack(drafts, 1) if drafts else self.ext_tokens.new_zeros(bcap, 0)
        pending = self.ext_tokens.view(-1)[t["pending_index"]]  # [bcap]
        grid_tokens = torch.cat([pending[:, None], draft_tokens], dim=1).view(-1)
        meta = AttnMeta(t["ver_slot"], t["ver_row"], bt, t["ver_seq"], k + 1)
        h = target(grid_tokens[t["ver_grid"]], t["ver_pos"], meta, self.target_kv)  # [G, hidden]
        logits = target.logits(h)  # [G, V]
        grid_logits = logits.new_zeros(bcap * (k + 1) + 1, logits.shape[-1])
        grid_logits.index_copy_(0, t["ver_row"], logits)
        grid_h = h.new_zeros(bcap * (k + 1) + 1, hidden)
        grid_h.index_copy_(0, t["ver_row"], h)
        grid_logits = grid_logits[:-1].view(bcap, k + 1, -1)
        slot_index = t["slot_index"]
        if k == 0:
            out = sampling.sample_plain(
                grid_logits[:, 0],
                self.slot_temperature[slot_index],
                self.slot_top_k[slot_index],
                self.slot_top_p[slot_index],
                self.slot_min_p[slot_index],
                self.generator,
            )[:, None]
            num_accepted = torch.zeros(bcap, dtype=torch.int64, device=self.device)
        else:
            num_accepted, out = self._accept(draft_tokens, grid_logits, t["num_verify"], slot_index)
        self.ext_tokens[slot_index, : k + 1] = out
        self.ext_hidden[slot_index, : k + 1] = grid_h[:-1].view(bcap, k + 1, hidden)
        score = torch.stack(scores, 1) if scores else torch.zeros(bcap, 0, device=self.device)
        return RoundOutputs(num_accepted, out, score)

    # ------------------------------------------------------------------ collect

    def collect(
        self, out: RoundOutputs, x: RoundInputs
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The one sync: accepted ``[B]``, out tokens ``[B, k + 1]``, draft scores ``[B, k]``."""
        bcap, k = x.bcap, x.k
        packed = torch.cat([out.num_accepted[:, None], out.out_tokens], dim=1).view(-1)
        host_tok = self._host_tokens[: packed.numel()]
        host_tok.copy_(packed, non_blocking=True)
        host_sc = self._host_scores[: bcap * k]
        host_sc.copy_(out.draft_scores.reshape(-1).float(), non_blocking=True)
        synchronize(self.device)
        tok = host_tok.numpy().reshape(bcap, k + 2)[: x.num_requests].copy()
        sc = host_sc.numpy().reshape(bcap, k)[: x.num_requests].copy()
        return tok[:, 0], tok[:, 1:], sc
