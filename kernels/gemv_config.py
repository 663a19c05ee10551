"""Launch configs of the skinny GEMM (``gemv``): the tuned table, the heuristic, the tile width.

Owns ``GemvConfig`` and ``pick_config`` without importing Triton, so the dispatcher and the
pure-torch references can ask for the same config as the kernel (``argmax_tile_width``: the
column tile of the LM head's argmax partials, which the reference must reproduce on a CPU-only
machine). Configs are tuned on an H200 (bench/KERNEL_NOTES.md). The tuning switches come from the
caller's ``KernelConfig.gemv`` (:class:`~speccal.kernels.config.GemvTuning`); ``launch_config``
is memoised per (shape, epilogue, tuning), so a launch config is resolved once per shape, at
capture or first use, not per launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from speccal.base.errors import InputError
from speccal.kernels.config import DEFAULT_KERNELS, GemvOverride, GemvTuning

__all__ = ["GemvConfig", "argmax_tile_width", "block_rows", "deferred_norm_tiles", "k_splits",
           "launch_config", "panel_fits", "pick_config", "resolve"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the skinny GEMM (all powers of two)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fma: bool = False
    panel: bool = False  # weights preloaded into registers before the PDL wait (panel_fits)
    prefetch: int | None = None  # weight tiles per program into L2 before the wait (None: default)


def _cfg(bn: int, bk: int, split: int, stages: int = 4) -> GemvConfig:
    return GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=stages)


# (N, K) -> [(max_m, config)], first max_m >= m wins. The ~2B preset's shapes, tuned on an H200
# (bench/bench_kernels.py --sweep; runs v1 and v2 in bench/KERNEL_NOTES.md: qkv and o come from
# the wider v2 sweep); other shapes use the heuristic, which encodes the same pattern.
_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig]]] = {
    (12288, 2048): [(64, _cfg(128, 128, 1))],  # gate_up
    (2048, 6144): [(64, _cfg(64, 128, 4))],  # down
    (151936, 2048): [(8, _cfg(64, 256, 1, 3)), (64, _cfg(128, 128, 1))],  # lm_head
    # qkv: 2-8 rows at 64-column tiles (H200, same run: B=1 verify -9 us, B=8 decode -11 us;
    # at 1 row +34 us), bench/RESULTS.md "Register panel"; K tiles of 256 in 3 stages there
    # (against 128 x 4: B=1 verify -7 to -11 us, B=8 decode -4 to -10 us, same run, v11)
    # 9-16 rows (B = 2 verification) at 64 x 128 x 4: -8 us per step, v12; past 16 rows (an M
    # tile of 64, ``block_rows``) 32 x 128 x 6: B = 4 verification -2.3 us per layer, v13
    (4096, 2048): [(1, _cfg(32, 128, 1, 6)), (8, _cfg(64, 256, 1, 3)), (16, _cfg(64, 128, 1)),
                   (64, _cfg(32, 128, 1, 6))],
    (2048, 2048): [(1, _cfg(64, 128, 4)), (64, _cfg(32, 128, 1, 6))],  # o
}


# residual-add launches: o at split 1 (add in the epilogue) measured 6.4 us vs 6.5 + a reduce;
# down keeps split 4 (10.7 us) and adds in the reduce (split 1 measured 13.4 us), H200, M = 1.
# o at <= PANEL_MAX_ROWS rows: the register panel (its weights load while attention runs; 9-16
# rows, an M tile of 16: B=2 verification -170 us against the streaming GEMV, H200, v11); past 16
# rows 16 x 256 x 4 at an M tile of 64 (``block_rows``; at a tile of 32, 32 x 128 x 4 had measured
# 22 us faster at B=4 verification, v12, and the panel in two M tiles +22 to +31 us)
_RESIDUAL_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig]]] = {
    (2048, 2048): [(16, GemvConfig(16, 128, 1, 8, 1, panel=True)), (64, _cfg(16, 256, 1, 4))],
}

# the register panel (``panel``): at most this many rows (one row: CUDA-core FMAs; 2-16: the
# tensor cores, an M tile of 8 or 16; 32 spills on sm_90) and this many weight bytes per
# program (64 KB: 64 registers per thread at 8 warps, beside an attention program on the SM)
PANEL_MAX_ROWS = 16
# the panel kernel's largest M tile: 32 rows spilled on sm_90 (255 registers, 192 KB of shared
# memory); 17-32 rows run as two tiles of 16 (``gemv._panel_kernel``'s TWO), so a panel serves
# at most 2 * PANEL_TILE_M rows
PANEL_TILE_M = 16
PANEL_MAX_BYTES = 64 * 1024


def _override(m: int, n: int, k: int, tuning: GemvTuning) -> GemvConfig | None:
    """``tuning.overrides``: the first :class:`~speccal.kernels.config.GemvOverride` of an
    ``(N, K)`` product that covers ``m`` rows replaces the tables' config, whatever the epilogue
    (benchmark variants: ``bench_decode --variants``)."""
    o: GemvOverride | None = tuning.override_for(m, n, k)
    if o is None:
        return None
    return GemvConfig(o.block_n, o.block_k, o.split_k, o.num_warps, o.num_stages, panel=o.panel,
                      prefetch=o.prefetch)


# shared memory the streaming GEMV's pipeline stages may take (x and weight tiles per stage; the
# sm_90 limit per program is 227 KB, the rest is left to the epilogue's layout conversions)
STAGE_BYTES = 224 * 1024


def resolve(cfg: GemvConfig, m: int, k: int, element_size: int,
            tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> GemvConfig:
    """The config a launch of ``m`` rows, K ``k``, runs: a register-panel config that is switched
    off (``tuning.panel`` false) or does not fit (``panel_fits``) becomes the streaming
    kernel's split-1 config at a column tile of at least 16 (``tl.dot``'s minimum); a streaming
    config whose stages of ``[block_rows(m), block_k]`` x and ``[block_n, block_k]`` weight
    tiles would pass ``STAGE_BYTES`` keeps as many stages as fit (at least one; fp32 at an M
    tile of 64, for one)."""
    if cfg.panel and not (tuning.panel and panel_fits(m, k, cfg, element_size, tuning)):
        cfg = GemvConfig(block_n=max(16, cfg.block_n), block_k=256, split_k=1, num_warps=4,
                         num_stages=4)
    if cfg.panel:
        return cfg
    stage = (block_rows(m, cfg.fma, tuning) + cfg.block_n) * cfg.block_k * element_size
    stages = max(1, min(cfg.num_stages, STAGE_BYTES // stage))
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def panel_fits(m: int, k: int, cfg: GemvConfig, element_size: int,
               tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> bool:
    """Whether the register panel of ``cfg`` serves ``m`` rows of a K-``k`` product (at most
    ``tuning.panel_max_rows`` rows, ``PANEL_MAX_BYTES`` of weights per program)."""
    pad = 1 << max(0, k - 1).bit_length()
    return m <= tuning.panel_max_rows and cfg.block_n * pad * element_size <= PANEL_MAX_BYTES


def block_rows(m: int, fma: bool = False, tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> int:
    """Rows of the streaming GEMV's M tile at ``m`` rows: every row in one tile. CUDA-core FMAs
    (``fma``): the rows' power of two. ``tl.dot``: 16 at one row; at 2-16 rows the power of two,
    at least ``tuning.min_block_m`` (Triton pads a smaller tile itself); past 16 rows at least
    ``tuning.wide_block_m`` (64: 24 rows in a 32-row tile measured slower in every product,
    bench/KERNEL_NOTES.md v13)."""
    if m < 1:
        raise InputError("m", m, "rows >= 1")
    pad = 1 << (m - 1).bit_length()
    if fma:
        return pad
    if m == 1:
        return 16
    return max(tuning.min_block_m, pad, tuning.wide_block_m if pad > 16 else 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _heuristic(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    # v1 sweep: one wave of ~100-130 programs streaming long K panels beat more, shorter ones
    block_n = 128 if n >= 8192 else 64
    block_k = 128
    tiles = _cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return _cfg(block_n, block_k, split)


def pick_config(m: int, n: int, k: int, num_sms: int = 132, epilogue: str | None = None,
                tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> GemvConfig:
    """Config for an ``[m, k] x [n, k]^T`` product: the tuned table, else a heuristic.

    ``epilogue``: ``"residual"`` looks in ``_RESIDUAL_TABLE`` first (split 1 where adding in the
    GEMV's epilogue beats a split-K reduce that adds); ``"silu_mul"`` and ``"argmax"`` force
    split 1, a split-K entry becoming one program per ``block_n / split_k`` rows (same program
    count).
    """
    first = _RESIDUAL_TABLE.get((n, k), []) if epilogue == "residual" else []
    table = (c for max_m, c in first + _TABLE.get((n, k), []) if m <= max_m)
    cfg = _override(m, n, k, tuning) or next(table, None) or _heuristic(m, n, k, num_sms)
    if epilogue in ("silu_mul", "argmax") and cfg.split_k > 1:
        cfg = replace(cfg, block_n=max(16, cfg.block_n // cfg.split_k), split_k=1, panel=False)
    return cfg


def argmax_tile_width(m: int, n: int, k: int, num_sms: int = 132,
                      config: GemvConfig | None = None,
                      tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> int:
    """Columns per argmax partial of an ``[m, k] x [n, k]^T`` product: the ``block_n`` of the
    GEMV config the argmax epilogue launches with (``config``, else ``pick_config(...,
    epilogue="argmax")``). The partials are ``[m, cdiv(n, width)]``."""
    return (config or pick_config(m, n, k, num_sms, epilogue="argmax", tuning=tuning)).block_n


def k_splits(k: int, cfg: GemvConfig, glu: bool = False) -> tuple[int, int]:
    """``(split, k_per_split)`` of a launch: K split into at most ``cfg.split_k`` panels whose
    length is a multiple of ``block_k`` (SwiGLU: one panel, the epilogue needs whole sums)."""
    split = 1 if glu else max(1, min(cfg.split_k, _cdiv(k, cfg.block_k)))
    k_per_split = _cdiv(_cdiv(k, split), cfg.block_k) * cfg.block_k
    return _cdiv(k, k_per_split), k_per_split


@functools.lru_cache(maxsize=4096)
def launch_config(m: int, n: int, k: int, num_sms: int = 132, epilogue: str | None = None,
                  element_size: int = 2, config: GemvConfig | None = None,
                  tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> GemvConfig:
    """The config an ``[m, k] x [n, k]^T`` launch runs (``element_size`` bytes per element):
    ``config``, else ``pick_config``'s, through ``resolve``. Memoised: every argument is a
    value, so one (shape, epilogue, tuning) is resolved once."""
    cfg = config or pick_config(m, n, k, num_sms, epilogue=epilogue, tuning=tuning)
    return resolve(cfg, m, k, element_size, tuning)


def deferred_norm_tiles(m: int, n: int, k: int, num_sms: int = 132, element_size: int = 2,
                        tuning: GemvTuning = DEFAULT_KERNELS.gemv) -> tuple[int, bool]:
    """``(P, folded)`` of a deferred norm's producer GEMV (``x [m, k] @ w [n, k].T`` added into
    a residual, ``element_size`` bytes per element; ``ops.linear_deferred_norm``): its column
    tiles, and whether its config splits K, so that the last program of each column tile
    reduces it (arrival counters)."""
    cfg = launch_config(m, n, k, num_sms, "residual", element_size, None, tuning)
    return -(-n // cfg.block_n), k_splits(k, cfg)[0] > 1
