"""Pure-torch references for every kernel in ``speccal.kernels``.

This module owns the semantics: each Triton kernel next to it must compute the same function, and
``speccal.kernels.ops`` falls back to these on CPU (what CI runs) or when Triton is absent. Every
function is vectorised and free of host syncs (no ``.item()``, ``.tolist()``, ``nonzero()`` or
Python ``if`` on tensor values), so the fallback can also be captured in a CUDA graph.

Data layout (shared with ``speccal.runner``, see docs/ARCHITECTURE.md):

- KV cache per layer: ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``;
  block 0 is reserved, slot 0 is the sentinel that padded rows write to.
- ``block_table [B, max_blocks] int32``, ``seq_lens [B] int32``: KV length including the rows
  being written this step.
- Query rows, two layouts. *Dense*: ``q [B, num_q_rows, num_heads, head_dim]``; request ``b`` uses
  its first ``q_lens[b]`` rows (all rows when ``q_lens`` is None); unused rows give zeros.
  *Packed* (the target's verify input): ``q [T, num_heads, head_dim]`` with request ``b`` on rows
  ``cu_q_lens[b] .. cu_q_lens[b+1]``; rows past ``cu_q_lens[B]`` are padding and give zeros.
  In both, query row ``i`` of request ``b`` sits at position ``seq_lens[b] - q_len[b] + i`` and
  attends causally to KV ``[0, that position]``.
- Verify rows (target input of one round): request ``b`` sends ``verify_lens[b] + 1`` rows, the
  base token then its first ``verify_lens[b]`` drafted tokens, packed back to back from row 0 and
  padded to the bucket's ``G`` rows with ``pad_id`` tokens, position 0 and slot 0.
- Split-KV tiling: ``num_splits [B] int32``, ``split_len [B] int32``; split ``s`` of request ``b``
  covers KV ``[s * split_len[b], min((s + 1) * split_len[b], seq_lens[b]))``.
- Routed experts (``moe_align_ref``, ``fused_moe_ref``): ``N`` rows choose ``top_k`` experts
  each, ``ids [N, top_k]``; pair ``p = row * top_k + slot``. The pairs sorted by expert (rows
  ascending within one) are laid out in blocks of ``block_m`` positions, each expert's run
  padded to a multiple of ``block_m`` (vLLM's ``moe_align_block_size``): ``sorted_pairs [P]``
  holds a pair or the sentinel ``N * top_k`` (padding), ``block_expert [P / block_m]`` each
  block's expert or -1 (a block past the last expert's run). ``P`` is the static worst case,
  ``N * top_k + min(E, N * top_k) * (block_m - 1)`` rounded up to ``block_m`` (at most that
  many experts have a run to pad), so the layout never has a data-dependent shape. Expert weights stacked: ``gate_up [E, 2 I, hidden]`` (gate rows
  first), ``down [E, hidden, I]``.
- Gated delta-net decode / verify (``speccal.runner.linear_attention``, whose CPU path is these
  functions): ``B`` requests of ``R`` rows, ``[B, R, ...]`` request-major; state pools
  ``conv_state [S, C, K - 1]`` (the last ``K - 1`` conv inputs) and ``ssm_state [S, Hv, Dk, Dv]``
  float32, addressed by ``read_slots [B]`` / ``write_slots [B]`` int64; ``num_valid [B]`` real
  rows (the rest is padding: no state change); snapshots, the state after each row, into a
  ``[B, R, ...]`` buffer or in place into pool rows ``snapshot_rows [B, R]`` int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speccal.kernels.reference_moe import (  # re-exported: one namespace of references
    fused_moe_ref,
    moe_align_ref,
    moe_route_ref,
    moe_sum_slots_ref,
)

__all__ = [
    "argmax_keys_ref",
    "causal_conv1d",
    "conv_update_ref",
    "conv_windows",
    "delta_rule_inputs",
    "delta_rule_verify_ref",
    "l2norm",
    "recurrent_gated_delta_rule",
    "rmsnorm_gated_ref",
    "argmax_partials_ref",
    "attention_tiling_update_ref",
    "embed_rms_norm_ref",
    "linear_argmax_ref",
    "linear_ref",
    "moe_align_ref",
    "fused_moe_ref",
    "moe_route_ref",
    "moe_sum_slots_ref",
    "mla_latent_attention_ref",
    "paged_attention_ref",
    "packed_rows_ref",
    "reduce_argmax_partials_ref",
    "rope_paged_attention_ref",
    "rms_norm_ref",
    "rotary_kv_write_ref",
    "store_snapshot",
    "unpack_argmax_keys_ref",
    "verify_accept_ref",
    "verify_metadata_update_ref",
    "verify_token_update_ref",
]


# ---------------------------------------------------------------------------------------------
# paged attention


def _query_layout(
    q: torch.Tensor,  # [B, R, H, D] dense or [T, H, D] packed
    batch: int,
    num_q_rows: int,
    q_lens: torch.Tensor | None,  # [B] int32
    cu_q_lens: torch.Tensor | None,  # [B + 1] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (request, row) source row index into q viewed as ``[rows, H, D]``, row length, validity."""
    dev = q.device
    rows = torch.arange(num_q_rows, device=dev)
    if cu_q_lens is not None:
        start = cu_q_lens[:-1].long()  # [B]
        lens = (cu_q_lens[1:] - cu_q_lens[:-1]).long()  # [B]
    else:
        start = torch.arange(batch, device=dev) * num_q_rows
        lens = (
            q_lens.long()
            if q_lens is not None
            else torch.full((batch,), num_q_rows, device=dev, dtype=torch.long)
        )
    valid = rows[None, :] < lens[:, None]  # [B, R]
    total = q.shape[0] if q.dim() == 3 else q.shape[0] * q.shape[1]
    src = (start[:, None] + rows[None, :]).clamp(max=total - 1)  # [B, R]
    return src, lens, valid


def paged_attention_ref(
    q: torch.Tensor,  # [B, R, H, D] or [T, H, D] (packed, with cu_q_lens)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    *,
    q_lens: torch.Tensor | None = None,  # [B] int32, dense only
    cu_q_lens: torch.Tensor | None = None,  # [B + 1] int32, packed only
    num_splits: torch.Tensor | None = None,  # [B] int32
    split_len: torch.Tensor | None = None,  # [B] int32
    max_splits: int = 1,
    sliding_window: int = 0,  # W > 0: keys [position - W + 1, position] only
) -> torch.Tensor:  # same shape and dtype as q
    """Causal paged attention over a block table, fp32 softmax (a sliding window optional).

    With ``num_splits``/``split_len`` given, it computes flash-decoding partial results per KV
    split (each normalised, with its log-sum-exp) and merges them, the way the split-KV kernel
    does; the result equals the unsplit one up to fp32 rounding.
    """
    batch = block_table.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[-2]
    group = num_heads // num_kv_heads
    max_blocks = block_table.shape[1]
    max_len = max_blocks * block_size
    dev = q.device

    q_flat = q.reshape(-1, num_heads, head_dim)  # [rows, H, D]
    src, lens, valid = _query_layout(q, batch, num_q_rows, q_lens, cu_q_lens)
    qb = q_flat[src].float()  # [B, R, H, D]

    bt = block_table.long()
    k = k_cache[bt].reshape(batch, max_len, num_kv_heads, head_dim).float()  # [B, L, KVH, D]
    v = v_cache[bt].reshape(batch, max_len, num_kv_heads, head_dim).float()
    # tokens past seq_len may be stale or uninitialised (NaN): never let them reach a product
    live_tok = (torch.arange(max_len, device=dev)[None, :] < seq_lens.long()[:, None])  # [B, L]
    k = k.masked_fill(~live_tok[:, :, None, None], 0.0).repeat_interleave(group, dim=2)
    v = v.masked_fill(~live_tok[:, :, None, None], 0.0).repeat_interleave(group, dim=2)

    scores = torch.einsum("brhd,blhd->bhrl", qb, k) * scale  # [B, H, R, L]
    rows = torch.arange(num_q_rows, device=dev)
    pos = seq_lens.long()[:, None] - lens[:, None] + rows[None, :]  # [B, R]
    tok = torch.arange(max_len, device=dev)
    allowed = (tok[None, None, :] <= pos[:, :, None]) & valid[:, :, None]  # [B, R, L]
    if sliding_window:
        allowed &= tok[None, None, :] > pos[:, :, None] - sliding_window
    allowed = allowed[:, None, :, :]  # [B, 1, R, L]

    if num_splits is None:
        scores = scores.masked_fill(~allowed, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True).clamp(min=-1e30)
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True)
        out = torch.einsum("bhrl,blhd->brhd", p / denom.clamp(min=1e-30), v)  # [B, R, H, D]
    else:
        split_of = tok[None, :] // split_len.long().clamp(min=1)[:, None]  # [B, L]
        live = split_of < num_splits.long()[:, None]  # [B, L]
        m_all = torch.full((max_splits, batch, num_heads, num_q_rows), float("-inf"), device=dev)
        o_all = torch.zeros(max_splits, batch, num_q_rows, num_heads, head_dim, device=dev)
        for s in range(max_splits):  # static count: capture-safe
            in_split = (split_of == s) & live  # [B, L]
            mask = allowed & in_split[:, None, None, :]
            sc = scores.masked_fill(~mask, float("-inf"))
            m = sc.amax(dim=-1, keepdim=True).clamp(min=-1e30)
            p = torch.exp(sc - m)
            denom = p.sum(-1, keepdim=True)
            lse = torch.where(denom > 0, m + torch.log(denom.clamp(min=1e-30)), float("-inf"))
            m_all[s] = lse[..., 0]
            o_all[s] = torch.einsum("bhrl,blhd->brhd", p / denom.clamp(min=1e-30), v)
        top = m_all.amax(dim=0).clamp(min=-1e30)  # [B, H, R]
        w = torch.exp(m_all - top)  # [S, B, H, R]
        w = w / w.sum(0).clamp(min=1e-30)
        out = torch.einsum("sbhr,sbrhd->brhd", w, o_all)

    out = out * valid[:, :, None, None]
    if cu_q_lens is None:
        return out.to(q.dtype).reshape(q.shape)
    # packed: scatter real rows back; rows of no request (and unused slots) land in a spill row
    idx = torch.where(valid, src, q_flat.shape[0])  # [B, R]
    spill = torch.zeros(q_flat.shape[0] + 1, num_heads, head_dim, device=dev)  # [T + 1, H, D]
    spill.index_copy_(0, idx.reshape(-1), out.reshape(-1, num_heads, head_dim))
    return spill[:-1].to(q.dtype)


def mla_latent_attention_ref(q, cache, block_table, seq_lens, cu_q_lens, num_rows, latent_dim,
                             scale) -> torch.Tensor:  # [N, heads, latent], q's dtype
    """``ops.mla_latent_attention`` (its arguments and shapes): MLA attention in absorbed form
    over the paged latent cache, each request's keys (the whole block table); row ``i`` of a request's ``q_len`` rows (packed: ``cu_q_lens``; grid:
    ``R``) at position ``seq_lens[b] - q_len + i`` sees keys ``0 .. max(position, 0)``; scores
    and softmax in fp32, the latent part of the keys as values."""
    n, heads, dim = q.shape
    num_b, num_r, dev = block_table.shape[0], num_rows, q.device
    t = block_table.shape[1] * cache.shape[1]
    keys = cache.index_select(0, block_table.reshape(-1).long()).view(num_b, t, dim).float()
    if cu_q_lens is None:
        cell = torch.arange(n, device=dev)  # the rows are the grid
    else:  # each packed row's right-aligned grid cell; rows past the last request's: trash
        cu = cu_q_lens.long()
        p = torch.arange(n, device=dev)
        req = torch.searchsorted(cu[1:], p, right=True).clamp(max=num_b - 1)
        q_len = cu[req + 1] - cu[req]
        cell = torch.where(p < cu[-1], req * num_r + num_r - q_len + p - cu[req], num_b * num_r)
    grid = q.new_zeros(num_b * num_r + 1, heads, dim).index_copy_(0, cell, q)
    grid = grid[:-1].view(num_b, num_r * heads, dim).float()
    pos = (seq_lens.long()[:, None] - num_r
           + torch.arange(num_r * heads, device=dev)[None] // heads).clamp_min(0)  # [B, RH]
    seen = torch.arange(t, device=dev)[None, None] <= pos[..., None]  # [B, RH, T]
    scores = torch.bmm(grid, keys.transpose(1, 2)) * scale
    out = torch.bmm(torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1),
                    keys[..., :latent_dim]).view(num_b * num_r, heads, latent_dim)
    return torch.cat([out, out.new_zeros(1, heads, latent_dim)]).index_select(0, cell).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# in-graph verify input update


def _verify_rows(verify_lens: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, ...]:
    """Row -> (request, index within request, is_real) for the packed verify layout."""
    dev = verify_lens.device
    q_lens = verify_lens.long() + 1  # [B]
    cu = torch.cumsum(q_lens, 0)  # [B], exclusive end
    t = torch.arange(num_rows, device=dev)  # [G]
    req = torch.searchsorted(cu, t, right=True)  # [G]
    real = req < verify_lens.shape[0]
    req_c = req.clamp(max=verify_lens.shape[0] - 1)
    start = cu[req_c] - q_lens[req_c]
    j = t - start
    return req_c, j, real, cu


def verify_token_update_ref(
    base_tokens: torch.Tensor,  # [B] int ([...] int with base_index)
    draft_tokens: torch.Tensor,  # [B, k_max] int
    verify_lens: torch.Tensor,  # [B] int32, drafted tokens each request sends (0..k_max)
    input_ids: torch.Tensor,  # [G] int, written
    pad_id: int = -1,
    base_index: torch.Tensor | None = None,  # [B] int, flat index into base_tokens
) -> torch.Tensor:  # input_ids
    """Write each request's base token and its first ``verify_lens[b]`` drafts into ``input_ids``.

    The base token of request ``b`` is ``base_tokens[b]``, or ``base_tokens.view(-1)[
    base_index[b]]`` when ``base_index`` is given. ``verify_lens`` is clamped to
    ``[0, k_max]``; rows past the last request get ``pad_id``; requests that would run past
    ``G`` are cut at ``G`` (the host picks ``G`` large enough).
    """
    if base_index is not None:
        base_tokens = base_tokens.reshape(-1)[base_index.long()]
    k_max = draft_tokens.shape[1]
    vl = verify_lens.long().clamp(0, k_max)
    req, j, real, _ = _verify_rows(vl, input_ids.shape[0])
    drafts = draft_tokens[req, (j - 1).clamp(0, max(k_max - 1, 0))] if k_max else base_tokens[req]
    tok = torch.where(j == 0, base_tokens[req], drafts)
    tok = torch.where(real, tok, torch.full_like(tok, pad_id))
    input_ids.copy_(tok.to(input_ids.dtype))
    return input_ids


def verify_metadata_update_ref(
    verify_lens: torch.Tensor,  # [B] int32
    context_lens: torch.Tensor,  # [B] int32, KV tokens cached before this round
    block_table: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    positions: torch.Tensor,  # [G] int64, written
    slot_mapping: torch.Tensor,  # [G] int64, written
    seq_lens: torch.Tensor,  # [B] int32, written
    cu_q_lens: torch.Tensor,  # [B + 1] int32, written
    k_max: int,
    grid_rows: torch.Tensor | None = None,  # [B * (k_max + 1)] int64, written
    max_cu: int | None = None,  # cap of the cu_q_lens entries
) -> None:
    """Positions, slot mapping, KV lengths and row offsets of the packed verify rows.

    Row ``j`` of request ``b`` is at position ``context_lens[b] + j`` and writes KV slot
    ``block_table[b, pos // block_size] * block_size + pos % block_size``; padded rows get
    position 0 and the sentinel slot 0. ``seq_lens[b] = context_lens[b] + verify_lens[b] + 1``.
    ``grid_rows[b * (k_max + 1) + j] = min(cu_q_lens[b] + j, G - 1)``: the packed row of grid
    cell ``(b, j)`` (cells past a request's rows point at some valid row; their values are
    ignored), for gathering per-row results into the ``[B, k_max + 1]`` grid. ``max_cu``: every
    ``cu_q_lens`` entry is clamped to at most it (``cu_q_lens.clamp_(max=max_cu)``; with
    ``G``, requests past the ``G`` rows get none); ``grid_rows`` keeps the unclamped offsets.
    """
    vl = verify_lens.long().clamp(0, k_max)
    req, j, real, cu = _verify_rows(vl, positions.shape[0])
    pos = context_lens.long()[req] + j
    blk = (pos // block_size).clamp(0, block_table.shape[1] - 1)
    slot = block_table.long()[req, blk] * block_size + pos % block_size
    positions.copy_(torch.where(real, pos, torch.zeros_like(pos)))
    slot_mapping.copy_(torch.where(real, slot, torch.zeros_like(slot)))
    seq_lens.copy_((context_lens.long() + vl + 1).to(seq_lens.dtype))
    cu_q_lens[:1].zero_()  # (a tensor op: ``cu_q_lens[0] = 0`` is a host copy, not capturable)
    cu_q_lens[1:].copy_((cu if max_cu is None else cu.clamp(max=max_cu)).to(cu_q_lens.dtype))
    if grid_rows is not None:
        start = torch.cat([cu.new_zeros(1), cu[:-1]])
        cells = start[:, None] + torch.arange(k_max + 1, device=cu.device)
        grid_rows.copy_(cells.clamp(max=positions.shape[0] - 1).view(-1))


def attention_tiling_update_ref(
    seq_lens: torch.Tensor,  # [B] int32
    num_splits: torch.Tensor,  # [B] int32, written
    split_len: torch.Tensor,  # [B] int32, written
    max_splits: int,
    block_n: int,
    min_split_len: int,
) -> None:
    """Split-KV fields from the KV lengths.

    ``n0 = clamp(ceil(seq_len / min_split_len), 1, max_splits)``;
    ``split_len = max(block_n, ceil(ceil(seq_len / n0) / block_n) * block_n)`` (a whole number of
    KV tiles); ``num_splits = ceil(seq_len / split_len)`` (0 for an empty request).
    """
    s = seq_lens.long().clamp(min=0)
    n0 = ((s + min_split_len - 1) // min_split_len).clamp(1, max_splits)
    per = (s + n0 - 1) // n0
    sl = ((per + block_n - 1) // block_n * block_n).clamp(min=block_n)
    split_len.copy_(sl.to(split_len.dtype))
    num_splits.copy_(((s + sl - 1) // sl).to(num_splits.dtype))


# ---------------------------------------------------------------------------------------------
# decode building blocks


def linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] (nn.Linear layout)
    epilogue: str | None = None,  # None | "silu_mul"
    residual: torch.Tensor | None = None,  # [M, N], becomes residual + result (in place)
    row_scale: torch.Tensor | None = None,  # [M]: each row of the product times this
) -> torch.Tensor:  # [M, N] ([M, N / 2] for "silu_mul"), x.dtype (the residual when given)
    """``x @ weight.T`` with (at least) fp32 accumulation, then an optional epilogue.

    ``silu_mul``: weight rows interleave ``(gate_i, up_i)``; returns ``silu(gate) * up``.
    ``residual``: adds the product into ``residual`` (one rounding) and returns it.
    ``row_scale``: multiplies row ``m`` of the fp32 product by ``row_scale[m]`` first (the
    consumer half of a deferred RMSNorm, ``ops.linear(row_scale=...)``).
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ weight.to(acc).t()
    if row_scale is not None:
        y = y * row_scale.to(acc)[:, None]
    if epilogue == "silu_mul":
        y = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
    if residual is None:
        return y.to(x.dtype)
    return residual.copy_((residual.to(acc) + y).to(residual.dtype))


def argmax_partials_ref(
    logits: torch.Tensor,  # [M, N] (as stored: the dtype the comparison sees)
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # tile_max [M, T] fp32, tile_idx [M, T] int32
    """Per-tile argmax of ``logits`` over column tiles of ``block_n``, ``T = cdiv(N, block_n)``.

    ``tile_max[m, t]`` is the max of columns ``[t * block_n, (t + 1) * block_n)`` of row ``m``
    and ``tile_idx[m, t]`` the first column holding it (``torch.argmax`` semantics: a NaN beats
    every number and reports itself; ties go to the lowest column). Columns past ``N`` are -inf.
    """
    m, n = logits.shape
    tiles = -(-n // block_n)
    v = logits.float()
    pad = v.new_full((m, tiles * block_n - n), float("-inf"))
    v = torch.cat([v, pad], 1).view(m, tiles, block_n)
    col = v.argmax(-1)  # [M, T]
    tile_max = v.gather(-1, col[..., None])[..., 0]
    first = torch.arange(tiles, device=v.device) * block_n
    return tile_max, (col + first[None, :]).to(torch.int32)


def linear_argmax_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # tile_max [M, T] fp32, tile_idx [M, T] int32
    """``argmax_partials_ref`` of ``linear_ref(x, weight)`` (the logits rounded to x's dtype)."""
    return argmax_partials_ref(linear_ref(x, weight), block_n)


def reduce_argmax_partials_ref(
    tile_max: torch.Tensor,  # [M, T] float
    tile_idx: torch.Tensor,  # [M, T] int: column of each tile's max
) -> torch.Tensor:  # [M] int64
    """Row tokens from per-tile partials, equal to ``torch.argmax`` of the full rows: the largest
    tile max (a NaN beats every number), ties to the first tile, whose columns are the lowest."""
    t = tile_max.argmax(-1, keepdim=True)  # [M, 1]
    return tile_idx.gather(-1, t)[:, 0].long()


def argmax_keys_ref(
    logits: torch.Tensor,  # [M, N] (as stored: the dtype the comparison sees)
) -> torch.Tensor:  # [M] int64: the packed keys' bits
    """Each row's argmax as one packed 64-bit key (what ``ops.linear_argmax(keys=...)`` leaves
    after its atomic max): high 32 bits the max logit's fp32 bits made order-preserving as an
    unsigned int (-0 counted as +0, every NaN as the largest), low 32 bits ``2**32 - 1 -
    column``, so the unsigned max of the keys picks the largest logit, then the lowest column
    (``torch.argmax``'s answer, a NaN included). Stored in int64 (the same bits)."""
    v = logits.float()
    col = v.argmax(-1)  # [M]: the first NaN, else the first max
    best = v.gather(-1, col[:, None])[:, 0]
    best = torch.where(best == 0, torch.zeros_like(best), best)
    bits = best.view(torch.int32).long() & 0xFFFFFFFF
    bits = torch.where(best.isnan(), torch.full_like(bits, 0x7FFFFFFF), bits)
    key = torch.where(bits < 0x80000000, bits | 0x80000000, 0xFFFFFFFF - bits)
    return (key << 32) | (0xFFFFFFFF - col)  # uint64 bits (int64 shifts wrap the same way)


def unpack_argmax_keys_ref(keys: torch.Tensor) -> torch.Tensor:  # [M] int64 -> [M] int64
    """The columns of ``argmax_keys_ref``'s keys: ``2**32 - 1 -`` their low 32 bits."""
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def rms_norm_ref(
    x: torch.Tensor,  # [M, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32; with ``residual``: ``h = x + residual``, returns ``(norm(h), h)``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    if residual is not None:
        h = h + residual.to(acc)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    if residual is None:
        return y.to(x.dtype)
    return y.to(x.dtype), h.to(x.dtype)


def embed_rms_norm_ref(
    input_ids: torch.Tensor,  # [M] int
    table: torch.Tensor,  # [V, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (h [M, N] table.dtype, norm(h) [M, N] table.dtype)
    """The embedding rows and their RMSNorm: ``h = table[input_ids]`` (as ``nn.Embedding``
    gives it: no scale, no padding row) and ``rms_norm_ref(h, weight, eps)``.

    An id outside ``[0, V)`` gives a zero row (and a zero norm) where torch's embedding would
    raise (a device assert on CUDA): the kernel must not read outside the table.
    """
    ids = input_ids.long()
    live = (ids >= 0) & (ids < table.shape[0])
    rows = table[ids.clamp(0, table.shape[0] - 1)]
    h = torch.where(live[:, None], rows, torch.zeros((), dtype=table.dtype, device=table.device))
    return h, rms_norm_ref(h, weight, eps)


def rotary_kv_write_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, R] fp32 (R <= D): cos in [:R/2], sin in [R/2:]
    slot_mapping: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written
    q_out: torch.Tensor | None = None,  # [T, H, D], written (None: q in place)
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_w [D], k_w [D], eps)
) -> torch.Tensor:  # q_out (q when None)
    """(Per-head q/k RMSNorm, fp32, then) neox rotary on the first ``R`` channels of q and k
    (fp32 math; the rest unrotated: partial rotary); rotated q to ``q_out``, rotated k and v
    into their slots."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions].float()  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if w is None:
            return x
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + qk_norm[2]) * w.float()

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    qw, kw = (qk_norm[0], qk_norm[1]) if qk_norm is not None else (None, None)
    out = q if q_out is None else q_out
    out.copy_(rot(norm(q, qw)).to(out.dtype))
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d)[slot_mapping] = rot(norm(k, kw)).to(k_cache.dtype)
    v_cache.view(-1, kvh, d)[slot_mapping] = v.to(v_cache.dtype)
    return out


def rotate_pairs(
    x: torch.Tensor,  # [N, heads, rotary_dim]
    cos: torch.Tensor,  # [N, 1, rotary_dim]: cat(freqs, freqs) cosines (RotaryTable rows)
    sin: torch.Tensor,  # [N, 1, rotary_dim]
    is_interleaved: bool,
) -> torch.Tensor:  # [N, heads, rotary_dim], x's dtype
    """Rotary over channel pairs ``(2i, 2i + 1)`` written out as ``[even' | odd']`` (DeepSeek's
    interleaved layout, as transformers' ``apply_rotary_pos_emb_interleave``), or over the two
    halves (``rotate_half``); fp32 math, rounded to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    if is_interleaved:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        out = xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin
    return out.to(x.dtype)


def mla_rope_cache_ref(
    q_first: torch.Tensor,  # [N, H, F]: the query channels before the rotated part
    q_pe: torch.Tensor,  # [N, H, rope]: each head's rope channels
    k_pe: torch.Tensor,  # [N, rope]: the shared key's rope channels
    latent: torch.Tensor,  # [N, latent]: the normed latent
    cos: torch.Tensor,  # [N, rope] fp32 (RotaryTable rows)
    sin: torch.Tensor,  # [N, rope] fp32
    slot_mapping: torch.Tensor,  # [N] int64
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope], written
    is_interleaved: bool,
) -> torch.Tensor:  # [N, H, F + rope], q_first's dtype
    """An MLA layer's rotary and latent-cache write: the heads' and the key's rope channels
    rotated in one pass (:func:`rotate_pairs`), ``[latent | rotated k_pe]`` into each row's
    cache slot, and the query ``[q_first | rotated q_pe]`` returned."""
    heads = q_pe.shape[1]
    both = rotate_pairs(torch.cat([q_pe, k_pe[:, None]], dim=1), cos[:, None], sin[:, None],
                        is_interleaved)  # [N, H + 1, rope]
    cache.view(-1, cache.shape[-1]).index_copy_(
        0, slot_mapping, torch.cat([latent, both[:, heads]], dim=-1).to(cache.dtype))
    return torch.cat([q_first, both[:, :heads]], dim=-1)


def packed_rows_ref(
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    num_rows: int,  # T
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [T] int64, slots [T] int64
    """Position and KV slot of each packed row (padding rows past ``cu_q_lens[B]``: 0 and the
    sentinel slot 0), as ``verify_metadata_update`` writes them."""
    t = torch.arange(num_rows, device=cu_q_lens.device)
    cu = cu_q_lens.long()
    b = (torch.searchsorted(cu[1:], t, right=True)).clamp(max=cu.shape[0] - 2)
    valid = t < cu[-1]
    q_len = cu[b + 1] - cu[b]
    pos = seq_lens.long()[b] - q_len + (t - cu[b])
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    page = block_table.long()[b, pos // block_size]
    slot = torch.where(valid, page * block_size + pos % block_size, torch.zeros_like(pos))
    return pos, slot


def rope_paged_attention_ref(
    q: torch.Tensor,  # [T, H, D] raw projection (packed rows)
    k_new: torch.Tensor,  # [T, KVH, D] raw projection
    v_new: torch.Tensor,  # [T, KVH, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    **split,  # num_splits, split_len, max_splits (see paged_attention_ref)
) -> torch.Tensor:  # [T, H, D]
    """``rotary_kv_write_ref`` (positions and slots from the packed layout, ``packed_rows_ref``)
    then ``paged_attention_ref`` on the rotated q: what the fused kernel computes."""
    pos, slot = packed_rows_ref(cu_q_lens, seq_lens, block_table, k_cache.shape[1], q.shape[0])
    q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rotary_kv_write_ref(q, k_new, v_new, pos, cos_sin_cache, slot, k_cache, v_cache, q_rot,
                        qk_norm)
    return paged_attention_ref(q_rot, k_cache, v_cache, block_table, seq_lens, num_q_rows, scale,
                               cu_q_lens=cu_q_lens, **split)


def verify_accept_ref(
    row_tokens: torch.Tensor,  # [G] int: the argmax of each packed row
    grid_rows: torch.Tensor,  # [B * (k + 1)] int: packed row of grid cell (b, j)
    draft_tokens: torch.Tensor,  # [B, k] int
    num_verify: torch.Tensor,  # [B] int, clamped to [0, k]
    slot_index: torch.Tensor,  # [B] int
    hidden: torch.Tensor,  # [G, H]
    ext_tokens: torch.Tensor,  # [slots, >= k + 1] int64, written
    ext_hidden: torch.Tensor,  # [slots, >= k + 1, H], written
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, tokens [B, k + 1] int64
    """Acceptance from the packed rows' argmax, and the slot state of the next round.

    ``target[b, j] = row_tokens[grid_rows[b * (k + 1) + j]]``. Greedy: the accepted length is
    the longest prefix of the first ``num_verify[b]`` drafts equal to ``target``; otherwise
    (forced) it is ``num_verify[b]``. Emitted tokens: the accepted drafts, then
    ``target[b, num_accepted]``, then ``-1``. ``ext_tokens[slot_index[b], :k + 1]`` gets them and
    ``ext_hidden[slot_index[b], j] = hidden[grid_rows[b * (k + 1) + j]]``.
    """
    batch, k = draft_tokens.shape
    cells = grid_rows.long().view(batch, k + 1)
    target = row_tokens.long()[cells]  # [B, k + 1]
    nv = num_verify.long().clamp(0, k)
    pos = torch.arange(k + 1, device=target.device)[None, :]
    drafts = torch.cat([draft_tokens.long(), draft_tokens.new_full((batch, 1), -1).long()], 1)
    if greedy:
        ok = (target[:, :k] == drafts[:, :k]) & (pos[:, :k] < nv[:, None])
        na = ok.long().cumprod(dim=-1).sum(dim=-1) if k else nv
    else:
        na = nv
    out = torch.where(pos < na[:, None], drafts, torch.full_like(drafts, -1))
    out = torch.where(pos == na[:, None], target.gather(1, na[:, None]), out)
    slots = slot_index.long()
    ext_tokens[slots, : k + 1] = out
    ext_hidden[slots, : k + 1] = hidden[cells]
    return na, out


# ---------------------------------------------------------------------------------------------
# gated delta-net decode / verify (transformers' torch fallbacks, modeling_qwen3_5.py)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # [..., dim]
    """``x / sqrt(sum(x^2) + eps)`` along the last axis (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor,  # [B, C, R]: this step's conv inputs
    conv_state: torch.Tensor,  # [B, C, K - 1]: the previous K - 1 inputs (zeros at start)
    weight: torch.Tensor,  # [C, K] depthwise kernel
    num_valid: torch.Tensor | None = None,  # [B] int64 real rows (the rest is padding)
) -> tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [B, C, R], new state [B, C, K - 1]
    """Depthwise causal conv1d with SiLU, continuing from ``conv_state``.

    The new state is the ``K - 1`` inputs ending at each request's last real row.
    """
    num_b, chans, num_r = x.shape
    km1 = conv_state.shape[-1]
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K - 1 + R]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=chans)  # [B, C, R]
    if num_valid is None:
        new_state = full[:, :, num_r:]
    else:
        idx = num_valid[:, None] + torch.arange(km1, device=x.device)  # [B, K - 1]
        new_state = full.gather(2, idx[:, None, :].expand(num_b, chans, km1))
    return F.silu(out).to(x.dtype), new_state


def conv_windows(
    x: torch.Tensor,  # [B, C, R]
    conv_state: torch.Tensor,  # [B, C, K - 1]
) -> torch.Tensor:  # [B, R, C, K - 1]: the conv state after each row
    """Per-row conv states (the snapshot strategy stores one per verified position)."""
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    km1 = conv_state.shape[-1]
    return full.unfold(2, km1, 1)[:, :, 1:].permute(0, 2, 1, 3)


def conv_update_ref(
    x: torch.Tensor,  # [B, R, C] conv inputs (the qkv projection's rows)
    conv_state: torch.Tensor,  # [S, C, K - 1] pool, read and written
    weight: torch.Tensor,  # [C, K]
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64; None: no final state written
    num_valid: torch.Tensor | None = None,  # [B] int64 real rows (None: all R)
    snapshots: torch.Tensor | None = None,  # [B, R, C, K - 1] out: the state after each row
    snapshot_rows: torch.Tensor | None = None,  # [B, R] int64 pool rows, same, in place
) -> torch.Tensor:  # [B, R, C] silu(conv), x's dtype
    """The conv step of a decode / verify: ``causal_conv1d`` over ``[conv_state[read] | x]``;
    the window ending at each request's last real row into ``conv_state[write]``, the window
    after every row (padding rows included) into the snapshots."""
    xt = x.transpose(1, 2)
    conv_in = conv_state[read_slots]
    mixed, new_conv = causal_conv1d(xt, conv_in, weight, num_valid)
    if snapshots is not None:
        snapshots.copy_(conv_windows(xt, conv_in))
    if snapshot_rows is not None:
        windows = conv_windows(xt, conv_in).reshape(-1, *conv_state.shape[1:])
        conv_state.index_copy_(0, snapshot_rows.reshape(-1), windows.to(conv_state.dtype))
    if write_slots is not None:
        conv_state.index_copy_(0, write_slots, new_conv.to(conv_state.dtype))
    return mixed.transpose(1, 2)


def delta_rule_inputs(q, k, v, g, beta):
    """Heads first, float32, l2-normed q/k, q scaled by ``head_k_dim ** -0.5``; grouped value
    heads: one q/k head serves ``Hv // Hk`` consecutive v heads (repeated here)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q = l2norm(q)
    k = l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, R, Hk, Dk]
    k: torch.Tensor,  # [B, R, Hk, Dk]
    v: torch.Tensor,  # [B, R, Hv, Dv]
    g: torch.Tensor,  # [B, R, Hv] log decay (<= 0; 0 on padding rows)
    beta: torch.Tensor,  # [B, R, Hv] write strength (0 on padding rows)
    state: torch.Tensor,  # [B, Hv, Dk, Dv] float32 initial state
    snapshots: torch.Tensor | None = None,  # [B, R, Hv, Dk, Dv] out: state after each row
    snapshot_rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # (pool [S, Hv, Dk, Dv],
    # rows [B, R] int64): the state after row i goes to pool row rows[:, i] (in place)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, R, Hv, Dv] (q's dtype), final state
    """Token-by-token gated delta rule: ``S = exp(g) S;  S += k (beta (v - S^T k))^T;
    o = S^T q`` (the decode / verify step; ``R`` is at most ``w + 1``)."""
    dtype = q.dtype
    q, k, v, g, beta = delta_rule_inputs(q, k, v, g, beta)
    s = state.float()
    out = torch.empty_like(v)  # [B, Hv, R, Dv]
    for i in range(q.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        kv_mem = (s * k[:, :, i, :, None]).sum(dim=-2)  # [B, Hv, Dv]
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i, None]
        s = s + k[:, :, i, :, None] * delta[:, :, None, :]
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(dim=-2)
        store_snapshot(i, s, snapshots, snapshot_rows)
    return out.transpose(1, 2).to(dtype), s


def store_snapshot(i: int, s: torch.Tensor, snapshots: torch.Tensor | None,
                   snapshot_rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The state after row ``i`` (``s [B, Hv, Dk, Dv]``) into the per-row buffer and / or the
    pool rows of :func:`recurrent_gated_delta_rule`'s ``snapshots`` / ``snapshot_rows``."""
    if snapshots is not None:
        snapshots[:, i] = s
    if snapshot_rows is not None:
        pool, rows = snapshot_rows
        pool.index_copy_(0, rows[:, i], s.to(pool.dtype))


def delta_rule_verify_ref(
    q: torch.Tensor,  # [B, R, Hk, Dk] (raw: l2-normed and scaled here)
    k: torch.Tensor,  # [B, R, Hk, Dk]
    v: torch.Tensor,  # [B, R, Hv, Dv]
    g: torch.Tensor,  # [B, R, Hv] log decay
    beta: torch.Tensor,  # [B, R, Hv] write strength
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] float32 pool, read and written
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64; None: no final state written
    num_valid: torch.Tensor | None = None,  # [B] int64 real rows: g, beta masked past them
    snapshots: torch.Tensor | None = None,  # [B, R, Hv, Dk, Dv] out: the state after each row
    snapshot_rows: torch.Tensor | None = None,  # [B, R] int64 pool rows, same, in place
) -> torch.Tensor:  # [B, R, Hv, Dv] q's dtype
    """The gated delta rule over ``R`` rows per request from ``ssm_state[read_slots]``
    (``recurrent_gated_delta_rule``), rows past ``num_valid`` inert (zero decay, zero write),
    the final state into ``ssm_state[write_slots]``."""
    if num_valid is not None:
        is_real = (torch.arange(q.shape[1], device=q.device)[None, :] < num_valid[:, None])
        g = g * is_real[..., None]
        beta = beta * is_real[..., None]
    pool = (ssm_state, snapshot_rows) if snapshot_rows is not None else None
    out, s = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state[read_slots], snapshots,
                                        pool)
    if write_slots is not None:
        ssm_state.index_copy_(0, write_slots, s.to(ssm_state.dtype))
    return out


def rmsnorm_gated_ref(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [M, D] x's dtype
    """``weight * rmsnorm(x) * silu(z)`` (normalise first, then gate): the norm in float32,
    rounded to x's dtype before the weight (transformers' ``Qwen3_5RMSNormGated``)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


def gated_decay_ref(
    a: torch.Tensor,  # [N, Hv] decay input (the model's dtype)
    b: torch.Tensor,  # [N, Hv] write-strength input
    dt_bias: torch.Tensor,  # [Hv]
    decay: torch.Tensor,  # [Hv] float32: -exp(A_log)
) -> tuple[torch.Tensor, torch.Tensor]:  # g [N, Hv] float32, beta [N, Hv] b's dtype
    """A gated delta-net layer's per-row gates: ``g = decay * softplus(a + dt_bias)`` in
    float32 and ``beta = sigmoid(b)`` in b's dtype (transformers' ``Qwen3_5GatedDeltaNet``)."""
    return decay * F.softplus(a.float() + dt_bias), b.sigmoid()
