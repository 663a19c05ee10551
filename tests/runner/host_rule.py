"""The round metadata rule on the host, in numpy: the test reference of the device derivation.

``RoundRunner.derive_inputs`` / ``derive_verify`` compute a round's metadata on the device from
the per-slot state (``slot_len``, ``slot_ext``). Here the same rule is written once more from
the host's view of a request (``num_computed`` = ``L``, ``num_extend`` = ``E``), in the static
layout captured graphs use (draft-extend rows ``bcap * (w + 1)``, ``R = w + 1``). Tests compare
the two; nothing in the runner calls this.
"""

from __future__ import annotations

import numpy as np

from speccal.runner.kv_cache import SENTINEL_SLOT


def host_inputs(runner, batch, bcap: int, k: int, num_verify: np.ndarray, g: int,
                block_table: np.ndarray) -> dict[str, np.ndarray]:
    """Every device-derived input of one round, by ``group.field`` name (``block_table
    [bcap, width]``: the table the round staged). Shapes as the runner's views: ``step.*``
    ``[k - 1, bcap]``."""
    bs, w1, trash = runner.block_size, runner.w + 1, runner.trash_slot
    n = len(batch)
    lens = np.array([r.num_computed for r in batch] + [0] * (bcap - n), dtype=np.int64)
    ext = np.array([r.num_extend for r in batch] + [1] * (bcap - n), dtype=np.int64)
    slots = np.array([r.slot for r in batch] + [trash] * (bcap - n), dtype=np.int64)
    is_req = np.arange(bcap) < n
    bt = block_table

    def slot_of(b, pos, real):
        s = bt[b, pos // bs].astype(np.int64) * bs + pos % bs
        return np.where(real, s, SENTINEL_SLOT)

    out = {"req.ctx_lens": lens.astype(np.int32), "req.pending_index": slots * w1 + ext - 1}
    if runner.draft is not None and k > 0:
        b = np.repeat(np.arange(bcap), ext)
        cu = np.concatenate([[0], np.cumsum(ext)])
        i = np.arange(cu[-1]) - cu[b]
        pos = lens[b] - ext[b] + i
        pad = bcap * w1 - len(b)  # trash state, sentinel slot, trash grid row
        out["ext.cu"] = cu.astype(np.int32)
        out["ext.index"] = np.concatenate([slots[b] * w1 + i, np.full(pad, trash * w1)])
        out["ext.pos"] = np.concatenate([np.maximum(pos, 0), np.zeros(pad, np.int64)])
        out["ext.slot"] = np.concatenate(
            [slot_of(b, np.maximum(pos, 0), is_req[b]), np.full(pad, SENTINEL_SLOT)])
        out["ext.row"] = np.concatenate(
            [b * w1 + (w1 - ext[b]) + i, np.full(pad, bcap * w1)])
        out["ext.seq"] = np.where(is_req, lens, w1).astype(np.int32)
        out["ext.last"] = cu[1:] - 1
        if k > 1:
            j = np.arange(1, k)[:, None]  # draft step j + 1 writes position L + j - 1
            spos = lens[None, :] + j - 1
            bb = np.broadcast_to(np.arange(bcap), spos.shape)
            real = np.broadcast_to(is_req, spos.shape)
            out["step.pos"] = np.where(real, spos, j - 1)
            out["step.slot"] = slot_of(bb, spos, real)
            out["step.seq"] = np.where(real, spos + 1, j).astype(np.int32)
    out["req.ver_seq"] = np.where(is_req, lens + k + 1, k + 1).astype(np.int32)
    # packed verify rows of the host update: request b gets num_verify[b] + 1 rows, padding
    # requests none, padded to G rows on the sentinel slot / trash grid row
    nv = np.zeros(bcap, dtype=np.int64)
    nv[:n] = num_verify
    nrows = np.where(is_req, nv + 1, 0)
    b = np.repeat(np.arange(bcap), nrows)
    cu = np.concatenate([[0], np.cumsum(nrows)])
    i = np.arange(cu[-1]) - cu[b]
    pad = g - len(b)
    grid = np.concatenate([b * (k + 1) + i, np.zeros(pad, np.int64)])
    pos = np.concatenate([lens[b] + i, np.zeros(pad, np.int64)])
    real = np.concatenate([is_req[b], np.zeros(pad, bool)])
    out["ver.grid"] = grid
    out["ver.pos"] = pos
    out["ver.slot"] = slot_of(np.concatenate([b, np.zeros(pad, np.int64)]), pos, real)
    out["ver.row"] = np.where(np.arange(g) < len(b), grid, bcap * (k + 1))
    return out
