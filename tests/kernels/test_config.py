"""The kernel configuration (``speccal.kernels.config``): validation, records, digest, from_env.

CPU only, no torch: ``KernelConfig`` is a plain frozen value. The last test walks the library
packages' sources and holds them to "library code never reads ``os.environ``": the one read
allowed is ``KernelConfig.from_env``'s, which the benchmarks call.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speccal.base.errors import InputError
from speccal.kernels.config import (
    _LATE_GROUPS,
    DEFAULT_KERNELS,
    ENV_VARS,
    AttentionTuning,
    GemvOverride,
    GemvTuning,
    KernelConfig,
    LinearAttentionTuning,
    NormFusion,
    PdlConfig,
    Precision,
)

GROUPS = {"pdl": PdlConfig, "gemv": GemvTuning, "attention": AttentionTuning,
          "norm": NormFusion, "precision": Precision, "linear_attention": LinearAttentionTuning}
OVERRIDE = GemvOverride(4096, 2048, 8, 64, 128, 1, 4, 4)
PANEL_OVERRIDE = GemvOverride(2048, 2048, 16, 16, 128, 1, 8, 1, panel=True, prefetch=4)


def _get(cfg: KernelConfig, path: str):
    """``cfg``'s field at ``path`` (``"prewait"``, ``"attention.verify_splits"``)."""
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _set(cfg: KernelConfig, path: str, value) -> KernelConfig:
    """A copy of ``cfg`` with the field at ``path`` replaced."""
    group, _, name = path.rpartition(".")
    if not group:
        return cfg.replace(**{name: value})
    return cfg.replace(**{group: dataclasses.replace(getattr(cfg, group), **{name: value})})


def _all_fields() -> set[str]:
    top = {f.name for f in dataclasses.fields(KernelConfig) if f.name not in GROUPS}
    return top | {f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}


# ------------------------------------------------------------------------------ construction


# (group class, bad field value, field the error names); one or more per field of every group
REFUSED = [
    (KernelConfig, dict(backend="cuda"), "kernels.backend"),
    (KernelConfig, dict(prewait="1"), "kernels.prewait"),
    (KernelConfig, dict(pdl=AttentionTuning()), "kernels.pdl"),
    (KernelConfig, dict(gemv=None), "kernels.gemv"),
    (KernelConfig, dict(attention={"fold": "on"}), "kernels.attention"),
    (KernelConfig, dict(norm="rows"), "kernels.norm"),
    (KernelConfig, dict(precision="ieee"), "kernels.precision"),
    (PdlConfig, dict(mode="on"), "kernels.pdl.mode"),
    (PdlConfig, dict(mode="1"), "kernels.pdl.mode"),
    (GemvTuning, dict(panel=1), "kernels.gemv.panel"),
    (GemvTuning, dict(panel_max_rows=12), "kernels.gemv.panel_max_rows"),
    (GemvTuning, dict(panel_max_rows=64), "kernels.gemv.panel_max_rows"),
    (GemvTuning, dict(panel_chunks=3), "kernels.gemv.panel_chunks"),
    (GemvTuning, dict(panel_chunks=1 << 17), "kernels.gemv.panel_chunks"),
    (GemvTuning, dict(panel_min_block_m=32), "kernels.gemv.panel_min_block_m"),
    (GemvTuning, dict(panel_preconvert="0"), "kernels.gemv.panel_preconvert"),
    (GemvTuning, dict(min_block_m=128), "kernels.gemv.min_block_m"),
    (GemvTuning, dict(min_block_m=0), "kernels.gemv.min_block_m"),
    (GemvTuning, dict(wide_block_m=16), "kernels.gemv.wide_block_m"),
    (GemvTuning, dict(wide_block_m=48), "kernels.gemv.wide_block_m"),
    (GemvTuning, dict(prefetch_tiles=-1), "kernels.gemv.prefetch_tiles"),
    (GemvTuning, dict(prefetch_tiles=True), "kernels.gemv.prefetch_tiles"),  # not an integer
    (GemvTuning, dict(defer_scale="soon"), "kernels.gemv.defer_scale"),
    (GemvTuning, dict(argmax_keys=None), "kernels.gemv.argmax_keys"),
    (GemvTuning, dict(overrides=(OVERRIDE, "4096:2048:8=64/128/1/4/4")),
     "kernels.gemv.overrides[1]"),
    (AttentionTuning, dict(fold="1"), "kernels.attention.fold"),
    (AttentionTuning, dict(fold_max_merge=0), "kernels.attention.fold_max_merge"),
    (AttentionTuning, dict(spread="yes"), "kernels.attention.spread"),
    (AttentionTuning, dict(decode_splits=0), "kernels.attention.decode_splits"),
    (AttentionTuning, dict(decode_splits=2.0), "kernels.attention.decode_splits"),
    (AttentionTuning, dict(verify_halve=2), "kernels.attention.verify_halve"),
    (AttentionTuning, dict(verify_splits=-3), "kernels.attention.verify_splits"),
    (AttentionTuning, dict(verify_block_n=96), "kernels.attention.verify_block_n"),
    (AttentionTuning, dict(verify_block_n=512), "kernels.attention.verify_block_n"),
    (AttentionTuning, dict(block_n=8), "kernels.attention.block_n"),
    (AttentionTuning, dict(min_block_m=32), "kernels.attention.min_block_m"),
    (AttentionTuning, dict(poll="1"), "kernels.attention.poll"),
    (AttentionTuning, dict(prefetch_tiles=-1), "kernels.attention.prefetch_tiles"),
    (AttentionTuning, dict(release="late"), "kernels.attention.release"),
    (AttentionTuning, dict(reduce_release="late"), "kernels.attention.reduce_release"),
    (AttentionTuning, dict(prewait="1"), "kernels.attention.prewait"),
    (AttentionTuning, dict(warps=16), "kernels.attention.warps"),
    (AttentionTuning, dict(stages=0), "kernels.attention.stages"),
    (AttentionTuning, dict(stages=5), "kernels.attention.stages"),
    (NormFusion, dict(defer="0"), "kernels.norm.defer"),
    (NormFusion, dict(input_defer_max=0), "kernels.norm.input_defer_max"),
    (Precision, dict(fp32_dot="fp16"), "kernels.precision.fp32_dot"),
    (LinearAttentionTuning, dict(impl="triton"), "kernels.linear_attention.impl"),
    (LinearAttentionTuning, dict(block_v=12), "kernels.linear_attention.block_v"),
    (LinearAttentionTuning, dict(block_v=0), "kernels.linear_attention.block_v"),
    (LinearAttentionTuning, dict(warps=3), "kernels.linear_attention.warps"),
    (GemvOverride, dict(n=0), "kernels.gemv.overrides.n"),
    (GemvOverride, dict(k=None), "kernels.gemv.overrides.k"),
    (GemvOverride, dict(max_m=0), "kernels.gemv.overrides.max_m"),
    (GemvOverride, dict(block_n=-64), "kernels.gemv.overrides.block_n"),
    (GemvOverride, dict(block_k=0), "kernels.gemv.overrides.block_k"),
    (GemvOverride, dict(split_k=1.0), "kernels.gemv.overrides.split_k"),
    (GemvOverride, dict(num_warps=0), "kernels.gemv.overrides.num_warps"),
    (GemvOverride, dict(num_stages="4"), "kernels.gemv.overrides.num_stages"),
    (GemvOverride, dict(panel="panel"), "kernels.gemv.overrides.panel"),
    (GemvOverride, dict(prefetch=-1), "kernels.gemv.overrides.prefetch"),
]


@pytest.mark.parametrize("cls, bad, field", REFUSED, ids=[field for _, _, field in REFUSED])
def test_construction_refuses_bad_values_naming_the_field(cls, bad, field):
    """Every group validates on construction: an InputError naming the field (dotted from
    ``kernels``), the value found and what was expected."""
    base = dataclasses.asdict(OVERRIDE) if cls is GemvOverride else {}
    with pytest.raises(InputError) as err:
        cls(**{**base, **bad})
    assert err.value.field == field
    if not field.endswith("]"):  # an override list's entry: the entry, not the list
        assert err.value.value == next(iter(bad.values()))
    assert err.value.expected and str(err.value).startswith(f"{field}: got ")


def test_every_field_has_a_refused_value():
    """The table above covers every field of every group (a new field needs a case)."""
    named = {field.removeprefix("kernels.").partition("[")[0] for _, _, field in REFUSED}
    overrides = {f"gemv.overrides.{f.name}" for f in dataclasses.fields(GemvOverride)}
    assert (_all_fields() | overrides) - named == set()


def test_defaults_and_derived_switches():
    """The defaults are the H200 measurements' (bench/KERNEL_NOTES.md), and the small rules
    derived from fields map every value as documented."""
    assert KernelConfig() == DEFAULT_KERNELS
    assert (DEFAULT_KERNELS.backend, DEFAULT_KERNELS.prewait) == ("auto", True)
    assert DEFAULT_KERNELS.pdl.mode == "late" and DEFAULT_KERNELS.precision.fp32_dot == "ieee"
    assert [PdlConfig(mode=m).level for m in ("off", "early", "late")] == [0, 1, 2]
    tri = {"auto": None, "off": False, "on": True}
    assert {v: AttentionTuning(fold=v).fold_override for v in tri} == tri
    assert {v: AttentionTuning(spread=v).spread_override for v in tri} == tri
    assert [AttentionTuning(release=r).release_level for r in ("start", "loop", "early")] == [
        0, 1, 2]
    assert Precision().dot("float32") == "ieee"
    assert Precision(fp32_dot="tf32x3").dot("float32") == "tf32x3"
    assert Precision(fp32_dot="ieee").dot("bfloat16") == "tf32"  # native path: not fp32
    assert GemvTuning(overrides=(OVERRIDE, PANEL_OVERRIDE)).override_for(8, 4096, 2048) == OVERRIDE
    assert GemvTuning(overrides=(OVERRIDE,)).override_for(9, 4096, 2048) is None
    assert GemvTuning(overrides=(OVERRIDE,)).override_for(1, 2048, 4096) is None


def test_configs_are_frozen_hashable_values():
    """Frozen (a launch config is memoised on them), hashable, equal by value; ``replace``
    swaps whole groups or top-level fields; an override list is frozen into a tuple."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_KERNELS.prewait = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_KERNELS.attention.verify_splits = 3
    listed = GemvTuning(overrides=[OVERRIDE])
    assert listed.overrides == (OVERRIDE,) and listed == GemvTuning(overrides=(OVERRIDE,))
    frozen = KernelConfig(gemv=GemvTuning(overrides=(OVERRIDE,)))
    assert hash(KernelConfig(gemv=listed)) == hash(frozen)
    changed = DEFAULT_KERNELS.replace(prewait=False, norm=NormFusion(defer="o"))
    assert (changed.prewait, changed.norm.defer, changed.gemv) == (False, "o", GemvTuning())
    assert DEFAULT_KERNELS.prewait is True  # the original is unchanged


# ------------------------------------------------------------------------------ records

# one valid non-default value per field (the digest must move with each)
CHANGES = {
    "backend": "reference",
    "prewait": False,
    "pdl.mode": "off",
    "gemv.panel": False,
    "gemv.panel_max_rows": 32,
    "gemv.panel_chunks": 8,
    "gemv.panel_min_block_m": 16,
    "gemv.panel_preconvert": True,
    "gemv.min_block_m": 32,
    "gemv.wide_block_m": 32,
    "gemv.prefetch_tiles": 0,
    "gemv.defer_scale": "late",
    "gemv.argmax_keys": False,
    "gemv.overrides": (OVERRIDE,),
    "attention.fold": "on",
    "attention.fold_max_merge": 64,
    "attention.spread": "auto",
    "attention.decode_splits": 8,
    "attention.verify_halve": False,
    "attention.verify_splits": 3,
    "attention.verify_block_n": 64,
    "attention.block_n": 32,
    "attention.min_block_m": 4,
    "attention.poll": True,
    "attention.prefetch_tiles": 2,
    "attention.release": "loop",
    "attention.reduce_release": "wait",
    "attention.prewait": "off",
    "attention.warps": 8,
    "attention.stages": 3,
    "norm.defer": "o",
    "norm.input_defer_max": 8,
    "precision.fp32_dot": "tf32",
    "linear_attention.impl": "fla",
    "linear_attention.block_v": 32,
    "linear_attention.warps": 4,
}


def _everything_changed() -> KernelConfig:
    cfg = DEFAULT_KERNELS
    for path, value in CHANGES.items():
        cfg = _set(cfg, path, value)
    return _set(cfg, "gemv.overrides", (OVERRIDE, PANEL_OVERRIDE))


def test_changes_cover_every_field():
    assert set(CHANGES) == _all_fields()
    for path, value in CHANGES.items():
        assert _get(DEFAULT_KERNELS, path) != value, path


@pytest.mark.parametrize("cfg", [DEFAULT_KERNELS, _everything_changed()], ids=["default", "all"])
def test_to_dict_from_dict_round_trip(cfg):
    """``to_dict`` is plain JSON (overrides in their text form) and ``from_dict`` inverts it,
    also after a trip through JSON text; the groups are nested objects of their fields."""
    data = cfg.to_dict()
    text = json.dumps(data, sort_keys=True, allow_nan=False)
    assert KernelConfig.from_dict(data) == cfg
    assert KernelConfig.from_dict(json.loads(text)) == cfg
    late = {name for name in _LATE_GROUPS if getattr(cfg, name) == _LATE_GROUPS[name]}
    assert set(data) == {f.name for f in dataclasses.fields(KernelConfig)} - late
    for name, cls in GROUPS.items():
        if name not in late:
            assert set(data[name]) == {f.name for f in dataclasses.fields(cls)}


def test_a_late_group_is_keyed_to_the_value_tables_ran_under():
    """A table recorded before ``linear_attention`` existed ran ``fla``: the group is omitted
    at ``fla`` (the shipped digests hold) and a missing group reads as ``fla``, although the
    class default is now ``fused``: ``fused`` is written out, a table without the group reads as
    ``fla`` (another digest than ``fused``'s), and the shipped digest is unchanged."""
    assert LinearAttentionTuning().impl == "fused"
    fla = LinearAttentionTuning(impl="fla")
    fused = DEFAULT_KERNELS
    assert _LATE_GROUPS["linear_attention"] == fla
    assert "linear_attention" not in DEFAULT_KERNELS.replace(linear_attention=fla).to_dict()
    assert fused.to_dict()["linear_attention"]["impl"] == "fused"
    old = {k: v for k, v in fused.to_dict().items() if k != "linear_attention"}
    assert KernelConfig.from_dict(old).linear_attention == fla
    assert KernelConfig.from_dict(old).digest() != fused.digest()
    assert DEFAULT_KERNELS.replace(linear_attention=fla).digest() == "9de3def2bf8cdce0"


def test_for_model_records_the_linear_attention_group_only_where_it_runs():
    """A model without linear-attention layers records the group at the value the tables
    before it ran, whatever was asked (its digest is the shipped dense tables'); a hybrid model
    records what it runs."""
    fla = LinearAttentionTuning(impl="fla")
    for asked in (DEFAULT_KERNELS, DEFAULT_KERNELS.replace(linear_attention=fla),
                  DEFAULT_KERNELS.replace(linear_attention=LinearAttentionTuning(block_v=16))):
        dense = asked.for_model(linear_attention=False)
        assert dense.linear_attention == fla and dense.digest() == "9de3def2bf8cdce0"
        assert asked.for_model(linear_attention=True) is asked
    assert DEFAULT_KERNELS.for_model(linear_attention=True).digest() != "9de3def2bf8cdce0"
    # every other group passes through
    poll = _set(DEFAULT_KERNELS, "attention.poll", True)
    assert poll.for_model(linear_attention=False).attention.poll is True


def test_overrides_are_recorded_in_their_syntax():
    data = _everything_changed().to_dict()
    assert data["gemv"]["overrides"] == ["4096:2048:8=64/128/1/4/4",
                                         "2048:2048:16=16/128/1/8/1/panel/pf4"]
    assert data["attention"]["verify_splits"] == 3 and data["pdl"] == {"mode": "off"}
    assert DEFAULT_KERNELS.to_dict()["attention"]["warps"] is None  # the launch's own: null


def test_from_dict_fills_defaults_and_refuses_unknown_keys():
    # a missing late group reads as the value recorded tables ran (fla), not the class default
    legacy = DEFAULT_KERNELS.for_model(linear_attention=False)
    assert KernelConfig.from_dict({}) == legacy
    assert KernelConfig.from_dict({"attention": {"verify_splits": 3}}) == _set(
        legacy, "attention.verify_splits", 3)
    assert KernelConfig.from_dict(DEFAULT_KERNELS.to_dict()) == DEFAULT_KERNELS
    cases = [
        ({"kernel": {}}, "kernels.kernel"),
        ({"attention": {"splits": 3}}, "kernels.attention.splits"),
        ({"gemv": {"overrides": ["4096:2048:8=64/128/1/4/4", "4096:2048=64"]}},
         "kernels.gemv.overrides[1]"),
        ({"attention": {"warps": 6}}, "kernels.attention.warps"),
        ({"backend": "cuda"}, "kernels.backend"),
        ([("backend", "auto")], "kernels"),
    ]
    for data, field in cases:
        with pytest.raises(InputError) as err:
            KernelConfig.from_dict(data)
        assert err.value.field == field, data


def test_digest_is_stable():
    """16 hex digits of the canonical JSON: equal configs built apart, a JSON round trip and
    another process (another hash seed) give the same digest."""
    cfg = _everything_changed()
    digest = cfg.digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert digest == cfg.digest() == _everything_changed().digest()
    assert KernelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).digest() == digest
    assert KernelConfig().digest() == DEFAULT_KERNELS.digest() != digest
    code = ("import json, sys; from speccal.kernels.config import KernelConfig;"
            "print(KernelConfig.from_dict(json.loads(sys.argv[1])).digest(),"
            " 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg.to_dict())], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [digest, "False"]  # and the config module imports without torch


def test_digest_is_what_a_cost_table_records():
    """``costmodel.compat.kernel_digest`` of ``to_dict`` (what a table records) is the digest."""
    pytest.importorskip("pydantic")  # costmodel's JSON boundary; absent from the GPU image
    from speccal.costmodel.compat import kernel_digest

    for cfg in (DEFAULT_KERNELS, _everything_changed()):
        assert kernel_digest(cfg.to_dict()) == cfg.digest()


def test_the_default_configuration_keeps_the_shipped_tables_digest():
    """Groups added after the shipped tables were recorded (``linear_attention``) are left out
    of ``to_dict`` at the value those tables ran, and a dense engine records the group at that
    value (``for_model``), so a default dense engine still matches those tables' kernel digest
    (no false "kernel digest differs" warning for every existing table); a hybrid engine's
    default (``fused``) is recorded and moves the digest."""
    pytest.importorskip("pydantic")
    from speccal.costmodel.table import load_table

    shipped = [p for p in sorted((Path(__file__).resolve().parents[2] / "tables").glob("*.json"))
               if "schema" not in p.name]
    assert shipped
    dense = DEFAULT_KERNELS.for_model(linear_attention=False)
    for path in shipped:
        kernels = load_table(path).compatibility.kernels
        assert kernels.digest == dense.digest(), path.name
    assert "linear_attention" not in dense.to_dict()
    fused = DEFAULT_KERNELS
    assert fused.to_dict()["linear_attention"]["impl"] == "fused"
    assert KernelConfig.from_dict(fused.to_dict()) == fused
    assert fused.digest() != dense.digest()


def test_digest_moves_with_every_field():
    """Changing any one field (every override field included) changes the digest, and no two
    of those changes collide."""
    seen = {DEFAULT_KERNELS.digest(): "default"}
    for path, value in CHANGES.items():
        digest = _set(DEFAULT_KERNELS, path, value).digest()
        assert digest not in seen, (path, seen.get(digest))
        seen[digest] = path
    alternative = dict(n=1024, k=1024, max_m=16, block_n=32, block_k=256, split_k=2,
                       num_warps=8, num_stages=2, panel=True, prefetch=0)
    assert set(alternative) == {f.name for f in dataclasses.fields(GemvOverride)}
    for name, value in alternative.items():
        changed = dataclasses.replace(OVERRIDE, **{name: value})
        digest = _set(DEFAULT_KERNELS, "gemv.overrides", (changed,)).digest()
        assert digest not in seen, (name, seen.get(digest))
        seen[digest] = f"gemv.overrides.{name}"
    order = _set(DEFAULT_KERNELS, "gemv.overrides", (PANEL_OVERRIDE, OVERRIDE)).digest()
    assert order != _set(DEFAULT_KERNELS, "gemv.overrides", (OVERRIDE, PANEL_OVERRIDE)).digest()


# ------------------------------------------------------------------------------ from_env

# variable -> (field it sets, [(value, what the field becomes)], [refused values])
ENV_CASES = {
    "SPECCAL_KERNELS": ("backend", [("auto", "auto"), ("triton", "triton"),
                                    ("reference", "reference")], ["refernce", "torch"]),
    "SPECCAL_PREWAIT": ("prewait", [("0", False), ("1", True)], ["on", "true", "2"]),
    "SPECCAL_PDL": ("pdl.mode", [("0", "off"), ("1", "early"), ("late", "late")],
                    ["yes", "early", "2"]),
    "SPECCAL_GEMV_PANEL": ("gemv.panel", [("0", False), ("1", True)], ["yes"]),
    "SPECCAL_PANEL_MAX_ROWS": ("gemv.panel_max_rows", [("32", 32), ("8", 8)],
                               ["12", "64", "x"]),
    "SPECCAL_PANEL_CHUNKS": ("gemv.panel_chunks", [("8", 8), ("1", 1)], ["3", "0", "x"]),
    "SPECCAL_PANEL_MIN_BLOCK_M": ("gemv.panel_min_block_m", [("16", 16), ("2", 2)],
                                  ["3", "32", "0", "x"]),
    "SPECCAL_PANEL_PRECVT": ("gemv.panel_preconvert", [("1", True), ("0", False)], ["on"]),
    "SPECCAL_GEMV_MIN_BLOCK_M": ("gemv.min_block_m", [("4", 4), ("64", 64)], ["128", "5"]),
    "SPECCAL_GEMV_WIDE_BLOCK_M": ("gemv.wide_block_m", [("32", 32), ("64", 64)],
                                  ["16", "128", "48"]),
    "SPECCAL_GEMV_PREFETCH": ("gemv.prefetch_tiles", [("0", 0), ("3", 3)], ["-1", "x"]),
    "SPECCAL_DEFER_SCALE": ("gemv.defer_scale", [("auto", "auto"), ("late", "late"),
                                                 ("early", "early")], ["soon"]),
    "SPECCAL_ARGMAX_KEYS": ("gemv.argmax_keys", [("0", False), ("1", True)], ["off"]),
    "SPECCAL_GEMV_OVERRIDE": (
        "gemv.overrides",
        [("4096:2048:8=64/128/1/4/4;2048:2048:16=16/128/1/8/1/panel/pf4",
          (OVERRIDE, PANEL_OVERRIDE)),
         ("4096:2048:8=64/128/1/4/4|2048:2048:16=16/128/1/8/1/panel/pf4;",  # "|" too
          (OVERRIDE, PANEL_OVERRIDE))],
        ["4096:2048=64", "4096:2048:8=64/128/1/4/4;4096:2048:8=64/128/1/4",
         "0:2048:8=64/128/1/4/4"]),
    "SPECCAL_ATTN_FOLD": ("attention.fold", [("auto", "auto"), ("0", "off"), ("1", "on")],
                          ["on", "yes"]),
    "SPECCAL_FOLD_MAX_MERGE": ("attention.fold_max_merge", [("64", 64)], ["0", "x"]),
    "SPECCAL_ATTN_SPREAD": ("attention.spread", [("auto", "auto"), ("0", "off"), ("1", "on")],
                            ["off"]),
    "SPECCAL_DECODE_SPLITS": ("attention.decode_splits", [("8", 8)], ["0", "-2"]),
    "SPECCAL_VERIFY_HALVE": ("attention.verify_halve", [("0", False), ("1", True)], ["2"]),
    "SPECCAL_VERIFY_SPLITS": ("attention.verify_splits", [("3", 3), ("16", 16)], ["0", "x"]),
    "SPECCAL_VERIFY_BLOCK_N": ("attention.verify_block_n", [("64", 64), ("256", 256)],
                               ["96", "8", "512"]),
    "SPECCAL_ATTN_BLOCK_N": ("attention.block_n", [("32", 32), ("16", 16)], ["8", "512"]),
    "SPECCAL_ATTN_MIN_BLOCK_M": ("attention.min_block_m", [("16", 16), ("1", 1)], ["32", "3"]),
    "SPECCAL_ATTN_POLL": ("attention.poll", [("1", True), ("0", False)], ["yes"]),
    "SPECCAL_ATTN_PREFETCH": ("attention.prefetch_tiles", [("2", 2), ("0", 0)], ["x", "-1"]),
    "SPECCAL_ATTN_RELEASE": ("attention.release", [("start", "start"), ("loop", "loop"),
                                                   ("early", "early")], ["late"]),
    "SPECCAL_ATTN_REDUCE_RELEASE": ("attention.reduce_release",
                                    [("auto", "auto"), ("early", "early"), ("wait", "wait")],
                                    ["late"]),
    "SPECCAL_ATTN_PREWAIT": ("attention.prewait", [("rows", "rows"), ("0", "off"),
                                                   ("1", "on")], ["yes", "on"]),
    "SPECCAL_ATTN_WARPS": ("attention.warps", [("4", 4), ("8", 8)], ["16", "x"]),
    "SPECCAL_ATTN_STAGES": ("attention.stages", [("1", 1), ("4", 4)], ["0", "8"]),
    "SPECCAL_NORM_DEFER": ("norm.defer", [("rows", "rows"), ("o", "o"), ("all", "all"),
                                          ("0", "off")], ["1", "off"]),
    "SPECCAL_INPUT_DEFER_MAX": ("norm.input_defer_max", [("8", 8)], ["0", "x", "-3"]),
    "SPECCAL_FP32_DOT": ("precision.fp32_dot", [("ieee", "ieee"), ("tf32", "tf32"),
                                                ("tf32x3", "tf32x3")], ["fp32"]),
    "SPECCAL_LINEAR_ATTENTION": ("linear_attention.impl", [("fla", "fla"), ("fused", "fused")],
                                 ["triton", "1"]),
    "SPECCAL_DELTA_BLOCK_V": ("linear_attention.block_v", [("16", 16), ("128", 128)],
                              ["12", "0", "x"]),
    "SPECCAL_DELTA_WARPS": ("linear_attention.warps", [("1", 1), ("4", 4)], ["3", "x"]),
}


def test_env_cases_cover_every_variable():
    assert set(ENV_CASES) == set(ENV_VARS)
    assert {path for path, _, _ in ENV_CASES.values()} == _all_fields()  # every field settable


@pytest.mark.parametrize("var", sorted(ENV_CASES))
def test_from_env_sets_one_field_per_variable(var):
    """Each variable sets its field and nothing else; a bad value (unparsable, or refused by
    the field's validation) is an InputError naming the variable, not the field."""
    path, valid, refused = ENV_CASES[var]
    for raw, value in valid:
        cfg = KernelConfig.from_env({var: raw})
        assert _get(cfg, path) == value, raw
        assert cfg == _set(DEFAULT_KERNELS, path, value)
    for raw in refused:
        with pytest.raises(InputError) as err:
            KernelConfig.from_env({var: raw})
        assert err.value.field == var, raw
        assert str(err.value.value) == raw


def test_from_env_unset_empty_and_combined():
    """No variable (or an empty one) keeps the defaults; several combine; unknown variables are
    not read; None reads the process environment (the benchmarks' call)."""
    assert KernelConfig.from_env({}) == DEFAULT_KERNELS
    assert KernelConfig.from_env({v: "" for v in ENV_VARS}) == DEFAULT_KERNELS
    assert KernelConfig.from_env({"SPECCAL_VERIFY_SPLIT": "3", "PATH": "/bin"}) == DEFAULT_KERNELS
    env = {"SPECCAL_PDL": "0", "SPECCAL_VERIFY_SPLITS": "3", "SPECCAL_KERNELS": "reference",
           "SPECCAL_NORM_DEFER": "all"}
    want = DEFAULT_KERNELS
    for path, value in (("pdl.mode", "off"), ("attention.verify_splits", 3),
                        ("backend", "reference"), ("norm.defer", "all")):
        want = _set(want, path, value)
    assert KernelConfig.from_env(env) == want


def test_from_env_reads_the_process_environment_by_default(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert KernelConfig.from_env() == DEFAULT_KERNELS
    monkeypatch.setenv("SPECCAL_ATTN_FOLD", "1")
    assert KernelConfig.from_env().attention.fold == "on"
    monkeypatch.setenv("SPECCAL_ATTN_FOLD", "yes")
    with pytest.raises(InputError, match="SPECCAL_ATTN_FOLD"):
        KernelConfig.from_env()


def test_from_env_says_what_to_set():
    """An unparsable value is answered with the variable's own spelling of its choices."""
    for var, expect in (("SPECCAL_PDL", "0, 1 or late"), ("SPECCAL_ATTN_FOLD", "auto, 0 or 1"),
                        ("SPECCAL_NORM_DEFER", "rows, o, all or 0"),
                        ("SPECCAL_GEMV_PANEL", "0 or 1"), ("SPECCAL_VERIFY_SPLITS", "integer"),
                        ("SPECCAL_GEMV_OVERRIDE", GemvOverride.SYNTAX)):
        with pytest.raises(InputError) as err:
            KernelConfig.from_env({var: "?"})
        assert expect in err.value.expected, var


# ------------------------------------------------------------------------------ overrides


def test_override_parse_accepts_its_syntax():
    assert GemvOverride.parse("4096:2048:8=64/128/1/4/4") == OVERRIDE
    assert GemvOverride.parse("2048:2048:16=16/128/1/8/1/panel/pf4") == PANEL_OVERRIDE
    assert GemvOverride.parse("1:2:3=4/5/6/7/8/panel") == GemvOverride(1, 2, 3, 4, 5, 6, 7, 8,
                                                                       panel=True)
    assert GemvOverride.parse("1:2:3=4/5/6/7/8/pf0").prefetch == 0


@pytest.mark.parametrize("entry", [
    "", "4096:2048=64", "4096:2048:8", "4096:2048:8=", "4096:2048:8=64/128/1/4",
    "4096:2048:8:2=64/128/1/4/4", "4096:2048:8=64/128/1/4/4/wide",
    "4096:2048:8=64/128/1/4/4/pf", "4096:2048:8=64/128/1/4/4/pf-1",
    "4096:2048:8=64/128/1/4/4/pf2/panel", "4096:2048:8=64/128/1/4/4/panel/pf2/pf3",
    "4096:2048:8=64/128/1/4/4/panel/panel", "4096:2048:8=64/128/x/4/4",
    "4096:2048:8=0/128/1/4/4", "a:2048:8=64/128/1/4/4",
])
def test_override_parse_refuses_bad_syntax(entry):
    """A malformed entry (or one whose numbers are refused) names the field it came from and
    answers with the syntax."""
    with pytest.raises(InputError) as err:
        GemvOverride.parse(entry)
    assert err.value.field == "kernels.gemv.overrides" and err.value.value == entry
    assert err.value.expected == GemvOverride.SYNTAX
    with pytest.raises(InputError) as err:
        GemvOverride.parse(entry, "kernels.gemv.overrides[2]")
    assert err.value.field == "kernels.gemv.overrides[2]"


# ------------------------------------------------------------------------------ no environment

_LIBRARY = ("runner", "kernels", "calibrate", "costmodel")
_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(path: Path) -> list[tuple[str, int]]:
    """``(enclosing class/function path, line)`` of every use of the process environment in
    one module: ``os.environ`` / ``os.getenv`` & co, or those names imported from ``os``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*scope, child.name)
            elif isinstance(child, ast.Attribute) and child.attr in _ENV_NAMES:
                found.append((".".join(scope), child.lineno))
            elif isinstance(child, ast.ImportFrom) and child.module == "os" and any(
                    a.name in _ENV_NAMES for a in child.names):
                found.append((".".join(scope), child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), ())
    return found


def test_walker_finds_environment_uses(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom os import getenv\n\nclass A:\n    def f(self):\n"
                   "        return os.environ.get('X')\n\nY = os.getenv('Y')\n"
                   "DOC = 'os.environ in a string is not a read'\n")
    assert _environment_uses(src) == [("", 2), ("A.f", 6), ("", 8)]


def test_library_code_never_reads_the_environment():
    """``runner``, ``kernels``, ``calibrate`` and ``costmodel`` use the process environment in
    exactly one place: ``KernelConfig.from_env`` (the benchmarks' constructor)."""
    uses: dict[tuple[str, str], list[int]] = {}
    for package in _LIBRARY:
        spec = importlib.util.find_spec(f"speccal.{package}")  # located, not imported
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            for scope, line in _environment_uses(path):
                where = (f"{package}/{path.relative_to(root).as_posix()}", scope)
                uses.setdefault(where, []).append(line)
    allowed = ("kernels/config.py", "KernelConfig.from_env")
    assert allowed in uses  # the walker sees the one read there
    assert {w: lines for w, lines in uses.items() if w != allowed} == {}


def test_expert_tiles_refuse_what_tl_dot_cannot_tile():
    from speccal.base.errors import InputError
    from speccal.kernels.config import DEFAULT_TILES, ExpertTiles

    assert DEFAULT_TILES.label() == "gu64x64-d32x128-w4-s-"
    assert ExpertTiles(num_stages=3).launch_options() == {"num_warps": 4, "num_stages": 3}
    for bad in (dict(gate_up_n=8), dict(down_k=48), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(InputError, match="ExpertTiles." + next(iter(bad))):
            ExpertTiles(**bad)
