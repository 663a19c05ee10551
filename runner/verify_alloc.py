"""Device-side prefix-closed verify allocation (adaptive target verify), torch only, no host sync.

This module owns :func:`allocate_prefixes_device`, the torch twin of
``speccal.policy_rules.allocate_prefixes`` (the rule's reference): inside a budget of ``G - B``
draft rows, the (request, position) items of highest prefix survival (cumulative product of the
draft scores) go first; ties go to the shallower position, then the lower request, which keeps every
request's allocation a prefix. Static shapes, no ``.item()`` / ``nonzero()`` / branch on tensor
values: ``RoundRunner.execute`` runs it between the draft and the target part of a round that
carries a verify budget (``RoundPlan(verify_budget=G)``), on the current round's draft scores, and
the target part reads the result in place (``num_verify`` / ``nv32`` static inputs).

Survival is computed in float64 (float32 on NPU), like the numpy rule, so the device picks the
same items as the host rule applied to the collected (float32) scores.
"""

from __future__ import annotations

import torch


def allocate_prefixes_device(
    scores: torch.Tensor, num_requests: int, budget_rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``verify_tokens [bcap]`` (int64) for ``scores [bcap, k]``; rows ``>= num_requests`` get 0.

    Parameters
    ----------
    scores : draft probability of each selected token (any float dtype; NaN counts as 0).
    num_requests : real requests ``B`` (host-known); the rest of the ``bcap`` rows are padding.
    budget_rows : draft rows the target may verify (``G - B``), clipped to ``[0, B * k]``.
    out : optional ``[bcap]`` int64 buffer written in place (a graph's static input).
    """
    bcap, k = scores.shape
    dtype = torch.float32 if scores.device.type == "npu" else torch.float64
    s = torch.nan_to_num(scores.to(dtype), nan=0.0).clamp(0.0, 1.0).cumprod(dim=1)
    pad = torch.arange(bcap, device=scores.device) >= num_requests
    s = s.masked_fill(pad[:, None], -1.0)
    m = max(0, min(int(budget_rows), int(num_requests) * k))
    flat = s.t().reshape(-1)  # position-major: index i * bcap + b
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=scores.device)
    chosen = (rank < m).view(k, bcap)
    verify = chosen.sum(dim=0, dtype=torch.int64)
    if out is not None:
        out.copy_(verify)
        return out
    return verify
