"""The routed experts' op: :func:`fused_moe` (re-exported by ``speccal.kernels.ops``).

Capture-safe on the GPU (a static-size layout of the (row, expert) pairs sorted by expert,
``reference.moe_align_ref``; the Triton kernels of ``fused_moe.py`` or the reference over it);
on a CPU, ``backend="auto"`` gathers each active expert's rows after one host read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speccal.kernels import reference as ref
from speccal.kernels._backend import pdl_level, use_triton
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.op_checks import FLOATS as _FLOATS
from speccal.kernels.op_checks import INTS as _INTS
from speccal.kernels.op_checks import need as _need
from speccal.kernels.op_checks import shape_of as _shape
from speccal.kernels.precompile import dry_pass_active

#: pairs per block of the routed-expert layout (``fused_moe``): tl.dot's smallest M tile
MOE_BLOCK_M = 16


def fused_moe(
    x: torch.Tensor,  # [N, hidden]
    weights: torch.Tensor,  # [N, top_k]: routing weights (float32 or x's dtype)
    ids: torch.Tensor,  # [N, top_k] int: each row's experts, distinct within a row
    gate_up: torch.Tensor,  # [E, 2 I, hidden]: gate rows, then up rows
    down: torch.Tensor,  # [E, hidden, I]
    *,
    row_mask: torch.Tensor | None = None,  # [N] bool: rows that belong to requests (None: all)
    activated: torch.Tensor | None = None,  # [R, E] bool: ORed in place with the experts used
    block_m: int = MOE_BLOCK_M,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [N, hidden] x's dtype, counts [E] int64
    """Routed SwiGLU experts: ``out[n] = sum_j weights[n, j] * down_e(silu(gate_e(x[n])) *
    up_e(x[n]))`` over row ``n``'s experts ``e = ids[n, j]``, added in ascending expert order;
    ``counts``: the pairs each expert got (``> 0``: the experts this call activated).

    Capture-safe: the (row, expert) pairs are sorted by expert into a block-aligned layout of
    static worst-case size (``reference.moe_align_ref``, no host read), the experts run over
    its blocks (Triton: ``fused_moe.py``, gate/up in one pass, blocks of no expert exit before
    reading weights; reference: ``reference.fused_moe_ref``, batched products over each
    block's gathered expert weights), and each row's pair outputs are summed
    (``reference.moe_sum_slots_ref``). Expert ids are device values, not checked here. On a
    CPU, ``backend="auto"`` runs :func:`_moe_by_expert` (one host read; CPU rounds are never
    captured); ``reference`` forces the static layout there.

    ``row_mask``: rows outside it (a round's padding rows) choose no expert: their pairs go to a
    sentinel expert past the last, whose blocks read no weights, their output rows are zero and
    ``counts`` leaves them out, so what a round activates is its requests' experts, whatever
    stale tokens its padding rows carry.

    ``activated``: every row ORed in place with ``counts > 0`` (a module's per-call and per-round
    expert masks), inside the layout's launch on the Triton path.

    Launches on the Triton path, up to :data:`ALIGN_MAX_PAIRS` pairs (decode and verify rows):
    the layout, counts and masks in one (``fused_moe.moe_align_triton``), gate/up and down
    (``fused_moe_triton``), the ordered sum with the masked rows zeroed in one
    (``fused_moe.moe_sum_slots_triton``): four in all, where the torch layout and sum take about
    twenty. One row (a B = 1 decode) skips the layout launch: its distinct experts are its
    blocks as they are (``fused_moe_one_row_triton``; the same weight reads), three launches.
    More pairs (prefill chunks) take the torch layout.
    """
    _need(x.dim() == 2 and x.stride(1) == 1 and x.dtype in _FLOATS, "x", (_shape(x), x.dtype),
          "[N, hidden] float, hidden contiguous")
    n, hidden = x.shape
    _need(ids.dim() == 2 and ids.shape[0] == n and ids.dtype in _INTS, "ids",
          (_shape(ids), ids.dtype), f"[{n}, top_k] int")
    _need(_shape(weights) == _shape(ids) and weights.dtype in _FLOATS, "weights",
          (_shape(weights), weights.dtype), f"{_shape(ids)} float")
    _need(gate_up.dim() == 3 and gate_up.shape[2] == hidden and gate_up.shape[1] % 2 == 0,
          "gate_up.shape", _shape(gate_up), f"[E, 2 I, {hidden}]")
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    _need(_shape(down) == (num_experts, hidden, inter), "down.shape", _shape(down),
          f"[{num_experts}, {hidden}, {inter}]")
    _need(gate_up.dtype == down.dtype == x.dtype, "gate_up/down dtype", (gate_up.dtype,
          down.dtype), f"x's {x.dtype}")
    _need(gate_up.stride(2) == 1 and down.stride(2) == 1, "gate_up/down", "strided",
          "the last dimension contiguous")
    _need(block_m >= 1, "block_m", block_m, "an int >= 1")
    if row_mask is not None:
        _need(_shape(row_mask) == (n,) and row_mask.dtype == torch.bool, "row_mask",
              (_shape(row_mask), row_mask.dtype), f"[{n}] bool")
    if activated is not None:
        _need(activated.dim() == 2 and activated.shape[1] == num_experts
              and activated.dtype == torch.bool and activated.is_contiguous(), "activated",
              (_shape(activated), activated.dtype), f"[R, {num_experts}] bool, contiguous")
    if use_triton(x, backend or tune.backend) and ids.numel() <= ALIGN_MAX_PAIRS:
        _need(block_m >= 16 and not block_m & (block_m - 1), "block_m", block_m,
              "a power of two >= 16 (tl.dot's M tile)")
        return _experts_triton(x, weights, ids, gate_up, down, row_mask, activated, block_m,
                               tune, dry=dry_pass_active())
    out, counts = _experts(x, weights, _to_sentinel(ids, row_mask, num_experts), gate_up, down,
                           num_experts, block_m, backend, tune, sentinel=row_mask is not None)
    if row_mask is not None:
        out = torch.where(row_mask[:, None], out, 0)  # the sentinel pairs wrote nothing
    if activated is not None:
        activated |= (counts > 0)[None]
    return out, counts


#: the most (row, expert) pairs whose layout one program builds (``fused_moe.moe_align_triton``)
ALIGN_MAX_PAIRS = 8192


def _to_sentinel(ids: torch.Tensor, row_mask: torch.Tensor | None, num_experts: int
                 ) -> torch.Tensor:
    """``ids`` with the rows outside ``row_mask`` sent to the sentinel expert ``num_experts``."""
    return ids if row_mask is None else torch.where(row_mask[:, None], ids, num_experts)


def _experts_triton(x, weights, ids, gate_up, down, row_mask, activated, block_m, tune, *,
                    dry: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_moe`'s Triton path: four launches (see its docstring). ``dry``: the
    precompile dry pass, where a launch is skipped only while its kernel still compiles, so
    the expert kernels index by the reference layout, never by a skipped layout launch's
    empty buffers (an illegal address); the output is zeros (the dry pass's rule for
    activations), the counts real, the masks untouched."""
    from speccal.kernels.fused_moe import (
        fused_moe_one_row_triton,
        fused_moe_triton,
        moe_align_triton,
        moe_sum_slots_triton,
    )

    pdl = pdl_level(x, tune) > 0
    num_experts = gate_up.shape[0]
    prec = tune.precision.fp32_dot if x.dtype == torch.float32 else None
    if ids.shape[0] == 1 and not dry:  # one decode row: no layout launch (three in all)
        pair_out, counts = fused_moe_one_row_triton(x, weights.contiguous(), ids, row_mask,
                                                    activated, gate_up, down, block_m, prec,
                                                    pdl=pdl)
        return moe_sum_slots_triton(pair_out, ids, row_mask, pdl=pdl), counts
    pairs, blocks, counts = moe_align_triton(ids, num_experts, block_m, row_mask,
                                             None if dry else activated, pdl=pdl)
    if dry:
        pairs, blocks, counts = ref.moe_align_ref(_to_sentinel(ids, row_mask, num_experts),
                                                  num_experts, block_m,
                                                  sentinel=row_mask is not None)
    pair_out = fused_moe_triton(x, weights.contiguous(), gate_up, down, pairs, blocks, prec,
                                pdl=pdl)
    out = moe_sum_slots_triton(pair_out, ids, row_mask, pdl=pdl)  # reads values only
    return (torch.zeros_like(x) if dry else out), counts


def _experts(x, weights, ids, gate_up, down, num_experts, block_m, backend, tune, *,
             sentinel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_moe` after its checks; ``sentinel``: ``ids`` may hold ``num_experts``."""
    chosen = backend or tune.backend
    if chosen == "auto" and not use_triton(x, chosen) and x.device.type == "cpu":
        return _moe_by_expert(x, weights, ids, gate_up, down)
    pairs, blocks, counts = ref.moe_align_ref(ids, num_experts, block_m, sentinel=sentinel)
    if use_triton(x, chosen):
        from speccal.kernels.fused_moe import fused_moe_triton

        _need(block_m >= 16 and not block_m & (block_m - 1), "block_m", block_m,
              "a power of two >= 16 (tl.dot's M tile)")
        prec = tune.precision.fp32_dot if x.dtype == torch.float32 else None
        pair_out = fused_moe_triton(x, weights.contiguous(), gate_up, down, pairs, blocks, prec,
                                    pdl=pdl_level(x, tune) > 0)
        if dry_pass_active():  # skipped launches: a finite stand-in, not the reference
            pair_out.zero_()
    else:
        pair_out = ref.fused_moe_ref(x, weights, gate_up, down, pairs, blocks)
    return ref.moe_sum_slots_ref(pair_out, ids), counts


def _moe_by_expert(x, weights, ids, gate_up, down):  # shapes as fused_moe -> (out, counts)
    """:func:`fused_moe` on a CPU with ``backend="auto"``: each active expert's rows gathered
    after one host read of the per-expert counts (a CPU round is never captured), its products
    on exactly those rows, the results added into the output in ascending expert order. The
    same roundings and order as the reference (the tests compare them); what a CPU round runs
    instead of the reference's per-block weight gathers (which copy an expert's weights per
    block: many times slower at real widths)."""
    k, inter, num_experts = ids.shape[1], down.shape[2], gate_up.shape[0]
    flat = ids.reshape(-1)
    # [E] int64 (a sentinel expert E, where fused_moe masked rows, is counted, then dropped)
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)  # [N k]: by expert, rows ascending within
    w = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts[:num_experts].tolist()):  # the one host read
        if c:
            pick = order[start:start + c]
            rows = pick // k
            h = x[rows] @ gate_up[e].t()  # [c, 2 I] in x's dtype
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].t()
            out.index_add_(0, rows, (y * w[pick, None]).to(x.dtype))
            start += c
    return out, counts[:num_experts]


def moe_route(
    logits: torch.Tensor,  # [N, E]: the router's (x's dtype for softmax, float32 for sigmoid)
    bias: torch.Tensor | None,  # [E] float32: the sigmoid selection bias (None: no bias)
    top_k: int,
    scoring: str,  # softmax | sigmoid
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    normalise: bool = False,
    scale: float = 1.0,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, top_k], ids [N, top_k] int64
    """The routers' selection rule after their product (``reference.moe_route_ref`` says what
    it computes). Triton, for decode / verify rows (up to :data:`ROUTE_MAX_ROWS`) where the
    expert count is at most 1,024 and groups divide a power-of-two expert count: one launch,
    one program a row (the top-k by repeated arg-max, ties to the lower expert id), where the
    torch rule takes four launches (softmax) to a dozen (grouped sigmoid). Otherwise the
    reference."""
    _need(logits.dim() == 2 and logits.dtype in _FLOATS and logits.stride(1) == 1, "logits",
          (_shape(logits), logits.dtype), "[N, E] float, contiguous rows")
    n, num_experts = logits.shape
    _need(scoring in ("softmax", "sigmoid"), "scoring", scoring, "softmax or sigmoid")
    _need(1 <= top_k <= num_experts, "top_k", top_k, f"in 1 .. {num_experts}")
    _need(num_groups >= 1 and num_experts % num_groups == 0, "num_groups", num_groups,
          f"a divisor of {num_experts}")
    _need(1 <= topk_groups <= num_groups, "topk_groups", topk_groups, f"in 1 .. {num_groups}")
    if bias is not None:
        _need(_shape(bias) == (num_experts,), "bias", _shape(bias), f"[{num_experts}]")
    args = (logits, bias, top_k, scoring, num_groups, topk_groups, normalise, scale)
    grouped_ok = num_groups == 1 or (scoring == "sigmoid"
                                     and num_experts & (num_experts - 1) == 0)
    if (use_triton(logits, backend or tune.backend) and n <= ROUTE_MAX_ROWS
            and num_experts <= 1024 and grouped_ok):
        from speccal.kernels.fused_moe import moe_route_triton

        got = moe_route_triton(*args, pdl=pdl_level(logits, tune) > 0)
        if not dry_pass_active():  # skipped launches: the reference gives the values
            return got
    return ref.moe_route_ref(*args)


#: the most rows the Triton router takes (a program a row; prefill chunks take torch's)
ROUTE_MAX_ROWS = 4096
