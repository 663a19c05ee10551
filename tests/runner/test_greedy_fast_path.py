"""The greedy fast path: an all-greedy batch selects tokens by argmax alone, chosen on the host.

CPU: the fast path emits exactly the general path's tokens (plain decoding and ``sample``
verification, host and in-graph verify inputs); a mixed batch takes the general path and its
greedy rows still equal the fast path's tokens; the token-based acceptance twins equal the
logit-based functions; capture expands a target key into the variants the acceptance mode
needs. CUDA (``cuda`` marker): captured greedy and sample graphs equal eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccal.base.errors import InputError
from speccal.runner import sampling
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.graphs import GraphKey, GraphSet
from speccal.runner.round import RoundRunner
from speccal.runner.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
HOT = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=40, ignore_eos=True)


def _cfg(**kw) -> EngineConfig:
    base = dict(model="tiny", draft_width=3, request_buckets=(1, 2, 4), max_model_len=128)
    return EngineConfig.flat(**(base | kw))


def _force_general(eng: Engine) -> None:
    """Make every round take the general path (the sampler / rejection sampler)."""
    eng.runner.sampling_kind = lambda batch, k: "sample"


def _spy(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(sampling, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, name, wrapped)
    return calls


def _run(eng: Engine, params: list[SamplingParams], rounds: int, k: int) -> tuple[list, list]:
    """Tokens per request (prefill token first) and the sampling kind of each round."""
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(11)
    for i, p in enumerate(params):
        eng.add_request(rng.integers(0, vocab, 6 + 9 * i).tolist(), p)
    out = {rid: [tok] for rid, tok in eng.prefill_pending().items()}
    kinds = []
    real_prepare = eng.runner.prepare

    def prepare(*args, **kwargs):
        x = real_prepare(*args, **kwargs)
        kinds.append(x.sampling)
        return x

    eng.runner.prepare = prepare
    for _ in range(rounds):
        res = eng.step(RoundPlan(num_draft_steps=k))
        for rid, toks in zip(res.request_ids, res.emitted, strict=True):
            out[rid].extend(toks)
    return [out[r] for r in sorted(out)], kinds


@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_plain_decode_fast_path_equals_general_path(monkeypatch, update):
    kw = dict(speculative=False, acceptance="sample", input_update=update)
    general = Engine(_cfg(**kw))
    _force_general(general)
    plain_calls = _spy(monkeypatch, "sample_plain")
    want, want_kinds = _run(general, [GREEDY] * 3, 8, 0)
    # prefill samples each request's first token with sample_plain (3 calls), then 8 rounds
    assert set(want_kinds) == {"sample"} and len(plain_calls) == 3 + 8
    plain_calls.clear()
    got, kinds = _run(Engine(_cfg(**kw)), [GREEDY] * 3, 8, 0)
    assert set(kinds) == {"greedy"}
    assert len(plain_calls) == 3  # prefill only: no round ran the filters / sort
    assert got == want
    assert all(len(t) == 9 for t in got)


@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_sample_verification_fast_path_equals_general_path(monkeypatch, update):
    kw = dict(acceptance="sample", input_update=update)
    general = Engine(_cfg(**kw))
    _force_general(general)
    rejection = _spy(monkeypatch, "verify_rejection")
    want, _ = _run(general, [GREEDY] * 3, 6, 3)
    assert len(rejection) == 6
    rejection.clear()
    got, kinds = _run(Engine(_cfg(**kw)), [GREEDY] * 3, 6, 3)
    assert set(kinds) == {"greedy"} and rejection == []
    assert got == want
    # greedy acceptance (always argmax-only) gives the same tokens again
    same, _ = _run(Engine(_cfg(input_update=update)), [GREEDY] * 3, 6, 3)
    assert same == want


@pytest.mark.parametrize("k", [0, 2])
def test_mixed_batch_uses_general_path(monkeypatch, k):
    kw = dict(acceptance="sample", speculative=k > 0)
    name = "sample_plain" if k == 0 else "verify_rejection"
    calls = _spy(monkeypatch, name)
    prefill_calls = 2 if k == 0 else 0  # prefill samples the first tokens with sample_plain
    mixed, kinds = _run(Engine(_cfg(**kw)), [GREEDY, HOT], 5, k)
    assert set(kinds) == {"sample"} and len(calls) == prefill_calls + 5
    calls.clear()
    greedy, greedy_kinds = _run(Engine(_cfg(**kw)), [GREEDY, GREEDY], 5, k)
    assert set(greedy_kinds) == {"greedy"} and len(calls) == prefill_calls
    if k == 0:  # one token per round: same shapes, so the greedy row is the same computation
        assert mixed[0] == greedy[0]
    else:  # the greedy request's tokens are a prefix-consistent greedy decode either way
        n = min(len(mixed[0]), len(greedy[0]))
        assert mixed[0][:n] == greedy[0][:n]


def test_sampling_kind_is_a_host_choice():
    eng = Engine(_cfg(acceptance="sample"))
    runner = eng.runner
    for p in (GREEDY, HOT):
        eng.add_request([1, 2, 3], p)
    eng.prefill_pending()
    batch = list(eng._running)
    assert runner.sampling_kind(batch[:1], 2) == "greedy"
    assert runner.sampling_kind(batch, 2) == "sample"
    assert runner.sampling_kind([], 0) == "greedy"
    eps = SamplingParams(temperature=sampling.GREEDY_TEMPERATURE / 2)
    assert sampling.batch_is_greedy([GREEDY, eps])
    assert not sampling.batch_is_greedy([GREEDY, SamplingParams(temperature=1e-4)])
    x = runner.prepare(batch, 2, 2, np.array([2, 2]), 6)
    assert x.sampling == "sample"
    assert runner.prepare(batch[:1], 1, 2, np.array([2]), 3).sampling == "greedy"


@pytest.mark.parametrize(
    ("acceptance", "k", "kinds"),
    [
        ("greedy", 0, ("greedy",)),
        ("greedy", 3, ("greedy",)),
        ("sample", 0, ("greedy", "sample")),
        ("sample", 2, ("greedy", "sample")),
        ("forced", 0, ("greedy", "sample")),
        ("forced", 2, ("greedy",)),
        ("synthetic", 2, ("greedy",)),
    ],
)
def test_sampling_kinds_per_acceptance_mode(acceptance, k, kinds):
    prof = (0.5, 0.5, 0.5) if acceptance == "synthetic" else None
    eng = Engine(_cfg(acceptance=acceptance, acceptance_profile=prof))
    assert sampling.selection_kinds(eng.runner.acceptance, k) == kinds
    # forced / synthetic / greedy verification never needs the sampler at k > 0
    assert sampling.argmax_only(acceptance, k, "sample") == (k > 0 and acceptance != "sample")
    assert sampling.argmax_only(acceptance, k, "greedy")


class _RecordingGraphs(GraphSet):
    """Stands in for GraphSet off CUDA (its ``capture_all``, a capture that runs each callable
    once and records the key)."""

    def __init__(self):
        self.outputs: dict[GraphKey, object] = {}
        self.kinds: dict[GraphKey, str] = {}

    def __contains__(self, key):
        return key in self.outputs

    def capture(self, key, fn):
        self.outputs[key] = fn()
        return self.outputs[key]


def test_capture_expands_target_keys_into_sampling_variants(monkeypatch):
    eng = Engine(_cfg(acceptance="sample"))
    runner: RoundRunner = eng.runner
    runner.graphs = _RecordingGraphs()
    seen = {}
    real_target = runner.target_part

    def target_part(x, drafts):
        seen[(x.bcap, x.k, x.g, x.sampling)] = True
        return real_target(x, drafts)

    monkeypatch.setattr(runner, "target_part", target_part)

    def make_inputs(key):
        return runner.prepare([], key.bcap, key.k, np.zeros(0, np.int64), key.g or key.bcap)

    keys = [GraphKey("draft", 2, 2), GraphKey("target", 2, 2, 6, "host")]
    keys.append(GraphKey("target", 1, 2, 3, "host", "greedy"))  # explicit: not expanded
    runner.capture(keys, make_inputs)
    got = sorted(k for k in runner.graphs.outputs if k.part == "target")
    assert got == [
        GraphKey("target", 1, 2, 3, "host", "greedy"),
        GraphKey("target", 2, 2, 6, "host", "greedy"),
        GraphKey("target", 2, 2, 6, "host", "sample"),
    ]
    assert set(seen) == {(1, 2, 3, "greedy"), (2, 2, 6, "greedy"), (2, 2, 6, "sample")}


def test_token_acceptance_twins_equal_logit_versions():
    g = torch.Generator().manual_seed(3)
    b, k, v = 16, 4, 40
    logits = torch.randn(b, k + 1, v, generator=g)
    logits[:, :, 7] = logits.max(-1).values  # ties: argmax takes the first, both ways
    tok = logits.argmax(-1)
    draft = torch.where(torch.rand(b, k, generator=g) < 0.7, tok[:, :k], (tok[:, :k] + 1) % v)
    nv = torch.arange(b) % (k + 1)
    for kw in ({}, {"num_verify": nv}):
        a = sampling.verify_greedy(draft, logits, **kw)
        c = sampling.verify_greedy_tokens(draft, tok, **kw)
        assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
        a = sampling.verify_forced(draft, logits, **kw)
        c = sampling.verify_forced_tokens(draft, tok, **kw)
        assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
        prof = [0.9, 0.7, 0.5, 0.3]
        a = sampling.verify_synthetic(draft, logits, prof, torch.Generator().manual_seed(5), **kw)
        c = sampling.verify_synthetic_tokens(
            draft, tok, prof, torch.Generator().manual_seed(5), **kw
        )
        assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # greedy rows of the rejection sampler: the same tokens as the argmax path
    temp = torch.zeros(b)
    r = sampling.verify_rejection(draft, logits, temp, None, torch.full((b,), 0.9), None, g)
    c = sampling.verify_greedy_tokens(draft, tok)
    assert all(torch.equal(x, y) for x, y in zip(r, c, strict=True))
    with pytest.raises(InputError, match="target_tokens"):
        sampling.verify_greedy_tokens(draft, tok[:, :k])
    with pytest.raises(InputError, match="target_tokens"):
        sampling.verify_forced_tokens(draft, logits[:, :, 0])


# ------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("k", [0, 3])
def test_captured_greedy_and_sample_graphs_equal_eager_cuda(k):
    kw = dict(
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        acceptance="sample",
        speculative=k > 0,
    )
    split = Engine(_cfg(graph_mode="split", **kw))
    keys = {key for key in split.runner.graphs.graphs if key.part == "target"}
    assert {key.sampling for key in keys} == {"greedy", "sample"}
    eager, eager_kinds = _run(Engine(_cfg(**kw)), [GREEDY] * 3, 6, k)
    graph, kinds = _run(split, [GREEDY] * 3, 6, k)
    assert set(kinds) == set(eager_kinds) == {"greedy"}
    assert graph == eager
    general = Engine(_cfg(graph_mode="split", **kw))
    _force_general(general)
    forced, _ = _run(general, [GREEDY] * 3, 6, k)
    assert forced == eager


@pytest.mark.parametrize(("acceptance", "k"), [("greedy", 0), ("greedy", 3), ("forced", 2)])
@pytest.mark.parametrize("keys", [True, False])
def test_in_graph_fast_path_takes_argmax_partials(monkeypatch, acceptance, k, keys, fused_on_cpu):
    """With the fused LM head (forced on here: ``ops.linear_argmax`` runs its reference on CPU,
    8 tiles of 64 over the tiny vocab), the in-graph fast path hands ``verify_accept`` the
    argmax as packed per-row keys (``GemvTuning.argmax_keys``, the default; the metadata update
    zeroed them) or as per-tile partials (off) instead of row tokens, and emits the host
    path's tokens."""
    from speccal.kernels import ops
    from speccal.kernels.config import GemvTuning, KernelConfig
    from speccal.runner.path import bind_path

    kernels = KernelConfig(gemv=GemvTuning(argmax_keys=keys))
    seen: list[bool] = []
    real = ops.verify_accept

    def spy(row_tokens, *args, **kwargs):
        if keys:
            seen.append(isinstance(row_tokens, ops.ArgmaxKeys))
        else:
            seen.append(isinstance(row_tokens, tuple) and row_tokens[0].shape[1] == 8)
        return real(row_tokens, *args, **kwargs)

    monkeypatch.setattr(ops, "verify_accept", spy)
    kw = dict(acceptance=acceptance, speculative=k > 0, kernels=kernels)

    def engine(update):  # the target's LM head on the fused code (references on CPU)
        eng = Engine(_cfg(input_update=update, **kw))
        bind_path(eng.loaded.target, fused_on_cpu(kernels))
        return eng

    want, _ = _run(engine("host"), [GREEDY] * 3, 6, k)
    assert seen == []  # the host path gathers tokens itself
    got, kinds = _run(engine("in_graph"), [GREEDY] * 3, 6, k)
    assert set(kinds) == {"greedy"} and seen == [True] * 6
    assert got == want
    assert all(len(set(t)) > 3 for t in got)  # not a degenerate decode
