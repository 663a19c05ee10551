"""The pure parts of calibration on every rank: per-rank skew per point, the refusal naming ranks
and points, the merge of the ranks' windows, the table hash check (no processes needed)."""

from __future__ import annotations

import pytest

from speccal.base.errors import InputError, SpeccalError
from speccal.calibrate.ranks import (
    DEFAULT_MAX_RANK_SKEW_PCT,
    RankSkewError,
    check_rank_skew,
    check_same_table,
    check_skew_bound,
    merge_ranks,
    rank_skew,
    table_digest,
)


def _row(bcap, g, window, step_ms, k=3, ctx=0):
    return {"context_index": ctx, "bcap": bcap, "g": g, "k": k, "window_index": window,
            "step_ms": step_ms, "elapsed_s": step_ms * 2 / 1000.0}


def _rank(scale, jitter=0.0):
    return [_row(1, 4, w, scale * 10.0 + jitter * w) for w in range(3)] + [
        _row(2, 8, w, scale * 20.0) for w in range(3)]


def test_skew_is_the_spread_of_the_ranks_median_windows():
    skews = rank_skew([_rank(1.0, jitter=1.0), _rank(1.02), _rank(0.99)])
    s = {x.key: x for x in skews}
    # point (0, 1, 4, 3): rank medians 11.0, 10.2, 9.9 -> (11.0 - 9.9) / 9.9
    p = s[(0, 1, 4, 3)]
    assert p.step_ms == pytest.approx((11.0, 10.2, 9.9))
    assert (p.slowest, p.fastest) == (0, 2)
    assert p.skew_pct == pytest.approx(100 * 1.1 / 9.9)
    assert s[(0, 2, 8, 3)].skew_pct == pytest.approx(100 * (20.4 - 19.8) / 19.8)


def test_skew_within_the_default_bound_passes():
    check_rank_skew(rank_skew([_rank(1.0), _rank(1.04)]), DEFAULT_MAX_RANK_SKEW_PCT)


def test_skew_beyond_the_bound_names_ranks_and_points():
    rows = [_rank(1.0), _rank(1.0), _rank(1.0)]
    rows[2] = [dict(r, step_ms=r["step_ms"] * (1.2 if r["bcap"] == 2 else 1.0)) for r in rows[2]]
    with pytest.raises(RankSkewError) as err:
        check_rank_skew(rank_skew(rows), 5.0)
    msg = str(err.value)
    assert "beyond the 5 % bound on 1 of 2 points (ranks [0, 2])" in msg
    assert "point (context 0, Bcap 2, G 8, k 3): rank 2 24.000 ms vs rank 0 20.000 ms" in msg
    assert "Bcap 1" not in msg
    assert err.value.exit_code == 1


def test_a_point_missing_on_one_rank_is_refused():
    with pytest.raises(InputError, match=r"missing on ranks \[1\]"):
        rank_skew([_rank(1.0), _rank(1.0)[:3]])


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_skew_bound_must_be_positive(bad):
    with pytest.raises(InputError, match="max_rank_skew_pct"):
        check_skew_bound(bad)


def test_merge_keeps_each_windows_slowest_rank():
    a = [_row(1, 4, 0, 10.0), _row(1, 4, 1, 12.0)]
    b = [_row(1, 4, 0, 11.0), _row(1, 4, 1, 9.0)]
    merged = merge_ranks([a, b])
    assert [r["step_ms"] for r in merged] == [11.0, 12.0]
    assert [r["window_index"] for r in merged] == [0, 1]


def test_table_hash_is_of_the_canonical_json_and_mismatches_name_ranks():
    assert table_digest('{"b": 1, "a": [1, 2]}') == table_digest('{"a":[1,2],"b":1}')
    d0, d1 = table_digest('{"a": 1}'), table_digest('{"a": 2}')
    check_same_table([d0, d0])
    with pytest.raises(SpeccalError, match=r"table hash differs on ranks \[1, 3\]"):
        check_same_table([d0, d1, d0, d1])


@pytest.mark.parametrize("field, value", [("loop", "bogus"), ("clock", "bogus"),
                                          ("state_strategy", "bogus")])
def test_several_ranks_refuse_what_one_rank_refuses(tmp_path, field, value):
    """``torchrun ... calibrate --loop bogus`` once started a whole calibration."""
    from speccal.base.errors import InputError
    from speccal.calibrate.pipeline import CalibrateOptions
    from speccal.calibrate.ranks import _check_options

    opts = CalibrateOptions(out=tmp_path / "t.json", **{field: value})
    with pytest.raises(InputError, match=f"--{field.replace('_', '-')}"):
        _check_options(opts, 5.0)
