"""Dispatcher of ``speccal.kernels``: validates shapes, then runs Triton or the reference.

Owns the public API the runner calls. Each op checks shapes and dtypes on the host (static
facts only: no device value is read, so every op is CUDA-graph capturable), then runs the Triton
kernel when ``_backend.use_triton`` says so (CUDA tensor and triton importable) and the pure-torch
reference in ``reference`` otherwise. The routed experts' op lives in ``ops_moe``, the gated
delta-net ops in ``ops_linear``, their shared checks in ``op_checks``; all are re-exported here.
Every op takes the caller's ``tune`` (a :class:`~speccal.kernels.config.KernelConfig`: backend,
PDL, tiles, fusion, fp32 dot precision); ``backend="reference"``/``"triton"`` overrides its
backend. The Triton kernel modules are imported inside the ops that launch them, so this module
(and the CPU paths) import without triton. Layouts are those of ``reference`` (KV cache
``[num_blocks, block_size, KVH, D]``, block table ``[B, max_blocks] int32``, ``seq_lens [B]
int32``, packed verify rows padded to ``G``).

Typical verify round, all inside the captured target graph::

    verify_token_update(ext_tokens, drafts, verify_lens, input_ids, base_index=pending)  # [G]
    verify_metadata_update(verify_lens, ctx_lens, block_table, bs, positions, slots, seq_lens, cu,
                           k_max, max_cu=G)
    attention_tiling_update(seq_lens, num_splits, split_len, plan)
    h, normed = embed_rms_norm(input_ids, embed_weight, layer0_norm_weight, eps)
    ... per layer: linear, paged_attention(..., cu_q_lens=cu, tiling=(num_splits, split_len),
        plan=plan, rope=...), linear(residual=h), rms_norm, linear, linear(norm=next) ...
        (a routed layer's MLP: fused_moe(normed, weights, ids, gate_up, down), no host read)
    partials = linear_argmax(normed, lm_head_weight)       # (tile_max [G, T], tile_idx [G, T])
    verify_accept(partials, grid_rows, drafts, num_verify, slots, hidden, ext_tokens, ext_hidden)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccal.kernels import reference as ref
from speccal.kernels._backend import num_sms, pdl_level, use_triton
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.gemv_config import (
    GemvConfig,
    argmax_tile_width,
    deferred_norm_tiles,
)
from speccal.kernels.op_checks import FLOATS as _FLOATS
from speccal.kernels.op_checks import INTS as _INTS
from speccal.kernels.op_checks import check_int as _check_int
from speccal.kernels.op_checks import check_qk_norm, check_slot_layout
from speccal.kernels.op_checks import need as _need
from speccal.kernels.op_checks import shape_of as _shape
from speccal.kernels.ops_attention import (  # noqa: F401 (re-exported)
    FOLD_MAX_MERGE,
    FOLD_MAX_PROGRAMS_PER_SM,
    SPREAD_MAX_PROGRAMS_PER_SM,
    VERIFY_MAX_SPLITS,
    VERIFY_STAGES,
    VERIFY_WIDE_PAIRS,
    VERIFY_WIDE_TILE,
    AttnSignal,
    SplitPlan,
    attention_signal,
    attention_tiling_update,
    fold_wanted,
    mla_latent_attention,
    mla_rope_cache,
    mla_rows_aligned,
    paged_attention,
    plan_splits,
    residual_panel,
    spread_wanted,
)
from speccal.kernels.ops_linear import (
    conv_update,
    delta_rule_verify,
    gated_decay,
    rmsnorm_gated,
)
from speccal.kernels.ops_moe import MOE_BLOCK_M, fused_moe, moe_route  # noqa: F401 (re-exported)
from speccal.kernels.precompile import dry_pass_active

__all__ = [
    "ArgmaxKeys",
    "AttnSignal",
    "DeferredNorm",
    "SplitPlan",
    "argmax_tile_width",
    "attention_signal",
    "attention_tiling_update",
    "conv_update",
    "delta_rule_verify",
    "embed_rms_norm",
    "fold_wanted",
    "fused_moe",
    "gated_decay",
    "spread_wanted",
    "linear",
    "linear_argmax",
    "linear_deferred_norm",
    "paged_attention",
    "plan_splits",
    "residual_panel",
    "rms_norm",
    "rmsnorm_gated",
    "rotary_kv_write",
    "verify_accept",
    "verify_metadata_update",
    "verify_token_update",
]



@dataclass(frozen=True)
class ArgmaxKeys:
    """Each row's argmax as one packed 64-bit key (``linear_argmax(keys=...)``,
    ``reference.argmax_keys_ref`` for the layout), for ``verify_accept``. ``keys [G]`` int64
    holds the unsigned keys' bits; the buffer must be zero before the LM head folds into it
    (``verify_metadata_update(argmax_keys=...)`` zeroes it at the start of a round)."""

    keys: torch.Tensor

    def tokens(self) -> torch.Tensor:  # [G] int64
        """The rows' argmax columns (``reference.unpack_argmax_keys_ref``)."""
        return ref.unpack_argmax_keys_ref(self.keys)


def _check_matmul(x: torch.Tensor, weight: torch.Tensor) -> None:
    """``x [M, K]`` and ``weight [N, K]`` of one float dtype, K contiguous (the skinny GEMM ops)."""
    _need(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x/weight shapes",
          (_shape(x), _shape(weight)), "[M, K] and [N, K]")
    _need(x.dtype in _FLOATS and weight.dtype == x.dtype, "x/weight dtype", (x.dtype, weight.dtype),
          "the same float dtype")
    _need(x.stride(1) == 1 and weight.stride(1) == 1, "x/weight", "strided", "K contiguous")


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------


def verify_token_update(
    base_tokens: torch.Tensor,  # [B] int ([...] int, contiguous, with base_index)
    draft_tokens: torch.Tensor,  # [B, k_max] int
    verify_lens: torch.Tensor,  # [B] int32
    input_ids: torch.Tensor,  # [G] int, written
    pad_id: int = -1,
    *,
    base_index: torch.Tensor | None = None,  # [B] int: flat index into base_tokens
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # input_ids
    """Write base token + first ``verify_lens[b]`` drafts of each request into ``input_ids``.

    Packed rows (``reference`` module docstring); padding rows get ``pad_id``. ``verify_lens``
    is clamped to ``[0, k_max]`` on device; the host must pick ``G >= sum(verify_lens + 1)``.
    ``base_index``: the base tokens are ``base_tokens.view(-1)[base_index]``, gathered inside
    the same launch (``base_tokens`` is then any contiguous int tensor, e.g. the runner's
    ``ext_tokens [slots, w + 1]``; the indices must lie in ``[0, base_tokens.numel())``, a
    device fact not checked here).
    """
    _need(draft_tokens.dim() == 2, "draft_tokens.shape", _shape(draft_tokens), "[B, k_max]")
    batch = draft_tokens.shape[0]
    _need(batch >= 1, "draft_tokens.shape", _shape(draft_tokens), "B >= 1")
    if base_index is None:
        _check_int(base_tokens, "base_tokens", (batch,))
    else:
        _check_int(base_index, "base_index", (batch,))
        _check_int(base_tokens, "base_tokens", _shape(base_tokens))
        _need(base_tokens.is_contiguous() and base_tokens.numel() >= 1, "base_tokens",
              (_shape(base_tokens), "contiguous" if base_tokens.is_contiguous() else "strided"),
              "a contiguous, non-empty int tensor (base_index indexes it flat)")
    _check_int(draft_tokens, "draft_tokens", _shape(draft_tokens))
    _check_int(verify_lens, "verify_lens", (batch,))
    _need(input_ids.dim() == 1 and input_ids.dtype in _INTS and input_ids.is_contiguous(),
          "input_ids", (_shape(input_ids), input_ids.dtype), "a contiguous [G] int tensor")
    _need(draft_tokens.stride(1) == 1 or draft_tokens.shape[1] <= 1, "draft_tokens", "strided",
          "last dim contiguous")
    if use_triton(input_ids, backend or tune.backend):
        from speccal.kernels.verify_tokens import verify_token_update_triton

        res = verify_token_update_triton(base_tokens, draft_tokens, verify_lens, input_ids,
                                         pad_id, base_index)
        if not dry_pass_active():
            return res
    return ref.verify_token_update_ref(base_tokens, draft_tokens, verify_lens, input_ids, pad_id,
                                       base_index)


def verify_accept(
    row_tokens,  # [G] int: argmax of each packed row, or (tile_max [G, T], tile_idx [G, T])
    grid_rows: torch.Tensor,  # [B * (k + 1)] int: packed row of each grid cell
    draft_tokens: torch.Tensor,  # [B, k] int (k may be 0: a plain decode step)
    num_verify: torch.Tensor,  # [B] int
    slot_index: torch.Tensor,  # [B] int
    hidden: torch.Tensor,  # [G, H]
    ext_tokens: torch.Tensor,  # [slots, W >= k + 1] int64, written
    ext_hidden: torch.Tensor,  # [slots, W, H], written
    *,
    greedy: bool = True,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, tokens [B, k + 1] int64
    """Greedy (or forced) acceptance from the packed rows' argmax plus the next round's slot
    state, in one launch on Triton (``reference.verify_accept_ref`` for the semantics).

    ``row_tokens`` is the rows' argmax, ``linear_argmax``'s per-tile partials ``(tile_max
    [G, T] float32, tile_idx [G, T] int32)``, both contiguous, or its packed keys
    (``ArgmaxKeys``); the Triton kernel then reduces the partials of the rows its request needs
    (largest max, NaN first, ties to the first tile, i.e. ``torch.argmax``'s answer), the
    reference reduces them with ``reference.reduce_argmax_partials_ref`` first; keys hold
    whole rows already.
    """
    _need(draft_tokens.dim() == 2, "draft_tokens.shape", _shape(draft_tokens), "[B, k]")
    batch, k = draft_tokens.shape
    _need(batch >= 1, "draft_tokens.shape", _shape(draft_tokens), "B >= 1")
    _check_int(draft_tokens, "draft_tokens", (batch, k))
    _need(k == 0 or draft_tokens.stride(1) == 1, "draft_tokens", "strided", "last dim contiguous")
    _need(hidden.dim() == 2 and hidden.stride(1) == 1, "hidden", _shape(hidden),
          "[G, H] with H contiguous")
    g, h = hidden.shape
    partials = isinstance(row_tokens, tuple)
    if partials:
        _check_partials(row_tokens, g)
    elif isinstance(row_tokens, ArgmaxKeys):
        _check_keys(row_tokens.keys, g, "row_tokens.keys")
    else:
        _check_int(row_tokens, "row_tokens", (g,))
    _check_int(grid_rows, "grid_rows", (batch * (k + 1),))
    _need(grid_rows.is_contiguous(), "grid_rows", "strided", "contiguous")
    _check_int(num_verify, "num_verify", (batch,))
    _check_int(slot_index, "slot_index", (batch,))
    _need(ext_tokens.dim() == 2 and ext_tokens.shape[1] >= k + 1
          and ext_tokens.dtype == torch.int64 and ext_tokens.stride(1) == 1, "ext_tokens",
          (_shape(ext_tokens), ext_tokens.dtype), f"[slots, >= {k + 1}] int64, contiguous rows")
    _need(ext_hidden.dim() == 3 and ext_hidden.shape[0] == ext_tokens.shape[0]
          and ext_hidden.shape[1] >= k + 1 and ext_hidden.shape[2] == h
          and ext_hidden.dtype == hidden.dtype and ext_hidden.stride(2) == 1, "ext_hidden",
          (_shape(ext_hidden), ext_hidden.dtype),
          f"[{ext_tokens.shape[0]}, >= {k + 1}, {h}] {hidden.dtype}, H contiguous")
    if use_triton(hidden, backend or tune.backend):
        from speccal.kernels.verify_accept import verify_accept_triton

        res = verify_accept_triton(row_tokens, grid_rows, draft_tokens, num_verify, slot_index,
                                   hidden, ext_tokens, ext_hidden, greedy,
                                   pdl_level(hidden, tune) > 0)
        if not dry_pass_active():
            return res
    if partials:
        row_tokens = ref.reduce_argmax_partials_ref(*row_tokens)
    elif isinstance(row_tokens, ArgmaxKeys):
        row_tokens = row_tokens.tokens()
    return ref.verify_accept_ref(row_tokens, grid_rows, draft_tokens, num_verify, slot_index,
                                 hidden, ext_tokens, ext_hidden, greedy)


def _check_keys(keys, g: int, field: str) -> None:
    """``keys [g]`` int64, contiguous (an ``ArgmaxKeys`` buffer)."""
    _need(isinstance(keys, torch.Tensor), field, type(keys).__name__, "a torch.Tensor")
    _need(_shape(keys) == (g,) and keys.dtype == torch.int64 and keys.is_contiguous(), field,
          (_shape(keys), keys.dtype), f"[{g}] int64, contiguous")


def _check_partials(partials: tuple, g: int) -> None:
    """``(tile_max [g, T] float32, tile_idx [g, T] int32)``, contiguous, T >= 1."""
    _need(len(partials) == 2, "row_tokens", f"a tuple of {len(partials)}",
          "(tile_max [G, T], tile_idx [G, T]) or a [G] int tensor")
    tile_max, tile_idx = partials
    field = "row_tokens[0] (tile_max)"
    _need(isinstance(tile_max, torch.Tensor), field, type(tile_max).__name__, "a torch.Tensor")
    _need(tile_max.dim() == 2 and tile_max.shape[0] == g and tile_max.shape[1] >= 1,
          f"{field}.shape", _shape(tile_max), f"[{g}, T], T >= 1")
    _need(tile_max.dtype == torch.float32, f"{field}.dtype", tile_max.dtype, "torch.float32")
    _check_int(tile_idx, "row_tokens[1] (tile_idx)", _shape(tile_max), (torch.int32,))
    _need(tile_max.is_contiguous() and tile_idx.is_contiguous(), "row_tokens", "strided",
          "contiguous tile_max and tile_idx")


def verify_metadata_update(
    verify_lens: torch.Tensor,  # [B] int32
    context_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    positions: torch.Tensor,  # [G] int64, written
    slot_mapping: torch.Tensor,  # [G] int64, written
    seq_lens: torch.Tensor,  # [B] int32, written
    cu_q_lens: torch.Tensor,  # [B + 1] int32, written
    k_max: int,
    *,
    grid_rows: torch.Tensor | None = None,  # [B * (k_max + 1)] int64, written
    max_cu: int | None = None,
    argmax_keys: torch.Tensor | None = None,  # [G] int64, zeroed
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> None:
    """Positions, slot mapping (padding -> slot 0), ``seq_lens`` and ``cu_q_lens`` on device;
    with ``grid_rows`` also each ``[B, k_max + 1]`` grid cell's packed row (clamped to G - 1),
    so the verify step gathers its per-row results without more launches. ``max_cu``: each
    ``cu_q_lens`` entry is at most this (``cu_q_lens.clamp_(max=max_cu)`` in the same launch;
    ``G`` gives padding requests past the ``G`` rows no rows). ``argmax_keys``: zeroed in the
    same launch, ready for this round's LM head to fold its argmax into (``ArgmaxKeys``)."""
    _need(verify_lens.dim() == 1 and verify_lens.shape[0] >= 1, "verify_lens.shape",
          _shape(verify_lens), "[B], B >= 1")
    batch = verify_lens.shape[0]
    _check_int(verify_lens, "verify_lens", (batch,))
    _check_int(context_lens, "context_lens", (batch,))
    _need(block_table.dim() == 2 and block_table.shape[0] == batch, "block_table.shape",
          _shape(block_table), f"[{batch}, max_blocks]")
    _check_int(block_table, "block_table", _shape(block_table), (torch.int32,))
    _need(isinstance(block_size, int) and block_size >= 1, "block_size", block_size, "an int >= 1")
    _need(isinstance(k_max, int) and k_max >= 0, "k_max", k_max, "an int >= 0")
    _need(max_cu is None or (isinstance(max_cu, int) and 0 <= max_cu < 2**31), "max_cu",
          max_cu, "None or an int in [0, 2**31)")
    g = positions.shape[0] if positions.dim() == 1 else -1
    _need(g >= 1, "positions.shape", _shape(positions), "[G], G >= 1")
    _check_int(positions, "positions", (g,), (torch.int64,))
    _check_int(slot_mapping, "slot_mapping", (g,), (torch.int64,))
    _check_int(seq_lens, "seq_lens", (batch,), (torch.int32,))
    _check_int(cu_q_lens, "cu_q_lens", (batch + 1,), (torch.int32,))
    outs = [("positions", positions), ("slot_mapping", slot_mapping), ("seq_lens", seq_lens),
            ("cu_q_lens", cu_q_lens)]
    if grid_rows is not None:
        _check_int(grid_rows, "grid_rows", (batch * (k_max + 1),), (torch.int64,))
        outs.append(("grid_rows", grid_rows))
    if argmax_keys is not None:
        _check_keys(argmax_keys, g, "argmax_keys")
    for name, t in outs:
        _need(t.is_contiguous(), name, "non-contiguous", "contiguous")
    if use_triton(positions, backend or tune.backend):
        from speccal.kernels.verify_metadata import verify_metadata_update_triton

        verify_metadata_update_triton(verify_lens, context_lens, block_table, block_size,
                                      positions, slot_mapping, seq_lens, cu_q_lens, k_max,
                                      grid_rows, max_cu, pdl=pdl_level(seq_lens, tune) > 0,
                                      argmax_keys=argmax_keys)
        if not dry_pass_active():
            return
    ref.verify_metadata_update_ref(verify_lens, context_lens, block_table, block_size, positions,
                                   slot_mapping, seq_lens, cu_q_lens, k_max, grid_rows, max_cu)
    if argmax_keys is not None:
        argmax_keys.zero_()


# ---------------------------------------------------------------------------------------------


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    *,
    out: torch.Tensor | None = None,  # [M, N] ([M, N / 2] for epilogue "silu_mul")
    config=None,  # gemv.GemvConfig | None
    epilogue: str | None = None,  # None | "silu_mul"
    residual: torch.Tensor | None = None,  # [M, N]: residual += result, returned
    norm: tuple | None = None,  # (weight [N], eps, out [M, N]), with residual only
    residual_settled: bool = False,
    row_scale: DeferredNorm | None = None,  # x is row_scale.xw: the product of the normed rows
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T`` for small M (decode/verify rows): split-K Triton GEMV on CUDA.

    ``row_scale`` (a ``DeferredNorm`` from ``linear_deferred_norm``, whose ``xw`` is ``x``):
    each row of the product is scaled by ``rsqrt(sum(ss[m]) / K + eps)`` before the epilogue,
    which gives the product of the RMSNorm'd rows without a norm launch.

    ``epilogue="silu_mul"``: the weight's rows interleave ``(gate_i, up_i)`` and the result is
    ``silu(gate) * up`` ``[M, N / 2]`` (SwiGLU in the GEMV's epilogue). ``residual``: the
    product is added into that tensor in place, which is returned (in the GEMV's epilogue at
    split 1, in the split-K reduce otherwise). SwiGLU runs split 1. ``norm``: also writes
    ``out = rms_norm(residual) * weight`` of the updated residual (the next layer's normed
    input; in the split-K reduce on Triton, no extra launch). ``residual_settled``: the caller
    vouches that the kernel launched just before this op does not write ``residual``, so under
    PDL the GEMV may read it before its wait (the fused layer's o projection: its residual was
    last written three launches earlier).
    """
    _need(epilogue in (None, "silu_mul"), "epilogue", epilogue, "None or 'silu_mul'")
    _check_matmul(x, weight)
    m, n = x.shape[0], weight.shape[0]
    n_out = n
    if epilogue == "silu_mul":
        _need(n % 2 == 0, "weight.shape", _shape(weight), "an even N (interleaved gate/up rows)")
        _need(residual is None, "residual", "given", "None with epilogue 'silu_mul'")
        n_out = n // 2
    if out is not None:
        _need(residual is None, "out", "given", "None when residual is given (it is the output)")
        _need(_shape(out) == (m, n_out) and out.dtype == x.dtype and out.stride(1) == 1, "out",
              (_shape(out), out.dtype), f"[{m}, {n_out}] {x.dtype}, N contiguous")
    if residual is not None:
        _need(_shape(residual) == (m, n) and residual.dtype == x.dtype
              and residual.stride(1) == 1, "residual", (_shape(residual), residual.dtype),
              f"[{m}, {n}] {x.dtype}, N contiguous")
    if norm is not None:
        _need(residual is not None, "norm", "given", "a residual to normalise (residual=...)")
        _need(isinstance(norm, tuple) and len(norm) == 3, "norm", type(norm).__name__,
              "a (weight, eps, out) tuple")
        nw, eps, xn = norm
        _need(_shape(nw) == (n,), "norm[0] (weight).shape", _shape(nw), f"[{n}]")
        _need(eps > 0, "norm[1] (eps)", eps, "> 0")
        _need(_shape(xn) == (m, n) and xn.dtype == x.dtype and xn.stride(1) == 1,
              "norm[2] (out)", (_shape(xn), xn.dtype), f"[{m}, {n}] {x.dtype}, N contiguous")
    scale = None
    if row_scale is not None:
        _need(isinstance(row_scale, DeferredNorm), "row_scale", type(row_scale).__name__,
              "a DeferredNorm (linear_deferred_norm)")
        _need(residual is None and norm is None, "row_scale", "with residual/norm",
              "no residual and no norm")
        ss = row_scale.ss
        _need(ss.dim() == 2 and ss.shape[0] == m and ss.dtype == torch.float32
              and ss.is_contiguous(), "row_scale.ss", (_shape(ss), ss.dtype),
              f"[{m}, P] float32, contiguous")
        scale = (ss, row_scale.eps)
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.gemv import linear_triton

        res = linear_triton(x, weight, out=out, config=config, epilogue=epilogue,
                            residual=residual, pdl=pdl_level(x, tune), norm=norm,
                            prefetch=tune.gemv.prefetch_tiles,
                            residual_settled=residual_settled and tune.prewait,
                            row_scale=scale, tune=tune)
        if not dry_pass_active():
            return res
        return _dry_gemv(res, residual, norm)
    rs = None
    if scale is not None:
        rs = torch.rsqrt(scale[0].sum(1) / x.shape[1] + scale[1])
    res = ref.linear_ref(x, weight, epilogue, residual, row_scale=rs)
    if norm is not None:
        norm[2].copy_(ref.rms_norm_ref(res, norm[0], norm[1]))
    return res if out is None else out.copy_(res)


def _dry_gemv(res: torch.Tensor, residual: torch.Tensor | None, norm: tuple | None) -> torch.Tensor:
    """What a GEMV returns in ``precompile``'s dry pass once its launch was skipped: finite
    values of the right shapes (zeros; a residual keeps its values), not the reference. The
    dry pass only needs shapes and valid indices downstream; the fp32 references (every weight
    cast to fp32 per call, attention over whole block tables) made it cost seconds per graph
    set. Index-producing ops (metadata, acceptance, tiling) still run their references."""
    if norm is not None:
        norm[2].zero_()
    return residual if residual is not None else res.zero_()


# argmax key of a row whose every logit is 0: value 0.0, column 0 (``reference.argmax_keys_ref``)
_ZERO_ROW_KEY = int(ref.argmax_keys_ref(torch.zeros(1, 1))[0])


@dataclass(frozen=True)
class DeferredNorm:
    """An RMSNorm left to the GEMV that consumes it (``linear_deferred_norm``).

    ``xw [M, N]``: the residual ``h`` times the norm weight, rounded to ``h``'s dtype; ``ss [M, P]``
    fp32: sums of ``h^2`` over ``P`` column tiles of ``h``. ``linear(xw, w, row_scale=this)`` is
    ``linear(rms_norm(h, weight, eps), w)`` up to where the rounding falls (the row factor
    ``rsqrt(mean(h^2) + eps)`` multiplies the fp32 product instead of the bf16 input)."""

    xw: torch.Tensor
    ss: torch.Tensor
    eps: float


def linear_deferred_norm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N]: residual += x @ weight.T, in place
    norm_weight: torch.Tensor,  # [N]
    eps: float,
    *,
    residual_settled: bool = False,
    after: AttnSignal | None = None,  # the attention launch that wrote x (attention_signal)
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> DeferredNorm:
    """``residual += x @ weight.T``, then the RMSNorm of the updated residual left to its
    consumer: the GEMV's epilogue writes ``xw = residual * norm_weight`` and per-tile sums of
    squares, and ``linear(xw, w2, row_scale=...)`` applies the row factor (the fused layer's
    o projection -> post-attention norm -> gate/up: one launch fewer per layer). Where the
    GEMV's config splits K, the last program of each column tile sums the split partials
    (arrival counters, no reduce launch): the fused layer's down projection -> next layer's
    input norm -> QKV. Without counters (a graph capture before any eager call) or off
    Triton the pieces come from torch after the add.
    ``residual_settled``: as in ``linear``. ``after``: the ``AttnSignal`` that the attention
    launch writing ``x`` armed; the register panel polls it instead of its PDL wait (an unarmed
    or absent signal: the wait).
    """
    _check_matmul(x, weight)
    _need(after is None or isinstance(after, AttnSignal), "after", type(after).__name__,
          "None or an AttnSignal")
    (m, k), n = x.shape, weight.shape[0]
    _need(isinstance(residual, torch.Tensor) and _shape(residual) == (m, n)
          and residual.dtype == x.dtype and residual.is_contiguous(), "residual",
          (_shape(residual), getattr(residual, "dtype", None)), f"[{m}, {n}] {x.dtype}, contiguous")
    _need(_shape(norm_weight) == (n,) and norm_weight.dtype == x.dtype, "norm_weight",
          (_shape(norm_weight), norm_weight.dtype), f"[{n}] {x.dtype}")
    _need(isinstance(eps, float) and eps > 0, "eps", eps, "a float > 0")
    tiles, folded = deferred_norm_tiles(m, n, k, num_sms(x.device), x.element_size(),
                                        tune.gemv)
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.gemv import fold_counters, linear_triton

        if folded and fold_counters(x.device, tiles) is None:  # a capture before any eager run
            tiles = None
    else:
        tiles = None
    if tiles is not None:
        xw = torch.empty_like(residual)
        ss = torch.empty(m, tiles, dtype=torch.float32, device=x.device)
        linear_triton(x, weight, residual=residual, pdl=pdl_level(x, tune),
                      prefetch=tune.gemv.prefetch_tiles,
                      residual_settled=residual_settled and tune.prewait,
                      defer=(norm_weight, xw, ss), after=after, tune=tune)
        if not dry_pass_active():
            return DeferredNorm(xw, ss, eps)
        if after is not None and after.target:  # as below: the counters' state in order
            after.counters.zero_()
        return DeferredNorm(_dry_gemv(xw, None, None), ss.zero_(), eps)
    if after is not None and after.target:  # counted by attention, not polled: zero it (in order)
        after.counters.zero_()
    linear(x, weight, residual=residual, residual_settled=residual_settled, backend=backend,
           tune=tune)
    hf = residual.float()
    ss = hf.pow(2).sum(1, keepdim=True)
    if tiles is not None:  # the dry pass: the sums in the kernel's layout, for its consumer
        ss = torch.cat([ss, ss.new_zeros(m, tiles - 1)], dim=1)
    return DeferredNorm((hf * norm_weight.float()).to(residual.dtype), ss, eps)


def linear_argmax(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    *,
    config: GemvConfig | None = None,  # split_k 1; None: pick_config(..., epilogue="argmax")
    keys: torch.Tensor | None = None,  # [M] int64 holding zeros: whole-row keys instead
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor] | ArgmaxKeys:  # (tile_max [M, T], tile_idx [M, T])
    """Per-tile argmax partials of ``x @ weight.T`` (the LM head of argmax-only rounds).

    With ``keys`` (zeros on entry: ``verify_metadata_update(argmax_keys=...)``): each row's
    whole argmax instead, one packed 64-bit key per row that every column tile folds in by an
    unsigned atomic max (``reference.argmax_keys_ref``; returned as ``ArgmaxKeys``), so the
    consumer reads one key per row instead of ``T`` partials.

    The logits are never written: on Triton the GEMV's ``ARGMAX`` epilogue stores, per row and
    column tile of ``width = argmax_tile_width(M, N, K, num_sms, config)`` columns, the tile's
    max logit (rounded to ``x``'s dtype, as ``linear`` would store it) and its first column;
    ``T = cdiv(N, width)``. The reference computes the same from ``linear``'s output. A NaN
    logit beats every number (``torch.argmax``'s rule), so ``verify_accept`` (or
    ``reference.reduce_argmax_partials_ref``) turns the partials into ``argmax(dim=-1)`` of the
    logits ``linear`` would return.
    """
    _check_matmul(x, weight)
    _need(x.shape[0] >= 1 and weight.shape[0] >= 1, "x/weight shapes",
          (_shape(x), _shape(weight)), "M >= 1 and N >= 1")
    _need(config is None or isinstance(config, GemvConfig), "config", type(config).__name__,
          "a GemvConfig or None")
    _need(config is None or config.split_k == 1, "config.split_k",
          getattr(config, "split_k", None), "1 (the argmax epilogue needs whole dot products)")
    (m, k), n = x.shape, weight.shape[0]
    if keys is not None:
        _check_keys(keys, m, "keys")
        _need(keys.device == x.device, "keys.device", keys.device, str(x.device))
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.gemv import linear_argmax_triton

        out = linear_argmax_triton(x, weight, config, pdl=pdl_level(x, tune),
                                   prefetch=tune.gemv.prefetch_tiles, keys=keys, tune=tune)
        if not dry_pass_active():
            return out if keys is None else ArgmaxKeys(keys)
        if keys is not None:  # dry pass: every row's argmax is column 0 (a valid token)
            keys.fill_(_ZERO_ROW_KEY)
            return ArgmaxKeys(keys)
        return tuple(t.zero_() for t in out)  # tile max 0 at column 0 in every tile
    if keys is not None:  # the keys' unsigned max with what they hold (zeros: the keys)
        new = ref.argmax_keys_ref(ref.linear_ref(x, weight))
        flip = -(1 << 63)  # unsigned order = signed order with the sign bit flipped
        keys.copy_(torch.maximum(keys ^ flip, new ^ flip) ^ flip)
        return ArgmaxKeys(keys)
    width = argmax_tile_width(m, n, k, num_sms(x.device), config, tune.gemv)
    return ref.linear_argmax_ref(x, weight, width)


def rms_norm(
    x: torch.Tensor,  # [M, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    *,
    residual: torch.Tensor | None = None,  # [M, N], becomes x + residual (in place)
    out: torch.Tensor | None = None,  # [M, N]
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [M, N]
    """RMSNorm (fp32 math); with ``residual``: ``residual += x`` then norm of that sum."""
    _need(x.dim() == 2 and x.stride(1) == 1, "x", _shape(x), "[M, N], N contiguous")
    _need(_shape(weight) == (x.shape[1],), "weight.shape", _shape(weight), f"[{x.shape[1]}]")
    _need(x.dtype in _FLOATS, "x.dtype", x.dtype, "a float dtype")
    _need(eps > 0, "eps", eps, "> 0")
    if residual is not None:
        _need(_shape(residual) == _shape(x) and residual.dtype == x.dtype
              and residual.stride(1) == 1, "residual", (_shape(residual), residual.dtype),
              f"{_shape(x)} {x.dtype}, N contiguous")
    if out is not None:
        _need(_shape(out) == _shape(x) and out.dtype == x.dtype and out.stride(1) == 1, "out",
              (_shape(out), out.dtype), f"{_shape(x)} {x.dtype}")
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.rmsnorm import rms_norm_triton

        res = rms_norm_triton(x, weight, eps, residual=residual, out=out,
                              pdl=pdl_level(x, tune) > 0)
        if not dry_pass_active():
            return res
    res = ref.rms_norm_ref(x, weight, eps, residual)
    if residual is not None:
        y, h = res
        residual.copy_(h)
    else:
        y = res
    return y if out is None else out.copy_(y)


def embed_rms_norm(
    input_ids: torch.Tensor,  # [M] int
    table: torch.Tensor,  # [V, N]: the embedding weight
    weight: torch.Tensor,  # [N]: the norm weight
    eps: float,
    *,
    out_h: torch.Tensor | None = None,  # [M, N] table.dtype, written: the embedding rows
    out: torch.Tensor | None = None,  # [M, N] table.dtype, written: their norm
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out_h, out)
    """Embedding gather and RMSNorm in one launch: ``out_h = table[input_ids]`` (what
    ``nn.Embedding`` returns: the residual stream of layer 0) and ``out = rms_norm(out_h,
    weight, eps)`` exactly as ``rms_norm`` computes it. Ids outside ``[0, V)`` give zero rows
    (``reference.embed_rms_norm_ref``); they are device values, not checked here."""
    _need(isinstance(input_ids, torch.Tensor), "input_ids", type(input_ids).__name__,
          "a torch.Tensor")
    _need(input_ids.dtype in _INTS, "input_ids.dtype", input_ids.dtype, "torch.int32 or torch.int64")
    _need(input_ids.dim() == 1 and input_ids.shape[0] >= 1, "input_ids.shape", _shape(input_ids),
          "[M], M >= 1")
    m = input_ids.shape[0]
    _need(isinstance(table, torch.Tensor) and table.dim() == 2 and min(table.shape) >= 1,
          "table.shape", _shape(table) if isinstance(table, torch.Tensor) else table,
          "[vocab, hidden], both >= 1")
    _need(table.dtype in _FLOATS, "table.dtype", table.dtype, "float16, bfloat16 or float32")
    _need(table.stride(1) == 1, "table", "strided", "hidden contiguous")
    n = table.shape[1]
    _need(_shape(weight) == (n,), "weight.shape", _shape(weight), f"[{n}] (the table's hidden)")
    _need(weight.dtype in _FLOATS, "weight.dtype", weight.dtype, "a float dtype")
    _need(eps > 0, "eps", eps, "> 0")
    _need(input_ids.device == table.device == weight.device, "devices",
          (str(input_ids.device), str(table.device), str(weight.device)),
          "input_ids, table and weight on one device")
    for name, o in (("out_h", out_h), ("out", out)):
        if o is not None:
            _need(_shape(o) == (m, n) and o.dtype == table.dtype and o.stride(1) == 1
                  and o.device == table.device, name, (_shape(o), o.dtype),
                  f"[{m}, {n}] {table.dtype} on {table.device}, hidden contiguous")
    if out_h is None:
        out_h = torch.empty(m, n, dtype=table.dtype, device=table.device)
    if out is None:
        out = torch.empty(m, n, dtype=table.dtype, device=table.device)
    if use_triton(table, backend or tune.backend):
        from speccal.kernels.rmsnorm import embed_rms_norm_triton

        res = embed_rms_norm_triton(input_ids, table, weight, eps, out_h, out,
                                    pdl=pdl_level(table, tune) > 0)
        if not dry_pass_active():
            return res
    h, y = ref.embed_rms_norm_ref(input_ids, table, weight, eps)
    return out_h.copy_(h), out.copy_(y)


def rotary_kv_write(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, R]: cos | sin of the R <= D rotating channels
    slot_mapping: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    *,
    q_out: torch.Tensor | None = None,  # [T, H, D], written; None: q in place
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_w [D], k_w [D], eps)
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # q_out (q when None)
    """Neox rotary on the first ``R`` channels of q and k (``R = cos_sin_cache.shape[1]``; the
    other ``D - R`` pass through: partial rotary); rotated q to ``q_out`` (q in place by
    default), rotated k and v written to ``slot_mapping`` slots. ``qk_norm``: per-head RMSNorm
    of q and k (all ``D`` channels) first (fp32)."""
    _need(q.dim() == 3 and k.dim() == 3 and _shape(v) == _shape(k) and k.shape[0] == q.shape[0]
          and k.shape[2] == q.shape[2], "q/k/v shapes", (_shape(q), _shape(k), _shape(v)),
          "[T, H, D], [T, KVH, D], [T, KVH, D]")
    t, _, d = q.shape
    _need(d % 2 == 0, "head_dim", d, "even")
    _need(k_cache.dim() == 4 and _shape(v_cache) == _shape(k_cache)
          and k_cache.shape[2:] == k.shape[1:], "k_cache/v_cache shape", _shape(k_cache),
          f"[num_blocks, block_size, {k.shape[1]}, {d}]")
    check_slot_layout(k_cache, v_cache)
    _need(all(x.stride(-1) == 1 for x in (q, k, v)), "q/k/v", "strided", "head_dim contiguous")
    _need(cos_sin_cache.dim() == 2 and 2 <= cos_sin_cache.shape[1] <= d
          and cos_sin_cache.shape[1] % 2 == 0 and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache.shape", _shape(cos_sin_cache),
          f"[max_pos, R] with R even, 2 <= R <= {d} (head_dim)")
    _check_int(positions, "positions", (t,), (torch.int64,))
    _check_int(slot_mapping, "slot_mapping", (t,), (torch.int64,))
    _need(q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype, "dtypes",
          (q.dtype, k.dtype, v.dtype, k_cache.dtype), "q, k, v alike; caches alike")
    if q_out is not None:
        _need(_shape(q_out) == _shape(q) and q_out.dtype == q.dtype and q_out.stride(-1) == 1,
              "q_out", (_shape(q_out), q_out.dtype), f"{_shape(q)} {q.dtype}, D contiguous")
    check_qk_norm(qk_norm, d, "qk_norm")
    if use_triton(q, backend or tune.backend):
        from speccal.kernels.rotary_kv import rotary_kv_write_triton

        res = rotary_kv_write_triton(q, k, v, positions, cos_sin_cache, slot_mapping, k_cache,
                                     v_cache, q_out=q_out, qk_norm=qk_norm,
                                     pdl=pdl_level(q, tune) > 0)
        if not dry_pass_active():
            return res
    return ref.rotary_kv_write_ref(q, k, v, positions, cos_sin_cache, slot_mapping, k_cache,
                                   v_cache, q_out, qk_norm)
