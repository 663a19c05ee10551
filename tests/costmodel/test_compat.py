"""Compatibility metadata: kernel digests and config diffs, the execution-path and
verification-mode rules, the shared builder, and the shipped tables under a known path."""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import pytest

from speccal.base.errors import CompatibilityError, InputError
from speccal.costmodel.compat import (
    ABSENT,
    Compatibility,
    CompatibilityWarning,
    as_compatibility,
    diff_kernel_configs,
    flatten_config,
    kernel_digest,
    make_compatibility,
)
from speccal.costmodel.table import load_table, save_table
from speccal.costmodel.table_build import build_table

from .helpers import COMPAT, KERNELS, compat, kernels_with, measurements

TABLES = Path(__file__).parents[2] / "tables"


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("compat") / "t.json"
    return save_table(build_table(measurements(), compatibility=COMPAT), path)


def _load_quietly(path, expect):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_table(path, expect=expect, runtime_versions={})


# ------------------------------------------------------------------------ kernel digest


def test_kernel_digest_is_sha256_of_canonical_json():
    text = json.dumps(KERNELS, sort_keys=True, separators=(",", ":"))
    assert kernel_digest(KERNELS) == hashlib.sha256(text.encode()).hexdigest()[:16]
    shuffled = dict(reversed(list(KERNELS.items())))
    assert kernel_digest(shuffled) == kernel_digest(KERNELS)
    as_tuple = kernels_with(**{"gemv.overrides": ("qkv:2-8:64x256x3",)})
    assert kernel_digest(as_tuple) == kernel_digest(KERNELS)  # tuples hash as JSON lists
    assert kernel_digest(kernels_with(**{"gemv.stages": 4})) != kernel_digest(KERNELS)


@pytest.mark.parametrize("bad", [{"x": math.nan}, {"x": object()}, ["not", "a", "dict"]])
def test_kernel_digest_refuses_what_json_cannot_hold(bad):
    with pytest.raises(InputError, match="kernels.config"):
        kernel_digest(bad)


def test_the_runner_digest_is_this_function():
    config = pytest.importorskip("speccal.kernels.config")
    kernels = config.DEFAULT_KERNELS
    assert kernels.digest() == kernel_digest(kernels.to_dict())


def test_flatten_and_diff_kernel_configs_by_dotted_name():
    assert flatten_config({"a": {"b": {"c": 1}, "d": [1, {"e": 2}]}, "f": {}}) == {
        "a.b.c": 1,
        "a.d": [1, {"e": 2}],
        "f": {},
    }
    other = kernels_with(**{"gemv.stages": 4, "pdl.mode": "off", "norm.extra": True})
    del other["prewait"]
    assert diff_kernel_configs(KERNELS, other) == [
        ("gemv.stages", 3, 4),
        ("norm.extra", ABSENT, True),
        ("pdl.mode", "late", "off"),
        ("prewait", True, ABSENT),
    ]
    assert diff_kernel_configs(KERNELS, KERNELS) == []


@pytest.mark.parametrize(
    ("kernels", "where"),
    [
        ({"digest": "0" * 16, "config": KERNELS}, "kernels.digest"),
        ({"digest": "unknown", "config": KERNELS}, "kernels.digest"),
        ({"digest": kernel_digest(KERNELS), "config": None}, "kernels.digest"),
        ({"digest": "ABCDEF0123456789", "config": None}, "kernels.digest"),
        ({"digest": "unknown"}, "kernels.config"),
        ({"digest": "unknown", "config": None, "extra": 1}, "kernels.extra"),
    ],
)
def test_kernels_block_is_validated(kernels, where):
    with pytest.raises(InputError, match=f"compatibility.{where}"):
        as_compatibility({**COMPAT, "kernels": kernels})


def test_execution_path_keys_are_required_and_checked():
    for key in ("attention_backend", "input_update", "kernels"):
        with pytest.raises(InputError, match=f"compatibility.{key}: got 'missing'"):
            as_compatibility({k: v for k, v in COMPAT.items() if k != key})
    with pytest.raises(InputError, match="compatibility.attention_backend"):
        as_compatibility(compat(attention_backend="flash"))
    with pytest.raises(InputError, match="compatibility.input_update"):
        as_compatibility(compat(input_update="auto"))


def test_make_compatibility_is_complete_and_fails_closed():
    bare = make_compatibility(draft_width=5)
    assert Compatibility.model_validate(bare).kernels.config is None
    assert bare["model"]["fingerprint"] == "unknown" and bare["attention_backend"] == "unknown"
    with pytest.raises(InputError, match="compatibility.topology.tp"):
        make_compatibility(draft_width=5, tp=0)
    assert COMPAT["kernels"] == {"digest": kernel_digest(KERNELS), "config": KERNELS}


# ------------------------------------------------------------------------ load-time rules


def test_kernel_digest_mismatch_warns_naming_every_differing_field(table_file):
    other = kernels_with(**{"gemv.stages": 4, "pdl.mode": "off"})
    del other["prewait"]
    with pytest.warns(CompatibilityWarning) as caught:
        table = load_table(table_file, expect=compat(kernels=other), runtime_versions={})
    (msg,) = [str(w.message) for w in caught]
    assert (
        f"kernels.digest: expected {kernel_digest(other)!r}, found {COMPAT['kernels']['digest']!r}"
        in msg
    )
    assert "gemv.stages: table=3 running=4" in msg
    assert 'pdl.mode: table="late" running="off"' in msg
    assert "prewait: table=true running=<absent>" in msg
    assert "gemv.panel_max_rows" not in msg  # only the fields that differ
    assert table.cost_ms(4, 12, 10).calibrated


def test_unknown_kernels_on_the_running_side_warn(table_file):
    unknown = compat(**{"kernels.digest": "unknown", "kernels.config": None})
    with pytest.warns(CompatibilityWarning, match=r"recorded as unknown \(running config\)"):
        load_table(table_file, expect=unknown, runtime_versions={})


def test_attention_backend_refused_unless_recorded_as_unknown(table_file):
    with pytest.raises(CompatibilityError, match="attention_backend.*'torch'.*'triton'"):
        load_table(table_file, expect=compat(attention_backend="torch"))
    with pytest.warns(CompatibilityWarning, match="attention_backend: expected 'unknown'"):
        load_table(table_file, expect=compat(attention_backend="unknown"), runtime_versions={})


@pytest.mark.parametrize("measured", ["forced", "synthetic", "greedy"])
@pytest.mark.parametrize("running", ["greedy", "sample", "synthetic", "forced"])
def test_tables_measured_on_the_argmax_path_load_silently_everywhere(tmp_path, measured, running):
    # Issue 25 item 10: calibration measures with forced acceptance on purpose; a greedy or
    # sampled run must not be told "verification_mode: expected 'greedy', found 'forced'".
    df = measurements()
    path = save_table(
        build_table(df, compatibility=compat(verification_mode=measured)), tmp_path / "t.json"
    )
    table = _load_quietly(path, compat(verification_mode=running))
    assert table.compatibility.verification_mode == measured


@pytest.mark.parametrize("running", ["greedy", "synthetic", "forced"])
def test_a_table_measured_with_sampling_warns_on_the_argmax_path(tmp_path, running):
    path = save_table(
        build_table(measurements(), compatibility=compat(verification_mode="sample")),
        tmp_path / "t.json",
    )
    with pytest.warns(CompatibilityWarning, match="verification_mode.*sampling work"):
        load_table(path, expect=compat(verification_mode=running), runtime_versions={})
    _load_quietly(path, compat(verification_mode="sample"))


@pytest.mark.parametrize("name", sorted(p.name for p in TABLES.glob("*.json")))
def test_shipped_tables_load_and_name_their_kernel_differences(name):
    # A shipped table of schema version 1 migrates on load and, against a running config that
    # knows its execution path, warns that its kernels were not recorded; one of version 2 or
    # later loads silently against its own execution path and names each differing kernel
    # field against another one. Neither ever fails.
    path = TABLES / name
    version = json.loads(path.read_text())["schema_version"]
    assert version in (1, 2, 3, 4)
    own = load_table(path)
    expect = {
        **own.compatibility.model_dump(mode="json"),
        "attention_backend": "triton" if own.compatibility.device.kind == "cuda" else "torch",
        "input_update": "in_graph",
        "kernels": {"digest": kernel_digest(KERNELS), "config": KERNELS},
        "verification_mode": "greedy",
    }
    with pytest.warns(CompatibilityWarning) as caught:
        table = load_table(path, expect=expect, runtime_versions={})
    msg = " ".join(str(w.message) for w in caught)
    assert "verification_mode" not in msg
    if version == 1:
        assert "kernel configuration recorded as unknown (table)" in msg
        assert table.provenance.migrated_from == "v1"
        return
    assert "kernels.digest" in msg and "table=" in msg and "running=" in msg  # fields named
    assert table.provenance.migrated_from == (None if version == 4 else f"v{version}")
    _load_quietly(path, {**own.compatibility.model_dump(mode="json"),
                         "verification_mode": "greedy"})


# ------------------------------------------------------------------------ round loop


def test_loop_is_validated_and_defaults_to_unknown():
    assert COMPAT["loop"] == "unknown"  # make_compatibility without a loop: nothing recorded
    legacy = {k: v for k, v in COMPAT.items() if k != "loop"}
    assert as_compatibility(legacy).loop == "unknown"  # a table saved before the loop existed
    assert make_compatibility(draft_width=3, loop="pipelined")["loop"] == "pipelined"
    with pytest.raises(InputError, match="compatibility.loop"):
        as_compatibility(compat(loop="async"))


@pytest.mark.parametrize(("measured", "running"),
                         [("pipelined", "synchronous"), ("synchronous", "pipelined")])
def test_a_table_of_another_round_loop_warns_and_loads(tmp_path, measured, running):
    path = save_table(build_table(measurements(), compatibility=compat(loop=measured)),
                      tmp_path / "t.json")
    with pytest.warns(CompatibilityWarning,
                      match=f"loop: expected '{running}', found '{measured}'") as caught:
        table = load_table(path, expect=compat(loop=running), runtime_versions={})
    assert len(caught) == 1  # performance-only: one warning, the table loads
    assert table.compatibility.loop == measured
    _load_quietly(path, compat(loop=measured))


@pytest.mark.parametrize(("measured", "running"),
                         [("unknown", "pipelined"), ("pipelined", "unknown")])
def test_a_loop_recorded_as_unknown_loads_silently(tmp_path, measured, running):
    path = save_table(build_table(measurements(), compatibility=compat(loop=measured)),
                      tmp_path / "t.json")
    assert _load_quietly(path, compat(loop=running)).compatibility.loop == measured
