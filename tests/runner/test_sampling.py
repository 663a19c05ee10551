"""Tests of speccal.runner.sampling: options, the shared filter, and the four acceptance modes.

Statistical tests are seeded. Each compares per-token counts with an independent float64 numpy
reference of the filtered target distribution; a count passes when it lies within
``SIGMAS = 5`` binomial standard deviations (plus one count of slack) of ``n * p``, and a token
of reference probability 0 must never appear. Sample sizes are stated in each test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.sampling import (
    GREEDY_TEMPERATURE,
    SamplingParams,
    check_supported,
    draft_token_probability,
    filtered_probs,
    sample_plain,
    sampling_tensors,
    synthetic_accepted_length,
    synthetic_draft_scores,
    verify_forced,
    verify_greedy,
    verify_rejection,
    verify_synthetic,
)

SIGMAS = 5.0
VOCAB = 16
N = 65_536  # samples in the main distribution tests, drawn as one vectorised batch


# ---------------------------------------------------------------------------------------------
# Helpers


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Independent float64 reference of the filter: temperature, min-p, top-k, top-p."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature < GREEDY_TEMPERATURE:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    z = x / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        kth = np.sort(p)[::-1][min(top_k, len(p)) - 1]
        keep &= p >= kth
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        chosen = np.zeros_like(keep)
        mass = 0.0
        for i in np.argsort(-q, kind="stable"):
            if q[i] == 0.0 or mass >= top_p:
                break
            # The tests' logits are chosen so that no boundary is a float near-tie.
            assert abs(mass - top_p) > 1e-6
            chosen[i] = True
            mass += q[i]
        q = np.where(chosen, q, 0.0)
        q /= q.sum()
    return q


def assert_follows(tokens, probs, label: str) -> None:
    """Per-token counts of ``tokens`` within SIGMAS binomial sigmas of ``len(tokens) * probs``."""
    tokens = np.asarray(tokens)
    n = tokens.size
    assert n > 1000, f"{label}: only {n} samples"
    assert tokens.min() >= 0 and tokens.max() < len(probs), label
    counts = np.bincount(tokens, minlength=len(probs))
    for v, (c, p) in enumerate(zip(counts, probs, strict=True)):
        if p == 0.0:
            assert c == 0, f"{label}: token {v} has probability 0 but appeared {c} times"
            continue
        bound = SIGMAS * math.sqrt(n * p * (1.0 - p)) + 1.0
        assert abs(c - n * p) <= bound, (
            f"{label}: token {v} count {c}, expected {n * p:.1f} ± {bound:.1f}"
        )


def base_logits(seed: int, rows: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64).float() * 1.5


def batch_params(n: int, t: float, k: int, p: float, m: float):
    return (
        torch.full((n,), t),
        torch.full((n,), k, dtype=torch.int64),
        torch.full((n,), p),
        torch.full((n,), m),
    )


def check_layout(draft, num_accepted, out) -> None:
    """Emitted prefix = accepted drafts then one token; -1 after it."""
    b, k = draft.shape
    pos = torch.arange(k + 1)[None, :]
    na = num_accepted[:, None]
    assert bool(((num_accepted >= 0) & (num_accepted <= k)).all())
    assert bool((out[:, :k] == draft.long()).masked_select(pos[:, :k] < na).all())
    assert bool((out >= 0).masked_select(pos == na).all())
    assert bool((out == -1).masked_select(pos > na).all())


# ---------------------------------------------------------------------------------------------
# SamplingParams and refusals


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(temperature=1, top_k=np.int64(4), stop_token_ids=[7, 9])
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.top_k == 4 and type(p.top_k) is int
    assert p.stop_token_ids == (7, 9)
    assert SamplingParams().is_greedy and not p.is_greedy
    check_supported(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1))
    hash(p)  # frozen and hashable once the list became a tuple


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("max_tokens", 0),
        ("stop_token_ids", (3, -1)),
        ("stop_token_ids", "12"),
        ("ignore_eos", 1),
        ("seed", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
    ],
)
def test_sampling_params_refuses_out_of_range(field, value):
    with pytest.raises(InputError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 1234),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("repetition_penalty", 1.1),
        ("logprobs", 0),
    ],
)
def test_check_supported_refuses_and_names_the_field(field, value):
    params = SamplingParams(temperature=0.8, **{field: value})  # valid, but not implemented
    with pytest.raises(UnsupportedError, match=field):
        check_supported(params)


def test_check_supported_names_every_offending_field():
    params = SamplingParams(seed=1, repetition_penalty=1.2, logprobs=2)
    with pytest.raises(UnsupportedError) as err:
        check_supported(params)
    for field in ("seed", "repetition_penalty", "logprobs"):
        assert field in str(err.value)


def test_sampling_tensors_packs_per_request_values():
    t, k, p, m = sampling_tensors(
        [SamplingParams(), SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.2)]
    )
    assert t.tolist() == [0.0, 0.5] and k.tolist() == [0, 3] and k.dtype == torch.int64
    assert p.tolist() == pytest.approx([1.0, 0.9]) and m.tolist() == pytest.approx([0.0, 0.2])
    with pytest.raises(InputError, match=r"params\[1\]"):
        sampling_tensors([SamplingParams(), {"temperature": 1.0}])


# ---------------------------------------------------------------------------------------------
# The shared filter and the plain sampler


def test_filtered_probs_matches_reference_on_random_rows():
    """512 random rows, random options (incl. greedy rows): max abs error 1e-5 vs float64."""
    rows, vocab = 512, 40
    rng = np.random.default_rng(7)
    logits = base_logits(8, rows, vocab)
    t = rng.choice([0.0, 0.3, 0.7, 1.0, 1.6], rows)
    k = rng.choice([0, 1, 3, 10, 60], rows)
    p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.2], rows)
    m = rng.choice([0.0, 0.02, 0.1, 0.4], rows)
    got = (
        filtered_probs(
            logits,
            torch.tensor(t, dtype=torch.float32),
            torch.tensor(k),
            torch.tensor(p, dtype=torch.float32),
            torch.tensor(m, dtype=torch.float32),
        )
        .double()
        .numpy()
    )
    for i in range(rows):
        want = ref_probs(logits[i].numpy(), t[i], k[i], p[i], m[i])
        assert np.abs(got[i] - want).max() < 1e-5, (i, t[i], k[i], p[i], m[i])
    # Every filter actually removed something somewhere (the test would fail with it deleted).
    assert (got == 0).sum() > rows


def test_filter_order_min_p_before_top_p():
    """min-p first shrinks the set top-p renormalises over; top-p first would keep token 2."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, torch.ones(1), None, torch.tensor([0.95]), torch.tensor([0.5]))
    # min-p 0.5 keeps {0.5, 0.3} -> renormalised {0.625, 0.375}; top-p 0.95 keeps both.
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)


def test_filter_shape_errors_name_the_field():
    logits = torch.zeros(3, 8)
    with pytest.raises(InputError, match="top_p"):
        filtered_probs(logits, torch.ones(3), None, torch.ones(2), None)
    with pytest.raises(InputError, match="logits"):
        filtered_probs(torch.zeros(3, 2, 8), torch.ones(3))


# (temperature, top_k, top_p, min_p) cases of the distribution tests
FILTER_CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.2, 0, 0.8, 0.0),
    (0.9, 0, 1.0, 0.1),
    (0.8, 6, 0.9, 0.05),
]


@pytest.mark.parametrize(("t", "k", "p", "m"), FILTER_CASES)
def test_sample_plain_follows_filtered_distribution(t, k, p, m):
    """65,536 samples of one row; counts within 5 sigma of the reference."""
    row = base_logits(1, 1)
    gen = torch.Generator().manual_seed(11)
    tokens = sample_plain(row.expand(N, VOCAB), *batch_params(N, t, k, p, m), gen)
    assert tokens.dtype == torch.int64 and tokens.shape == (N,)
    assert_follows(
        tokens.numpy(), ref_probs(row[0].numpy(), t, k, p, m), f"plain t={t} k={k} p={p} m={m}"
    )


def test_sample_plain_greedy_rows_are_argmax_and_filters_may_be_none():
    logits = base_logits(2, 64)
    t = torch.tensor([0.0, 1.0] * 32)
    gen = torch.Generator().manual_seed(3)
    tokens = sample_plain(logits, t, None, None, None, gen)
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    assert not torch.equal(tokens[1::2], argmax[1::2])  # random rows: 32 draws all argmax is ~0


# ---------------------------------------------------------------------------------------------
# Greedy, forced and synthetic verification


def test_verify_greedy_first_mismatch_all_accept_and_later_matches_ignored():
    # Target argmax per request and row; drafts chosen against it.
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0]])
    draft = torch.tensor([[1, 9, 3], [1, 2, 3], [0, 2, 3], [5, 6, 1]], dtype=torch.int32)
    logits = (
        torch.nn.functional.one_hot(target, 10).float() * 3.0
        + base_logits(4, 16, 10).view(4, 4, 10) * 0.1
    )
    na, out = verify_greedy(draft, logits)
    assert na.tolist() == [1, 3, 0, 2]
    assert out.tolist() == [[1, 2, -1, -1], [1, 2, 3, 4], [1, -1, -1, -1], [5, 6, 7, -1]]
    assert na.dtype == out.dtype == torch.int64


def test_verify_greedy_k1():
    logits = torch.zeros(2, 2, 5)
    logits[0, 0, 3] = logits[0, 1, 1] = logits[1, 0, 2] = logits[1, 1, 4] = 1.0
    na, out = verify_greedy(torch.tensor([[3], [3]]), logits)
    assert na.tolist() == [1, 0]
    assert out.tolist() == [[3, 1], [2, -1]]


def test_trimmed_verify_greedy_and_forced():
    """num_verify[b] < k: rows past it are ignored and the token comes from row num_accepted."""
    vocab = 8
    target = torch.tensor([[1, 2, 3, 4]] * 4)
    logits = torch.nn.functional.one_hot(target, vocab).float()
    draft = torch.tensor([[1, 2, 3]] * 4)  # every draft matches
    nv = torch.tensor([0, 1, 2, 3])
    na, out = verify_greedy(draft, logits, num_verify=nv)
    assert na.tolist() == [0, 1, 2, 3]
    assert out.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1], [1, 2, 3, -1], [1, 2, 3, 4]]
    # A mismatch past num_verify does not matter; one before it does.
    draft2 = torch.tensor([[1, 0, 0]] * 4)
    na2, _ = verify_greedy(draft2, logits, num_verify=nv)
    assert na2.tolist() == [0, 1, 1, 1]
    naf, outf = verify_forced(draft2, logits, num_verify=nv)
    assert naf.tolist() == [0, 1, 2, 3]
    assert outf.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1], [1, 0, 3, -1], [1, 0, 0, 4]]
    with pytest.raises(InputError, match="num_verify"):
        verify_greedy(draft, logits, num_verify=torch.tensor([1, 2]))


def test_verify_forced_accepts_everything_with_greedy_bonus():
    logits = base_logits(5, 3 * 4).view(3, 4, VOCAB)
    draft = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    na, out = verify_forced(draft, logits)
    assert na.tolist() == [3, 3, 3]
    assert torch.equal(out[:, :3], draft) and torch.equal(out[:, 3], logits[:, 3].argmax(-1))


def test_verify_shape_errors_name_the_field():
    with pytest.raises(InputError, match="target_logits"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 8))
    with pytest.raises(InputError, match="draft_tokens"):
        verify_forced(torch.zeros(2, 3), torch.zeros(2, 4, 8))
    with pytest.raises(InputError, match="temperature"):
        verify_rejection(
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 2, 8),
            torch.ones(4),
            None,
            None,
            None,
            None,
        )
    with pytest.raises(InputError, match="draft_probs"):
        verify_rejection(
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 2, 8),
            torch.ones(2),
            None,
            None,
            None,
            None,
            draft_probs=torch.ones(2, 2, 8),
        )


def test_verify_synthetic_mean_accepted_length_and_tokens():
    """65,536 requests, k=3 of a w=4 profile: mean accepted length within 0.03 of
    0.9 + 0.9*0.7 + 0.9*0.7*0.5 = 1.845 (num_accepted in [0, 3] has sd <= 1.5, so 5 sigma of
    the mean is 1.5 / 256 * 5 = 0.029); per-position conditional rates within 5 binomial sigma."""
    profile = (0.9, 0.7, 0.5, 0.3)
    k = 3
    logits = base_logits(6, N // 64 * (k + 1)).view(N // 64, k + 1, VOCAB).repeat(64, 1, 1)
    draft = torch.randint(0, VOCAB, (N, k), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(12)
    na, out = verify_synthetic(draft, logits, profile, gen)
    expected = 0.9 + 0.9 * 0.7 + 0.9 * 0.7 * 0.5
    assert abs(na.double().mean().item() - expected) < 0.03
    for j in range(k):
        reached = (na >= j).sum().item()
        rate = (na >= j + 1).sum().item() / reached
        assert abs(rate - profile[j]) <= SIGMAS * math.sqrt(profile[j] * (1 - profile[j]) / reached)
    check_layout(draft, na, out)
    greedy = logits.argmax(-1).gather(1, na[:, None]).squeeze(1)
    assert torch.equal(out.gather(1, na[:, None]).squeeze(1), greedy)


def test_verify_synthetic_extremes_trim_and_profile_errors():
    logits = base_logits(9, 8 * 3).view(8, 3, VOCAB)
    draft = torch.zeros(8, 2, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    assert verify_synthetic(draft, logits, [1.0, 1.0], gen)[0].tolist() == [2] * 8
    assert verify_synthetic(draft, logits, torch.tensor([0.0, 1.0]), gen)[0].tolist() == [0] * 8
    nv = torch.tensor([0, 1, 2, 2, 1, 0, 2, 1])
    assert torch.equal(verify_synthetic(draft, logits, [1.0, 1.0, 0.5], gen, num_verify=nv)[0], nv)
    with pytest.raises(InputError, match="profile"):
        verify_synthetic(draft, logits, [0.5], gen)
    with pytest.raises(InputError, match=r"profile\[1\]"):
        verify_synthetic(draft, logits, [0.5, 1.5], gen)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_synthetic_draft_scores_keep_the_profile_and_rank_the_drafts(lam):
    """65,536 requests, a w=3 profile: each score is p_j or p_j + lam (Bern(p_j) - p_j); drawn
    against the scores, position j is still accepted at its profile rate given its prefix (5
    binomial sigma), and drafts scored high pass at the high score's rate, those scored low at
    the low one's (the score is a calibrated probability per draft)."""
    profile = torch.tensor([0.9, 0.6, 0.3])
    k = 3
    gen = torch.Generator().manual_seed(4)
    before = gen.get_state()
    q = synthetic_draft_scores(profile, lam, gen, torch.empty(N, k))
    if lam == 0.0:  # the profile itself, no random draw: the acceptance draws are unchanged
        assert torch.equal(q, profile.expand(N, k)) and torch.equal(gen.get_state(), before)
    hi, lo = profile + lam * (1 - profile), profile * (1 - lam)
    assert ((q == hi) | (q == lo)).all()
    na = synthetic_accepted_length(q, gen, None, N, k, "cpu")
    for j in range(k):
        p = float(profile[j])
        reached = na >= j
        n = int(reached.sum())
        rate = float((na[reached] >= j + 1).float().mean())
        assert abs(rate - p) <= SIGMAS * math.sqrt(p * (1 - p) / n)
        for level in (float(hi[j]), float(lo[j])):
            sel = reached & (q[:, j] == level)
            m = int(sel.sum())
            if m == 0 or level in (0.0, 1.0):  # lam = 1: the outcome itself
                if m:
                    assert float((na[sel] >= j + 1).float().mean()) == level
                continue
            got = float((na[sel] >= j + 1).float().mean())
            assert abs(got - level) <= SIGMAS * math.sqrt(level * (1 - level) / m)


def test_synthetic_draft_scores_refuse_a_short_profile():
    with pytest.raises(InputError, match="profile"):
        synthetic_draft_scores(torch.tensor([0.5]), 0.5, None, torch.empty(4, 2))
    with pytest.raises(InputError, match="profile"):
        synthetic_accepted_length(torch.ones(4, 1), None, None, 4, 2, "cpu")


# ---------------------------------------------------------------------------------------------
# Rejection sampling


def _check_positions(draft, na, out, refs, label: str) -> None:
    """Emitted token at position j, among requests that reached j, follows refs[j]."""
    k = draft.shape[1]
    for j in range(k + 1):
        reached = na >= j
        assert_follows(out[reached, j].numpy(), refs[j], f"{label} position {j}")


@pytest.mark.parametrize(("t", "k", "p", "m"), FILTER_CASES)
def test_rejection_point_mass_follows_target_distribution(t, k, p, m):
    """K=2, vocab 16, 65,536 requests in one batch: each emitted position follows the filtered
    target row (5 sigma), the acceptance rate of position 0 is p(draft) (5 sigma)."""
    rows = base_logits(21, 3)
    refs = [ref_probs(rows[j].numpy(), t, k, p, m) for j in range(3)]
    # Draft 0 is the most likely token (most requests reach position 2); draft 1 the second.
    draft = torch.tensor([int(np.argmax(refs[0])), int(np.argsort(-refs[1])[1])]).expand(N, 2)
    gen = torch.Generator().manual_seed(31)
    na, out = verify_rejection(draft, rows.expand(N, 3, VOCAB), *batch_params(N, t, k, p, m), gen)
    check_layout(draft, na, out)
    _check_positions(draft, na, out, refs, f"t={t} k={k} p={p} m={m}")
    a0 = refs[0][draft[0, 0]]
    assert abs((na >= 1).sum().item() - N * a0) <= SIGMAS * math.sqrt(N * a0 * (1 - a0)) + 1


def test_rejection_draft_outside_filtered_support_is_always_rejected():
    rows = base_logits(22, 3)
    refs = [ref_probs(rows[j].numpy(), 1.0, 3) for j in range(3)]
    outside = int(np.argmin(refs[0]))
    draft = torch.tensor([outside, 0]).expand(N, 2)
    na, out = verify_rejection(
        draft,
        rows.expand(N, 3, VOCAB),
        *batch_params(N, 1.0, 3, 1.0, 0.0),
        torch.Generator().manual_seed(5),
    )
    assert int(na.max()) == 0
    assert_follows(out[:, 0].numpy(), refs[0], "top-k=3, draft outside")


def test_rejection_mixed_temperature_batch():
    """3 x 32,768 requests interleaved in one batch: greedy rows equal verify_greedy exactly;
    the two random groups (different temperatures and filters) follow their own targets."""
    rows = base_logits(23, 3)
    groups = [(0.0, 0, 1.0, 0.0), (0.6, 4, 1.0, 0.0), (1.4, 0, 0.9, 0.02)]
    n = 3 * 32_768
    gid = torch.arange(n) % 3
    t, k, p, m = (torch.tensor([g[i] for g in groups])[gid] for i in range(4))
    draft = torch.tensor([int(rows[0].argmax()), int(rows[1].argsort(descending=True)[1])]).expand(
        n, 2
    )
    logits = rows.expand(n, 3, VOCAB)
    na, out = verify_rejection(draft, logits, t, k.long(), p, m, torch.Generator().manual_seed(41))
    check_layout(draft, na, out)
    gna, gout = verify_greedy(draft, logits)
    assert torch.equal(na[gid == 0], gna[gid == 0]) and torch.equal(out[gid == 0], gout[gid == 0])
    for g in (1, 2):
        sel = gid == g
        refs = [ref_probs(rows[j].numpy(), *groups[g]) for j in range(3)]
        _check_positions(draft[sel], na[sel], out[sel], refs, f"group {groups[g]}")


def test_rejection_temperature_zero_equals_greedy_on_random_logits():
    logits = base_logits(24, 256 * 4).view(256, 4, VOCAB)
    draft = logits[:, :3].argmax(-1)
    draft[::3, 1] = (draft[::3, 1] + 1) % VOCAB  # force some mismatches
    nv = torch.arange(256) % 4
    want = verify_greedy(draft, logits, num_verify=nv)
    got = verify_rejection(
        draft,
        logits,
        torch.zeros(256),
        torch.full((256,), 3),
        torch.full((256,), 0.5),
        torch.full((256,), 0.3),
        torch.Generator().manual_seed(0),
        num_verify=nv,
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_trimmed_rejection_bonus_comes_from_row_num_accepted():
    """3 x 32,768 requests with num_verify 0, 1, 2. Position 0 always follows row 0; when
    num_verify=1 and the draft was accepted, the bonus follows row 1; nothing past num_verify."""
    rows = base_logits(25, 3)
    t = 0.9
    refs = [ref_probs(rows[j].numpy(), t) for j in range(3)]
    n = 3 * 32_768
    nv = torch.arange(n) % 3
    draft = torch.tensor([int(np.argmax(refs[0])), int(np.argmax(refs[1]))]).expand(n, 2)
    na, out = verify_rejection(
        draft,
        rows.expand(n, 3, VOCAB),
        *batch_params(n, t, 0, 1.0, 0.0),
        torch.Generator().manual_seed(51),
        num_verify=nv,
    )
    check_layout(draft, na, out)
    assert bool((na <= nv).all())
    assert bool((out[nv == 0, 1:] == -1).all())
    assert_follows(out[nv == 0, 0].numpy(), refs[0], "num_verify=0 position 0")
    bonus = (nv == 1) & (na == 1)
    assert bool((out[bonus, 2] == -1).all())
    assert_follows(out[bonus, 1].numpy(), refs[1], "num_verify=1 bonus")


def test_rejection_general_draft_probs_follows_target_distribution():
    """K=2, vocab 16, 65,536 requests whose drafts are drawn from a non-point-mass proposal
    q: emitted positions follow the (top-k filtered) target, 5 sigma."""
    rows = base_logits(26, 3)
    t, k = 0.9, 8
    refs = [ref_probs(rows[j].numpy(), t, k) for j in range(3)]
    q = torch.softmax(base_logits(27, 2) * 0.8, dim=-1)  # [2, V], positive everywhere
    q[1] = torch.tensor(refs[1], dtype=torch.float32)  # position 1: proposal == target
    g = torch.Generator().manual_seed(61)
    draft = torch.stack(
        [torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(2)], 1
    )
    na, out = verify_rejection(
        draft,
        rows.expand(N, 3, VOCAB),
        *batch_params(N, t, k, 1.0, 0.0),
        g,
        draft_probs=q.expand(N, 2, VOCAB),
    )
    check_layout(draft, na, out)
    _check_positions(draft, na, out, refs, "draft_probs")
    # Acceptance of position 0 is sum_x min(p, q); position 1 (q == p) is always accepted.
    a0 = float(np.minimum(refs[0], q[0].double().numpy()).sum())
    assert abs((na >= 1).sum().item() - N * a0) <= SIGMAS * math.sqrt(N * a0 * (1 - a0)) + 1
    assert bool((na[na >= 1] == 2).all())


# ---------------------------------------------------------------------------------------------
# Draft score


def test_draft_token_probability():
    logits = base_logits(28, 32, 50)
    token = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(2))
    want = torch.softmax(logits.double(), -1).gather(1, token[:, None]).squeeze(1)
    got = draft_token_probability(logits, token)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-6)
    got16 = draft_token_probability(logits.bfloat16(), token)
    assert torch.allclose(got16.double(), want, atol=2e-2)
    full = draft_token_probability(logits[:1].expand(50, 50), torch.arange(50))
    assert abs(full.sum().item() - 1.0) < 1e-5
    with pytest.raises(InputError, match="token"):
        draft_token_probability(logits, token[:5])


# ---------------------------------------------------------------------------------------------
# CUDA: no host sync, capturable


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_cuda_round_has_no_host_sync_and_captures_in_a_graph():
    dev = torch.device("cuda")
    b, k = 64, 3
    logits = base_logits(29, b * (k + 1)).view(b, k + 1, VOCAB).to(dev)
    draft = logits[:, :k].argmax(-1)
    t, tk, tp, mp = (x.to(dev) for x in batch_params(b, 0.8, 6, 0.9, 0.05))
    t[::2] = 0.0
    nv = torch.arange(b, device=dev) % (k + 1)
    q = torch.softmax(logits[:, :k] * 0.5, -1)
    prof = torch.tensor([0.8, 0.6, 0.4], device=dev)
    gen = torch.cuda.default_generators[dev.index or 0]

    def round_():
        return (
            verify_rejection(draft, logits, t, tk, tp, mp, gen, num_verify=nv),
            verify_rejection(draft, logits, t, tk, tp, mp, gen, draft_probs=q),
            verify_greedy(draft, logits, num_verify=nv),
            verify_synthetic(draft, logits, prof, gen),
            verify_forced(draft, logits),
            sample_plain(logits[:, 0], t, tk, tp, mp, gen),
            draft_token_probability(logits[:, 0], draft[:, 0]),
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        try:
            eager = round_()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = round_()
    graph.replay()
    first = static[0][1].clone()
    greedy_rows = static[0][1][0::2].clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[2][1], eager[2][1])  # deterministic parts equal eager
    assert torch.equal(static[4][1], eager[4][1])
    assert torch.equal(static[0][1][0::2], greedy_rows)  # greedy rows stable across replays
    assert not torch.equal(static[0][1], first)  # the generator advances between replays
    for na, out in (static[0], static[1], static[3]):
        check_layout(draft.cpu(), na.cpu(), out.cpu())
