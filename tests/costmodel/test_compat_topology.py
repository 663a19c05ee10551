"""Topology in the compatibility metadata: tp, dp and world_size are semantic (another layout is
refused naming expected and found), the per-rank device names performance-only (a warning
naming the ranks); a one-rank run records world_size 1 and its device, and a table without
world_size / devices (older than them, or a bare fit) loads with them unknown and writes them
nowhere."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from speccal.base.errors import CompatibilityError, InputError
from speccal.costmodel.compat import CompatibilityWarning, as_compatibility
from speccal.costmodel.table import load_table, save_table
from speccal.costmodel.table_build import build_table

from .fixtures.make_fixtures import HERE as FIXTURES
from .helpers import compat, measurements

CPU = "Intel(R) Xeon(R) Processor"


def one_rank(name: str = "test-cpu", **changes) -> dict:
    """COMPAT as a one-rank run records it (Engine.compatibility): world_size 1, its device."""
    return compat(**{"topology.world_size": 1, "topology.devices": [name], "device.name": name,
                     **changes})


def two_ranks(**changes) -> dict:
    """COMPAT as a TP=2 run records it (DistributedEngine.compatibility)."""
    return compat(**{"topology.tp": 2, "topology.world_size": 2,
                     "topology.devices": [CPU, CPU], **changes})


@pytest.fixture(scope="module")
def tp2_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("topology") / "tp2.json"
    return save_table(build_table(measurements(), compatibility=two_ranks()), path)


def test_table_from_two_ranks_records_world_size_and_both_devices(tp2_table):
    topo = json.loads(tp2_table.read_text())["compatibility"]["topology"]
    assert topo == {"tp": 2, "dp": 1, "world_size": 2, "devices": [CPU, CPU]}
    loaded = load_table(tp2_table, expect=two_ranks())
    assert loaded.compatibility.topology.world_size == 2
    assert loaded.compatibility.topology.devices == [CPU, CPU]


def test_tp2_table_loaded_by_a_tp1_engine_is_refused_naming_expected_and_found(tp2_table):
    with pytest.raises(CompatibilityError) as info:
        load_table(tp2_table, expect=compat())  # a one-rank engine: world_size unknown
    msg = str(info.value)
    assert "tp2.json: topology.tp: got 2, expected 1" in msg
    assert "topology.tp: expected 1, found 2" in msg


def test_world_size_mismatch_is_semantic(tp2_table):
    # the same tp, another dp: both the size and the world size are named
    expect = two_ranks(**{"topology.dp": 2, "topology.world_size": 4,
                          "topology.devices": [CPU] * 4})
    with pytest.raises(CompatibilityError) as info:
        load_table(tp2_table, expect=expect)
    assert "topology.dp: expected 2, found 1" in str(info.value)
    assert "topology.world_size: expected 4, found 2" in str(info.value)


def test_other_device_names_only_warn_naming_the_rank(tp2_table):
    expect = two_ranks(**{"topology.devices": [CPU, "NVIDIA H200"]})
    with pytest.warns(CompatibilityWarning,
                      match=r"topology\.devices: .*\(rank 1: table=Intel\(R\) Xeon\(R\) "
                            r"Processor running=NVIDIA H200\)"):
        load_table(tp2_table, expect=expect)


def test_older_table_without_the_fields_loads_under_a_multi_rank_engine(tmp_path):
    # the goldens predate world_size / devices: unknown, not compared, nothing to warn about
    golden = json.loads((FIXTURES / "table_v6_additive.json").read_text())
    assert set(golden["compatibility"]["topology"]) == {"tp", "dp"}
    running = {**golden["compatibility"],
               "topology": {"tp": 1, "dp": 1, "world_size": 1, "devices": ["golden-cpu"]}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table = load_table(FIXTURES / "table_v6_additive.json", expect=running)
    assert not [w for w in seen if "topology" in str(w.message)]  # (versions may differ)
    assert table.compatibility.topology.world_size == "unknown"
    assert table.compatibility.topology.devices == "unknown"
    # ... and re-saved it stays byte-identical (unknown fields are not written)
    out = save_table(table, tmp_path / "again.json")
    assert out.read_bytes() == (FIXTURES / "table_v6_additive.json").read_bytes()


@pytest.mark.parametrize("topology,field,expected", [
    ({"tp": 2, "dp": 1, "world_size": 4}, "topology.world_size", "tp * dp = 2 * 1 = 2"),
    ({"tp": 2, "dp": 1, "world_size": 2, "devices": [CPU]}, "topology.devices",
     "2 device names (world_size), one per rank"),
    ({"tp": 1, "dp": 1, "devices": []}, "topology.devices", "a non-empty list of device names"),
    ({"tp": 1, "dp": 1, "world_size": 0}, "topology.world_size", "an integer >= 1 or 'unknown'"),
])
def test_bad_topology_is_refused_naming_the_field(topology, field, expected):
    with pytest.raises(InputError, match=rf"compatibility\.{re.escape(field)}: got .*expected "
                                          rf"{re.escape(expected)}"):
        as_compatibility(compat(topology=topology))


def test_one_rank_table_records_its_world_and_refuses_two_ranks(tmp_path):
    path = save_table(build_table(measurements(), compatibility=one_rank()), tmp_path / "t.json")
    topo = json.loads(path.read_text())["compatibility"]["topology"]
    assert topo == {"tp": 1, "dp": 1, "world_size": 1, "devices": ["test-cpu"]}
    assert load_table(path, expect=one_rank()).compatibility.topology.world_size == 1
    with pytest.raises(CompatibilityError) as info:
        load_table(path, expect=two_ranks())
    assert "topology.tp: expected 2, found 1" in str(info.value)
    assert "topology.world_size: expected 2, found 1" in str(info.value)


def test_one_rank_table_on_another_device_warns_once_by_device_name(tmp_path):
    # device.name already names rank 0's device: topology.devices would only repeat it
    path = save_table(build_table(measurements(), compatibility=one_rank()), tmp_path / "t.json")
    with pytest.warns(CompatibilityWarning) as seen:
        load_table(path, expect=one_rank("other-cpu"))
    (msg,) = [str(w.message) for w in seen if "device" in str(w.message)]
    assert "device.name: expected 'other-cpu', found 'test-cpu'" in msg
    assert "topology.devices" not in msg


@pytest.mark.parametrize("golden", ["table_legacy_no_draft_width.json", "table_v1_additive.json",
                                    "table_v1_sps.json", "table_v2_additive.json",
                                    "table_v2_sps.json"])
def test_every_past_golden_loads_under_a_one_rank_engine_with_its_world_unknown(golden):
    table = load_table(FIXTURES / golden)
    recorded = table.compatibility.model_dump(mode="json")
    assert set(recorded["topology"]) == {"tp", "dp"}  # unknown world: not written
    name = recorded["device"]["name"]
    running = {**recorded, "topology": {"tp": 1, "dp": 1, "world_size": 1, "devices": [name]}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = load_table(FIXTURES / golden, expect=running)
    assert not [w for w in seen if "topology" in str(w.message)]
    assert (again.compatibility.topology.world_size, again.compatibility.topology.devices) == (
        "unknown", "unknown")
    with pytest.raises(CompatibilityError, match=r"topology\.tp: expected 2, found 1"):
        load_table(FIXTURES / golden, expect={
            **running, "topology": {"tp": 2, "dp": 1, "world_size": 2, "devices": [name] * 2}})
