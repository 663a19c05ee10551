"""Pure-torch references of the routed-expert kernels (``kernels/fused_moe.py``): the routers'
rule, the block-aligned pair layout, the experts over it and the ordered slot sum. Part of
``speccal.kernels.reference`` (which re-exports every name here; its docstring describes the
layout); kept apart for size.
"""

from __future__ import annotations

import torch

#: added to the chosen sigmoid weights' sum before renormalising (transformers' DeepSeek-V3)
SIGMOID_NORM_EPS = 1e-20


def moe_route_ref(logits, bias, top_k, scoring, num_groups=1, topk_groups=1, normalise=False,
                  scale=1.0) -> tuple[torch.Tensor, torch.Tensor]:  # weights, ids [N, top_k]
    """Each row's experts and their weights from the router's logits (``ops.moe_route``'s
    arguments and shapes).

    softmax: probabilities over all experts (float32), the ``top_k`` largest, optionally
    renormalised, times ``scale``, cast to the logits' dtype. sigmoid: per-expert scores
    (float32); the selection score adds ``bias``; with groups, only the ``topk_groups`` groups
    whose two best selection scores sum highest are eligible; the weights are the *unbiased*
    scores of the chosen experts, optionally renormalised (+ :data:`SIGMOID_NORM_EPS`), times
    ``scale`` (float32)."""
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if scale != 1.0:
            weights = weights * scale
        return weights.to(logits.dtype), ids
    scores = torch.sigmoid(logits.float())  # [N, E]
    choice = scores if bias is None else scores + bias.float()
    if num_groups > 1:
        n, g = choice.shape[0], num_groups
        grouped = choice.view(n, g, choice.shape[1] // g)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = torch.topk(group_score, topk_groups, dim=-1, sorted=False).indices
        eligible = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~eligible[:, :, None], float("-inf")).view(n, -1)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    return weights * scale, ids


def moe_align_ref(
    ids: torch.Tensor,  # [N, top_k] int: each row's experts
    num_experts: int,
    block_m: int,
    *,
    sentinel: bool = False,  # ids may hold num_experts: pairs of no expert (masked rows)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # sorted_pairs [P], block_expert [P/bm], counts [E]
    """The block-aligned layout of the (row, expert) pairs (module docstring), and the pairs per
    expert. A static-shape stable sort: no host read, so it can sit in a captured graph (about
    twenty launches on CUDA: one stable sort gives the order and the sorted experts, one
    ``searchsorted`` each expert's first pair and count). ``sentinel``: the pairs of expert
    ``num_experts`` are laid out last, in blocks of expert -1 (read by no kernel), and left out
    of ``counts``."""
    flat = ids.reshape(-1).long()
    num_pairs, dev = flat.numel(), flat.device
    laid = num_experts + 1 if sentinel else num_experts  # experts given a run in the layout
    by_expert, order = torch.sort(flat, stable=True)  # pairs ascending within one expert
    bounds = torch.searchsorted(by_expert, torch.arange(laid + 1, device=dev))  # [E' + 1]
    counts = bounds.diff()  # [E']: pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E']: each expert's run ends here in the layout
    # a pair's destination: its expert's run start plus its rank among the expert's pairs
    dest = (ends - padded - bounds[:-1])[by_expert] + torch.arange(num_pairs, device=dev)
    num_blocks = -(-(num_pairs + min(laid, num_pairs) * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    sorted_pairs.scatter_(0, dest, order)
    starts = torch.arange(0, num_blocks * block_m, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    return (sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1),
            counts[:num_experts])


def fused_moe_ref(
    x: torch.Tensor,  # [N, hidden]
    weights: torch.Tensor,  # [N, top_k]: routing weights (float32 or x's dtype)
    gate_up: torch.Tensor,  # [E, 2 I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    sorted_pairs: torch.Tensor,  # [P] int64 (moe_align_ref)
    block_expert: torch.Tensor,  # [P / block_m] int64
) -> torch.Tensor:  # [N * top_k, hidden] x's dtype: pair p's expert output times its weight
    """Every pair's ``weight * down(silu(gate(x)) * up(x))`` of its expert, block by block: each
    block gathers its expert's stacked weights and runs batched products (static shapes; a
    block of no expert computes on expert 0's weights and its rows are dropped). The products
    round to ``x``'s dtype as ``nn.Linear`` does, the weight multiplies in the promoted dtype.
    The gather holds one expert's weights per block: the CPU path of small models and the
    semantics of the Triton kernels, not a fast path for large ones."""
    n, k = weights.shape
    num_blocks, hidden = block_expert.shape[0], x.shape[1]
    inter = down.shape[2]
    rows = torch.cat([x, x.new_zeros(1, hidden)]).index_select(0, sorted_pairs // k)
    expert = block_expert.clamp(min=0)
    h = torch.bmm(rows.view(num_blocks, -1, hidden), gate_up.index_select(0, expert).transpose(1, 2))
    act = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
    y = torch.bmm(act, down.index_select(0, expert).transpose(1, 2)).view(-1, hidden)
    w = torch.cat([weights.reshape(-1), weights.new_zeros(1)]).index_select(0, sorted_pairs)
    out = x.new_zeros(n * k + 1, hidden)  # the last row takes the padding
    return out.index_copy_(0, sorted_pairs, (y * w[:, None]).to(x.dtype))[: n * k]


def moe_sum_slots_ref(
    pair_out: torch.Tensor,  # [N * top_k, hidden]
    ids: torch.Tensor,  # [N, top_k]
) -> torch.Tensor:  # [N, hidden]
    """Each row's pair outputs summed in ascending expert order, one addition after the other
    (what adding every expert's rows into a zero result expert by expert gives, transformers'
    order)."""
    n, k = ids.shape
    order = torch.argsort(ids, dim=1)  # [N, k]
    y = pair_out.view(n, k, -1).gather(1, order[..., None].expand(n, k, pair_out.shape[1]))
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out
