"""Trace format (speccal.trace): validation, derived counts, parquet / JSONL round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speccal.base.errors import InputError, SchemaError
from speccal.trace import (
    RoundTrace,
    RoundTraceBuilder,
    TokenTrace,
    TokenTraceBuilder,
    load_trace,
    save_trace,
)


def small_round_trace(w: int = 3) -> RoundTrace:
    b = RoundTraceBuilder(w)
    b.add(w, [0, 3, 1], [[0.2, 0.5, 0.5], [0.9, 0.8, 0.7], [0.6, 0.1, 0.4]], [10, 12, 14])
    b.add(w, [2, 2], [[0.7, 0.7, 0.2], [1.0, 1.0, 0.0]], [11, 13])
    b.add(2, [2], [[0.5, 0.5]], [40])  # a censored round (k < w): scores NaN at position 2
    return b.build({"source": "test", "phases": ["a"]})


def small_token_trace(w: int = 3) -> TokenTrace:
    b = TokenTraceBuilder(w)
    for t, m in enumerate([3, 0, 1, 2, 0]):
        b.add(0, t, 20 + t, m, np.full(w, 0.5))
    for t, m in enumerate([1, 1]):
        b.add(1, t, 8 + t, m, np.full(w, 0.25))
    return b.build({"source": "test"})


def test_round_trace_layout_and_counts():
    tr = small_round_trace()
    assert tr.num_rounds == 3 and not tr.full_width
    np.testing.assert_array_equal(tr.cu_requests, [0, 3, 5, 6])
    np.testing.assert_allclose(tr.kv_length, [12, 12, 40])
    # H[r, i] = requests with accepted >= i + 1
    np.testing.assert_array_equal(tr.survival_counts(), [[2, 1, 1], [2, 2, 0], [1, 1, 0]])
    acc, sc = tr.padded(0, 2)
    np.testing.assert_array_equal(acc, [[0, 3, 1], [2, 2, 0]])
    assert sc.shape == (2, 3, 3) and sc[1, 2].sum() == 0
    assert np.isnan(tr.draft_scores[5, 2])


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_round_trip(tmp_path, suffix):
    tr = small_round_trace()
    back = load_trace(save_trace(tr, tmp_path / f"t{suffix}"))
    assert isinstance(back, RoundTrace)
    for f in ("num_requests", "kv_length", "k", "accepted", "phase"):
        np.testing.assert_array_equal(getattr(back, f), getattr(tr, f))
    np.testing.assert_array_equal(np.isnan(back.draft_scores), np.isnan(tr.draft_scores))
    np.testing.assert_allclose(np.nan_to_num(back.draft_scores), np.nan_to_num(tr.draft_scores))
    assert back.meta == tr.meta


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_token_trace_round_trip(tmp_path, suffix):
    tr = small_token_trace()
    back = load_trace(save_trace(tr, tmp_path / f"t{suffix}"))
    assert isinstance(back, TokenTrace)
    np.testing.assert_array_equal(back.accept, tr.accept)
    np.testing.assert_array_equal(back.match_length, [3, 0, 1, 2, 0, 1, 1])
    np.testing.assert_allclose(back.draft_scores, tr.draft_scores)


def test_round_trace_validation_names_the_field():
    base = dict(draft_width=2, num_requests=[2], kv_length=[5.0], k=[2], accepted=[1, 2])
    RoundTrace(**base)
    with pytest.raises(SchemaError, match="accepted"):
        RoundTrace(**{**base, "accepted": [3, 0]})
    with pytest.raises(SchemaError, match="k"):
        RoundTrace(**{**base, "k": [3]})
    with pytest.raises(SchemaError, match="accepted"):
        RoundTrace(**{**base, "accepted": [1]})
    with pytest.raises(SchemaError, match="draft_scores"):
        RoundTrace(**base, draft_scores=[[0.5, 1.5], [0.1, 0.1]])
    with pytest.raises(SchemaError, match="kv_length"):
        RoundTrace(**{**base, "kv_length": [np.nan]})


def test_token_trace_positions_must_be_contiguous():
    with pytest.raises(SchemaError, match="position"):
        TokenTrace(
            draft_width=1, request=[0, 0], position=[0, 2], kv_length=[1, 2], accept=[[1], [0]]
        )


def test_files_refuse_bad_headers(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        json.dumps({"speccal_trace": {"schema_version": 99, "kind": "rounds", "draft_width": 2}})
        + "\n"
    )
    with pytest.raises(SchemaError, match="schema_version"):
        load_trace(p)
    p.write_text('{"something": 1}\n')
    with pytest.raises(SchemaError):
        load_trace(p)
    with pytest.raises(InputError, match="trace"):
        load_trace(tmp_path / "missing.parquet")
    with pytest.raises(InputError, match=".parquet or .jsonl"):
        save_trace(small_round_trace(), tmp_path / "t.csv")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_plan_kv_length_round_trips_and_is_what_replay_decides_on(tmp_path, suffix):
    """The live runner records the KV each round's plan saw (``plan_kv_length``); it survives
    both formats, and ``decision_kv`` is it (else the after-round ``kv_length``)."""
    b = RoundTraceBuilder(3)
    b.add(3, [1, 2], [[0.5] * 3, [0.5] * 3], [10, 12], plan_kv_length=4.0)
    b.add(3, [0, 3], [[0.5] * 3, [0.5] * 3], [13, 16], plan_kv_length=9.5)
    tr = b.build({"source": "test"})
    np.testing.assert_array_equal(tr.decision_kv, [4.0, 9.5])
    back = load_trace(save_trace(tr, tmp_path / f"t{suffix}"))
    np.testing.assert_array_equal(back.plan_kv_length, [4.0, 9.5])
    plain = load_trace(save_trace(small_round_trace(), tmp_path / f"p{suffix}"))
    assert plain.plan_kv_length is None
    np.testing.assert_array_equal(plain.decision_kv, plain.kv_length)
    # a builder given it for some rounds only records none
    b2 = RoundTraceBuilder(3)
    b2.add(3, [1], [[0.5] * 3], [10], plan_kv_length=4.0)
    b2.add(3, [1], [[0.5] * 3], [14])
    assert b2.build().plan_kv_length is None


def test_plan_kv_length_is_validated(tmp_path):
    with pytest.raises(SchemaError, match="plan_kv_length"):
        RoundTrace(draft_width=3, num_requests=[1], kv_length=[5.0], k=[3], accepted=[1],
                   plan_kv_length=[-1.0])
    p = tmp_path / "t.jsonl"
    tr = RoundTrace(draft_width=3, num_requests=[1, 1], kv_length=[5.0, 9.0], k=[3, 3],
                    accepted=[1, 2], plan_kv_length=[1.0, 5.0])
    save_trace(tr, p)
    lines = p.read_text().splitlines()
    row = json.loads(lines[2])
    del row["plan_kv_length"]
    p.write_text("\n".join([lines[0], lines[1], json.dumps(row)]) + "\n")
    with pytest.raises(SchemaError, match="plan_kv_length"):
        load_trace(p)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_kv_max_length_round_trips_and_measures_the_spread(tmp_path, suffix):
    """The builder records each round's longest request (``kv_max_length``); it survives both
    formats, and ``kv_spread`` says how far past the round's mean KV it sat."""
    b = RoundTraceBuilder(3)
    b.add(3, [1, 2], [[0.5] * 3, [0.5] * 3], [10, 30])  # mean 20, longest 30: 1.5x
    b.add(3, [0, 3, 1, 1], [[0.5] * 3] * 4, [100, 10, 10, 40])  # mean 40, longest 100: 2.5x
    b.add(3, [1], [[0.5] * 3], [7])  # one request: 1x
    tr = b.build()
    np.testing.assert_array_equal(tr.kv_max_length, [30.0, 100.0, 7.0])
    back = load_trace(save_trace(tr, tmp_path / f"t{suffix}"))
    np.testing.assert_array_equal(back.kv_max_length, [30.0, 100.0, 7.0])
    spread = back.kv_spread()
    assert spread["median_max_over_mean"] == pytest.approx(1.5)
    assert spread["rounds_past_1_5x_pct"] == pytest.approx(100 / 3)
    assert spread["p90_max_over_mean"] == pytest.approx(np.percentile([1.5, 2.5, 1.0], 90))
    bare = RoundTrace(draft_width=3, num_requests=[1, 2], kv_length=[5.0, 9.0], k=[3, 3],
                      accepted=[1, 2, 0])  # a trace from elsewhere: no longest recorded
    plain = load_trace(save_trace(bare, tmp_path / f"p{suffix}"))
    assert plain.kv_max_length is None and plain.kv_spread() is None


def test_kv_max_length_is_validated():
    with pytest.raises(SchemaError, match="kv_max_length.*mean kv_length 5"):
        RoundTrace(draft_width=3, num_requests=[1], kv_length=[5.0], k=[3], accepted=[1],
                   kv_max_length=[4.0])
    with pytest.raises(SchemaError, match="kv_max_length"):
        RoundTrace(draft_width=3, num_requests=[1, 1], kv_length=[5.0, 6.0], k=[3, 3],
                   accepted=[1, 1], kv_max_length=[5.0])
