"""Captured round graphs and the in-graph verify input update.

CPU: the in-graph update path (reference kernels, packed verify rows) emits exactly the host
path's tokens; split graphs are refused off CUDA; the eager block table is trimmed to the
batch's blocks. CUDA (``cuda`` marker): graph output equals eager output and the fast path
equals the fallback, token for token, over several greedy rounds (fp32 and bf16), for the
dense ``tiny`` preset and the routed MLA ``moe-tiny``.
"""

from __future__ import annotations

import numpy as np
import pytest

from speccal.base.errors import UnsupportedError
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams


def _run(eng: Engine, rounds: int, k: int, verify=None, experts=None) -> list[list[int]]:
    """Tokens per request of ``rounds`` rounds over three prompts; ``experts`` (a list) collects
    each round's ``experts_activated``."""
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(7)
    for n in (5, 17, 30):
        eng.add_request(rng.integers(0, vocab, n).tolist(), SamplingParams(max_tokens=60, ignore_eos=True))
    out: dict[int, list[int]] = {rid: [tok] for rid, tok in eng.prefill_pending().items()}
    for i in range(rounds):
        nv = None if verify is None else verify[i % len(verify)][: len(eng.running_ids())]
        res = eng.step(RoundPlan(num_draft_steps=k, verify_tokens=nv))
        if experts is not None:
            experts.append(res.experts_activated)
        for rid, toks in zip(res.request_ids, res.emitted, strict=True):
            out.setdefault(rid, []).extend(toks)
    return [out[r] for r in sorted(out)]


def _cfg(**kw) -> EngineConfig:
    base = dict(model="tiny", draft_width=3, request_buckets=(1, 2, 4), max_model_len=128)
    return EngineConfig.flat(**(base | kw))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("acceptance", ["greedy", "forced", "synthetic", "synthetic-scored"])
def test_in_graph_update_matches_host_path_cpu(k, acceptance):
    """The in-graph path (fused ``verify_accept`` after the argmax; synthetic lengths drawn
    first) emits the host path's tokens, also for forced and synthetic acceptance (same seed,
    same draws; ``synthetic-scored``: the draft part draws informative scores first)."""
    verify = [[k, 0, k], [1 if k > 1 else 0, k, k]]
    kw = {"acceptance": acceptance, "seed": 3}
    if acceptance.startswith("synthetic"):
        kw |= {"acceptance": "synthetic", "acceptance_profile": (0.6, 0.5, 0.4),
               "score_informativeness": 0.6 if acceptance == "synthetic-scored" else 0.0}
    host = _run(Engine(_cfg(input_update="host", **kw)), 6, k, verify)
    fast_eng = Engine(_cfg(input_update="in_graph", **kw))
    fast = _run(fast_eng, 6, k, verify)
    assert host == fast
    assert fast_eng.runner.resolve_update(4, k, 4 * (k + 1)) == "in_graph"


def test_auto_falls_back_to_host_without_triton_backend():
    eng = Engine(_cfg())
    assert eng.runner.resolve_update(4, 3, 16) == "host"
    # outside the validated shapes: G larger than every row the bucket can hold
    forced = Engine(_cfg(input_update="in_graph"))
    with pytest.raises(UnsupportedError, match="outside the contract"):
        forced.runner.resolve_update(4, 3, 17)


def test_capability_not_declared_falls_back():
    eng = Engine(_cfg(input_update="auto"))
    caps = eng.loaded.target.capabilities
    eng.loaded.target.capabilities = type(caps)(supports_in_graph_input_update=False)
    assert eng.runner.resolve_update(4, 3, 16) == "host"


def test_split_graphs_refused_on_cpu():
    with pytest.raises(UnsupportedError, match="eager"):
        _cfg(graph_mode="split")


def test_eager_block_table_trimmed_to_batch_blocks():
    eng = Engine(_cfg(block_size=8))
    eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.prefill_pending()
    batch = list(eng._running)
    x = eng.runner.prepare(batch, 1, 3, np.array([3]), 4)
    # 19 cached tokens + 3 drafts + 1: 23 tokens -> 3 blocks of 8, not max_model_len's 17
    assert tuple(x.host.block_table.shape) == (1, 3)
    assert eng.runner.max_blocks_per_seq > 3


@pytest.mark.parametrize("speculative", [True, False])
def test_routed_rounds_count_the_same_experts_on_both_input_updates_cpu(speculative):
    """``moe-tiny`` (routed layers and a routed MTP head) on the host and the in-graph input
    update: the same tokens and, every round, the same activated experts. The padding rows
    of the bucket (three requests in the bucket of four; verify rows past a request's)
    carry whatever tokens their slot held last, which differs between the two updates (and
    between eager and captured rounds); they route to no expert (``bind_real_rows``), so the
    counts are the requests' own. Before, the plain rounds counted 13 experts against 10."""
    k, verify = (3, [[3, 1, 2], [0, 3, 3]]) if speculative else (0, None)
    runs = {}
    for update in ("host", "in_graph"):
        experts: list = []
        eng = Engine(_cfg(model="moe-tiny", dtype="float32", speculative=speculative,
                          input_update=update))
        assert eng.runner.resolve_update(4, k, 4 * (k + 1)) == update
        runs[update] = (_run(eng, 8, k, verify, experts), experts)
    assert runs["host"] == runs["in_graph"]
    assert all(all(n > 0 for n in e) for e in runs["host"][1])


# ------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_split_graphs_equal_eager_cuda(dtype, backend):
    """Same tokens, graph vs eager, same kernels (bf16 too: identical kernels, identical order)."""
    kw = dict(device="cuda", dtype=dtype, attention_backend=backend)
    verify = [[3, 1, 2], [0, 3, 3]]
    eager = _run(Engine(_cfg(**kw)), 8, 3, verify)
    graph = _run(Engine(_cfg(graph_mode="split", **kw)), 8, 3, verify)
    assert eager == graph


@pytest.mark.cuda
@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_synthetic_scores_reach_the_captured_acceptance_cuda(update):
    """Synthetic acceptance with scores that are the outcome (``score_informativeness`` 1),
    captured graphs: the draft graph draws the scores, the target graph's acceptance reads
    them, so every request's accepted length is its reported scores' leading ones."""
    eng = Engine(_cfg(device="cuda", dtype="float32", attention_backend="triton",
                      graph_mode="split", input_update=update, acceptance="synthetic",
                      acceptance_profile=(0.8, 0.6, 0.4), score_informativeness=1.0, seed=5))
    for i in range(4):
        eng.add_request([i + 1] * 5, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(20):  # at most 4 tokens a round: nobody finishes
        res = eng.step(RoundPlan(3))
        assert set(np.unique(res.draft_scores)) <= {0.0, 1.0}
        np.testing.assert_array_equal(res.accepted,
                                      np.cumprod(res.draft_scores == 1.0, axis=1).sum(1))


@pytest.mark.cuda
@pytest.mark.parametrize("graph_mode", ["eager", "split"])
def test_fast_path_equals_fallback_cuda(graph_mode):
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", graph_mode=graph_mode)
    verify = [[2, 2, 0], [3, 1, 3]]
    host = _run(Engine(_cfg(input_update="host", **kw)), 8, 3, verify)
    fast = _run(Engine(_cfg(input_update="in_graph", **kw)), 8, 3, verify)
    assert host == fast


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculative", [True, False])
def test_routed_mla_graphs_equal_eager_cuda(dtype, speculative):
    """``moe-tiny`` (MLA attention over the latent cache, routed layers on the fused-MoE
    kernels, a routed MTP head) captured in split graphs emits the eager run's tokens, and
    every round counts the same activated experts (the masks update inside the graphs)."""
    kw = dict(model="moe-tiny", device="cuda", dtype=dtype, attention_backend="triton",
              speculative=speculative)
    k, verify = (3, [[3, 1, 2], [0, 3, 3]]) if speculative else (0, None)
    want_experts, got_experts = [], []
    eager = _run(Engine(_cfg(**kw)), 8, k, verify, want_experts)
    graph = _run(Engine(_cfg(graph_mode="split", **kw)), 8, k, verify, got_experts)
    assert eager == graph
    assert got_experts == want_experts and all(e for e in got_experts)


@pytest.mark.cuda
def test_plain_decode_graphs_equal_eager_cuda():
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", speculative=False)
    eager = _run(Engine(_cfg(**kw)), 10, 0)
    graph = _run(Engine(_cfg(graph_mode="split", **kw)), 10, 0)
    assert eager == graph


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", ["1", "late"])
def test_pdl_launches_change_no_token_cuda(pdl, monkeypatch):
    """Programmatic dependent launch (opt-in) only reorders launches: eager without PDL and split
    graphs captured with it emit the same tokens (bf16, speculative and plain)."""
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="triton")
    verify = [[3, 1, 2], [0, 3, 3]]
    want = _run(Engine(_cfg(**kw)), 8, 3, verify)
    want_plain = _run(Engine(_cfg(speculative=False, **kw)), 10, 0)
    monkeypatch.setenv("SPECCAL_PDL", pdl)
    got = _run(Engine(_cfg(graph_mode="split", **kw)), 8, 3, verify)
    got_plain = _run(Engine(_cfg(graph_mode="split", speculative=False, **kw)), 10, 0)
    assert got == want and got_plain == want_plain
