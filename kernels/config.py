"""The kernel configuration: one frozen, validated value that decides which kernels run and how.

This module owns :class:`KernelConfig` and its small typed groups (:class:`PdlConfig`,
:class:`GemvTuning` with its typed :class:`GemvOverride` list, :class:`AttentionTuning`,
:class:`NormFusion`, :class:`Precision`, :class:`LinearAttentionTuning`). Library code receives a ``KernelConfig`` from its caller
(``speccal.runner`` threads the engine's ``ExecutionPath.kernels`` to every op) and never reads
the process environment. :meth:`KernelConfig.from_env` builds one from ``SPECCAL_*`` variables
for benchmarks only (``bench/``): it is the one place in the package that reads ``os.environ``.

Every default is the configuration measured fastest on the H200 (bench/KERNEL_NOTES.md); the
comments next to each default say which run showed it. ``to_dict`` is the nested JSON object a
cost table records (``compatibility.kernels.config``) and ``digest`` its 16-hex-digit SHA-256
(``speccal.costmodel.compat.kernel_digest``: the same function). No torch import: the CLI and
the cost-model side may build and print configs without a GPU stack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from speccal.base.digest import json_digest
from speccal.base.errors import InputError

__all__ = [
    "AttentionTuning",
    "DEFAULT_KERNELS",
    "ENV_VARS",
    "GemvOverride",
    "GemvTuning",
    "KernelConfig",
    "LinearAttentionTuning",
    "NormFusion",
    "PdlConfig",
    "Precision",
]


def _name(group: str, name: str) -> str:
    return f"kernels.{group}.{name}" if group else f"kernels.{name}"


def _check_choice(group: str, name: str, value, choices) -> None:
    if value not in choices:
        raise InputError(_name(group, name), value, f"one of {', '.join(map(str, choices))}")


def _check_int(group: str, name: str, value, minimum: int, *, optional: bool = False,
               pow2: bool = False, maximum: int | None = None) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    ok = ok and (maximum is None or value <= maximum) and (not pow2 or not value & (value - 1))
    if not ok:
        what = "a power of two" if pow2 else "an integer"
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InputError(_name(group, name), value,
                         f"{what} {bounds}" + (" or null (built-in default)" if optional else ""))


def _check_bool(group: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise InputError(_name(group, name), value, "true or false")


@dataclass(frozen=True)
class PdlConfig:
    """Programmatic dependent launch (Hopper and newer; off elsewhere whatever the mode).

    ``mode``: ``off``; ``early`` (every kernel lets its successor launch right after its own
    wait); ``late`` (default; GEMVs release only after their K loop: -5 % per decode step on the
    H200, and early release made the 1-8 row GEMV chain slower, KERNEL_NOTES v4).
    """

    mode: str = "late"

    def __post_init__(self) -> None:
        _check_choice("pdl", "mode", self.mode, ("off", "early", "late"))

    @property
    def level(self) -> int:
        """0 off, 1 early, 2 late (the kernels' ``PDL`` constexpr)."""
        return {"off": 0, "early": 1, "late": 2}[self.mode]


@dataclass(frozen=True)
class GemvOverride:
    """One launch config that replaces the tuned table's for an ``(n, k)`` product at
    ``<= max_m`` rows (whatever the epilogue); the first matching override wins."""

    n: int
    k: int
    max_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    panel: bool = False
    prefetch: int | None = None  # weight tiles per program into L2 before the wait

    def __post_init__(self) -> None:
        for name in ("n", "k", "max_m", "block_n", "block_k", "split_k", "num_warps",
                     "num_stages"):
            _check_int("gemv.overrides", name, getattr(self, name), 1)
        _check_bool("gemv.overrides", "panel", self.panel)
        _check_int("gemv.overrides", "prefetch", self.prefetch, 0, optional=True)

    SYNTAX = "N:K:MAX_M=block_n/block_k/split_k/num_warps/num_stages[/panel][/pfT]"

    @classmethod
    def parse(cls, entry: str, field_name: str = "kernels.gemv.overrides") -> GemvOverride:
        """Parse ``N:K:MAX_M=block_n/block_k/split_k/num_warps/num_stages[/panel][/pfT]``."""
        try:
            shape, _, rest = entry.partition("=")
            n, k, max_m = (int(v) for v in shape.split(":"))
            parts = rest.split("/")
            extra = parts[5:]
            panel = extra[:1] == ["panel"]
            pf = extra[panel:]
            if len(parts) < 5 or len(pf) > 1 or (pf and not pf[0].startswith("pf")):
                raise ValueError(entry)
            prefetch = int(pf[0][2:]) if pf else None
            bn, bk, split, warps, stages = (int(v) for v in parts[:5])
            return cls(n, k, max_m, bn, bk, split, warps, stages, panel=panel, prefetch=prefetch)
        except (ValueError, InputError):
            raise InputError(field_name, entry, cls.SYNTAX) from None


@dataclass(frozen=True)
class GemvTuning:
    """The skinny GEMM (``gemv``): register panel, M tiles, L2 prefetch, epilogue options."""

    panel: bool = True  # the tables' register-panel configs apply (else the streaming kernel)
    panel_max_rows: int = 16  # most rows a panel serves (32 spilled on sm_90), pow2 <= 32
    panel_chunks: int = 4  # K chunks of the panel's batched dot at 2-8 rows, pow2
    panel_min_block_m: int = 8  # smallest M tile of the panel dot: B=1 verify -30 us vs 16, v10
    panel_preconvert: bool = False  # convert panel weights to dot registers before the wait
    min_block_m: int = 16  # smallest streaming M tile at 2-16 rows, pow2 <= 64
    wide_block_m: int = 64  # streaming M tile past 16 rows: wgmma, B=4 verify -121 us, v13
    prefetch_tiles: int = 2  # weight tiles per program into L2 before the PDL wait, v7
    defer_scale: str = "auto"  # deferred norm's row scale after the K loop: auto (> 16 rows)
    argmax_keys: bool = True  # LM head folds each row's argmax into one packed key
    overrides: tuple[GemvOverride, ...] = ()

    def __post_init__(self) -> None:
        g = "gemv"
        for name in ("panel", "panel_preconvert", "argmax_keys"):
            _check_bool(g, name, getattr(self, name))
        _check_int(g, "panel_max_rows", self.panel_max_rows, 1, pow2=True, maximum=32)
        _check_int(g, "panel_chunks", self.panel_chunks, 1, pow2=True, maximum=1 << 16)
        _check_int(g, "panel_min_block_m", self.panel_min_block_m, 1, pow2=True, maximum=16)
        _check_int(g, "min_block_m", self.min_block_m, 1, pow2=True, maximum=64)
        _check_int(g, "wide_block_m", self.wide_block_m, 32, pow2=True, maximum=64)
        _check_int(g, "prefetch_tiles", self.prefetch_tiles, 0)
        _check_choice(g, "defer_scale", self.defer_scale, ("auto", "late", "early"))
        overrides = tuple(self.overrides)
        for i, o in enumerate(overrides):
            if not isinstance(o, GemvOverride):
                raise InputError(f"kernels.gemv.overrides[{i}]", o, "a GemvOverride")
        object.__setattr__(self, "overrides", overrides)

    def override_for(self, m: int, n: int, k: int) -> GemvOverride | None:
        """The first override of an ``(n, k)`` product that covers ``m`` rows, else None."""
        return next((o for o in self.overrides if (o.n, o.k) == (n, k) and m <= o.max_m), None)

    def scale_late(self, rows: int) -> bool:
        """Whether a deferred norm's consumer of ``rows`` rows reduces its row scales after its
        K loop: ``late``, ``early``, or ``auto`` (past 16 rows: B=4 verify -14 / -16 us, B=1
        +5 / +6 us on the H200, v13)."""
        return self.defer_scale == "late" or (self.defer_scale == "auto" and rows > 16)


@dataclass(frozen=True)
class AttentionTuning:
    """The split-KV paged attention: plan sizes, merge strategy, tiles, PDL handshakes.

    ``None`` in an optional field means the built-in default of ``speccal.kernels.ops``'s
    planner (recorded as null: the planner's rule, not a number, is what ran).
    """

    fold: str = "auto"  # fold the split merge into the split kernel: auto (ops.fold_wanted) | on | off
    fold_max_merge: int | None = None  # the folded merge's work limit
    spread: str = "off"  # spread merge: off (B=1 verify +57 us when on, v11) | auto | on
    decode_splits: int | None = None  # split cap of 1-row plans
    verify_halve: bool = True  # verification plans take half the 1-row plan's splits
    verify_splits: int | None = None  # split cap of verification plans
    verify_block_n: int | None = None  # KV tile of the wide verification plans, pow2 16-256
    block_n: int | None = None  # KV tile of a split plan, pow2 16-256
    min_block_m: int = 2  # smallest M tile (rows x GQA group): -7 us at B=1 decode vs 16, v10
    poll: bool = False  # register-panel o projection starts on attention's flag
    prefetch_tiles: int = 0  # K/V tiles per split program into L2 before the PDL wait
    release: str = "start"  # when a split program releases its successor: start | loop | early
    reduce_release: str = "auto"  # reduce releases the o projection: auto (panel) | early | wait
    prewait: str = "rows"  # read vouched metadata before the wait: rows (verify only) | on | off
    warps: int | None = None  # warps per split / reduce program: 4 | 8
    stages: int | None = None  # pipeline stages of the K/V loop: 1-4

    def __post_init__(self) -> None:
        a = "attention"
        _check_choice(a, "fold", self.fold, ("auto", "on", "off"))
        _check_choice(a, "spread", self.spread, ("auto", "on", "off"))
        _check_choice(a, "release", self.release, ("start", "loop", "early"))
        _check_choice(a, "reduce_release", self.reduce_release, ("auto", "early", "wait"))
        _check_choice(a, "prewait", self.prewait, ("rows", "on", "off"))
        for name in ("verify_halve", "poll"):
            _check_bool(a, name, getattr(self, name))
        for name in ("fold_max_merge", "decode_splits", "verify_splits"):
            _check_int(a, name, getattr(self, name), 1, optional=True)
        for name in ("verify_block_n", "block_n"):
            _check_int(a, name, getattr(self, name), 16, optional=True, pow2=True, maximum=256)
        _check_int(a, "min_block_m", self.min_block_m, 1, pow2=True, maximum=16)
        _check_int(a, "prefetch_tiles", self.prefetch_tiles, 0)
        if self.warps is not None:
            _check_choice(a, "warps", self.warps, (4, 8))
        _check_int(a, "stages", self.stages, 1, optional=True, maximum=4)

    @property
    def fold_override(self) -> bool | None:
        """True / False force / forbid folding; None leaves it to ``ops.fold_wanted``."""
        return None if self.fold == "auto" else self.fold == "on"

    @property
    def spread_override(self) -> bool | None:
        """True / False force / forbid the spread merge; None leaves it to ``ops.spread_wanted``."""
        return None if self.spread == "auto" else self.spread == "on"

    @property
    def release_level(self) -> int:
        return {"start": 0, "loop": 1, "early": 2}[self.release]

    def reduce_early(self, successor_panel: bool) -> bool:
        """Whether the split-KV reduce lets the o projection launch before its own wait: a
        streaming GEMV launched that early was slower (B=1 verify +145 us, B=2 +77 us)."""
        if self.reduce_release != "auto":
            return self.reduce_release == "early"
        return bool(successor_panel)

    def prewait_rows(self, rows: int) -> bool:
        """Whether a plan of ``rows`` query rows reads vouched metadata before its PDL wait
        (B=1 decode ~50 us slower, B=1 verify ~18 us faster on the H200)."""
        return self.prewait == "on" or (self.prewait == "rows" and rows > 1)


@dataclass(frozen=True)
class NormFusion:
    """Which RMSNorms of the fused layer are deferred into the GEMVs around them.

    ``defer``: ``o`` the post-attention norm (-40 us per B=1 decode step); ``all`` also each
    layer's input norm; ``rows`` (default) ``o``, plus the input norm at 2..``input_defer_max``
    rows (-21 us at B=1 verify, +30 us at one row, v10; -25 us at 12 rows, v13); ``off`` none.
    """

    defer: str = "rows"
    input_defer_max: int = 16

    def __post_init__(self) -> None:
        _check_choice("norm", "defer", self.defer, ("rows", "o", "all", "off"))
        _check_int("norm", "input_defer_max", self.input_defer_max, 1)

    @property
    def defer_post(self) -> bool:
        return self.defer != "off"

    def defer_input(self, rows: int) -> bool:
        """Whether a ``rows``-row step defers each layer's input norm into the next QKV GEMV."""
        return self.defer == "all" or (self.defer == "rows" and 2 <= rows <= self.input_defer_max)


@dataclass(frozen=True)
class Precision:
    """Matrix-unit precision of the Triton dots.

    ``fp32_dot``: the ``input_precision`` of ``tl.dot`` on float32 operands. ``ieee`` (default)
    is true fp32, so an fp32 run matches transformers token for token; ``tf32`` / ``tf32x3`` trade
    that for speed. bf16 / fp16 operands always take the native tensor-core path.
    """

    fp32_dot: str = "ieee"

    def __post_init__(self) -> None:
        _check_choice("precision", "fp32_dot", self.fp32_dot, ("ieee", "tf32", "tf32x3"))

    def dot(self, dtype_name: str) -> str:
        """The ``input_precision`` for operands of ``dtype_name`` (``float32``, ``bfloat16``...)."""
        return self.fp32_dot if dtype_name == "float32" else "tf32"


@dataclass(frozen=True)
class LinearAttentionTuning:
    """Which kernels run a hybrid target's gated delta-net decode / verify (prefill always takes
    the chunked path: ``fla``'s chunked kernel on CUDA, the torch chunked form on CPU).

    ``impl``: ``fused`` (default: four launches per layer, ``speccal.kernels.gated_delta``: the
    gates, conv1d state update + SiLU, the delta rule over every row with in-kernel q/k l2norm,
    its state read once and written once, every row's snapshot in the same launch, then the
    gated RMSNorm; on CUDA tensors, or any under Triton's interpreter; and the hybrid layers'
    fused launch plan on CUDA: zero-centred norms as one ``ops.rms_norm`` or folded into the
    GEMV before them, dense MLPs and output projections as GEMVs with the residual and the next
    norm in their launch, Qwen3.5's four projections as one GEMV, the attention rows' q/k norms,
    partial rotary and KV write as one launch: ``speccal.runner.hybrid``) or ``fla`` (torch ops
    around ``fla``'s fused recurrent kernel; the snapshot strategy calls it once per verified
    row). ``fused`` became the default once it emitted transformers' fp32 greedy tokens under
    both state strategies on CUDA and ran qwen3.5-2b's B = 1 decode step in 1.92 ms against
    ``fla``'s 4.45 ms (H100, b7e53da, bench/RESULTS.md). Tables recorded before this group
    existed ran ``fla`` (``_LATE_GROUPS``); an engine without linear-attention layers records
    the group at that value (:meth:`KernelConfig.for_model`), so a dense table's digest does not
    depend on it. ``block_v``: the delta rule's value-dim tile per program (None: 8, fla's),
    ``warps``: its warps (None: 1, fla's).
    """

    impl: str = "fused"
    block_v: int | None = None
    warps: int | None = None

    def __post_init__(self) -> None:
        g = "linear_attention"
        _check_choice(g, "impl", self.impl, ("fla", "fused"))
        _check_int(g, "block_v", self.block_v, 1, optional=True, pow2=True, maximum=256)
        if self.warps is not None:
            _check_choice(g, "warps", self.warps, (1, 2, 4, 8))

    @property
    def is_fused(self) -> bool:
        return self.impl == "fused"


@dataclass(frozen=True)
class ExpertTiles:
    """Launch tiles of the routed experts' two Triton kernels (``fused_moe.fused_moe_triton``):
    gate/up's and down's ``BLOCK_N`` x ``BLOCK_K`` (powers of two, >= 16: ``tl.dot``'s tiles),
    the warps of both and their software-pipeline stages (None: Triton's default). Not part of
    :class:`KernelConfig` (nor of a table's digest): the defaults are what ``ops.fused_moe``
    runs, down half as wide and twice as deep as gate/up, so a decode round's few active blocks
    spread over twice the programs (hidden / 32 per block) with half the K steps;
    ``bench/bench_moe_tiles.py`` times others on a GPU."""

    gate_up_n: int = 64
    gate_up_k: int = 64
    down_n: int = 32
    down_k: int = 128
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        g = "ExpertTiles"
        for name in ("gate_up_n", "gate_up_k", "down_n", "down_k"):
            _check_int(g, name, getattr(self, name), 16, pow2=True)
        _check_choice(g, "num_warps", self.num_warps, (1, 2, 4, 8, 16))
        _check_int(g, "num_stages", self.num_stages, 1, optional=True, maximum=8)

    def label(self) -> str:
        """``gu64x64-d32x128-w4-s-`` (stages ``-``: Triton's default)."""
        stages = "-" if self.num_stages is None else self.num_stages
        return (f"gu{self.gate_up_n}x{self.gate_up_k}-d{self.down_n}x{self.down_k}"
                f"-w{self.num_warps}-s{stages}")

    def launch_options(self) -> dict:
        """The Triton launch options of both kernels."""
        out = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            out["num_stages"] = self.num_stages
        return out


DEFAULT_TILES = ExpertTiles()


_GROUPS = {"pdl": PdlConfig, "gemv": GemvTuning, "attention": AttentionTuning,
           "norm": NormFusion, "precision": Precision, "linear_attention": LinearAttentionTuning}
#: groups added after tables were first recorded, each with the value those tables ran under:
#: :meth:`KernelConfig.to_dict` omits a group at that value (a dense engine's default digest
#: stays the shipped tables') and :meth:`KernelConfig.from_dict` reads a missing group as it.
#: Keyed to the recorded value, not to the class default: when a default changes (``fused``
#: for ``linear_attention`` once the H200 has timed it), a table without the group still means
#: what it ran, and the new default is written out
_LATE_GROUPS = {"linear_attention": LinearAttentionTuning(impl="fla")}


@dataclass(frozen=True)
class KernelConfig:
    """Everything that decides which kernels run and with which launch parameters.

    ``backend``: ``auto`` (Triton for CUDA tensors when importable), ``triton`` (refuse when it
    cannot run) or ``reference`` (the pure-torch references everywhere, for bisecting).
    ``prewait``: a kernel whose caller vouches for its inputs reads them before its PDL wait (a
    GEMV's residual, attention's metadata).
    """

    backend: str = "auto"
    prewait: bool = True
    pdl: PdlConfig = field(default_factory=PdlConfig)
    gemv: GemvTuning = field(default_factory=GemvTuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    norm: NormFusion = field(default_factory=NormFusion)
    precision: Precision = field(default_factory=Precision)
    linear_attention: LinearAttentionTuning = field(default_factory=LinearAttentionTuning)

    def __post_init__(self) -> None:
        _check_choice("", "backend", self.backend, ("auto", "triton", "reference"))
        _check_bool("", "prewait", self.prewait)
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise InputError(f"kernels.{name}", getattr(self, name), f"a {cls.__name__}")

    # ------------------------------------------------------------------ records

    def to_dict(self) -> dict[str, Any]:
        """The nested JSON object a table records (overrides as their string form).

        Groups added after tables were first recorded (:data:`_LATE_GROUPS`) are written only
        when they differ from the value those tables ran under, so such a configuration keeps
        the digest the recorded tables carry; :meth:`from_dict` reads a missing group as that
        value."""
        out = asdict(self)
        out["gemv"]["overrides"] = [_override_text(o) for o in self.gemv.overrides]
        for name, recorded in _LATE_GROUPS.items():
            if getattr(self, name) == recorded:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KernelConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an InputError naming them."""
        if not isinstance(data, Mapping):
            raise InputError("kernels", data, "a kernel configuration object")
        top = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - top)
        if unknown:
            raise InputError(f"kernels.{unknown[0]}", data[unknown[0]], f"one of {sorted(top)}")
        kwargs: dict[str, Any] = {k: data[k] for k in ("backend", "prewait") if k in data}
        for name, group in _GROUPS.items():
            if name in _LATE_GROUPS and name not in data:  # what the recorded tables ran
                kwargs[name] = _LATE_GROUPS[name]
                continue
            raw = data.get(name) or {}
            if not isinstance(raw, Mapping):
                raise InputError(f"kernels.{name}", raw, f"an object of {group.__name__} fields")
            block = dict(raw)
            names = {f.name for f in fields(group)}
            bad = sorted(set(block) - names)
            if bad:
                raise InputError(f"kernels.{name}.{bad[0]}", block[bad[0]], f"one of {sorted(names)}")
            if name == "gemv" and "overrides" in block:
                if not isinstance(block["overrides"], (list, tuple)):
                    raise InputError("kernels.gemv.overrides", block["overrides"],
                                     f"a list of {GemvOverride.SYNTAX} strings")
                block["overrides"] = tuple(
                    GemvOverride.parse(o, f"kernels.gemv.overrides[{i}]")
                    for i, o in enumerate(block["overrides"]))
            kwargs[name] = group(**block)
        return cls(**kwargs)

    def digest(self) -> str:
        """16 hex digits of the SHA-256 of the canonical JSON of :meth:`to_dict`
        (``speccal.base.digest.json_digest``, as ``costmodel.compat.kernel_digest``)."""
        return json_digest(self.to_dict(), "kernels")

    def for_model(self, *, linear_attention: bool) -> KernelConfig:
        """This configuration as an engine records it: a group the model never runs (the
        linear-attention one of a model without such layers) at the value recorded tables ran
        under (:data:`_LATE_GROUPS`), so the digest names only kernels that ran."""
        if linear_attention:
            return self
        return replace(self, linear_attention=_LATE_GROUPS["linear_attention"])

    def replace(self, **groups: Any) -> KernelConfig:
        """A copy with whole groups or top-level fields replaced."""
        return replace(self, **groups)

    # ------------------------------------------------------------------ benchmarks

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """Build a config from ``SPECCAL_*`` variables (``ENV_VARS``), for ``bench/`` only.

        Unset variables keep the defaults; a bad value is an InputError naming the variable.
        """
        env = os.environ if environ is None else environ
        groups: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
        top: dict[str, Any] = {}
        for var, (group, name, parse) in ENV_VARS.items():
            raw = env.get(var, "")
            if raw == "":
                continue
            try:
                value = parse(raw)
            except (ValueError, KeyError):
                raise InputError(var, raw, _ENV_EXPECT.get(var, "a valid value")) from None
            (top if group is None else groups[group])[name] = value
        try:
            built = {name: cls_(**groups[name]) for name, cls_ in _GROUPS.items()}
            return cls(**top, **built)
        except InputError as exc:  # name the variable, not the field it sets
            var = next((v for v, (g, n, _) in ENV_VARS.items() if _name(g or "", n) == exc.field),
                       exc.field)
            raise InputError(var, exc.value, exc.expected) from None


DEFAULT_KERNELS = KernelConfig()


def _override_text(o: GemvOverride) -> str:
    text = f"{o.n}:{o.k}:{o.max_m}={o.block_n}/{o.block_k}/{o.split_k}/{o.num_warps}/{o.num_stages}"
    return text + ("/panel" if o.panel else "") + ("" if o.prefetch is None else f"/pf{o.prefetch}")


def _flag(raw: str) -> bool:
    return {"0": False, "1": True}[raw]


def _choice(mapping: Mapping[str, Any]):
    return lambda raw: mapping[raw]


def _overrides(raw: str) -> tuple[GemvOverride, ...]:
    entries = filter(None, raw.replace("|", ";").split(";"))
    return tuple(GemvOverride.parse(e, "SPECCAL_GEMV_OVERRIDE") for e in entries)


_TRI = {"auto": "auto", "0": "off", "1": "on"}

# variable -> (group or None for top level, field, parser): the benchmarks' switches
ENV_VARS: dict[str, tuple[str | None, str, Any]] = {
    "SPECCAL_KERNELS": (None, "backend", _choice({"auto": "auto", "triton": "triton",
                                                  "reference": "reference"})),
    "SPECCAL_PREWAIT": (None, "prewait", _flag),
    "SPECCAL_PDL": ("pdl", "mode", _choice({"0": "off", "1": "early", "late": "late"})),
    "SPECCAL_GEMV_PANEL": ("gemv", "panel", _flag),
    "SPECCAL_PANEL_MAX_ROWS": ("gemv", "panel_max_rows", int),
    "SPECCAL_PANEL_CHUNKS": ("gemv", "panel_chunks", int),
    "SPECCAL_PANEL_MIN_BLOCK_M": ("gemv", "panel_min_block_m", int),
    "SPECCAL_PANEL_PRECVT": ("gemv", "panel_preconvert", _flag),
    "SPECCAL_GEMV_MIN_BLOCK_M": ("gemv", "min_block_m", int),
    "SPECCAL_GEMV_WIDE_BLOCK_M": ("gemv", "wide_block_m", int),
    "SPECCAL_GEMV_PREFETCH": ("gemv", "prefetch_tiles", int),
    "SPECCAL_DEFER_SCALE": ("gemv", "defer_scale", _choice({"auto": "auto", "late": "late",
                                                            "early": "early"})),
    "SPECCAL_ARGMAX_KEYS": ("gemv", "argmax_keys", _flag),
    "SPECCAL_GEMV_OVERRIDE": ("gemv", "overrides", _overrides),
    "SPECCAL_ATTN_FOLD": ("attention", "fold", _choice(_TRI)),
    "SPECCAL_FOLD_MAX_MERGE": ("attention", "fold_max_merge", int),
    "SPECCAL_ATTN_SPREAD": ("attention", "spread", _choice(_TRI)),
    "SPECCAL_DECODE_SPLITS": ("attention", "decode_splits", int),
    "SPECCAL_VERIFY_HALVE": ("attention", "verify_halve", _flag),
    "SPECCAL_VERIFY_SPLITS": ("attention", "verify_splits", int),
    "SPECCAL_VERIFY_BLOCK_N": ("attention", "verify_block_n", int),
    "SPECCAL_ATTN_BLOCK_N": ("attention", "block_n", int),
    "SPECCAL_ATTN_MIN_BLOCK_M": ("attention", "min_block_m", int),
    "SPECCAL_ATTN_POLL": ("attention", "poll", _flag),
    "SPECCAL_ATTN_PREFETCH": ("attention", "prefetch_tiles", int),
    "SPECCAL_ATTN_RELEASE": ("attention", "release", _choice({"start": "start", "loop": "loop",
                                                              "early": "early"})),
    "SPECCAL_ATTN_REDUCE_RELEASE": ("attention", "reduce_release",
                                    _choice({"auto": "auto", "early": "early", "wait": "wait"})),
    "SPECCAL_ATTN_PREWAIT": ("attention", "prewait", _choice({"rows": "rows", "0": "off",
                                                              "1": "on"})),
    "SPECCAL_ATTN_WARPS": ("attention", "warps", int),
    "SPECCAL_ATTN_STAGES": ("attention", "stages", int),
    "SPECCAL_NORM_DEFER": ("norm", "defer", _choice({"rows": "rows", "o": "o", "all": "all",
                                                      "0": "off"})),
    "SPECCAL_INPUT_DEFER_MAX": ("norm", "input_defer_max", int),
    "SPECCAL_FP32_DOT": ("precision", "fp32_dot", _choice({"ieee": "ieee", "tf32": "tf32",
                                                           "tf32x3": "tf32x3"})),
    "SPECCAL_LINEAR_ATTENTION": ("linear_attention", "impl", _choice({"fla": "fla",
                                                                      "fused": "fused"})),
    "SPECCAL_DELTA_BLOCK_V": ("linear_attention", "block_v", int),
    "SPECCAL_DELTA_WARPS": ("linear_attention", "warps", int),
}

_ENV_EXPECT = {
    "SPECCAL_KERNELS": "auto, triton or reference",
    "SPECCAL_PDL": "0, 1 or late",
    "SPECCAL_DEFER_SCALE": "auto, late or early",
    "SPECCAL_ATTN_FOLD": "auto, 0 or 1",
    "SPECCAL_ATTN_SPREAD": "auto, 0 or 1",
    "SPECCAL_ATTN_RELEASE": "start, loop or early",
    "SPECCAL_ATTN_REDUCE_RELEASE": "auto, early or wait",
    "SPECCAL_ATTN_PREWAIT": "rows, 0 or 1",
    "SPECCAL_NORM_DEFER": "rows, o, all or 0",
    "SPECCAL_FP32_DOT": "ieee, tf32 or tf32x3",
    "SPECCAL_LINEAR_ATTENTION": "fla or fused",
    "SPECCAL_GEMV_OVERRIDE": GemvOverride.SYNTAX,
}
for _var, (_g, _n, _p) in ENV_VARS.items():
    _ENV_EXPECT.setdefault(_var, "0 or 1" if _p is _flag else "an integer")
