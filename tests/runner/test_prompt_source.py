"""Engine.set_prompt_source: prefixes of a prefilled source are admitted by copying their KV (and,
for a hybrid target, the recurrent state kept after each named length)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccal.base.errors import InputError
from speccal.live.generate import generate
from speccal.runner import engine as engine_mod
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams
from tests.runner.test_hybrid_engine import write_checkpoint

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(**kw) -> Engine:
    base = dict(model="tiny", draft_width=3, request_buckets=(1, 2, 4), max_model_len=160,
                block_size=8, prefill_chunk=32)
    return Engine(EngineConfig.flat(**(base | kw)))


def _source(n: int = 120) -> list[int]:
    return np.random.default_rng(7).integers(0, 256, size=n).tolist()


def _count_prefills(monkeypatch, owner=engine_mod) -> list[int]:
    """Prompt lengths of every ``owner.prefill`` call from now on (default: the engine's dense
    prefill; a hybrid engine's state strategy prefills its own)."""
    seen: list[int] = []
    real = owner.prefill

    def counting(req, *a, **kw):
        seen.append(len(req.prompt))
        return real(req, *a, **kw)

    monkeypatch.setattr(owner, "prefill", counting)
    return seen


@pytest.mark.parametrize("pipeline", [False, True])
def test_copied_prompts_decode_the_tokens_of_prefilled_ones(monkeypatch, pipeline):
    """Prefixes of the source (1 token, inside a block, block edges, the whole source; one is
    not a prefix) give the greedy tokens of the same prompts prefilled, in one batch."""
    src = _source()
    prompts = [src[:1], src[:13], src[:16], src[:17], src[:120], [5, 6, 7, 8, 9]]
    ref = generate(_engine(pipeline=pipeline), prompts, GREEDY, 3)
    eng = _engine(pipeline=pipeline)
    eng.set_prompt_source(src)
    seen = _count_prefills(monkeypatch)
    out = generate(eng, prompts, GREEDY, 3)
    assert out == ref
    assert seen == [5]  # only the prompt that is not a prefix was prefilled


def test_copied_kv_equals_a_prefill_of_the_prefix():
    src = _source()
    ref, eng = _engine(), _engine()
    eng.set_prompt_source(src)
    for e in (ref, eng):
        e.add_request(src[:45], GREEDY)
        e.prefill_pending()
    (r,), (c,) = ref._running, eng._running
    n, last = 45, len(ref.kv.layers) - 1
    for i, ((rk, rv), (ck, cv)) in enumerate(zip(ref.kv.layers, eng.kv.layers, strict=True)):
        # the head's row n - 1 is the pending draft-extend row: the first round writes it
        m = n - 1 if i == last else n
        for a, b in ((rk, ck), (rv, cv)):
            ra = torch.cat([a[blk] for blk in r.blocks])[:m]
            ca = torch.cat([b[blk] for blk in c.blocks])[:m]
            torch.testing.assert_close(ca, ra, rtol=1e-5, atol=1e-5)
    assert c.num_computed == r.num_computed == n and c.output == r.output
    torch.testing.assert_close(eng.runner.ext_hidden[c.slot], ref.runner.ext_hidden[r.slot],
                               rtol=1e-5, atol=1e-5)


def test_source_survives_reset_and_is_dropped_with_none(monkeypatch):
    src = _source(64)
    eng = _engine(acceptance="forced")
    eng.set_prompt_source(src)
    assert eng.prompt_source is not None and eng.prompt_source.nbytes > 0
    free = eng.num_free_kv_tokens
    seen = _count_prefills(monkeypatch)
    for _ in range(2):
        eng.add_request(src[:30], GREEDY)
        eng.add_request(src[:64], GREEDY)
        res = eng.step(RoundPlan(2))
        assert res.kv_lengths.tolist() == [33, 67]
        eng.reset()
    assert seen == [] and eng.num_free_kv_tokens == free  # the source holds no pool blocks
    eng.set_prompt_source(None)
    assert eng.prompt_source is None
    eng.add_request(src[:30], GREEDY)
    eng.prefill_pending()
    assert seen == [30]


def test_bad_sources_are_refused():
    eng = _engine()
    with pytest.raises(InputError, match="prompt source"):
        eng.set_prompt_source([])
    with pytest.raises(InputError, match="token ids"):
        eng.set_prompt_source([1, 2, 10**9])
    with pytest.raises(InputError, match="max_model_len"):
        eng.set_prompt_source(_source(161))
    assert eng.prompt_source is None and eng.num_free_kv_tokens == eng.geometry.kv_capacity_tokens


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid") / "hf"
    write_checkpoint(folder, "qwen3_5")
    return folder


def _hybrid(folder, **kw) -> Engine:
    base = dict(model=str(folder), draft_width=2, request_buckets=(1, 2, 4), max_model_len=96,
                block_size=4, prefill_chunk=16)
    return Engine(EngineConfig.flat(**(base | kw)))


def _hybrid_source(eng: Engine, n: int = 70) -> list[int]:
    vocab = eng.loaded.config.vocab_size
    return np.random.default_rng(7).integers(0, vocab, size=n).tolist()


@pytest.mark.parametrize(("strategy", "pipeline"),
                         [("scratch_swap", False), ("snapshots", True)])
def test_hybrid_copied_prompts_decode_the_tokens_of_prefilled_ones(monkeypatch, hybrid_folder,
                                                                   strategy, pipeline):
    """A hybrid source keeps the state after each named length (inside a chunk, on a chunk
    edge, 1 token, the whole source): those prompts decode the greedy tokens of the same
    prompts prefilled, speculative rounds included; a prefix of another length is prefilled."""
    ref = _hybrid(hybrid_folder, state_strategy=strategy, pipeline=pipeline)
    src = _hybrid_source(ref)
    lengths = [1, 9, 16, 33, 70]
    prompts = [src[:n] for n in lengths] + [src[:20]]
    want = generate(ref, prompts, GREEDY, 2)
    eng = _hybrid(hybrid_folder, state_strategy=strategy, pipeline=pipeline)
    eng.set_prompt_source(src, lengths=lengths)
    assert sorted(eng.prompt_source.states) == lengths
    seen = _count_prefills(monkeypatch, eng.runner.state)
    assert generate(eng, prompts, GREEDY, 2) == want
    assert seen == [20]  # the one length without a kept state


def test_hybrid_copied_state_equals_a_prefill_of_the_prefix(hybrid_folder):
    ref, eng = _hybrid(hybrid_folder), _hybrid(hybrid_folder)
    src = _hybrid_source(ref)
    eng.set_prompt_source(src, lengths=[45])
    for e in (ref, eng):
        e.add_request(src[:45], GREEDY)
        e.prefill_pending()
    (r,), (c,) = ref._running, eng._running
    rs, cs = ref.runner.state, eng.runner.state
    for (rc, rss), (cc, css) in zip(rs.state.layers, cs.state.layers, strict=True):
        torch.testing.assert_close(cc[cs.row_of[c.slot]], rc[rs.row_of[r.slot]],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(css[cs.row_of[c.slot]], rss[rs.row_of[r.slot]],
                                   rtol=1e-4, atol=1e-5)
    assert c.output == r.output
    torch.testing.assert_close(eng.runner.ext_hidden[c.slot], ref.runner.ext_hidden[r.slot],
                               rtol=1e-5, atol=1e-5)


def test_hybrid_source_needs_lengths_and_leaves_its_slot_clean(hybrid_folder):
    eng = _hybrid(hybrid_folder)
    src = _hybrid_source(eng, 40)
    assert eng.supports_prompt_source and eng.prompt_source_needs_lengths
    with pytest.raises(InputError, match="prompt source lengths"):
        eng.set_prompt_source(src)
    with pytest.raises(InputError, match=r"lengths in \[1, 40\]"):
        eng.set_prompt_source(src, lengths=[5, 41])
    assert eng.prompt_source is None
    free = eng.num_free_kv_tokens
    eng.set_prompt_source(src, lengths=[40, 12, 12])
    assert sorted(eng.prompt_source.states) == [12, 40]
    assert eng.num_free_kv_tokens == free  # the source's blocks went back to the pool
    st = eng.runner.state
    for conv, ssm in st.state.layers:  # the slot the source was prefilled in is zero again
        assert not conv.any() and not ssm.any()
    assert eng.prompt_source.nbytes > 2 * st.bytes_per_row


def test_dense_sources_ignore_lengths_but_check_them():
    eng = _engine()
    src = _source(50)
    with pytest.raises(InputError, match="prompt source lengths"):
        eng.set_prompt_source(src, lengths=[0])
    eng.set_prompt_source(src, lengths=[10])
    assert eng.prompt_source.states is None and eng.prompt_source.covers(src[:30])
