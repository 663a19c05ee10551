"""Several contexts in one calibration: default geometric levels, interleaved windows."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.feasibility import default_contexts, reserve_tokens
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from tests.calibrate.fakes import CONFIG, fake

GEO = Geometry(draft_width=3, request_buckets=(1, 2, 4, 8), kv_capacity_tokens=1 << 16)


@pytest.mark.parametrize(
    "reserve, levels",
    [
        (28, ((32, 1, 64), (128, 65, 256), (512, 257, 1024), (2048, 1025, 4096))),
        (424, ((1, 1, 425), (452, 426, 904), (962, 905, 1925), (2048, 1926, 4096))),
        (848, ((1, 1, 849), (932, 850, 1865), (2048, 1866, 4096))),
    ],
)
def test_default_levels_are_geometric_contiguous_and_leave_room_to_grow(reserve, levels):
    got, _ = default_contexts(
        GEO, 8, reserve, prefill_tokens=2048, min_kv_length=1, max_kv_length=4096
    )
    assert got == levels
    for p, lo, hi in got:
        assert lo <= p and p + reserve <= hi


def test_one_level_when_nothing_narrower_fits_and_a_refusal_when_none_does():
    small = Geometry(
        draft_width=3, request_buckets=(1,), kv_capacity_tokens=1 << 16, max_model_len=600
    )
    got, note = default_contexts(
        small, 1, 424, prefill_tokens=2048, min_kv_length=1, max_kv_length=4096
    )
    assert got == ((176, 1, 600),) and "model context 600" in note
    tiny = Geometry(
        draft_width=3, request_buckets=(1,), kv_capacity_tokens=1 << 16, max_model_len=300
    )
    with pytest.raises(InputError, match="smaller explicit config"):
        default_contexts(tiny, 1, 424, prefill_tokens=2048, min_kv_length=1, max_kv_length=4096)
    assert reserve_tokens(8, 32, 3, 3) == 424


def test_windows_alternate_between_contexts(tmp_path):
    cfg = {
        **CONFIG,
        "contexts": [
            {"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 100},
            {"prefill_tokens": 120, "min_kv_length": 101, "max_kv_length": 200},
        ],
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    make = fake()
    opts = CalibrateOptions(
        config_path=tmp_path / "cfg.json", out=tmp_path / "t.json", progress=False
    )
    with open("/dev/null", "w") as sink:
        calibrate(opts, console=Console(file=sink), engine_factory=make, clock=make.clock)
    rows = [
        json.loads(line)
        for line in (tmp_path / "t.json.journal.jsonl").read_text().split("\n")
        if line.strip()
    ]
    order = [r["row"]["context_index"] for r in rows if r.get("kind") == "window"]
    # Window-major, and inside a window round the two intervals alternate point by point:
    # no interval is measured in one stretch.
    assert order[:10] == [0, 1] * 5
    assert len(order) == 2 * 5 * CONFIG["windows_per_point"]
    assert all(a != b for a, b in zip(order, order[1:], strict=False))
