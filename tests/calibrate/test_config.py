"""Calibration config: defaults with their sources, both xLLM file shapes, refusals naming the key."""

from __future__ import annotations

import json

import pytest

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.config import (
    DEFAULT_MAX_KV_LENGTH,
    DEFAULT_PREFILL_TOKENS,
    ContextInterval,
    UserConfig,
    parse_config_file,
    parse_config_obj,
    resolve_config,
)
from speccal.calibrate.feasibility import reserve_tokens
from speccal.calibrate.grid import build_grid

# The two files of the xLLM adaptive speculative decoding document, verbatim.
ADAPTIVE_STEP_FILE = """{
  "version": 1,
  "policy": {
    "window_size": 20,
    "update_interval": 5,
    "switch_min_gain": 0.05
  },
  "calibration": {
    "model": "additive",
    "request_buckets": [1, 2, 4, 8, 16],
    "contexts": [
      {"prefill_tokens": 2048, "min_kv_length": 1, "max_kv_length": 4096}
    ],
    "warmup_steps": 8,
    "window_steps": 32,
    "windows_per_point": 3,
    "token_seed": 1
  }
}"""
BARE_FILE = """{
  "model": "additive",
  "request_buckets": [1, 2, 4, 8, 16],
  "contexts": [
    {"prefill_tokens": 1868, "min_kv_length": 1800, "max_kv_length": 4096}
  ],
  "warmup_steps": 8,
  "window_steps": 32,
  "windows_per_point": 3,
  "token_seed": 1
}"""


def big_geometry(w: int = 5, buckets=(1, 2, 4, 8, 16)) -> Geometry:
    return Geometry(
        draft_width=w,
        request_buckets=buckets,
        kv_capacity_tokens=16 * 8192,
        max_model_len=8192,
        block_size=16,
    )


def test_every_default_applied_with_its_source():
    geo = big_geometry()
    cfg = resolve_config(UserConfig.build(), geo)
    assert cfg.model == "additive"
    assert cfg.mode == "target_verify"
    assert cfg.draft_width == 5
    assert cfg.request_buckets == geo.request_buckets
    # every legal captured target bucket, full width included
    prepared = {b * j for b in geo.request_buckets for j in range(1, 7)}
    assert cfg.target_graph_rows == {
        b: tuple(sorted(g for g in prepared if b <= g <= 6 * b)) for b in geo.request_buckets
    }
    # Geometric KV levels spanning the default interval: contiguous, never overlapping, each
    # with room for its requests to grow (a KV-aware table needs three or more).
    reserve = reserve_tokens(8, 32, 3, 5)  # 636 tokens: room for three levels below 4096
    assert len(cfg.contexts) == 3
    assert cfg.contexts[0].min_kv_length == 1
    assert cfg.contexts[-1].max_kv_length == DEFAULT_MAX_KV_LENGTH
    assert cfg.contexts[-1].prefill_tokens == DEFAULT_PREFILL_TOKENS
    for a, b in zip(cfg.contexts, cfg.contexts[1:], strict=False):
        assert b.min_kv_length == a.max_kv_length + 1
    for c in cfg.contexts:
        assert c.min_kv_length <= c.prefill_tokens <= c.max_kv_length - reserve
    his = [c.max_kv_length for c in cfg.contexts]
    assert all(b > a for a, b in zip(his, his[1:], strict=False))
    assert (cfg.warmup_steps, cfg.window_steps, cfg.windows_per_point, cfg.token_seed) == (
        8,
        32,
        3,
        1,
    )
    assert cfg.policy.to_dict() == {
        "window_size": 20,
        "update_interval": 5,
        "switch_min_gain": 0.05,
    }
    expected = {k: "default" for k in cfg.sources}
    expected["draft_width"] = "run"
    assert cfg.sources == expected
    assert len(cfg.sources) == 16
    assert list(cfg.notes) == ["request_buckets", "contexts"]
    assert "3 geometric KV levels" in cfg.notes["contexts"]
    assert "SERVED_REQUEST_BUCKETS" in cfg.notes["request_buckets"]


def test_adaptive_step_file_accepted_unchanged(tmp_path):
    path = tmp_path / "draft-steps.json"
    path.write_text(ADAPTIVE_STEP_FILE)
    parsed = parse_config_file(path)
    assert parsed.shape == "adaptive_draft_step"
    cfg = resolve_config(UserConfig.build(parsed), big_geometry())
    assert cfg.mode == "draft_step"  # the adaptive-draft-step shape calibrates per k
    assert cfg.notes["mode"].startswith("draft_step because")
    assert cfg.sources["request_buckets"] == "file"
    assert cfg.sources["policy.switch_min_gain"] == "file"
    assert cfg.sources["target_graph_rows"] == "default"
    # draft_step: G = Bcap * (k + 1), k = 1..w, and the G a partly filled bucket (3 requests in
    # bucket 4) pads 3 * (k + 1) rows to, each measured with 3 requests
    assert cfg.target_graph_rows[4] == (6, 8, 10, 12, 16, 20, 24)
    assert [s for s in cfg.partly_filled if s[0] == 4] == [
        (4, 6, 1, 3), (4, 10, 2, 3), (4, 12, 3, 3), (4, 16, 4, 3), (4, 20, 5, 3)]
    points = build_grid(cfg)
    assert sum(p.requests < p.bcap for p in points) == len(cfg.partly_filled) * len(cfg.contexts)


def test_bare_file_accepted_unchanged():
    parsed = parse_config_obj(json.loads(BARE_FILE))
    assert parsed.shape == "calibration"
    cfg = resolve_config(UserConfig.build(parsed), big_geometry())
    assert cfg.contexts == (ContextInterval(1868, 1800, 4096),)
    assert cfg.sources["contexts"] == "file"
    assert cfg.mode == "target_verify"


def test_flag_overrides_file():
    parsed = parse_config_obj({"window_steps": 16, "warmup_steps": 2})
    cfg = resolve_config(
        UserConfig.build(parsed, {"window_steps": 4, "mode": "draft_step"}), big_geometry()
    )
    assert (cfg.window_steps, cfg.sources["window_steps"]) == (4, "flag")
    assert (cfg.warmup_steps, cfg.sources["warmup_steps"]) == (2, "file")
    assert cfg.sources["mode"] == "flag"


@pytest.mark.parametrize(
    "obj, key",
    [
        ({"modle": "additive"}, "modle"),
        ({"version": 1, "calibration": {"window_stepz": 3}}, "calibration.window_stepz"),
        ({"version": 1, "policy": {"window": 3}}, "policy.window"),
        (
            {"contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 9, "x": 1}]},
            "contexts.0.x",
        ),
        ({"version": 1, "model": "additive"}, "model"),  # bare key mixed into the wrapped shape
        ({"window_steps": "32"}, "window_steps"),
        ({"window_steps": 32.0}, "window_steps"),
        ({"model": "cubic"}, "model"),
        ({"version": 2}, "version"),
        ({"request_buckets": [1, "2"]}, "request_buckets.1"),
        ({"version": 1, "policy": {"switch_min_gain": "5%"}}, "policy.switch_min_gain"),
    ],
)
def test_unknown_keys_and_wrong_types_refused_naming_the_key(obj, key):
    with pytest.raises(InputError) as exc:
        parse_config_obj(obj)
    assert exc.value.field == key


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(InputError, match="--config"):
        parse_config_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(InputError, match="valid JSON"):
        parse_config_file(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1]")
    with pytest.raises(InputError, match="a JSON object"):
        parse_config_file(arr)


def test_draft_width_in_file_must_match_run():
    geo = big_geometry(w=5)
    ok = resolve_config(UserConfig.build(parse_config_obj({"draft_width": 5})), geo)
    assert ok.sources["draft_width"] == "run"
    with pytest.raises(InputError) as exc:
        resolve_config(UserConfig.build(parse_config_obj({"draft_width": 7})), geo)
    assert exc.value.field == "draft_width" and "num_speculative_tokens=5" in str(exc.value)


def test_short_model_context_shrinks_default_prefill():
    geo = Geometry(
        draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=1 << 20, max_model_len=1024
    )
    cfg = resolve_config(UserConfig.build(), geo)
    reserve = reserve_tokens(8, 32, 3, 3)
    # Only two levels leave every interval room for 424 generated tokens below 1024.
    assert cfg.contexts == (
        ContextInterval(1, 1, 1 + reserve),
        ContextInterval(512, 2 + reserve, 1024),
    )
    assert cfg.sources["contexts"] == "default"
    assert "model context 1024" in cfg.notes["contexts"]
    assert "2 geometric KV levels" in cfg.notes["contexts"]


def test_kv_capacity_shrinks_default_interval():
    # 2 slots of the largest bucket share 4096 tokens: 2048 each.
    geo = Geometry(
        draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=4096, max_model_len=8192
    )
    cfg = resolve_config(UserConfig.build(), geo)
    assert cfg.contexts[-1].max_kv_length == 2048
    assert cfg.contexts[-1].prefill_tokens == 1024
    assert "KV capacity 4096" in cfg.notes["contexts"]


def test_default_that_cannot_fit_asks_for_smaller_config():
    geo = Geometry(
        draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=1 << 20, max_model_len=256
    )
    with pytest.raises(InputError) as exc:
        resolve_config(UserConfig.build(), geo)
    assert exc.value.field == "contexts"
    assert "smaller explicit config" in str(exc.value)
    # the same run with a smaller explicit config fits
    small = parse_config_obj({"warmup_steps": 2, "window_steps": 4, "windows_per_point": 2})
    cfg = resolve_config(UserConfig.build(small), geo)
    assert cfg.contexts[-1].max_kv_length == 256


@pytest.mark.parametrize(
    "contexts, field",
    [
        ([[64, 1, 100], [150, 100, 200]], "contexts"),  # inclusive bounds touch at 100
        ([[10, 20, 100]], "contexts[0].prefill_tokens"),  # prompt shorter than min_kv_length
        ([[64, 50, 40]], "contexts[0].max_kv_length"),
    ],
)
def test_bad_contexts_refused(contexts, field):
    obj = {
        "contexts": [
            dict(zip(("prefill_tokens", "min_kv_length", "max_kv_length"), c, strict=True))
            for c in contexts
        ]
    }
    with pytest.raises(InputError) as exc:
        resolve_config(UserConfig.build(parse_config_obj(obj)), big_geometry())
    assert exc.value.field == field


def test_target_graph_rows_forms():
    geo = big_geometry(w=3, buckets=(1, 2, 4))
    as_map = parse_config_obj(
        {"request_buckets": [1, 2], "target_graph_rows": {"1": [2], "2": [4]}}
    )
    cfg = resolve_config(UserConfig.build(as_map), geo)
    assert cfg.target_graph_rows == {1: (2, 4), 2: (4, 8)}  # full width always added
    as_list = parse_config_obj({"request_buckets": [1, 2], "target_graph_rows": [2, 3]})
    cfg = resolve_config(UserConfig.build(as_list), geo)
    assert cfg.target_graph_rows == {1: (2, 3, 4), 2: (2, 3, 8)}
    with pytest.raises(InputError, match="captured for at least one"):
        resolve_config(UserConfig.build(parse_config_obj({"target_graph_rows": [7]})), geo)
    with pytest.raises(InputError, match="every request bucket"):
        resolve_config(UserConfig.build(parse_config_obj({"target_graph_rows": {"1": [2]}})), geo)
