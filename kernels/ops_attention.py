"""Paged attention and its split-KV planning: :class:`SplitPlan`, :func:`plan_splits` (and the
fold / spread choices), :func:`paged_attention`, and the attention -> o projection signal
(:class:`AttnSignal`, :func:`attention_signal`, :func:`residual_panel`); re-exported by
``speccal.kernels.ops``, whose docstring describes the dispatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels import reference as ref
from speccal.kernels._backend import arrival_counters, num_sms, pdl_level, use_triton
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.gemv_config import (
    launch_config,
)
from speccal.kernels.op_checks import FLOATS as _FLOATS
from speccal.kernels.op_checks import check_int as _check_int
from speccal.kernels.op_checks import check_qk_norm, check_slot_layout
from speccal.kernels.op_checks import need as _need
from speccal.kernels.op_checks import shape_of as _shape
from speccal.kernels.ops_moe import MOE_BLOCK_M, fused_moe  # noqa: F401 (MOE_BLOCK_M: re-exported)
from speccal.kernels.precompile import dry_pass_active


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class SplitPlan:
    """Static split-KV plan of one graph bucket.

    ``max_splits`` fixes the attention grid ``(B * KVH, max_splits)``; ``block_n`` is the KV tile
    (split lengths are multiples of it); a split never gets fewer than ``min_split_len`` tokens;
    ``num_stages``: the software-pipeline stages of the split kernel's K/V loop (Triton).
    """

    max_splits: int = 1
    block_n: int = 64
    min_split_len: int = 64
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.max_splits < 1:
            raise InputError("max_splits", self.max_splits, "an int >= 1")
        if self.num_stages not in (1, 2, 3, 4):
            raise InputError("num_stages", self.num_stages, "1, 2, 3 or 4")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise InputError("block_n", self.block_n, "a power of two >= 16")
        if self.min_split_len < 1:
            raise InputError("min_split_len", self.min_split_len, "an int >= 1")


def plan_splits(batch: int, num_kv_heads: int, num_sms: int = 132, max_len: int = 1 << 20,
                block_n: int = 64, rows: int = 1, tune: KernelConfig = DEFAULT_KERNELS) -> SplitPlan:
    """Split plan that gives about four programs per multiprocessor for ``batch`` requests.

    Static in (batch, heads, SMs, rows), so one plan per captured bucket. ``max_len`` caps the
    splits at one KV tile (``block_n``, or ``AttentionTuning.block_n``) each. ``rows`` > 1
    (verification): half the splits of the 1-row plan (each split's partials grow with the rows
    and the merge reads them all; the H200 dense-2b sweep in bench/KERNEL_NOTES.md "v6": B=1
    12 of 24, B=8 4 of 9, where 4 also lets the merge fold; ``verify_halve`` false keeps the
    1-row plan's count), and at most ``verify_splits`` (default ``VERIFY_MAX_SPLITS``);
    its K/V loop runs ``VERIFY_STAGES`` pipeline stages, and where it holds at least
    ``VERIFY_WIDE_PAIRS`` (request, KV head) pairs its tiles are ``VERIFY_WIDE_TILE`` tokens
    (``verify_block_n``). 1-row plans: at most ``decode_splits`` splits (None: no cap), 2
    stages. The switches are ``tune.attention``'s (:class:`~speccal.kernels.config.AttentionTuning`).
    """
    if batch < 1 or num_kv_heads < 1 or rows < 1:
        raise InputError("batch/num_kv_heads/rows", (batch, num_kv_heads, rows), "ints >= 1")
    att = tune.attention
    block_n = att.block_n or block_n
    want = -(-4 * num_sms // (batch * num_kv_heads))
    cap = max(1, -(-max_len // block_n))
    splits = max(1, min(want, 64, cap))
    if rows == 1:
        splits = min(splits, att.decode_splits or splits)
        return SplitPlan(max_splits=splits, block_n=block_n, min_split_len=block_n)
    half = splits // 2 if att.verify_halve else splits
    splits = max(1, min(half, att.verify_splits or VERIFY_MAX_SPLITS))
    if batch * num_kv_heads >= VERIFY_WIDE_PAIRS:
        block_n = att.verify_block_n or max(block_n, VERIFY_WIDE_TILE)
    return SplitPlan(max_splits=splits, block_n=block_n, min_split_len=block_n,
                     num_stages=VERIFY_STAGES)


# the folded split-KV merge (kernels/paged_attention.py): the last split program of a (request,
# KV head) merges at most this many (row x head) x split partials, and the grid must leave room
# on the SMs (the merge code's registers cost occupancy once programs queue). H200, "v5" in
# bench/KERNEL_NOTES.md: folding every shape made B=1 decode 2 % faster, B=1 full-width verify
# (12 rows x 24 splits merged by one program) 27 % slower and B=8 decode (576 programs) slower.
# 128 (v12): B=4 verification (12 x 8) folds, -12 us on the H200 (same run, bench/RESULTS.md)
FOLD_MAX_MERGE = 128
FOLD_MAX_PROGRAMS_PER_SM = 2
# the spread merge's programs wait for each other: one per multiprocessor at most, so the whole
# grid is resident whatever else shares the SMs (a spin on a program never scheduled would hang)
SPREAD_MAX_PROGRAMS_PER_SM = 1
VERIFY_MAX_SPLITS = 64  # split cap of multi-row (verification) plans (on top of the halving)
# verification plans of at least VERIFY_WIDE_PAIRS (request, KV head) pairs take KV tiles of
# VERIFY_WIDE_TILE tokens (fewer, larger loads per split program: on the H200, same run, B=4
# verification -76 us and B=8 -35 us, but B=1 +97 us and B=2 +45 us, bench/RESULTS.md), and
# every verification plan VERIFY_STAGES pipeline stages (3: B=1 and B=2 verification -4 and
# -8 us; the 1-row plans keep 2, which measured 7-9 us faster at B=1 and B=2 decode)
VERIFY_WIDE_PAIRS = 32
VERIFY_WIDE_TILE = 128
VERIFY_STAGES = 3


def fold_wanted(batch: int, num_kv_heads: int, max_splits: int, rows: int, group: int,
                num_sms: int = 132, force: bool | None = None,
                max_merge: int | None = None) -> bool:
    """Whether attention merges its KV splits in the split kernel (no reduce launch).

    ``rows``: query rows per request (``num_q_rows``); ``group``: query heads per KV head.
    ``force`` (True / False) overrides the rule: merge work ``rows * group * splits`` (padded to
    powers of two) at most ``FOLD_MAX_MERGE`` and at most ``FOLD_MAX_PROGRAMS_PER_SM`` programs
    per multiprocessor (``max_merge`` replaces the first). One split never needs a merge.
    """
    if max_splits <= 1:
        return False
    if force is not None:
        return force
    p2 = _next_pow2
    merge = p2(rows) * group * p2(max_splits)
    programs = batch * num_kv_heads * max_splits
    limit = FOLD_MAX_MERGE if max_merge is None else max_merge
    return merge <= limit and programs <= FOLD_MAX_PROGRAMS_PER_SM * num_sms


def spread_wanted(batch: int, num_kv_heads: int, max_splits: int, rows: int,
                  num_sms: int = 132, force: bool | None = None) -> bool:
    """Whether attention merges its KV splits spread over the split programs themselves (each
    live program waits for the others of its (request, KV head), then merges some of the rows:
    no reduce launch, no one program merging them all). Only where the grid fits the SMs one
    program each (``SPREAD_MAX_PROGRAMS_PER_SM``), so every program it waits for is resident;
    by default (``force`` None) only for multi-row (verification) plans, the merge the fold
    leaves to a reduce launch; ``force`` True lifts the row rule, never the grid one.
    """
    if max_splits <= 1 or force is False:
        return False
    programs = batch * num_kv_heads * max_splits
    if programs > SPREAD_MAX_PROGRAMS_PER_SM * num_sms:
        return False
    return bool(force) or rows > 1



@dataclass
class AttnSignal:
    """A flag from an attention launch to the o projection that consumes its output
    (``AttentionTuning.poll``): ``counters`` (int32 ``[2]``: pieces done, consumer programs out,
    zero between launches) and ``target``, the pieces the launch that armed it will count (0:
    unarmed, the consumer takes its PDL wait). The register-panel o GEMV then starts on the
    count (``pdl.await_signal``) instead of the attention grid's completion."""

    counters: torch.Tensor
    target: int = 0


def residual_panel(residual: torch.Tensor, weight: torch.Tensor,
                   tune: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether ``weight [N, K]`` added into ``residual [M, N]`` (``linear(..., residual=)``,
    ``linear_deferred_norm``) launches as the register panel (``gemv_config.launch_config``)."""
    m, (n, k) = residual.shape[0], weight.shape
    return launch_config(m, n, k, num_sms(residual.device), "residual",
                         residual.element_size(), None, tune.gemv).panel


def attention_signal(residual: torch.Tensor, o_weight: torch.Tensor,
                     tune: KernelConfig = DEFAULT_KERNELS) -> AttnSignal | None:
    """An unarmed ``AttnSignal`` for an attention launch whose ``[M, K]`` output feeds the o
    projection ``o_weight [N, K]`` added into ``residual [M, N]`` (``linear_deferred_norm``), or
    None where that consumer would not poll: ``tune.attention.poll`` off, not Triton with PDL, the
    o GEMV not a register panel (``gemv_config.launch_config``), or no counters (a capture before any
    eager run)."""
    if not (tune.attention.poll and use_triton(residual, tune.backend)
            and pdl_level(residual, tune) > 0):
        return None
    if not residual_panel(residual, o_weight, tune):
        return None
    cnt = arrival_counters("signal", residual.device, 2, slots=2)
    return None if cnt is None else AttnSignal(cnt)


def paged_attention(
    q: torch.Tensor,  # [B, R, H, D] dense or [T, H, D] packed (with cu_q_lens)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    *,
    q_lens: torch.Tensor | None = None,  # [B] int32, dense ragged verify
    cu_q_lens: torch.Tensor | None = None,  # [B + 1] int32, packed verify
    tiling: tuple[torch.Tensor, torch.Tensor] | None = None,  # (num_splits [B], split_len [B])
    plan: SplitPlan | None = None,
    out: torch.Tensor | None = None,  # like q
    rope: tuple | None = None,  # (k_new [T, KVH, D], v_new, cos_sin_cache [P, D], qk_norm | None)
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
    meta_settled: bool = False,  # the previous launch writes none of the metadata
    signal: AttnSignal | None = None,  # armed here for the o projection (attention_signal)
    successor_panel: bool | None = None,  # the next launch is a register panel (residual_panel)
    sliding_window: int = 0,  # keys within the last W positions only (0: full); reference only
) -> torch.Tensor:  # like q
    """Causal paged attention for decode (1 row) and verification (up to w+1 rows per request).

    ``sliding_window`` W > 0: each row sees keys ``[position - W + 1, position]`` only. The
    reference implements it; the Triton kernel does not, and refuses it.

    ``rope`` (packed layout only): q is the raw projection (any row/head stride, D contiguous)
    and the new rows' ``k_new``/``v_new`` are not in the cache yet; the op first applies the
    optional per-head RMSNorm (``qk_norm = (q_weight, k_weight, eps)``) and neox rotary at each
    row's position to q and k, writes the rotated k and v to their slots (from the block table;
    padding rows past ``cu_q_lens[B]`` are not written by the kernel), then attends. One launch
    instead of ``rotary_kv_write`` + attention.

    Query row ``i`` of request ``b`` sits at position ``seq_lens[b] - q_len[b] + i`` and attends
    to KV ``[0, that position]``; ``q_len`` is ``num_q_rows`` (dense), ``q_lens[b]`` (dense,
    ragged) or ``cu_q_lens[b+1] - cu_q_lens[b]`` (packed, where ``num_q_rows`` is the largest
    per-request row count). Rows of no request give zeros. GQA: ``H`` a multiple of ``KVH``.
    Split-KV: ``plan`` fixes ``max_splits``; ``tiling`` comes from ``attention_tiling_update``
    (computed here, one more launch, when None). fp32 softmax and accumulation.

    ``meta_settled``: the caller vouches that the kernel launched just before this op writes
    none of ``seq_lens``, ``q_lens``/``cu_q_lens``, ``tiling`` and ``block_table`` (the fused
    layer: its QKV GEMV precedes attention), so on Triton the metadata is read before the PDL
    wait. Ignored when ``tiling`` is None (its update is then that previous launch).

    ``signal`` (from ``attention_signal``, Triton with PDL): the launch counts its finished
    pieces of the output there and arms the signal, so the consumer's register panel
    (``linear_deferred_norm(..., after=signal)``) polls it instead of waiting for the whole
    attention grid. Off Triton the signal stays unarmed (the consumer waits as usual).

    ``successor_panel``: whether the launch after this op is a register-panel GEMV (the o
    projection, ``residual_panel``); under ``AttentionTuning.reduce_release="auto"`` the split-KV
    reduce then lets it launch before the reduce's own wait (None: wherever panels are on).
    """
    _need(k_cache.dim() == 4, "k_cache.shape", _shape(k_cache),
          "[num_blocks, block_size, num_kv_heads, head_dim]")
    _need(_shape(v_cache) == _shape(k_cache), "v_cache.shape", _shape(v_cache),
          f"equal to k_cache.shape {_shape(k_cache)}")
    _need(k_cache.dtype in _FLOATS and v_cache.dtype == k_cache.dtype, "k_cache.dtype",
          (k_cache.dtype, v_cache.dtype), "one of float16/bfloat16/float32 for both caches")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _need(block_table.dim() == 2, "block_table.shape", _shape(block_table), "[B, max_blocks]")
    batch = block_table.shape[0]
    _check_int(block_table, "block_table", _shape(block_table), (torch.int32,))
    _check_int(seq_lens, "seq_lens", (batch,), (torch.int32,))
    _need(q.dtype == k_cache.dtype, "q.dtype", q.dtype, f"the cache dtype {k_cache.dtype}")
    _need(isinstance(num_q_rows, int) and num_q_rows >= 1, "num_q_rows", num_q_rows, "an int >= 1")
    packed = cu_q_lens is not None
    if packed:
        _need(q.dim() == 3 and q.shape[2] == head_dim, "q.shape", _shape(q),
              f"[T, num_heads, {head_dim}] (packed, with cu_q_lens)")
        _check_int(cu_q_lens, "cu_q_lens", (batch + 1,), (torch.int32,))
        _need(q_lens is None, "q_lens", "given", "None when cu_q_lens is given")
    else:
        _need(q.dim() == 4 and q.shape[0] == batch and q.shape[1] == num_q_rows
              and q.shape[3] == head_dim, "q.shape", _shape(q),
              f"[{batch}, {num_q_rows}, num_heads, {head_dim}]")
        if q_lens is not None:
            _check_int(q_lens, "q_lens", (batch,), (torch.int32,))
    num_heads = q.shape[-2]
    _need(num_heads % num_kv_heads == 0, "num_heads", num_heads,
          f"a multiple of num_kv_heads={num_kv_heads}")
    if rope is not None:
        _check_rope(rope, q, k_cache, v_cache, packed)
    else:
        _need(q.stride(-1) == 1 and q.is_contiguous(), "q", "non-contiguous",
              "a contiguous tensor")
    _need(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache/v_cache", "strided",
          "head_dim contiguous")
    if out is not None:
        _need(_shape(out) == _shape(q) and out.dtype == q.dtype and out.is_contiguous(), "out",
              (_shape(out), out.dtype), f"contiguous {_shape(q)} {q.dtype}")
    _need(signal is None or (isinstance(signal, AttnSignal) and signal.counters.device == q.device),
          "signal", type(signal).__name__, f"None or an AttnSignal on {q.device}")
    if signal is not None:
        signal.target = 0  # armed below by the Triton launch only
    plan = plan or SplitPlan()
    if tiling is None:
        num_splits = torch.empty(batch, dtype=torch.int32, device=q.device)
        split_len = torch.empty(batch, dtype=torch.int32, device=q.device)
        attention_tiling_update(seq_lens, num_splits, split_len, plan, backend=backend,
                                tune=tune)
    else:
        num_splits, split_len = tiling
        _check_int(num_splits, "tiling[0] (num_splits)", (batch,), (torch.int32,))
        _check_int(split_len, "tiling[1] (split_len)", (batch,), (torch.int32,))

    _need(isinstance(sliding_window, int) and sliding_window >= 0, "sliding_window",
          sliding_window, "an int >= 0")
    if use_triton(q, backend or tune.backend):
        if sliding_window:
            raise UnsupportedError(
                f"config.json:sliding_window={sliding_window}: the Triton paged-attention "
                "kernel has no sliding window; use attention_backend='torch'")
        from speccal.kernels.paged_attention import paged_attention_triton

        res = paged_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, num_q_rows, scale, num_splits, split_len,
            plan.max_splits, q_lens=q_lens, cu_q_lens=cu_q_lens, out=out, block_n=plan.block_n,
            num_stages=plan.num_stages,
            rope=rope, pdl=pdl_level(q, tune) > 0, meta_settled=meta_settled and tiling is not None,
            signal=signal if pdl_level(q, tune) > 0 else None, successor_panel=successor_panel,
            tune=tune,
        )
        if not dry_pass_active():
            return res
        return res.zero_()  # dry pass: a finite stand-in (see _dry_gemv), not the reference
    split = dict(
        num_splits=num_splits if plan.max_splits > 1 else None,
        split_len=split_len if plan.max_splits > 1 else None, max_splits=plan.max_splits,
    )
    if rope is not None:
        _need(not sliding_window, "sliding_window", sliding_window, "0 with rope (fused layer)")
        res = ref.rope_paged_attention_ref(
            q, rope[0], rope[1], rope[2], k_cache, v_cache, block_table, seq_lens, num_q_rows,
            scale, cu_q_lens, rope[3], **split,
        )
    else:
        res = ref.paged_attention_ref(
            q, k_cache, v_cache, block_table, seq_lens, num_q_rows, scale, q_lens=q_lens,
            cu_q_lens=cu_q_lens, sliding_window=sliding_window, **split,
        )
    return res if out is None else out.copy_(res)


def _check_rope(rope, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                packed: bool) -> None:
    _need(packed, "rope", "given", "the packed layout (cu_q_lens)")
    _need(isinstance(rope, tuple) and len(rope) == 4, "rope", type(rope).__name__,
          "(k_new, v_new, cos_sin_cache, qk_norm or None)")
    k_new, v_new, cos_sin, qk_norm = rope
    t, _, d = q.shape
    kvh = k_cache.shape[2]
    for name, x in (("rope k_new", k_new), ("rope v_new", v_new)):
        _need(_shape(x) == (t, kvh, d) and x.dtype == q.dtype and x.stride(-1) == 1,
              f"{name}", (_shape(x), x.dtype), f"[{t}, {kvh}, {d}] {q.dtype}, D contiguous")
    _need(q.stride(-1) == 1, "q", "strided", "head_dim contiguous")
    _need(d % 2 == 0, "head_dim", d, "even")
    _need(cos_sin.dim() == 2 and cos_sin.shape[1] == d and cos_sin.stride(1) == 1
          and cos_sin.dtype == torch.float32, "rope cos_sin_cache",
          (_shape(cos_sin), cos_sin.dtype), f"[max_pos, {d}] float32")
    check_slot_layout(k_cache, v_cache)
    check_qk_norm(qk_norm, d, "rope qk_norm")


def attention_tiling_update(
    seq_lens: torch.Tensor,  # [B] int32
    num_splits: torch.Tensor,  # [B] int32, written
    split_len: torch.Tensor,  # [B] int32, written
    plan: SplitPlan,
    *,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> None:
    """Per-request split count and split length for ``paged_attention`` (see ``SplitPlan``)."""
    _need(seq_lens.dim() == 1, "seq_lens.shape", _shape(seq_lens), "[B]")
    batch = seq_lens.shape[0]
    _check_int(seq_lens, "seq_lens", (batch,), (torch.int32,))
    _check_int(num_splits, "num_splits", (batch,), (torch.int32,))
    _check_int(split_len, "split_len", (batch,), (torch.int32,))
    _need(isinstance(plan, SplitPlan), "plan", type(plan).__name__, "a SplitPlan")
    if use_triton(seq_lens, backend or tune.backend):
        from speccal.kernels.attention_tiling import attention_tiling_update_triton

        attention_tiling_update_triton(seq_lens, num_splits, split_len, plan.max_splits,
                                       plan.block_n, plan.min_split_len,
                                       pdl=pdl_level(seq_lens, tune) > 0)
        if not dry_pass_active():
            return
    ref.attention_tiling_update_ref(seq_lens, num_splits, split_len, plan.max_splits,
                                    plan.block_n, plan.min_split_len)


def mla_latent_attention(
    q: torch.Tensor,  # [N, heads, latent + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_q_lens: torch.Tensor | None,  # [B + 1] int32 (packed rows); None: N = B * R, the grid
    num_rows: int,  # R: the most rows of one request
    latent_dim: int,
    scale: float,
    *,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [N, heads, latent] q's dtype
    """MLA attention in absorbed form (one key head of ``[latent | rope]`` channels, the latent
    as value) of decode / verify rows over the paged latent cache, causal by position: row
    ``i`` of a request's ``q_len`` rows (packed: ``cu_q_lens``, rows past ``cu_q_lens[B]`` give
    zeros; grid: ``R`` rows a request) is at ``seq_lens[b] - q_len + i`` and sees keys ``0 ..
    max(that, 0)``. Triton: ``mla_decode.py`` (split-KV over the keys before ``seq_lens``,
    read straight from the cache, two launches); reference:
    ``reference.mla_latent_attention_ref``."""
    _need(q.dim() == 3 and q.dtype in _FLOATS and q.stride(2) == 1, "q", (_shape(q), q.dtype),
          "[N, heads, latent + rope] float, last dim contiguous")
    n, heads, dim = q.shape
    num_b = block_table.shape[0] if block_table.dim() == 2 else -1
    _need(cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == dim
          and cache.is_contiguous() and cache.dtype == q.dtype, "cache",
          (_shape(cache), cache.dtype), f"[blocks, block_size, 1, {dim}] {q.dtype}, contiguous")
    _need(num_b >= 1, "block_table", _shape(block_table), "[B, max_blocks]")
    _need(_shape(seq_lens) == (num_b,), "seq_lens", _shape(seq_lens), f"[{num_b}]")
    if cu_q_lens is None:
        _need(num_rows >= 1 and n == num_b * num_rows, "num_rows", num_rows,
              f"R with B * R == {n} rows (the grid)")
    else:
        _need(_shape(cu_q_lens) == (num_b + 1,), "cu_q_lens", _shape(cu_q_lens),
              f"[{num_b + 1}]")
        _need(num_rows >= 1, "num_rows", num_rows, "an int >= 1")
    _need(0 < latent_dim < dim, "latent_dim", latent_dim, f"in 1 .. {dim - 1}")
    args = (q, cache, block_table, seq_lens, cu_q_lens, num_rows, latent_dim, scale)
    chosen = backend or tune.backend
    aligned = mla_rows_aligned(cache, latent_dim)
    if chosen == "triton" and not aligned:
        raise UnsupportedError(
            f"mla_latent_attention on Triton: cache rows of {dim} x {cache.element_size()} bytes "
            f"with the rope part at {latent_dim} x {cache.element_size()}: expected both multiples "
            f"of 16 bytes (every MLA checkpoint's 512 + 64 channels are)")
    if not use_triton(q, chosen) or not aligned:
        return ref.mla_latent_attention_ref(*args)
    from speccal.kernels.mla_decode import mla_latent_attention_triton

    prec = tune.precision.fp32_dot if q.dtype == torch.float32 else None
    out = mla_latent_attention_triton(*args, prec, pdl=pdl_level(q, tune) > 0)
    if dry_pass_active():  # skipped launches: zeros (the dry pass's rule for activations)
        return torch.zeros_like(out)
    return out


def mla_rope_cache(
    q_first: torch.Tensor,  # [N, H, F]: absorbed no-rope query (decode) or q_nope (prefill)
    q_pe: torch.Tensor,  # [N, H, rope]: each head's rope channels (a view of q is fine)
    k_pe: torch.Tensor,  # [N, rope]: the shared key's rope channels
    latent: torch.Tensor,  # [N, latent]: the normed latent
    cos: torch.Tensor,  # [N, rope] rows of the rotary table (float32 as RotaryTable holds them)
    sin: torch.Tensor,  # [N, rope]
    slot_mapping: torch.Tensor,  # [N] int64
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope], written
    is_interleaved: bool,
    *,
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [N, H, F + rope], q_first's dtype
    """An MLA layer's rotary and latent-cache write in one pass: the heads' and the shared
    key's rope channels rotated (interleaved pairs or halves, fp32), ``[latent | rotated k_pe]``
    written to each row's cache slot, ``[q_first | rotated q_pe]`` returned. Triton:
    ``mla_rope.py`` (one launch); reference: ``reference.mla_rope_cache_ref``."""
    _need(q_first.dim() == 3 and q_pe.dim() == 3 and q_pe.shape[:2] == q_first.shape[:2]
          and q_first.dtype == q_pe.dtype and q_first.dtype in _FLOATS, "q_first/q_pe",
          (_shape(q_first), _shape(q_pe), q_first.dtype),
          "[N, H, F] and [N, H, rope], one float dtype")
    n, heads, _ = q_first.shape
    rope = q_pe.shape[2]
    _need(rope >= 2 and rope % 2 == 0, "rope channels", rope, "even, >= 2")
    _need(_shape(k_pe) == (n, rope) and k_pe.dtype in _FLOATS, "k_pe", _shape(k_pe),
          f"[{n}, {rope}] float")
    _need(latent.dim() == 2 and latent.shape[0] == n and latent.dtype in _FLOATS, "latent",
          _shape(latent), f"[{n}, latent] float")
    lat = latent.shape[1]
    for name, t in (("cos", cos), ("sin", sin)):
        _need(_shape(t) == (n, rope) and t.dtype in _FLOATS, name, (_shape(t), t.dtype),
              f"[{n}, {rope}] float")
    _check_int(slot_mapping, "slot_mapping", (n,), (torch.int64,))
    _need(cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == lat + rope
          and cache.is_contiguous(), "cache", _shape(cache),
          f"[blocks, block_size, 1, {lat + rope}] contiguous")
    _need(all(t.stride(-1) == 1 for t in (q_first, q_pe, k_pe, latent, cos, sin)),
          "q_first/q_pe/k_pe/latent/cos/sin", "strided", "last dim contiguous")
    args = (q_first, q_pe, k_pe, latent, cos, sin, slot_mapping, cache, is_interleaved)
    if not use_triton(q_first, backend or tune.backend):
        return ref.mla_rope_cache_ref(*args)
    from speccal.kernels.mla_rope import mla_rope_cache_triton

    out = mla_rope_cache_triton(*args)
    if dry_pass_active():  # skipped launches: zeros (the dry pass's rule for activations)
        return torch.zeros_like(out)
    return out


def mla_rows_aligned(cache: torch.Tensor, latent_dim: int) -> bool:
    """Whether the Triton MLA kernel takes this latent cache: each cached row and its rope part
    start on 16 bytes (the kernel's vector loads; on an H100 a bf16 cache of 24 + 12 channels,
    72-byte rows, faulted with a misaligned address)."""
    size = cache.element_size()
    return (cache.shape[-1] * size) % 16 == 0 and (latent_dim * size) % 16 == 0
