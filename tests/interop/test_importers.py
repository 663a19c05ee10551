"""Importing acceptance measured in other engines: every format round-trips through replay with
the same per-position acceptance, and every malformed file is one InputError naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.interop import importers
from speccal.interop.acceptance import (
    Acceptance,
    apportion,
    from_draft_lengths,
    from_histogram,
    from_prefix,
    prefix_from_draft_lengths,
)
from speccal.interop.importers import read_acceptance
from speccal.interop.prometheus import parse_exposition
from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.scenarios import scenario_geometry, synthetic_table
from speccal.trace import load_trace

from . import engine_files

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "notebooks" / "data" / "transition.parquet"
DATA = ROOT / "notebooks" / "data" / "interop"


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE)


def _replayed_acceptance(tr) -> tuple[float, float]:
    """(mean accepted length, acceptance rate) of fixed:w replayed on ``tr``."""
    cost = CostModel.from_table(synthetic_table(scenario_geometry(tr.draft_width, 8), "draft_step"))
    run = replay(tr, cost, ReplayConfig(policies=())).run(f"fixed:{tr.draft_width}")
    t = run.totals()
    return t["mean_accepted_length"], t["acceptance_rate"]


def _survival(tr) -> list[int]:
    return tr.survival_counts().sum(axis=0).tolist()


def _write(tmp_path, name, text) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------ round trips


def test_vllm_metrics_round_trip_exactly(trace, tmp_path):
    c = engine_files.counts(trace)
    p = _write(tmp_path, "m.prom", engine_files.vllm_metrics_text(c, engines=3))
    acc = read_acceptance(p)
    assert acc.exact and acc.source["format"] == "vllm-metrics"
    tr = acc.to_trace(8, 1024.0)
    assert _survival(tr) == c["per_pos"]  # the per-position counters, summed over 3 ranks
    mean, rate = _replayed_acceptance(tr)
    assert mean == pytest.approx(c["accepted"] / c["drafts"], abs=1e-12)
    assert rate == pytest.approx(c["accepted"] / c["draft_tokens"], abs=1e-12)


def test_vllm_metrics_since_an_earlier_scrape_imports_the_window(trace, tmp_path):
    half = trace.num_rounds // 2
    before = _write(
        tmp_path,
        "a.prom",
        engine_files.vllm_metrics_text(engine_files.counts(trace, slice(0, half))),
    )
    after = _write(tmp_path, "b.prom", engine_files.vllm_metrics_text(engine_files.counts(trace)))
    acc = read_acceptance(after, since=before)
    want = engine_files.counts(trace, slice(half, None))  # the hard phase alone
    assert _survival(acc.to_trace(8, 1024.0)) == want["per_pos"]
    assert acc.num_steps == want["drafts"]


def test_vllm_request_stats_detailed_keep_every_step(trace, tmp_path):
    stats = engine_files.vllm_request_stats(trace, rounds=200)
    p = _write(tmp_path, "r.json", json.dumps(stats))
    acc = read_acceptance(p)
    assert acc.source["detailed"] is True
    tr = acc.to_trace(8, 512.0)
    # interleaved as concurrent decoding runs them: round r is step r of the 8 requests
    assert np.array_equal(tr.accepted, trace.accepted[: 200 * 8])
    hist = sum(
        np.bincount(s["choices"][0]["speculative_decoding_stats"]["per_step_accepted"], minlength=4)
        for s in stats
    )
    mean, _ = _replayed_acceptance(tr)
    assert mean == pytest.approx(float((hist * np.arange(4)).sum() / hist.sum()))


def test_vllm_request_stats_summary_and_json_lines(trace, tmp_path):
    stats = engine_files.vllm_request_stats(trace, rounds=50, detailed=False)
    p = _write(tmp_path, "r.jsonl", "\n".join(json.dumps(s) for s in stats) + "\n")
    acc = read_acceptance(p, "vllm-requests")
    assert acc.source["detailed"] is False
    assert acc.histogram().tolist() == np.bincount(trace.accepted[:400], minlength=4).tolist()


def test_speculation_profile_histogram_is_exact(trace, tmp_path):
    prof = engine_files.speculation_profile(trace)
    p = _write(tmp_path, "speculation_profile.json", json.dumps(prof))
    acc = read_acceptance(p)
    assert acc.exact
    assert acc.histogram().tolist() == np.bincount(trace.accepted, minlength=4).tolist()
    np.testing.assert_allclose(acc.prefix_acceptance(), prof["marginal_accept_rates"], atol=1e-6)


def test_speculation_profile_rates_only_within_one_row(trace, tmp_path):
    prof = engine_files.speculation_profile(trace)
    del prof["acceptance_length_histogram"]
    p = _write(tmp_path, "p.json", json.dumps(prof))
    acc = read_acceptance(p, profile_rows=1000)
    assert not acc.exact and acc.num_steps == 1000
    np.testing.assert_allclose(acc.prefix_acceptance(), prof["marginal_accept_rates"], atol=1e-3)
    del prof["marginal_accept_rates"]  # conditional alone: their running product
    acc = read_acceptance(_write(tmp_path, "q.json", json.dumps(prof)), profile_rows=1000)
    np.testing.assert_allclose(
        acc.prefix_acceptance(), np.cumprod(prof["conditional_accept_rates"]), atol=1e-3
    )


def test_csv_keeps_the_recorded_rounds_and_kv(trace, tmp_path):
    p = _write(tmp_path, "a.csv", engine_files.accepted_csv(trace, rounds=30))
    acc = read_acceptance(p)
    tr = acc.to_trace(3, 99.0)  # the CSV's rounds win over --num-requests
    assert tr.num_rounds == 30 and (tr.num_requests == 8).all()
    assert np.array_equal(tr.accepted, trace.accepted[:240])
    assert np.allclose(tr.kv_length, trace.kv_length[:30])
    # each row's KV is its round's here: the longest request of a round is the round's mean
    assert np.allclose(tr.kv_max_length, tr.kv_length)
    assert _survival(tr) == engine_files.counts(trace, slice(0, 30))["per_pos"]


def test_csv_without_drafted_needs_the_width(tmp_path):
    p = _write(tmp_path, "a.csv", "accepted\n0\n3\n2\n")
    with pytest.raises(InputError, match="--draft-width"):
        read_acceptance(p)
    acc = read_acceptance(p, draft_width=3)
    tr = acc.to_trace(2, 10.0)
    assert tr.num_requests.tolist() == [2, 1]  # the last group may be smaller


def test_shipped_example_inputs_import(trace):
    """The files docs/INTEROP.md and the notebook read are the shipped trace's acceptance."""
    c = engine_files.counts(trace)
    acc = read_acceptance(DATA / "vllm-metrics.prom")
    assert acc.prefix_acceptance().tolist() == [v / c["drafts"] for v in c["per_pos"]]
    for name in (
        "vllm-requests.json",
        "vllm-requests-legacy.json",
        "vllm-requests-dynamic-k.json",
        "speculation_profile.json",
        "accepted.csv",
    ):
        assert read_acceptance(DATA / name).num_steps > 0


def test_histogram_rows_are_scaled_past_max_rows_and_shuffled():
    acc = from_histogram(np.array([5000, 3000, 2000]), source={}, max_rows=100, seed=1)
    assert not acc.exact and acc.histogram().tolist() == [50, 30, 20]
    assert acc.source["counts"] == [5000, 3000, 2000]
    assert not (np.diff(acc.accepted) >= 0).all()  # shuffled, not sorted runs


def test_apportion_sums_and_keeps_proportions():
    out = apportion(np.array([1.0, 1.0, 1.0]), 10)
    assert out.sum() == 10 and sorted(out.tolist()) == [3, 3, 4]


def test_prometheus_parser_reads_labels_escapes_and_timestamps():
    text = (
        '# HELP x help\nx_total{a="1",b="q\\"uo\\\\te"} 12.0 1700000000\ny 3\nz{ a = "v" ,} +Inf\n'
    )
    s = parse_exposition(text)
    assert [x.name for x in s] == ["x_total", "y", "z"]
    assert s[0].label("b") == 'q"uo\\te' and s[0].value == 12.0
    assert s[2].value == float("inf") and s[2].label("a") == "v"


# ------------------------------------------------------------------------------ bad files


def _metrics(**edit) -> str:
    c = {"drafts": 10, "draft_tokens": 30, "accepted": 12, "per_pos": [6, 4, 2]}
    c.update(edit)
    return engine_files.vllm_metrics_text(c)


@pytest.mark.parametrize(
    "text, field",
    [
        ("", "acceptance"),  # empty file
        ("   \n", "acceptance"),
        ("this is not a metric line\n", "line 1"),
        (_metrics().replace('position="1"', 'position="4"'), "position"),  # missing position 1
        (_metrics(per_pos=[6, -4, 2], accepted=4), "per_pos"),  # negative count
        (_metrics(drafts=-10), "num_drafts"),
        (_metrics(per_pos=[11, 4, 2], accepted=17), "per_pos_total[0]"),  # accepted > drafted
        (_metrics(accepted=40, per_pos=[10, 10, 20]), "accepted"),  # accepted > draft tokens
        (_metrics(per_pos=[6, 2, 4]), "per_pos_total[2]"),  # not monotone
        (_metrics(accepted=11), "num_accepted_tokens_total"),  # sum of positions differs
        (_metrics(draft_tokens=27), "num_draft_tokens_total"),  # shortened drafts (censored)
        (_metrics(drafts=0, draft_tokens=0, accepted=0, per_pos=[0, 0, 0]), "num_drafts"),
        (_metrics().replace("vllm:spec_decode_num_drafts_total", "vllm:other"), "num_drafts_total"),
        (_metrics().replace("12.0", "12.5"), "counter value"),
    ],
)
def test_bad_vllm_metrics(tmp_path, text, field):
    p = _write(tmp_path, "m.prom", text)
    with pytest.raises(InputError) as exc:
        read_acceptance(p)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg, msg


def test_vllm_metrics_of_two_models_need_a_name(tmp_path):
    text = _metrics() + _metrics().replace("dense-2b", "other")
    p = _write(tmp_path, "m.prom", text)
    with pytest.raises(InputError, match="model_name"):
        read_acceptance(p)
    assert read_acceptance(p, model_name="other").num_steps == 10


def test_since_with_a_counter_reset_is_refused(tmp_path):
    a = _write(tmp_path, "a.prom", _metrics(drafts=20, draft_tokens=60, accepted=12))
    b = _write(tmp_path, "b.prom", _metrics())
    with pytest.raises(InputError, match="restarted"):
        read_acceptance(b, since=a)


def _stats(**edit) -> str:
    s = {
        "acceptance_histogram": {"0": 2, "3": 1},
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 3,
        "num_draft_tokens": 9,
        "num_spec_tokens": 3,
        "per_step_accepted": [0, 3, 0],
        "per_step_drafted": [3, 3, 3],
    }
    s.update(edit)
    return json.dumps([{"choices": [{"speculative_decoding_stats": s}]}])


@pytest.mark.parametrize(
    "text, field",
    [
        ("[]", "speculative_decoding_stats"),
        ('[{"choices": [{"speculative_decoding_stats": null}]}]', "speculative_decoding_stats"),
        (_stats(acceptance_histogram={"0": -2, "3": 1}), "acceptance_histogram[0]"),
        (_stats(acceptance_histogram={"0": 2, "5": 1}), "acceptance_histogram"),
        (_stats(num_spec_steps=4), "num_spec_steps"),
        (_stats(num_draft_tokens=8), "num_draft_tokens"),  # censored
        (_stats(num_accepted_draft_tokens=4), "num_accepted_draft_tokens"),
        (_stats(per_step_drafted=[3, 2, 3]), "per_step_drafted"),
        (_stats(per_step_accepted=[0, 3]), "per_step_accepted"),
        (_stats(per_step_accepted=[0, 0, 3], per_step_drafted=[3, 3, 3]), None),  # same histogram
        (_stats(per_step_accepted=[0, 4, 0]), "per_step_accepted"),  # accepted > drafted
        (_stats(num_spec_tokens=0), "num_spec_tokens"),
    ],
)
def test_bad_vllm_request_stats(tmp_path, text, field):
    p = _write(tmp_path, "r.json", text)
    if field is None:
        assert read_acceptance(p, "vllm-requests").num_steps == 3
        return
    with pytest.raises(InputError) as exc:
        read_acceptance(p, "vllm-requests")
    assert field in str(exc.value), str(exc.value)


def _profile(**edit) -> str:
    p = {
        "schema_version": "1.0",
        "measured": True,
        "num_speculative_tokens": 3,
        "verification_method": "longest_prefix",
        "marginal_accept_rates": [0.6, 0.4, 0.2],
        "conditional_accept_rates": [0.6, 0.666667, 0.5],
        "acceptance_length_histogram": {"1": 4, "2": 2, "3": 2, "4": 2},
    }
    p.update(edit)
    return json.dumps(p)


@pytest.mark.parametrize(
    "text, field",
    [
        (_profile(measured=False), "profile.measured"),
        (_profile(schema_version="2.0"), "schema_version"),
        (_profile(verification_method="block"), "verification_method"),
        (_profile(marginal_accept_rates=[0.6, 0.4]), "marginal_accept_rates"),  # missing position
        (
            _profile(
                marginal_accept_rates=[0.6, 0.7, 0.2],
                acceptance_length_histogram=None,
                conditional_accept_rates=None,
            ),
            "marginal_accept_rates[1]",
        ),
        (_profile(marginal_accept_rates=[0.6, 0.4, 1.2]), "marginal_accept_rates"),
        (_profile(conditional_accept_rates=[0.6, 0.9, 0.5]), "conditional_accept_rates[1]"),
        (_profile(acceptance_length_histogram={"1": 4, "2": -2}), "acceptance_length_histogram[2]"),
        (_profile(acceptance_length_histogram={"0": 4}), "acceptance_length_histogram"),
        (_profile(acceptance_length_histogram={"1": 1, "4": 9}), "marginal_accept_rates"),
        (
            _profile(
                acceptance_length_histogram=None,
                marginal_accept_rates=None,
                conditional_accept_rates=None,
            ),
            "no rates",
        ),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_speculation_profile(tmp_path, text, field):
    p = _write(tmp_path, "speculation_profile.json", text)
    with pytest.raises(InputError) as exc:
        read_acceptance(p, "profile")
    assert field in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    "text, field",
    [
        ("request,k\n0,3\n", "csv.columns"),
        ("accepted,drafted\n", "0 rows"),
        ("accepted,drafted\n1,3\nx,3\n", "csv.accepted[row 1]"),
        ("accepted,drafted\n1,3\n-1,3\n", "csv.accepted[row 1]"),
        ("accepted,drafted\n1,3\n4,3\n", "accepted > drafted"),
        ("accepted,drafted\n1,3\n1,2\n", "csv.drafted[row 1]"),
        ("accepted,drafted,kv_length\n1,3,-5\n", "csv.kv_length[row 0]"),
        ("accepted,drafted,round\n1,3,0.5\n", "csv.round[row 0]"),
    ],
)
def test_bad_csv(tmp_path, text, field):
    p = _write(tmp_path, "a.csv", text)
    with pytest.raises(InputError) as exc:
        read_acceptance(p)
    assert field in str(exc.value), str(exc.value)


def test_unknown_format_and_undetectable_files(tmp_path):
    p = _write(tmp_path, "a.bin", "hello\n")
    with pytest.raises(InputError, match="--format"):
        read_acceptance(p)
    with pytest.raises(InputError, match="--format"):
        read_acceptance(p, "tsv")
    with pytest.raises(InputError, match="--since"):
        read_acceptance(_write(tmp_path, "b.csv", "accepted\n1\n"), since=p, draft_width=3)


def test_acceptance_refuses_lengths_past_the_width_and_bad_profiles():
    with pytest.raises(InputError, match="accepted"):
        Acceptance(draft_width=2, accepted=np.array([0, 3]))
    with pytest.raises(InputError, match="0 steps"):
        Acceptance(draft_width=2, accepted=np.array([], dtype=np.int64))
    with pytest.raises(InputError, match=r"\[1\]"):
        from_prefix(np.array([0.5, 0.6]), source={})
    assert (
        importers.detect_format(Path("x.json"), '{"acceptance_histogram": {}}') == "vllm-requests"
    )


# ------------------------------------------------------------- vLLM per-request, merged shape
# The merged shape follows vllm-project/vllm PR #48915 (merged): top-level
# ``metrics.speculative_decoding``, dense ``acceptance_histogram`` of num_spec_tokens + 1
# entries (docs/features/speculative_decoding/acceptance_metrics.md at
# local-inference-lab/vllm@3b85a950b49803bf62c7a6b0fa7287349ec2eae7, a vLLM fork's copy of the
# merged doc; the PR's e2e test reads ``response.json()["metrics"]["speculative_decoding"]``).
# ``acceptance_histogram_by_draft_length`` is in no stored vLLM snapshot: its layout (a list
# indexed by draft length 0..num_spec_tokens of dense histograms) is taken from the issue text
# and vLLM's ``SpecDecodingStats.num_drafts_by_draft_length`` (engine_files docstring).


def _merged(**edit) -> dict:
    s = {
        "mean_acceptance_length": 2.0,
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [2, 0, 0, 1],
        "acceptance_histogram_by_draft_length": [
            [0, 0, 0, 0],
            [0, 0, 0, 0],
            [0, 0, 0, 0],
            [2, 0, 0, 1],
        ],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 3,
        "num_draft_tokens": 9,
        "num_spec_tokens": 3,
    }
    s.update(edit)
    return s


def _merged_text(*stats) -> str:
    return json.dumps(
        [{"choices": [{"index": 0}], "metrics": {"speculative_decoding": s}} for s in stats]
    )


def test_merged_vllm_request_metrics_read_and_say_which_shape(trace, tmp_path):
    stats = engine_files.vllm_request_metrics(trace, rounds=200)
    acc = read_acceptance(_write(tmp_path, "r.json", json.dumps(stats)))
    assert acc.source["shape"] == importers.SHAPE_MERGED
    assert "#48915" in acc.source["shape_read"] and acc.source["detailed"] is True
    # detailed: every step in order, as with the legacy shape
    assert np.array_equal(acc.to_trace(8, 512.0).accepted, trace.accepted[: 200 * 8])
    summary = engine_files.vllm_request_metrics(trace, rounds=50, detailed=False)
    acc = read_acceptance(
        _write(tmp_path, "s.jsonl", "\n".join(map(json.dumps, summary))), "vllm-requests"
    )
    assert acc.exact and acc.source["detailed"] is False
    assert acc.histogram().tolist() == np.bincount(trace.accepted[:400], minlength=4).tolist()
    legacy = read_acceptance(DATA / "vllm-requests-legacy.json")
    assert legacy.source["shape"] == importers.SHAPE_LEGACY
    assert "pre-merge" in legacy.source["shape_read"]
    merged = read_acceptance(DATA / "vllm-requests.json")
    assert merged.source["shape"] == importers.SHAPE_MERGED
    assert np.array_equal(merged.accepted, legacy.accepted)  # the same steps, either shape


def test_by_draft_length_estimator_recovers_a_known_truth_exactly():
    """Expected counts (no sampling) of conditional acceptance 0.8, 0.6, 0.5 at every
    position, 1000 steps at K = 1 and 1000 at K = 3: the product-limit estimate is the truth
    0.8, 0.48, 0.24; pooling per-position counts over all steps is not (K = 1 steps never
    verified positions 2 and 3)."""
    c = np.zeros((4, 4), dtype=np.int64)
    c[1, :2] = [200, 800]  # K = 1: accepted 0 or 1 (censored)
    c[3] = [200, 320, 240, 240]  # K = 3: 1000 * (0.2, 0.8 * 0.4, 0.48 * 0.5, 0.24)
    prefix, reached = prefix_from_draft_lengths(c)
    assert prefix == pytest.approx([0.8, 0.48, 0.24], abs=1e-12)
    assert reached.tolist() == [2000, 800, 480]
    naive = [(c[:, i + 1 :].sum()) / c.sum() for i in range(3)]
    assert naive[1] == pytest.approx(0.24)  # half the truth: the estimator matters
    acc = from_draft_lengths(c, source={}, rows=10000)
    assert acc.prefix_acceptance() == pytest.approx([0.8, 0.48, 0.24], abs=1e-4)
    assert acc.draft_width == 3 and not acc.exact
    stats = _merged(
        acceptance_histogram=c.sum(axis=0).tolist(),
        acceptance_histogram_by_draft_length=c.tolist(),
        num_spec_steps=2000,
        num_accepted_draft_tokens=int((c.sum(axis=0) * np.arange(4)).sum()),
        num_draft_tokens=1000 * 1 + 1000 * 3,
    )
    acc = importers.vllm_requests(_merged_text(stats))
    assert acc.source["prefix_acceptance_estimated"] == pytest.approx([0.8, 0.48, 0.24])
    assert acc.source["steps_by_draft_length"] == {"1": 1000, "3": 1000}


def test_dynamic_k_deployment_imports_the_per_position_truth(tmp_path):
    """Seeded: the fixture's 15000 steps at K = 3, 3, 2, 1 (batch sizes 1, 2, 4, 8) drawn at
    conditional acceptance 0.8, 0.6, 0.5; tolerance 0.03 is over 4 standard errors at every
    position (1452 steps reach position 3: sd of its estimate ~0.007)."""
    truth = np.cumprod(engine_files.DYNAMIC_CONDITIONAL)
    acc = read_acceptance(DATA / "vllm-requests-dynamic-k.json")
    assert acc.source["shape"] == importers.SHAPE_MERGED
    assert acc.source["draft_lengths"] == "variable"
    assert acc.source["steps_by_draft_length"] == {"1": 8000, "2": 4000, "3": 3000}
    est = np.array(acc.source["prefix_acceptance_estimated"])
    assert est == pytest.approx(truth, abs=0.03)
    assert acc.prefix_acceptance() == pytest.approx(est, abs=1 / 16384 + 1e-12)
    # detailed (per_step_drafted instead of the histograms): the same counts, the same estimate
    detailed = engine_files.vllm_dynamic_k_requests(rounds=4000, detailed=True)
    for r in detailed:
        del r["metrics"]["speculative_decoding"]["acceptance_histogram_by_draft_length"]
    acc2 = read_acceptance(_write(tmp_path, "d.json", json.dumps(detailed)))
    assert acc2.source["prefix_acceptance_estimated"] == pytest.approx(est, abs=1e-12)
    tr = acc.to_trace(8, 1024.0)
    assert tr.draft_width == 3 and (tr.k == 3).all()  # full-width rounds for replay
    assert tr.meta["shape"] == importers.SHAPE_MERGED


def test_dynamic_k_metrics_scrape_is_refused_naming_the_per_request_route(tmp_path):
    pairs = np.concatenate(list(engine_files.dynamic_k_pairs(400).values()))
    d, a = pairs[:, 0], pairs[:, 1]
    c = {
        "drafts": int(a.size),
        "draft_tokens": int(d.sum()),
        "accepted": int(a.sum()),
        "per_pos": [int((a >= i + 1).sum()) for i in range(3)],
    }
    p = _write(tmp_path, "m.prom", engine_files.vllm_metrics_text(c))
    with pytest.raises(InputError) as exc:
        read_acceptance(p)
    msg = str(exc.value)
    assert "num_draft_tokens_total" in msg
    assert "--per-request-spec-decode-metrics" in msg and "--format vllm-requests" in msg
    assert "acceptance_histogram_by_draft_length" in msg


BY = "acceptance_histogram_by_draft_length"


@pytest.mark.parametrize(
    "text, field",
    [
        (_merged_text(_merged(acceptance_histogram={"0": 2, "3": 1})), "dense list"),
        (_merged_text(_merged(acceptance_histogram=[2, 0, 1])), "acceptance_histogram"),
        (_merged_text(_merged(acceptance_histogram=[2, 0, -1, 1])), "acceptance_histogram[2]"),
        (_merged_text(_merged(num_spec_steps=4)), "num_spec_steps"),
        (_merged_text(_merged(num_accepted_draft_tokens=2)), "num_accepted_draft_tokens"),
        (  # by-draft-length histograms disagree with the histogram
            _merged_text(_merged(**{BY: [[0] * 4, [0] * 4, [0] * 4, [1, 0, 0, 2]]})),
            BY,
        ),
        (  # a step that drafted 1 cannot accept 2
            _merged_text(
                _merged(**{BY: [[0] * 4, [1, 0, 1, 0], [0] * 4, [1, 0, 0, 1]]}, num_draft_tokens=7)
            ),
            f"{BY}[1][2]",
        ),
        (  # drafted tokens disagree with the draft lengths
            _merged_text(
                _merged(**{BY: [[0] * 4, [1, 0, 0, 0], [0] * 4, [1, 0, 0, 1]]}, num_draft_tokens=9)
            ),
            "num_draft_tokens",
        ),
        (  # shortened steps without draft lengths: unobserved positions
            _merged_text(_merged(**{BY: None}, num_draft_tokens=8)),
            BY,
        ),
        (  # the schedule never drafts num_spec_tokens: position 3 never verified
            _merged_text(
                _merged(
                    acceptance_histogram=[1, 1, 1, 0],
                    **{BY: [[0] * 4, [1, 1, 0, 0], [0, 0, 1, 0], [0] * 4]},
                    num_accepted_draft_tokens=3,
                    num_draft_tokens=4,
                )
            ),
            "position 3 never",
        ),
        (  # merged per-step arrays that disagree with the by-draft-length histograms
            _merged_text(_merged(per_step_accepted=[0, 3, 0], per_step_drafted=[3, 3, 2])),
            "num_draft_tokens",
        ),
        (  # one file, two shapes
            json.dumps(
                [
                    {"metrics": {"speculative_decoding": _merged()}},
                    {
                        "choices": [
                            {"speculative_decoding_stats": _merged(acceptance_histogram={"0": 3})}
                        ]
                    },
                ]
            ),
            "one shape per file",
        ),
        ('[{"metrics": {"speculative_decoding": null}}]', "metrics.speculative_decoding"),
    ],
)
def test_bad_merged_vllm_request_metrics(tmp_path, text, field):
    p = _write(tmp_path, "r.json", text)
    with pytest.raises(InputError) as exc:
        read_acceptance(p, "vllm-requests")
    assert field in str(exc.value), str(exc.value)


def test_legacy_shape_still_refuses_shortened_drafts(tmp_path):
    stats = json.loads(_stats(num_draft_tokens=8))
    for key in ("per_step_accepted", "per_step_drafted"):
        del stats[0]["choices"][0]["speculative_decoding_stats"][key]
    p = _write(tmp_path, "r.json", json.dumps(stats))
    with pytest.raises(InputError, match="legacy shape has no draft lengths"):
        read_acceptance(p, "vllm-requests")
