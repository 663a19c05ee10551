"""Engine API: geometry, compatibility, capacity, devices, acceptance modes, statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccal.base.errors import CapacityError, InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.live.generate import generate
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams


def _cfg(**kw):
    base = dict(
        model="tiny", draft_width=3, request_buckets=(1, 2, 4), max_model_len=128, block_size=8
    )
    return EngineConfig.flat(**(base | kw))


def test_geometry_and_compatibility():
    eng = Engine(_cfg())
    g = eng.geometry
    assert isinstance(g, Geometry)
    assert g.request_buckets == (1, 2, 4) and g.target_rows[4] == (4, 6, 8, 12, 16)
    assert g.kv_capacity_tokens >= 4 * 128 and g.max_model_len == 128 and g.block_size == 8
    c = eng.compatibility()
    assert (
        c["draft_width"] == 3 and c["graph_mode"] == "eager" and c["verification_mode"] == "greedy"
    )
    assert c["device"]["kind"] == "cpu"
    # one rank records its world too (absent in a table means unknown: older tables)
    assert c["topology"] == {"tp": 1, "dp": 1, "world_size": 1, "devices": [c["device"]["name"]]}
    assert c["model"]["dtype"] == "float32" and c["model"]["architecture"] == "preset:tiny"
    assert Engine(_cfg(seed=1)).compatibility()["model"]["fingerprint"] != c["model"]["fingerprint"]
    assert Engine(_cfg()).compatibility()["model"]["fingerprint"] == c["model"]["fingerprint"]
    assert eng.is_random_weights and "RANDOM" in eng.description


def test_forced_rounds_have_grid_shapes_and_kv_lengths():
    eng = Engine(_cfg(acceptance="forced"))
    for n in (5, 9, 17, 30):
        eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=60, ignore_eos=True))
    res = eng.step(RoundPlan(2))
    assert res.num_prefill_tokens == 61
    assert (res.bcap, res.g, res.k) == (4, 12, 2)
    assert (res.accepted == 2).all() and res.accept_matrix.all()
    assert [len(e) for e in res.emitted] == [4] * 4  # first token + 2 drafts + bonus
    assert res.kv_lengths.tolist() == [n + 3 for n in (5, 9, 17, 30)]
    assert eng.kv_lengths().tolist() == res.kv_lengths.tolist()
    res = eng.step(RoundPlan(3, verify_tokens=[0, 1, 3, 2]))
    assert res.g == 12 and res.accepted.tolist() == [0, 1, 3, 2]
    assert (
        res.draft_scores.shape == (4, 3)
        and ((res.draft_scores > 0) & (res.draft_scores <= 1)).all()
    )
    assert eng.kv_lengths().tolist() == [
        n + 3 + a + 1 for n, a in zip((5, 9, 17, 30), [0, 1, 3, 2], strict=False)
    ]


def test_padded_bucket_and_release():
    eng = Engine(_cfg())
    rids = [
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)) for _ in range(3)
    ]
    res = eng.step(RoundPlan(1))
    assert res.bcap == 4 and res.num_requests == 3
    free = eng.num_free_kv_tokens
    eng.release(rids[0])
    assert eng.num_free_kv_tokens > free and eng.running_ids() == rids[1:]
    with pytest.raises(InputError, match="request id"):
        eng.release(rids[0])
    eng.reset()
    assert eng.num_free_kv_tokens == eng.geometry.kv_capacity_tokens and not eng.has_unfinished()


def test_more_requests_than_buckets_wait():
    eng = Engine(_cfg(request_buckets=(1, 2)))
    prompts = [[i + 1, i + 2] for i in range(5)]
    outs = generate(eng, prompts, SamplingParams(max_tokens=6, ignore_eos=True), 3)
    plain = generate(
        Engine(_cfg(request_buckets=(1, 2), speculative=False)),
        prompts,
        SamplingParams(max_tokens=6, ignore_eos=True),
        0,
    )
    assert outs == plain and all(len(o) == 6 for o in outs)


def test_capacity_errors():
    eng = Engine(_cfg(kv_capacity_tokens=64))
    with pytest.raises(CapacityError, match="needs up to .* KV slots"):
        eng.add_request(list(range(1, 60)), SamplingParams(max_tokens=10))
    for _ in range(2):
        eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    with pytest.raises(CapacityError, match="KV cache full"):
        for _ in range(20):
            eng.step(RoundPlan(3))
    with pytest.raises(InputError, match="max_model_len"):
        eng.add_request([1] * 100, SamplingParams(max_tokens=40))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"device": "gpu"}, InputError, "device: got 'gpu'"),
        ({"device": "npu"}, UnsupportedError, "torch_npu"),
        ({"draft_width": 0}, InputError, "draft_width"),
        ({"acceptance": "typical"}, InputError, "acceptance"),
        ({"acceptance": "synthetic"}, InputError, "acceptance_profile"),
        (
            {"acceptance": "synthetic", "acceptance_profile": (0.5, 1.2, 0.1)},
            InputError,
            r"acceptance_profile\[1\]",
        ),
        ({"graph_mode": "split"}, UnsupportedError, "graph_mode"),
        ({"model": "nonexistent-preset"}, InputError, "preset"),
        ({"dtype": "int8"}, InputError, "dtype"),
    ],
)
def test_config_refusals(kw, exc, match):
    with pytest.raises(exc, match=match):
        Engine(_cfg(**kw))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_refused_without_gpu():
    with pytest.raises(UnsupportedError, match="CUDA is not available"):
        Engine(_cfg(device="cuda"))


def test_request_refusals():
    eng = Engine(_cfg())
    with pytest.raises(UnsupportedError, match="seed"):
        eng.add_request([1, 2], SamplingParams(seed=3))
    with pytest.raises(UnsupportedError, match="acceptance='sample'"):
        eng.add_request([1, 2], SamplingParams(temperature=0.7))
    with pytest.raises(InputError, match="prompt_ids"):
        eng.add_request([1, 512])
    with pytest.raises(InputError, match="prompt_ids"):
        eng.add_request([])
    eng.add_request([1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(InputError, match="num_draft_steps"):
        eng.step(RoundPlan(4))
    with pytest.raises(InputError, match="verify_tokens"):
        eng.step(RoundPlan(2, verify_tokens=[3]))


def test_synthetic_mean_accepted_length():
    """Profile (0.9, 0.6, 0.5): E[a] = 0.9 + 0.54 + 0.27 = 1.71 per request-round.

    4 requests x 150 rounds = 600 samples; per-round sd of a is ~1.1, so the standard error is
    ~0.045; tolerance 0.15 (> 3 standard errors), seeded.
    """
    profile = (0.9, 0.6, 0.5)
    eng = Engine(
        _cfg(acceptance="synthetic", acceptance_profile=profile, seed=5, max_model_len=1024)
    )
    for i in range(4):
        eng.add_request([i + 1] * 4, SamplingParams(max_tokens=900, ignore_eos=True))
    for _ in range(150):
        eng.step(RoundPlan(3))
    expected = 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.5
    assert eng.stats.num_rounds == 600
    assert abs(eng.stats.mean_accepted_length - expected) < 0.15
    p = eng.stats.prefix_acceptance()
    np.testing.assert_allclose(p, [0.9, 0.54, 0.27], atol=0.07)
    assert eng.stats.hist.sum() == 600


def test_synthetic_scores_are_what_the_acceptance_draws_against():
    """``score_informativeness`` 1: every reported draft score is 0 or 1 and a request's accepted
    length is its scores' leading ones (the score is the outcome); 0: every score is its
    position's profile value. The acceptance rate is the profile's either way."""
    profile = (0.9, 0.6, 0.5)
    for lam in (1.0, 0.0):
        eng = Engine(_cfg(acceptance="synthetic", acceptance_profile=profile, seed=2,
                          max_model_len=512, score_informativeness=lam))
        assert eng.runner.score_informativeness == lam
        for i in range(4):
            eng.add_request([i + 1] * 3, SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(60):
            res = eng.step(RoundPlan(3))
            sc = res.draft_scores
            if lam == 1.0:
                assert set(np.unique(sc)) <= {0.0, 1.0}
                np.testing.assert_array_equal(res.accepted, np.cumprod(sc == 1.0, axis=1).sum(1))
            else:
                np.testing.assert_allclose(sc, np.broadcast_to(profile, sc.shape), rtol=1e-6)
        np.testing.assert_allclose(eng.stats.prefix_acceptance(), [0.9, 0.54, 0.27], atol=0.08)


def test_score_informativeness_is_checked():
    with pytest.raises(InputError, match="score_informativeness"):
        _cfg(acceptance="synthetic", acceptance_profile=(0.9, 0.6, 0.5), score_informativeness=1.5)
    with pytest.raises(InputError, match="score_informativeness.*synthetic"):
        _cfg(acceptance="greedy", score_informativeness=0.5)
    with pytest.raises(InputError, match="score_informativeness"):
        _cfg(acceptance="synthetic", acceptance_profile=(0.9, 0.6, 0.5),
             score_informativeness="high")


def test_sample_mode_mixed_temperatures_keeps_greedy_rows_exact():
    prompts = [[5, 6, 7], [9, 10, 11, 12], [1, 2], [3, 3, 3, 3, 3]]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    hot = SamplingParams(
        max_tokens=16, ignore_eos=True, temperature=1.5, top_k=20, top_p=0.9, min_p=0.01
    )
    plain = generate(Engine(_cfg(speculative=False, seed=11)), prompts, greedy, 0)
    eng = Engine(_cfg(acceptance="sample", seed=11))  # seed: preset weights and sampling
    outs = generate(eng, prompts, [greedy, hot, greedy, hot], 3)
    assert outs[0] == plain[0] and outs[2] == plain[2]
    assert outs[1] != plain[1] or outs[3] != plain[3]  # temperature 1.5 changes something
    assert all(len(o) == 16 for o in outs)


def test_stats_per_position():
    eng = Engine(_cfg())
    generate(eng, [[4, 5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True), 3)
    s = eng.stats
    assert s.num_drafted == 3 * s.num_rounds
    assert (np.diff(s.accepted_at) <= 0).all()  # prefix-closed
    assert s.hist.sum() == s.num_rounds and (s.hist * np.arange(4)).sum() == s.num_accepted
    d = s.to_dict()
    assert set(d) >= {
        "acceptance_rate",
        "mean_accepted_length",
        "accepted_length_hist",
        "accepted_at",
    }


def test_a_step_whose_requests_all_finish_at_prefill_returns_an_empty_round():
    # max_tokens = 1: the prefill's first token finishes each request, no round runs; the empty
    # result keeps every field in its place (it was once built by position and shifted three)
    eng = Engine(_cfg(acceptance="forced"))
    rids = [eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
            for n in (5, 9)]
    res = eng.step(RoundPlan(2))
    assert (res.num_requests, res.bcap, res.g, res.k) == (0, 0, 0, 2)
    assert res.round_index == -1 and sorted(res.finished) == sorted(rids)
    assert res.kv_lengths.shape == (0,) and res.kv_lengths.dtype == np.int64
    assert res.num_prefill_tokens == 14 and res.state_bytes == 0
    assert sorted(res.first_tokens) == sorted(rids)
    assert [len(e) for e in res.emitted] == [1, 1] and res.draft_scores.shape == (0, 2)
