"""Cost tables: build, lookup, save/load, migration, refusal, compatibility, schema drift.

The compatibility rules themselves (kernel digests, verification modes) are test_compat.py; the
lookup module and its memo are test_lookup.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speccal.base.errors import CompatibilityError, GridError, InputError, SchemaError
from speccal.costmodel.compat import CompatibilityWarning, SpeccalWarning
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import (
    MIGRATIONS,
    json_schema,
    load_table,
    parse_table,
    save_table,
    schema_path,
)
from speccal.costmodel.table_build import NonPositiveCostWarning, build_table, refit_table
from speccal.costmodel.table_schema import SCHEMA_VERSION, CostTable

from .helpers import (
    ALPHA,
    BIAS,
    COMPAT,
    NONADDITIVE_PREDICTED_12,
    THETA,
    assert_same_fits,
    compat,
    measurements,
    nonadditive_measurements,
)

FIXTURES = Path(__file__).parent / "fixtures"
SCHEMA_DIR = Path(__file__).parents[2] / "tables" / "schema"
SCHEMA_FILE = SCHEMA_DIR / f"cost_table.v{SCHEMA_VERSION}.schema.json"
#: Past versions' JSON Schemas are frozen: sha256 of the committed file.
FROZEN_SCHEMAS = {
    1: "c6599d40c326760cc8d9159d8b381719433c72d72b830357152573adb70939e2",
    2: "68473499ebe6d78fd705984ba99b64ca79e308b12f62f6271b31d9eec0f691ea",
    3: "968454b7e94382abf1345d5b5668e5e4656d309627042525229837052f45a757",
    4: "d33ca7bdfa646334ba9d4058612b9497910dd963385cb92d9230d43a555e23f7",
    5: "eac49b25c8b1f738fa7228e4c38ec538e204caa926b15c2a0895f843bcf44496",
}
#: Golden files of every version: name -> (schema version on disk, migrated_from after load).
GOLDEN = {
    "table_legacy_no_draft_width.json": (None, "legacy"),
    "table_v1_additive.json": (1, "v1"),
    "table_v1_sps.json": (1, "v1"),
    "table_v2_additive.json": (2, "v2"),
    "table_v2_sps.json": (2, "v2"),
    "table_v3_additive.json": (3, "v3"),
    "table_v3_sps.json": (3, "v3"),
    "table_v4_additive.json": (4, "v4"),
    "table_v4_sps.json": (4, "v4"),
    "table_v5_additive.json": (5, "v5"),
    "table_v5_sps.json": (5, "v5"),
    "table_v6_additive.json": (6, None),
    "table_v6_sps.json": (6, None),
}


@pytest.fixture(scope="module")
def two_context_df():
    return measurements(
        contexts=((512, 1, 1024), (2048, 1025, 4096)), context_offsets_ms=(0.0, 2.0)
    )


@pytest.fixture(scope="module")
def additive(two_context_df):
    return build_table(two_context_df, model="additive", compatibility=COMPAT)


@pytest.fixture(scope="module")
def sps(two_context_df):
    return build_table(two_context_df, model="sps", compatibility=COMPAT)


# ------------------------------------------------------------------------ lookup


def test_additive_lookup_per_context(additive):
    truth = BIAS + ALPHA[4] + THETA[12]
    assert additive.cost_ms(4, 12, 10) == (pytest.approx(truth), True, None)
    assert additive.cost_ms(4, 12, 1025).cost_ms == pytest.approx(truth + 2.0)
    assert additive.mode == "draft_step" and additive.model == "additive"
    assert additive.geometry().draft_width == 3


@pytest.mark.parametrize(
    ("bcap", "g", "kv", "reason"),
    [
        (4, 12, 0, "outside every calibrated context interval"),
        (4, 12, 4097, "outside every calibrated context interval"),
        (3, 12, 10, "bcap 3 is not a calibrated request bucket"),
        (1, 16, 10, "not a captured target bucket of bcap 1"),
    ],
)
@pytest.mark.parametrize("which", ["additive", "sps"])
def test_uncalibrated_answers_say_why(request, which, bcap, g, kv, reason):
    table = request.getfixturevalue(which)
    out = table.cost_ms(bcap, g, kv)
    assert not out.calibrated and math.isnan(out.cost_ms) and reason in out.reason


def test_additive_refuses_an_unmeasured_g_level(two_context_df):
    df = two_context_df[two_context_df.g != 6]
    table = build_table(df, compatibility=COMPAT)
    out = table.cost_ms(2, 6, 10)  # a captured bucket of Bcap 2, but G=6 was never measured
    assert not out.calibrated and "not a calibrated target bucket" in out.reason


def test_sps_interpolates_inside_and_refuses_outside_the_measured_range(two_context_df):
    df = two_context_df[two_context_df.g <= 16]
    table = build_table(df.query("g != 6"), model="sps", compatibility=COMPAT)
    # a draft_step sps fit keeps one curve per k: G 6 at k = 2 lies on the k = 2 curve (G 3 at
    # Bcap 1, G 12 at Bcap 4), never on another k's curve
    inside = table.cost_ms(2, 6, 10, 2)
    p = table.fits[0].sps
    cost = {g: c for g, c, k in zip(p.g_levels, p.cost_ms, p.k, strict=True) if k == 2}
    assert sorted(cost) == [3, 12]
    assert inside.calibrated
    assert inside.cost_ms == pytest.approx(cost[3] + (6 - 3) / (12 - 3) * (cost[12] - cost[3]))
    no_k = table.cost_ms(2, 6, 10)
    assert not no_k.calibrated and "k (the round's draft forwards) is needed" in no_k.reason
    geom_rows = table.geometry().target_rows
    assert 24 in geom_rows[8] and 24 > max(cost)
    out = table.cost_ms(8, 24, 10, 2)
    assert not out.calibrated and "outside the calibrated range of k 2" in out.reason


@pytest.mark.parametrize("which", ["additive", "sps"])
def test_cost_surface_agrees_with_cost_ms_everywhere(request, which):
    table = request.getfixturevalue(which)
    b, g, kv, k = np.meshgrid(
        [1, 2, 3, 4, 8], np.arange(0, 36), [0, 10, 1024, 1025, 5000], [0, 1, 2, 3, 4],
        indexing="ij",
    )
    surf = table.cost_surface()(b, g, kv, k)
    assert surf.shape == b.shape
    scalar = np.array(
        [
            table.cost_ms(int(x), int(y), int(z), int(kk)).cost_ms
            for x, y, z, kk in zip(b.ravel(), g.ravel(), kv.ravel(), k.ravel(), strict=True)
        ]
    )
    np.testing.assert_array_equal(surf.ravel(), scalar)
    assert np.isfinite(surf).sum() > 20


# ------------------------------------------------------------------------ build refusals


def test_disconnected_grid_is_refused_at_build():
    pts = [(1, 1), (1, 2), (4, 8), (4, 12)]
    df = make_measurements(
        bias_ms=1.0, alpha_ms={1: 0.0, 4: 1.0}, theta_ms={1: 0, 2: 0.1, 8: 0.4, 12: 0.6}, points=pts
    )
    with pytest.raises(GridError, match="bcap=\\[4\\] g=\\[8, 12\\]"):
        build_table(df, compatibility=COMPAT)
    assert build_table(df, model="sps", compatibility=COMPAT).model == "sps"


def test_k_beyond_draft_width_is_refused():
    with pytest.raises(InputError, match="k <= draft_width = 1"):
        build_table(measurements(), compatibility=compat(draft_width=1))


def test_bad_compatibility_names_the_key():
    with pytest.raises(InputError, match="compatibility.topology.dp"):
        build_table(measurements(), compatibility=compat(**{"topology.dp": 0}))


# ------------------------------------------------------------------------ save / load


def test_save_load_is_byte_identical_and_refittable(tmp_path, additive):
    path = save_table(additive, tmp_path / "t.json")
    loaded = load_table(path)
    assert save_table(loaded, tmp_path / "t2.json").read_bytes() == path.read_bytes()
    again = refit_table(loaded, provenance=loaded.provenance)
    assert again.to_json() == additive.to_json()
    as_sps = refit_table(loaded, model="sps")
    assert as_sps.model == "sps" and as_sps.calibration.sources["model"] == "caller"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty file"),
        (b"   \n", "empty file"),
        (b'{"schema_version": 1, "calib', "invalid JSON at line 1"),
        (b"\x89PNG\r\n\x1a\n garbage", "invalid JSON"),
        (b"[1, 2, 3]", "a JSON object"),
    ],
)
def test_unreadable_documents_are_schema_errors(tmp_path, content, match):
    (tmp_path / "t.json").write_bytes(content)
    with pytest.raises(SchemaError, match=match):
        load_table(tmp_path / "t.json")


def test_truncated_table_is_a_schema_error(tmp_path, additive):
    text = additive.to_json()
    (tmp_path / "t.json").write_text(text[: len(text) // 2])
    with pytest.raises(SchemaError, match="invalid JSON"):
        load_table(tmp_path / "t.json")


def test_missing_file_is_a_schema_error(tmp_path):
    with pytest.raises(SchemaError, match="readable cost table"):
        load_table(tmp_path / "absent.json")


@pytest.mark.parametrize("where", ["", "calibration", "fits.0.additive", "compatibility.model"])
def test_unknown_keys_are_refused_with_their_path(additive, where):
    doc = additive.to_json_dict()
    node = doc
    for part in filter(None, where.split(".")):
        node = node[int(part)] if part.isdigit() else node[part]
    node["surprise"] = 1
    with pytest.raises(SchemaError, match="surprise.*unknown key"):
        parse_table(json.dumps(doc))


def test_missing_key_is_named(additive):
    doc = additive.to_json_dict()
    del doc["fits"][0]["additive"]["theta_ms"]
    with pytest.raises(SchemaError, match="fits.0.additive.theta_ms.*required"):
        parse_table(json.dumps(doc))


def test_newer_schema_is_refused(additive):
    doc = additive.to_json_dict()
    doc["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SchemaError, match="newer speccal; upgrade"):
        parse_table(json.dumps(doc))


def test_inconsistent_draft_widths_are_refused(additive):
    doc = additive.to_json_dict()
    doc["calibration"]["draft_width"] = 5
    with pytest.raises(SchemaError, match="calibration.draft_width"):
        parse_table(json.dumps(doc))


def test_overlapping_fits_in_a_file_are_refused(additive):
    doc = additive.to_json_dict()
    doc["fits"][1]["min_kv_length"] = 1000
    with pytest.raises(SchemaError, match="non-overlapping"):
        parse_table(json.dumps(doc))


# ------------------------------------------------------------------------ compatibility


SEMANTIC = [
    ("draft_width", 5),
    ("model.architecture", "other"),
    ("model.fingerprint", "sha256:fff"),
    ("model.dtype", "bfloat16"),
    ("model.quantization", "fp8"),
    ("topology.tp", 2),
    ("topology.dp", 2),
    ("graph_mode", "unified"),
    ("attention_backend", "torch"),
    ("device.kind", "cuda"),
]


@pytest.mark.parametrize(("field", "value"), SEMANTIC)
def test_semantic_mismatch_is_refused_naming_expected_and_found(tmp_path, additive, field, value):
    path = save_table(additive, tmp_path / "t.json")
    with pytest.raises(CompatibilityError) as info:
        load_table(path, expect=compat(**{field: value}))
    msg = str(info.value)
    assert field in msg and repr(value) in msg
    found = additive.compatibility
    for part in field.split("."):
        found = getattr(found, part)
    assert repr(found) in msg


@pytest.mark.parametrize(
    ("expect", "versions", "field"),
    [
        (compat(**{"device.name": "other-cpu"}), None, "device.name"),
        (compat(input_update="host"), None, "input_update: expected 'host', found 'in_graph'"),
        (COMPAT, {"speccal_version": "9.9.9"}, "provenance.speccal_version"),
        (COMPAT, {"torch_version": "0.0.1"}, "provenance.torch_version"),
    ],
)
def test_performance_only_mismatch_warns_and_loads(tmp_path, additive, expect, versions, field):
    path = save_table(additive, tmp_path / "t.json")
    with pytest.warns(CompatibilityWarning, match=field):
        table = load_table(path, expect=expect, runtime_versions=versions)
    assert table.cost_ms(4, 12, 10).calibrated


def test_matching_config_loads_silently(tmp_path, additive):
    path = save_table(additive, tmp_path / "t.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_table(path, expect=COMPAT, runtime_versions=additive.provenance.versions())


def test_compatibility_without_the_execution_path_is_refused(additive):
    old = {k: v for k, v in COMPAT.items() if k != "attention_backend"}
    with pytest.raises(InputError, match="expect.attention_backend: got 'missing'"):
        load_table(FIXTURES / "table_v2_additive.json", expect=old)
    with pytest.raises(InputError, match="compatibility.kernels.digest"):
        build_table(measurements(), compatibility=compat(**{"kernels.digest": "0" * 16}))


# ------------------------------------------------------------------------ unphysical values


def _edited(doc: dict, where: str, value) -> str:
    node = doc
    *parents, leaf = where.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return json.dumps(doc)  # Python writes NaN / Infinity tokens, which Python's json reads back


@pytest.mark.parametrize(
    ("name", "where", "value", "expected"),
    [
        ("table_v3_additive.json", "fits.0.additive.bias_ms", math.nan, "finite number"),
        ("table_v3_additive.json", "fits.1.additive.theta_ms.2", math.inf, "finite number"),
        ("table_v3_additive.json", "fits.0.additive.alpha_ms.1", -math.inf, "finite number"),
        ("table_v3_additive.json", "fits.0.additive.bias_ms", -0.5, "greater than or equal to 0"),
        ("table_v3_additive.json", "fits.0.windows.3.elapsed_s", -0.01, "greater than 0"),
        ("table_v3_additive.json", "fits.0.windows.3.elapsed_s", 0.0, "greater than 0"),
        ("table_v3_additive.json", "fits.1.windows.0.elapsed_s", math.nan, "finite number"),
        ("table_v3_additive.json", "fits.0.windows.5.step_ms", -2.0, "greater than 0"),
        ("table_v3_sps.json", "fits.0.sps.cost_ms.1", math.nan, "finite number"),
        ("table_v3_sps.json", "fits.0.sps.cost_ms.0", 0.0, "greater than 0"),
        ("table_v1_additive.json", "fits.0.additive.bias_ms", math.nan, "finite number"),
    ],
)
def test_unphysical_values_are_refused_naming_field_and_value(name, where, value, expected):
    text = _edited(json.loads((FIXTURES / name).read_text()), where, value)
    with pytest.raises(SchemaError) as info:
        parse_table(text, source="t.json")
    msg = str(info.value)
    assert f"t.json: {where}: got {value!r}" in msg and expected in msg


def test_build_refuses_a_negative_additive_bias():
    # One cycle (1, 2) - (1, 4) - (2, 2) + (2, 4) = 39 ms, spread by least squares over the four
    # points: the reference cell (1, 2) is fitted at 1 - 39 / 4 = -8.75 ms.
    df = make_measurements(
        bias_ms=1.0, alpha_ms={1: 0.0, 2: 0.0}, theta_ms={2: 0.0, 4: 0.0}, draft_width=3
    )
    df.loc[(df.bcap == 2) & (df.g == 4), "step_ms"] = 40.0
    df["elapsed_s"] = df["step_ms"] * df["window_steps"] / 1000.0
    with pytest.raises(GridError, match=r"fits.0.additive.bias_ms: got -8.75.*Bcap 1, G 2"):
        build_table(df, compatibility=COMPAT)


# ------------------------------------------------------------------------ golden files, schema


@pytest.mark.parametrize("name", ["table_v6_additive.json", "table_v6_sps.json"])
def test_golden_current_files_load_and_resave_byte_identically(name):
    raw = (FIXTURES / name).read_bytes()
    table = parse_table(raw)
    assert table.to_json().encode() == raw
    assert table.draft_width == 3 and table.provenance.migrated_from is None
    assert table.compatibility.kernels.config["pdl"] == {"mode": "late"}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_files_of_every_version_load_as_the_latest(name):
    on_disk, origin = GOLDEN[name]
    doc = json.loads((FIXTURES / name).read_text())
    assert doc.get("schema_version") == on_disk
    table = load_table(FIXTURES / name)
    assert table.schema_version == SCHEMA_VERSION and table.provenance.migrated_from == origin
    if on_disk is None or on_disk < 2:  # the execution path arrived in version 2
        c = table.compatibility
        assert (c.attention_backend, c.input_update) == ("unknown", "unknown")
        assert (c.kernels.digest, c.kernels.config) == ("unknown", None)
    current = load_table(FIXTURES / f"table_v3_{table.model}.json")
    # the same measurements in every version; refitted, they give this version's fits (a
    # migrated fit keeps its own parameters: no draft-forward term, one sps curve)
    assert [f.windows for f in table.fits] == [f.windows for f in current.fits]
    assert_same_fits(refit_table(table).fits, current.fits)
    if table.model == "additive":  # the selection kept no draft-forward term: same prices
        got, want = table.cost_ms(2, 8, 3000), current.cost_ms(2, 8, 3000, 3)
        assert got.cost_ms == pytest.approx(want.cost_ms, rel=1e-12)  # refitted: rounding
        assert got.calibrated and want.calibrated


def test_v4_document_with_a_v5_key_is_refused():
    doc = json.loads((FIXTURES / "table_v4_additive.json").read_text())
    doc["kv_spread"] = json.loads((FIXTURES / "table_v5_additive.json").read_text())["kv_spread"]
    with pytest.raises(SchemaError, match="kv_spread.*added in 5"):
        parse_table(json.dumps(doc))


def test_v5_spread_block_migrates_its_context_into_every_point():
    """A version 5 table's spread points (one context, block-level) price as before: each point
    takes the block's context; a v5 block without its context is refused by name."""
    v5 = json.loads((FIXTURES / "table_v5_additive.json").read_text())
    ci = v5["kv_spread"]["context_index"]
    table = load_table(FIXTURES / "table_v5_additive.json")
    assert [p.context_index for p in table.kv_spread.points] == [ci] * len(v5["kv_spread"]["points"])
    assert [p.slope_ms_per_token for p in table.kv_spread.points] == [
        p["slope_ms_per_token"] for p in v5["kv_spread"]["points"]]
    del v5["kv_spread"]["context_index"]
    with pytest.raises(SchemaError, match="kv_spread.context_index"):
        parse_table(json.dumps(v5))


def test_spread_points_must_sit_at_a_fitted_context_once_per_bucket():
    doc = json.loads((FIXTURES / "table_v6_additive.json").read_text())
    bad = json.loads(json.dumps(doc))
    bad["kv_spread"]["points"][0]["context_index"] = 7
    with pytest.raises(SchemaError, match=r"kv_spread.points.0.context_index: got 7"):
        parse_table(json.dumps(bad))
    twice = json.loads(json.dumps(doc))
    twice["kv_spread"]["points"].append(dict(twice["kv_spread"]["points"][0]))
    with pytest.raises(SchemaError, match=r"kv_spread.points.4.bcap: got 2.*at most one point"):
        parse_table(json.dumps(twice))


def test_every_past_version_has_a_migration():
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION))


def test_golden_additive_lookup_values():
    table = load_table(FIXTURES / "table_v3_additive.json")
    fit = table.fits[1]
    p = fit.additive
    expected = p.bias_ms + p.alpha_ms[p.bcap_levels.index(2)] + p.theta_ms[p.g_levels.index(8)]
    assert table.cost_ms(2, 8, 3000).cost_ms == expected
    # Truth of the fixture: 4.0 + 0.3 + 0.05 * 8 + 1.5 ms, noise 0.02 ms per window.
    assert expected == pytest.approx(6.2, abs=0.05)


def test_legacy_table_without_draft_width_reads_as_width_7(tmp_path):
    table = load_table(FIXTURES / "table_legacy_no_draft_width.json")
    assert table.draft_width == 7 == table.calibration.draft_width == table.geometry().draft_width
    assert table.provenance.migrated_from == "legacy"
    with pytest.raises(CompatibilityError, match="draft_width"):
        load_table(FIXTURES / "table_legacy_no_draft_width.json", expect=compat(draft_width=5))
    # Saving writes the latest version.
    resaved = json.loads(save_table(table, tmp_path / "t.json").read_text())
    assert (
        resaved["schema_version"] == SCHEMA_VERSION and resaved["compatibility"]["draft_width"] == 7
    )
    assert resaved["provenance"]["migrated_from"] == "legacy"


def test_migrated_v1_table_against_a_known_path_warns_and_loads():
    # The execution path of a v1 table is unknown: its attention backend and kernels warn
    # (they cannot be refused: nothing says they differ), and the table is used.
    expect = compat(**{"model.fingerprint": "sha256:0f1e2d", "device.name": "golden-cpu"})
    with pytest.warns(CompatibilityWarning) as caught:
        table = load_table(FIXTURES / "table_v1_additive.json", expect=expect)
    msg = " ".join(str(w.message) for w in caught)
    assert "attention_backend: expected 'triton', found 'unknown'" in msg
    assert "kernel configuration recorded as unknown (table)" in msg
    assert "input_update: expected 'in_graph', found 'unknown'" in msg
    assert table.cost_ms(2, 8, 3000).calibrated


def test_v1_document_with_a_v2_key_is_refused():
    doc = json.loads((FIXTURES / "table_v1_additive.json").read_text())
    doc["compatibility"]["attention_backend"] = "triton"
    with pytest.raises(SchemaError, match="compatibility.attention_backend.*added in version 2"):
        parse_table(json.dumps(doc))


def test_committed_json_schema_matches_the_models():
    committed = json.loads(SCHEMA_FILE.read_text())
    assert committed == json_schema(), (
        "cost table models changed: bump schema_version if old readers break, then run "
        "python3 -c 'from speccal.costmodel.table import write_json_schema; write_json_schema()'"
    )
    assert schema_path() == SCHEMA_FILE.resolve()


@pytest.mark.parametrize("version", sorted(FROZEN_SCHEMAS))
def test_past_json_schemas_are_frozen(version):
    path = SCHEMA_DIR / f"cost_table.v{version}.schema.json"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == FROZEN_SCHEMAS[version], (
        f"{path.name} is the schema of a released version: never edit it"
    )
    assert set(FROZEN_SCHEMAS) | {SCHEMA_VERSION} == set(range(1, SCHEMA_VERSION + 1))


@pytest.mark.parametrize("name", sorted(n for n, (v, _) in GOLDEN.items() if v is not None))
def test_golden_files_validate_against_their_versions_schema(name):
    jsonschema = pytest.importorskip("jsonschema")
    doc = json.loads((FIXTURES / name).read_text())
    schema = json.loads(
        (SCHEMA_DIR / f"cost_table.v{doc['schema_version']}.schema.json").read_text()
    )
    jsonschema.validate(doc, schema)


def test_saved_and_migrated_tables_validate_against_the_committed_schema(additive):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.validate(additive.to_json_dict(), schema)
    jsonschema.validate(load_table(FIXTURES / "table_v1_sps.json").to_json_dict(), schema)


# ------------------------------------------------------------------------ round trip property


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(["additive", "sps"]),
    width=st.integers(1, 7),
    first=st.integers(0, 3),
    count=st.integers(1, 4),
    bias=st.floats(0.01, 1e4, allow_subnormal=False),
    noise=st.floats(0.0, 0.1),  # relative to the bias: a fit never prices a cell below 0
    windows=st.integers(1, 3),
    split=st.integers(2, 4096),
    seed=st.integers(0, 2**32 - 1),
)
def test_generated_tables_round_trip_byte_identically(
    model, width, first, count, bias, noise, windows, split, seed
):
    # Consecutive powers of two with j in 1..w+1 share G = 2*Bcap with the next bucket: connected.
    bcaps = [1, 2, 4, 8][first : first + count]
    gs = sorted({b * j for b in bcaps for j in range(1, width + 2)})
    rng = np.random.default_rng(seed)
    df = make_measurements(
        bias_ms=bias,
        alpha_ms={b: float(rng.uniform(0, 5)) for b in bcaps},
        theta_ms={g: float(rng.uniform(0, 5)) for g in gs},
        draft_width=width,
        contexts=((128, 1, split - 1), (4096, split, 8192)) if split > 2 else ((128, 1, 8192),),
        windows_per_point=windows,
        noise_ms=noise * bias,
        seed=seed,
    )
    table = build_table(df, model=model, compatibility=compat(draft_width=width))
    text = table.to_json()
    back = parse_table(text)
    assert back.to_json() == text
    assert isinstance(back, CostTable) and back == table


# ------------------------------------------------------------------------ non-positive fitted costs


@pytest.fixture(scope="module")
def nonphysical():
    with pytest.warns(NonPositiveCostWarning) as caught:
        table = build_table(nonadditive_measurements(), compatibility=COMPAT)
    return table, caught


def test_build_warns_and_lists_cells_with_non_positive_fitted_cost(nonphysical):
    table, caught = nonphysical
    (w,) = [c for c in caught if c.category is NonPositiveCostWarning]
    assert issubclass(w.category, SpeccalWarning)
    msg = str(w.message)
    assert "1 cell(s)" in msg and "context 1 (KV 1025-4096) Bcap 1 G 2: -8.750 ms (measured)" in msg
    assert table.nonpositive_cells() == [
        {
            "context_index": 1,
            "min_kv_length": 1025,
            "max_kv_length": 4096,
            "bcap": 1,
            "g": 2,
            "k": None,
            "cost_ms": pytest.approx(NONADDITIVE_PREDICTED_12),
            "measured": True,
        }
    ]


def test_fit_report_summary_lists_non_positive_cells(nonphysical):
    from speccal.costmodel.report import cost_grid, summary

    fits = summary(nonphysical[0])["fits"]
    assert fits[0]["nonpositive_cells"] == []
    assert fits[1]["nonpositive_cells"] == [
        {"bcap": 1, "g": 2, "k": None, "cost_ms": pytest.approx(NONADDITIVE_PREDICTED_12),
         "measured": True}
    ]
    row = cost_grid(nonphysical[0]).query("context_index == 1 and bcap == 1 and g == 2").iloc[0]
    assert not row.calibrated and "fitted cost not positive" in row.reason


def test_non_positive_fitted_cost_looks_up_as_uncalibrated(nonphysical):
    table, _ = nonphysical
    out = table.cost_ms(1, 2, 2000)
    assert not out.calibrated and math.isnan(out.cost_ms)
    assert "fitted cost not positive" in out.reason and "-8.750 ms" in out.reason
    assert table.cost_ms(1, 2, 10) == (pytest.approx(3.0), True, None)  # context 0 is physical
    assert table.cost_ms(1, 4, 2000).calibrated  # other cells of context 1 stay calibrated
    surf = table.cost_surface()
    assert np.isnan(surf(1, 2, 2000)) and surf(1, 2, 10) == pytest.approx(3.0)
    b, g, kv = np.meshgrid([1, 2], np.arange(0, 10), [10, 2000], indexing="ij")
    scalar = [
        table.cost_ms(int(x), int(y), int(z)).cost_ms
        for x, y, z in zip(b.ravel(), g.ravel(), kv.ravel(), strict=True)
    ]
    np.testing.assert_array_equal(surf(b, g, kv).ravel(), scalar)
    assert (surf(b, g, kv)[np.isfinite(surf(b, g, kv))] > 0).all()


def test_policy_falls_back_to_full_width_at_a_non_positive_cost(nonphysical):
    # k = 1 (G = 2) is the cheapest step in context 0, so the policy switches to it; the batch
    # then moves into context 1, where k = 1 is fitted at -8.75 ms. Holding it there would run
    # (and score) a round at a negative cost: the policy must run full width instead.
    from speccal.policy import AdaptiveStepConfig, BatchState, CostModel, Feedback, make_policy

    cost = CostModel.from_table(nonphysical[0])
    cfg = AdaptiveStepConfig(window_size=4, update_interval=2, switch_min_gain=0.0)
    policy = make_policy("adaptive-step", cost, step_config=cfg)
    decisions = []
    for r, kv in enumerate((10.0, 10.0, 10.0, 2000.0)):
        d = policy.decide(BatchState(round_index=r, num_requests=1, kv_length=kv))
        decisions.append((d.k, d.reason))
        policy.observe(Feedback(round_index=r, k=d.k, accepted=np.zeros(1, dtype=np.int64)))
    # the first scoring comes with the first feedback (round 1); round 2 re-scores and holds
    assert decisions[1] == (1, "switch") and decisions[2] == (1, "hold")
    assert decisions[3] == (3, "uncalibrated")


def test_physical_fit_builds_without_a_warning(two_context_df):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeccalWarning)
        table = build_table(two_context_df, compatibility=COMPAT)
    assert table.nonpositive_cells() == []


def test_table_show_warns_about_non_positive_cells(nonphysical, tmp_path):
    from typer.testing import CliRunner

    from speccal.cli import app

    table, _ = nonphysical
    path = tmp_path / "t.json"
    save_table(table, path)
    res = CliRunner().invoke(app, ["table", "show", str(path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "fitted cost not positive at Bcap 1 G 2: -8.750 ms" in res.output
