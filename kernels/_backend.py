"""Backend choice for ``speccal.kernels``: Triton on CUDA tensors when importable, else reference.

Triton is imported lazily and only here, so ``import speccal.kernels`` works on a CPU-only
machine without it. ``SPECCAL_KERNELS=reference`` forces the pure-torch references everywhere
(for comparisons and bisecting); ``TRITON_INTERPRET=1`` lets the Triton kernels run on CPU
tensors through Triton's interpreter (slow; tests only). Programmatic dependent launch (PDL) is
on by default on Hopper and newer GPUs in its ``late`` form (``SPECCAL_PDL=late``: measured
-5 % per decode step on the H200, bench/KERNEL_NOTES.md); ``SPECCAL_PDL=0`` turns it off,
``1`` releases every successor at once (``pdl_mode``).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = [
    "argmax_keys_enabled",
    "arrival_counters",
    "attention_fold_override",
    "attention_min_block_m",
    "attention_poll",
    "attention_prewait",
    "attention_block_n",
    "attention_stages",
    "attention_warps",
    "attention_prefetch_tiles",
    "attention_release",
    "attention_spread",
    "decode_max_splits",
    "defer_input_norm",
    "defer_scale_late",
    "fold_max_merge",
    "gemv_min_block_m",
    "gemv_prefetch_tiles",
    "gemv_wide_block_m",
    "input_defer_max",
    "interpreting",
    "norm_defer",
    "num_sms",
    "panel_chunks",
    "panel_enabled",
    "panel_min_block_m",
    "panel_preconvert",
    "pdl_enabled",
    "pdl_mode",
    "prewait_loads",
    "triton_available",
    "use_triton",
    "verify_block_n",
    "verify_halves",
    "verify_max_splits",
]


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on ``t`` runs the Triton kernel.

    ``backend`` is ``"triton"``, ``"reference"`` or None (auto: Triton for CUDA tensors, or for
    any tensor under the interpreter, unless ``SPECCAL_KERNELS=reference``).
    """
    if backend is None:
        backend = _env_choice("SPECCAL_KERNELS", "auto", ("auto", "triton", "reference"),
                              "auto, triton or reference")
    elif backend not in ("triton", "reference"):
        from speccal.base.errors import InputError

        raise InputError("backend", backend, "triton, reference or None")
    if backend == "reference":
        return False
    ok = triton_available() and (t.is_cuda or interpreting())
    if backend == "triton" and not ok:
        from speccal.base.errors import UnsupportedError

        raise UnsupportedError("backend='triton' needs a CUDA tensor and an importable triton")
    return ok


_PDL_MODES = {"0": 0, "1": 1, "late": 2}


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether Triton launches on ``t``'s device use programmatic dependent launch.

    PDL (``griddepcontrol`` + the launch attribute) lets a kernel start while its predecessor
    drains; every kernel launched this way waits for its predecessor before touching data it
    produced. Needs compute capability >= 9.0. Opt-in (``pdl_mode``): on the H200 early release
    made the decode GEMV chain slower at 1-8 rows and faster at 48; late release never lost
    (bench/KERNEL_NOTES.md, v4).
    """
    return pdl_mode(t) > 0


def pdl_mode(t: torch.Tensor) -> int:
    """0 (``SPECCAL_PDL=0``): no PDL; 1 (``SPECCAL_PDL=1``): every Triton kernel lets its
    successor launch as soon as its own wait is over; 2 (``late``, the default): GEMVs let it
    launch only after their K loop (the other kernels as in 1)."""
    mode = _PDL_MODES[_env_choice("SPECCAL_PDL", "late", _PDL_MODES, "0, 1 or late")]
    if not mode or not t.is_cuda or interpreting():
        return 0
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return mode if _pdl_device(idx) else 0


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (132, an H200's count, off CUDA: plans stay comparable)."""
    if device.type != "cuda":
        return 132
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def attention_fold_override() -> bool | None:
    """``SPECCAL_ATTN_FOLD``: ``1`` / ``0`` force / forbid folding attention's split-KV merge into
    the split kernel; ``auto`` (default) leaves it to ``ops.fold_wanted``'s rule."""
    value = _env_choice("SPECCAL_ATTN_FOLD", "auto", ("auto", "0", "1"), "auto, 0 or 1")
    return None if value == "auto" else value == "1"


def argmax_keys_enabled() -> bool:
    """``SPECCAL_ARGMAX_KEYS``: ``1`` (default) the runner's LM head folds each row's argmax into
    one packed key by atomic max (``ops.ArgmaxKeys``), ``0`` it writes per-tile partials that
    ``verify_accept`` reduces (an A/B switch for benchmarks, read at graph capture)."""
    return _env_choice("SPECCAL_ARGMAX_KEYS", "1", ("0", "1"), "0 or 1") == "1"


def attention_spread() -> bool | None:
    """``SPECCAL_ATTN_SPREAD``: ``auto`` spreads attention's split-KV merge over the split
    programs where ``ops.spread_wanted``'s rule says so (multi-row plans whose grid fits the
    SMs), ``1`` also for 1-row plans (still only a grid that fits), ``0`` (default) never: on
    the H200 the spread merge made the B=1 verify step 57 us slower than the reduce launch it
    replaces (bench/KERNEL_NOTES.md v11). Read at launch (graph capture)."""
    value = _env_choice("SPECCAL_ATTN_SPREAD", "0", ("auto", "0", "1"), "auto, 0 or 1")
    return None if value == "auto" else value == "1"


def _env_choice(var: str, default: str, choices, expected: str) -> str:
    """``os.environ[var]`` (``default`` when unset), one of ``choices``, else an InputError
    naming the variable, the value and ``expected``."""
    value = os.environ.get(var, default)
    if value not in choices:
        from speccal.base.errors import InputError

        raise InputError(var, value, expected)
    return value


def _env_int(var: str, minimum: int) -> int | None:
    """``int(os.environ[var])`` (None when unset or empty), at least ``minimum``."""
    value = os.environ.get(var, "")
    if not value:
        return None
    if not value.isdigit() or int(value) < minimum:
        from speccal.base.errors import InputError

        raise InputError(var, value, f"an int >= {minimum} (or unset)")
    return int(value)


def _positive_int(var: str) -> int | None:
    return _env_int(var, 1)


def fold_max_merge() -> int | None:
    """``SPECCAL_FOLD_MAX_MERGE``: the folded attention merge's work limit (``ops.fold_wanted``;
    unset: the built-in default). A tuning switch for benchmarks."""
    return _positive_int("SPECCAL_FOLD_MAX_MERGE")


def decode_max_splits(default: int) -> int:
    """``SPECCAL_DECODE_SPLITS``: split cap of 1-row (decode) plans (``ops.plan_splits``; unset:
    ``default``). A tuning switch for benchmarks, read when a plan is made (graph capture)."""
    value = _positive_int("SPECCAL_DECODE_SPLITS")
    return default if value is None else value


def verify_halves() -> bool:
    """``SPECCAL_VERIFY_HALVE``: ``1`` (default) verification plans take half the 1-row plan's
    splits; ``0`` the same count (``ops.plan_splits``). A tuning switch for benchmarks."""
    return _env_choice("SPECCAL_VERIFY_HALVE", "1", ("0", "1"), "0 or 1") == "1"


def verify_block_n(default: int) -> int:
    """``SPECCAL_VERIFY_BLOCK_N``: KV tokens per tile of the wide verification plans
    (``ops.plan_splits``; a power of two in [16, 256]; unset: ``default``). A tuning switch for
    benchmarks, read when a plan is made (graph capture)."""
    return _tile_switch("SPECCAL_VERIFY_BLOCK_N", default)


def verify_max_splits(default: int) -> int:
    """``SPECCAL_VERIFY_SPLITS``: split cap of verification plans (``ops.plan_splits``; unset:
    ``default``). A tuning switch for benchmarks, read when a plan is made (graph capture)."""
    value = _positive_int("SPECCAL_VERIFY_SPLITS")
    return default if value is None else value


# Weight tiles each GEMV program prefetches into L2 before its PDL wait (bench/KERNEL_NOTES.md v7).
GEMV_PREFETCH_TILES = 2


def gemv_prefetch_tiles() -> int:
    """``SPECCAL_GEMV_PREFETCH``: weight tiles per GEMV program prefetched into L2 before its PDL
    wait (``0`` none; unset: ``GEMV_PREFETCH_TILES``). A tuning switch for benchmarks."""
    value = _env_int("SPECCAL_GEMV_PREFETCH", 0)
    return GEMV_PREFETCH_TILES if value is None else value


def panel_enabled() -> bool:
    """``SPECCAL_GEMV_PANEL``: ``1`` (default) the GEMV tables' register-panel configs apply,
    ``0`` they are replaced by the streaming kernel (``gemv_config.resolve``; an A/B switch for
    benchmarks, read when a config is picked, i.e. at graph capture)."""
    return _env_choice("SPECCAL_GEMV_PANEL", "1", ("0", "1"), "0 or 1") == "1"


# K chunks of the register panel's batched dot at 2-8 rows (``gemv._panel_chunks``)
PANEL_CHUNKS = 4


def panel_chunks() -> int:
    """``SPECCAL_PANEL_CHUNKS``: K chunks (independent accumulation chains) of the register-panel
    GEMV's tensor-core dot at 2-8 rows, a power of two (unset: ``PANEL_CHUNKS``). A tuning switch
    for benchmarks, read at launch (graph capture)."""
    return _pow2_switch("SPECCAL_PANEL_CHUNKS", PANEL_CHUNKS, 1 << 16)


def _pow2_switch(var: str, default: int, largest: int, smallest: int = 1) -> int:
    """A power-of-two switch ``var`` in ``[smallest, largest]`` (unset: ``default``), else an
    InputError naming it."""
    value = _positive_int(var)
    if value is not None and (value & (value - 1) or not smallest <= value <= largest):
        from speccal.base.errors import InputError

        bounds = f"<= {largest}" if smallest == 1 else f"in [{smallest}, {largest}]"
        raise InputError(var, value, f"a power of two {bounds}")
    return default if value is None else value


# the smallest M tile of the GEMVs' tensor-core dot at 2-16 rows (tl.dot pads a smaller tile
# itself on Hopper, Triton 3.6). The register panel takes 8: half the x staged through shared
# memory, B=1 verification -30 us on the H200 (B=8 decode +15 us, same run). The streaming
# kernel keeps 16: its 2-8 row tiles at 8 were not measured apart from the panel's (both at 8:
# B=8 decode +23 us). bench/KERNEL_NOTES.md v10
GEMV_MIN_BLOCK_M = 16
PANEL_MIN_BLOCK_M = 8
# the streaming GEMV's M tile past 16 rows: 64 (one warp group's tensor-core tile) instead of the
# rows' power of two (32 at 17-32 rows). On the H200, same run, B=4 verification (24 rows) -121 us
# with the 33-64 row configs, bench/KERNEL_NOTES.md v13
GEMV_WIDE_BLOCK_M = 64


def gemv_min_block_m() -> int:
    """``SPECCAL_GEMV_MIN_BLOCK_M``: the smallest M tile of the streaming GEMV's tensor-core dot
    at 2 rows or more, a power of two <= 64 (unset: ``GEMV_MIN_BLOCK_M``; one row always takes
    16: a 1-row tile measured 2x slower). A tuning switch for benchmarks, read at launch."""
    return _pow2_switch("SPECCAL_GEMV_MIN_BLOCK_M", GEMV_MIN_BLOCK_M, 64)


def gemv_wide_block_m() -> int:
    """``SPECCAL_GEMV_WIDE_BLOCK_M``: the smallest M tile of the streaming GEMV past 16 rows, 32
    or 64 (unset: ``GEMV_WIDE_BLOCK_M``). A tuning switch for benchmarks, read at launch."""
    return _pow2_switch("SPECCAL_GEMV_WIDE_BLOCK_M", GEMV_WIDE_BLOCK_M, 64, 32)


# rows past which the deferred norm's consumer reduces its row scales after its K loop (``auto``):
# on the H200, same runs, B=4 verification (24 rows, an M tile of 64) -14 / -16 us, B=1 (6 rows)
# +5 / +6 us, bench/KERNEL_NOTES.md v13
DEFER_SCALE_LATE_ROWS = 16


def defer_scale_late(rows: int) -> bool:
    """``SPECCAL_DEFER_SCALE``: whether the deferred norm's consumer GEMV of ``rows`` rows turns
    its rows' sums of squares into row scales after its K loop (the loads are issued before it,
    so their latency hides under the weight stream) rather than before it (the K loop waits for
    them): ``late``, ``early``, or ``auto`` (default: late past ``DEFER_SCALE_LATE_ROWS`` rows).
    Read at launch (graph capture)."""
    mode = _env_choice("SPECCAL_DEFER_SCALE", "auto", ("auto", "late", "early"),
                       "auto, late or early")
    return mode == "late" or (mode == "auto" and rows > DEFER_SCALE_LATE_ROWS)


def panel_min_block_m() -> int:
    """``SPECCAL_PANEL_MIN_BLOCK_M``: the smallest M tile of the register panel's tensor-core dot
    (2-8 rows), a power of two <= 16 (unset: ``PANEL_MIN_BLOCK_M``). Read at launch."""
    return _pow2_switch("SPECCAL_PANEL_MIN_BLOCK_M", PANEL_MIN_BLOCK_M, 16)


# the attention split kernel's M tile is the power of two of rows x GQA group, at least this
# (tl.dot pads it): at one row and group 2 a 2-row tile, -7 us per B=1 decode step on the H200
# against 16 (bench/KERNEL_NOTES.md v10)
ATTN_MIN_BLOCK_M = 2


def attention_min_block_m() -> int:
    """``SPECCAL_ATTN_MIN_BLOCK_M``: the smallest M tile (query rows x GQA group) of the attention
    split kernel, a power of two <= 16 (unset: ``ATTN_MIN_BLOCK_M``). A tuning switch for
    benchmarks, read at launch (graph capture)."""
    return _pow2_switch("SPECCAL_ATTN_MIN_BLOCK_M", ATTN_MIN_BLOCK_M, 16)


def attention_poll() -> bool:
    """``SPECCAL_ATTN_POLL``: ``1`` lets the register-panel o projection start on a flag instead of
    its PDL wait: the attention launch (its merging split programs, or its reduce programs)
    counts itself done in a counter that the panel's programs poll (``ops.AttnSignal``), so the
    o projection does not wait for the attention grid's completion. ``0`` (default) keeps the
    PDL wait. Read at launch (graph capture)."""
    return _env_choice("SPECCAL_ATTN_POLL", "0", ("0", "1"), "0 or 1") == "1"


PANEL_PRECONVERT = False


def panel_preconvert() -> bool:
    """``SPECCAL_PANEL_PRECVT``: ``1`` makes the 2-8 row register panel convert its weights to
    the dot operand's registers before its PDL wait (a dot with zeros there, onto which the real
    one accumulates), so after the wait only x goes through shared memory (unset:
    ``PANEL_PRECONVERT``). Read at launch."""
    default = "1" if PANEL_PRECONVERT else "0"
    return _env_choice("SPECCAL_PANEL_PRECVT", default, ("0", "1"), "0 or 1") == "1"


def prewait_loads() -> bool:
    """``SPECCAL_PREWAIT``: ``1`` (default) lets a kernel whose caller vouches for its inputs read
    them before its PDL wait: a GEMV's residual (``ops.linear(residual_settled=True)``) and the
    attention metadata (``ops.paged_attention(meta_settled=True)``); ``0`` after the wait (an A/B
    switch for benchmarks)."""
    return _env_choice("SPECCAL_PREWAIT", "1", ("0", "1"), "0 or 1") == "1"


# K/V tiles each attention split program prefetches into L2 before its PDL wait, where the caller
# vouches for the metadata (``ops.paged_attention(meta_settled=True)``).
ATTN_PREFETCH_TILES = 0


def attention_prefetch_tiles() -> int:
    """``SPECCAL_ATTN_PREFETCH``: cached K/V tiles per attention split program prefetched into L2
    before its PDL wait (``0`` none; unset: ``ATTN_PREFETCH_TILES``). A tuning switch for
    benchmarks, read at launch (graph capture)."""
    value = _env_int("SPECCAL_ATTN_PREFETCH", 0)
    return ATTN_PREFETCH_TILES if value is None else value


_ATTN_RELEASE = {"start": 0, "loop": 1, "early": 2}


def attention_release() -> int:
    """``SPECCAL_ATTN_RELEASE``: when an attention split program lets the next kernel launch
    under PDL: ``start`` (default, right after its wait), ``loop`` (after its KV loop) or
    ``early`` (before its wait: the successor's programs launch while the kernel before the
    attention still runs). A tuning switch for benchmarks, read at launch (graph capture)."""
    return _ATTN_RELEASE[_env_choice("SPECCAL_ATTN_RELEASE", "start", _ATTN_RELEASE,
                                     "start, loop or early")]


def attention_reduce_early(successor_panel: bool | None = None) -> bool:
    """``SPECCAL_ATTN_REDUCE_RELEASE``: whether the split-KV reduce kernel lets its successor
    (the o projection) launch before its own PDL wait, so the successor's programs are resident
    while the split kernel still runs: ``early``, ``wait`` (after it) or ``auto`` (default:
    early where the o projection is a register panel, which loads its weights in that time;
    ``successor_panel`` says whether it is, None: wherever panels are on, ``SPECCAL_GEMV_PANEL``).
    A streaming GEMV launched that early was slower on the H200: B=1 verify +145 us, B=2 +77 us
    (bench/RESULTS.md). A switch for benchmarks, read at launch (graph capture)."""
    value = _env_choice("SPECCAL_ATTN_REDUCE_RELEASE", "auto", ("auto", "early", "wait"),
                        "auto, early or wait")
    if value != "auto":
        return value == "early"
    return panel_enabled() if successor_panel is None else bool(successor_panel)


def attention_prewait(rows: int) -> bool:
    """``SPECCAL_ATTN_PREWAIT``: whether the attention split kernel reads vouched-for metadata
    before its PDL wait (``ops.paged_attention(meta_settled=True)``; ``SPECCAL_PREWAIT=0`` also
    turns it off) for a plan of ``rows`` query rows per request: ``rows`` (default) only for
    multi-row (verification) plans, ``1`` always, ``0`` never. On the H200 the early reads made
    the B=1 decode step ~50 us slower and the B=1 verify step ~18 us faster (two runs,
    bench/RESULTS.md): where the predecessor has already finished, a dependent chain before the
    wait only adds latency."""
    value = _env_choice("SPECCAL_ATTN_PREWAIT", "rows", ("rows", "0", "1"), "rows, 0 or 1")
    return value == "1" or (value == "rows" and rows > 1)


def attention_warps(default: int) -> int:
    """``SPECCAL_ATTN_WARPS``: warps per attention split / reduce program (``4`` or ``8``;
    unset: ``default``). A tuning switch for benchmarks, read at launch (graph capture)."""
    value = _env_choice("SPECCAL_ATTN_WARPS", str(default), ("4", "8"), "4 or 8")
    return int(value)


def attention_stages(default: int) -> int:
    """``SPECCAL_ATTN_STAGES``: software-pipeline stages of the attention split kernel's K/V
    loop, 1-4 (unset: ``default``). A tuning switch for benchmarks, read at launch (graph
    capture)."""
    value = _env_choice("SPECCAL_ATTN_STAGES", str(default), ("1", "2", "3", "4"), "1, 2, 3 or 4")
    return int(value)


def attention_block_n(default: int) -> int:
    """``SPECCAL_ATTN_BLOCK_N``: KV tokens per tile of a split plan (``ops.plan_splits``; a power
    of two in [16, 256]; unset: ``default``). A tuning switch for benchmarks, read when a plan is
    made (graph capture)."""
    return _tile_switch("SPECCAL_ATTN_BLOCK_N", default)


def _tile_switch(var: str, default: int) -> int:
    """A KV tile switch ``var``: a power of two in [16, 256] (unset: ``default``)."""
    return _pow2_switch(var, default, 256, 16)


def norm_defer() -> str:
    """``SPECCAL_NORM_DEFER``: which RMSNorms of the fused layer are deferred into the GEMVs
    around them (``ops.linear_deferred_norm``): ``o`` the post-attention norm (o projection
    epilogue -> gate/up row scale: one launch fewer per layer, -40 us per B=1 decode step on the
    H200); ``all`` also each layer's input norm (down projection's folded split-K reduce -> next
    QKV row scale); ``rows`` (default) ``o``, and the input norm too where a step has
    ``INPUT_DEFER_ROWS`` rows (``defer_input_norm``); ``0`` none. Read at capture."""
    return _env_choice("SPECCAL_NORM_DEFER", "rows", ("rows", "o", "all", "0"),
                       "rows, o, all or 0")


# rows of a step whose input norm ``rows`` defers: on the H200 the deferred input norm measured
# -21 us at B=1 verification (6 rows) and -16 us at B=8 decode (8), but +30 us at B=1 decode
# (one row: the counter round trip costs what the reduce launch did) and +37 us at B=8
# verification (48 rows), bench/KERNEL_NOTES.md v10; -25 us at B=2 verification (12 rows), +4
# at B=4 (24 rows), v13
INPUT_DEFER_ROWS = (2, 16)


def input_defer_max() -> int:
    """``SPECCAL_INPUT_DEFER_MAX``: the most rows of a step whose input norm ``rows`` defers
    (unset: ``INPUT_DEFER_ROWS``' upper end). A tuning switch for benchmarks, read at capture."""
    value = _env_int("SPECCAL_INPUT_DEFER_MAX", 1)
    return INPUT_DEFER_ROWS[1] if value is None else value


def defer_input_norm(rows: int) -> bool:
    """Whether the fused layers of a ``rows``-row step defer each layer's input RMSNorm into the
    next QKV GEMV (``norm_defer``)."""
    mode = norm_defer()
    return mode == "all" or (mode == "rows" and INPUT_DEFER_ROWS[0] <= rows <= input_defer_max())


_ARRIVAL: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(pool: str, device: torch.device, needed: int,
                     slots: int = 1 << 16) -> torch.Tensor | None:
    """Per-device int32 arrival counters of a folded reduce (``pool``: one set per kernel family,
    so two families never share a slot), zeros that the kernels reset after use. Allocated once,
    outside any CUDA graph capture: a capture that finds none (or fewer than ``needed``) gets
    None, and its caller takes the reduce launch instead of allocating in the graph's pool."""
    key = (pool, device)
    cnt = _ARRIVAL.get(key)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = _ARRIVAL[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    return cnt if needed <= cnt.numel() else None
