"""Builders and loop-based oracles shared by the kernel tests (float64, written for clarity)."""

from __future__ import annotations

import torch


def paged_kv(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """Random K/V caches; block 0 (reserved) is poisoned with NaN so a read of it shows."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device="cpu").to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen, device="cpu").to(dtype=dtype, device=device)
    k[0] = float("nan")
    v[0] = float("nan")
    return k, v


def block_table_for(seq_lens, block_size, max_blocks, num_blocks, gen, device):
    """[B, max_blocks] int32 of distinct random blocks >= 1; unused entries point at block 0."""
    batch = len(seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * max_blocks] + 1
    bt = perm.view(batch, max_blocks).clone()
    for b, n in enumerate(seq_lens):
        bt[b, -(-n // block_size):] = 0
    return bt.to(torch.int32).to(device)


def attention_oracle(q_rows, k_cache, v_cache, block_table, seq_lens, scale):
    """q_rows[b]: [q_len_b, H, D]; returns list of [q_len_b, H, D] float64 outputs."""
    outs = []
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    for b, qb in enumerate(q_rows):
        n = int(seq_lens[b])
        toks = [int(block_table[b, t // bs]) * bs + t % bs for t in range(n)]
        k = k_cache.reshape(-1, kvh, k_cache.shape[3])[toks].double()  # [n, KVH, D]
        v = v_cache.reshape(-1, kvh, v_cache.shape[3])[toks].double()
        group = qb.shape[1] // kvh
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        rows = []
        for i in range(qb.shape[0]):
            pos = n - qb.shape[0] + i
            s = torch.einsum("hd,nhd->hn", qb[i].double(), k[: pos + 1]) * scale
            rows.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[: pos + 1]))
        outs.append(torch.stack(rows) if rows else qb.new_zeros(qb.shape).double())
    return outs


def verify_oracle(base, drafts, verify_lens, ctx_lens, block_table, block_size, g, pad_id=-1):
    """Loop version of the packed verify rows: (ids, positions, slots, seq_lens, cu)."""
    ids, pos, slots, cu = [], [], [], [0]
    k_max = drafts.shape[1]
    seq = []
    for b in range(len(base)):
        n = min(max(int(verify_lens[b]), 0), k_max)
        for j in range(n + 1):
            ids.append(int(base[b]) if j == 0 else int(drafts[b, j - 1]))
            p = int(ctx_lens[b]) + j
            pos.append(p)
            slots.append(int(block_table[b, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + n + 1)
        seq.append(int(ctx_lens[b]) + n + 1)
    pad = g - len(ids)
    return (ids + [pad_id] * pad, pos + [0] * pad, slots + [0] * pad, seq, cu)


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def cos_sin_table(head_dim, device, max_pos=4096, base=1e6):
    """``[max_pos, head_dim]`` fp32 neox table, cos in the first half and sin in the second."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(device)


def split_qkv(qkv, heads, kv_heads, head_dim):
    """Views ``q [T, H, D]``, ``k``, ``v [T, KVH, D]`` of a fused ``[T, (H + 2 KVH) D]`` buffer."""
    t = qkv.shape[0]
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    return q, k, v


def accept_case(seed, batch, k, g, hidden, dtype, device, slots=11, width=7):
    """Inputs of ``ops.verify_accept``: argmax tokens that match the drafts on a random prefix
    (so greedy acceptance stops at varied places), the grid -> packed row map the metadata
    kernel writes (``min(cu[b] + j, g - 1)``), verify lengths some of which need clamping, and
    distinct slots; the slot state is poisoned (-7 / NaN) where nothing should be written."""
    gen = torch.Generator().manual_seed(seed)
    nv = torch.randint(-1, k + 2, (batch,), generator=gen)
    drafts = torch.randint(0, 50, (batch, k), generator=gen)
    rows = nv.clamp(0, k) + 1
    cu = torch.cat([torch.zeros(1, dtype=torch.long), rows.cumsum(0)])
    grid = (cu[:-1, None] + torch.arange(k + 1)[None, :]).clamp(max=g - 1).reshape(-1)
    row_tok = torch.randint(0, 50, (g,), generator=gen)
    for b in range(batch):  # agree with the drafts on a random prefix
        agree = int(torch.randint(0, k + 1, (1,), generator=gen))
        for j in range(min(agree, k)):
            row_tok[grid[b * (k + 1) + j]] = drafts[b, j]
    hid = torch.randn(g, hidden, generator=gen).to(dtype)
    slot = torch.randperm(slots, generator=gen)[:batch]
    ext_tok = torch.full((slots, width), -7, dtype=torch.int64)
    ext_h = torch.full((slots, width, hidden), float("nan"), dtype=dtype)
    return [t.to(device) for t in (row_tok, grid, drafts, nv, slot, hid, ext_tok, ext_h)]


def accept_oracle(row_tok, grid, drafts, nv, slot, hid, ext_tok, ext_h, greedy):
    """Loop version of ``verify_accept``: returns (num_accepted, tokens) and writes the slots."""
    batch, k = drafts.shape
    na_all, out_all = [], []
    for b in range(batch):
        target = [int(row_tok[grid[b * (k + 1) + j]]) for j in range(k + 1)]
        v = min(max(int(nv[b]), 0), k)
        na = 0
        if greedy:
            while na < v and int(drafts[b, na]) == target[na]:
                na += 1
        else:
            na = v
        out = [int(drafts[b, j]) for j in range(na)] + [target[na]] + [-1] * (k - na)
        s = int(slot[b])
        ext_tok[s, : k + 1] = torch.tensor(out)
        for j in range(k + 1):
            ext_h[s, j] = hid[grid[b * (k + 1) + j]]
        na_all.append(na)
        out_all.append(out)
    return torch.tensor(na_all), torch.tensor(out_all)


ROUNDING_BASE = {torch.bfloat16: 256.0, torch.float16: 2048.0, torch.float32: 2.0 ** 24}


def argmax_case(seed, m, n, k, dtype, device, block_n):
    """Inputs of ``ops.linear_argmax`` with exact products (small integers, fp32 sums exact) and
    the cases the argmax must settle like ``torch.argmax`` of the stored logits; returns
    ``(x, w, special)``, ``special`` the expected argmax of the crafted rows:

    - row 0: columns ``a < b`` in different tiles hold ``base`` and ``base + 1`` (exact in fp32
      for half types), which round to the same value in ``dtype``: the first wins, so an argmax
      over the fp32 accumulator (``b``) fails;
    - row 1: the same max 3 in two tiles (an exact tie: the first column);
    - row 2: ``+inf`` in x times a column of ones gives ``+inf`` logits, and NaN (``inf * 0``)
      in two columns: the first NaN wins (torch.argmax's rule).
    Other rows: random integers in [-2, 2], full of ties. Needs ``k >= 8``, ``n >= 6 * block_n``
    and ``n % block_n != 1``.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (m, k), generator=gen).float()
    w = torch.randint(-2, 3, (n, k), generator=gen).float()
    tiles = -(-n // block_n)
    a, b = block_n + 3, (tiles - 1) * block_n + 1  # tile 1 and the last (maybe partial) tile
    dup_a, dup_b = 2 * block_n + 5, 4 * block_n + 7
    nan_a, nan_b = 3 * block_n + 9, 5 * block_n
    w[[a, b]] = 0.0
    w[[a, b], 0] = ROUNDING_BASE[dtype]
    w[b, 1] = 1.0
    w[[dup_a, dup_b], 2] = 3.0
    w[:, 5] = 1.0
    w[[nan_a, nan_b], 5] = 0.0
    special = {0: a, 1: dup_a, 2: nan_a}
    x[:, 0] = 0.0  # the large values meet row 0 only: every other sum stays exact in fp32
    x[0] = 0.0
    x[0, :2] = 1.0
    if m > 1:
        x[1] = 0.0
        x[1, 2] = 1.0
    if m > 2:
        x[2, 5] = float("inf")
    special = {r: c for r, c in special.items() if r < m}
    return x.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device), special


def logits_for_tokens(row_tokens, vocab, gen):
    """``[G, vocab]`` float32 logits whose ``torch.argmax`` is ``row_tokens``: small random
    integers, the token's column at the row max and the same max again in a later column (a
    tie the first column wins); every third row a NaN at the token and the last column and
    ``+inf`` before the token (a NaN beats +inf wherever the two sit)."""
    g = row_tokens.shape[0]
    logits = torch.randint(0, 6, (g, vocab), generator=gen).float()
    for r in range(g):
        tok = int(row_tokens[r])
        later = tok + 1 + int(torch.randint(0, vocab - tok - 1, (1,), generator=gen))
        if r % 3 == 2:
            logits[r, tok // 2 if tok else later] = float("inf")
            logits[r, tok] = float("nan")
            logits[r, -1] = float("nan")
        else:
            logits[r, tok] = 9.0
            logits[r, later] = 9.0
    return logits


def moe_case(seed, rows, hidden, inter, experts, top_k, dtype, device, idle=()):
    """Routed-expert inputs: x, routing weights (float32), distinct experts per row (none of
    ``idle``), stacked ``gate_up [E, 2I, H]`` / ``down [E, H, I]``; the idle experts' weights
    are NaN, so a read of them shows."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e not in idle])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]]
                       for _ in range(rows)])
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.rand(rows, top_k, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    for e in idle:
        gate_up[e] = down[e] = float("nan")
    return (x.to(dtype=dtype, device=device), w.to(device), ids.to(device),
            gate_up.to(dtype=dtype, device=device), down.to(dtype=dtype, device=device))


def moe_oracle(x, weights, ids, gate_up, down):
    """Each expert on the rows that chose it (float64), weighted, summed per row."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(ids[n].tolist()):
            h = gate_up[e] @ x[n]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[n] += float(weights[n, j]) * (down[e] @ act)
    return out
