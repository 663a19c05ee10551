"""Checks shared by the engine tests against transformers (dense, hybrid, MoE, MLA families).

- :func:`run_requests`: run prompts to completion on an engine, collecting each request's
  tokens (first tokens of prefill-finished requests included) and every round's result;
- :func:`stop_case`: the mixed batch's sampling params and expected tokens, request 0 stopping
  at a stop token taken from its reference;
- :class:`OracleDraft`: a draft part whose drafts copy the reference for a scheduled number of
  positions and then go wrong, so greedy verification accepts exactly that many and every
  accepted length ``0 .. k`` happens while the tokens must stay the reference's;
- :func:`assert_no_host_read`: a call made under torch's fake-tensor mode, where a host read
  or an op whose output shape depends on tensor values raises (what breaks graph capture);
  :func:`target_rows_without_host_read`: a target's forward on packed decode / verify rows
  checked so.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from speccal.runner.engine import Engine, RoundPlan
from speccal.runner.path import bind_path
from speccal.runner.sampling import SamplingParams


def run_requests(eng: Engine, prompts, params, k: int,
                 plan: RoundPlan | None = None) -> tuple[list[list[int]], list]:
    """``(tokens per request in order, every RoundResult)`` of running ``prompts`` to
    completion at ``k`` draft steps (or ``plan``)."""
    rids = [eng.add_request(p, prm) for p, prm in zip(prompts, params, strict=True)]
    out = {r: [] for r in rids}
    results = []
    while eng.has_unfinished():
        res = eng.step(plan or RoundPlan(k))
        for rid, toks in zip(res.request_ids, res.emitted, strict=True):
            out[rid] += toks
        for rid, tok in res.first_tokens.items():  # prefill-finished requests
            if rid not in res.request_ids:
                out[rid].append(tok)
        results.append(res)
    return [out[r] for r in rids], results


def served_shape_run(eng: Engine, prompts, refs: list[list[int]], max_tokens, params,
                     want, k: int) -> None:
    """The served path's round shape (``eng``: pipelined, device-side verify input update):
    the head's own drafts at batch 1, then on the mixed batch ``params`` (``want``: its
    expected tokens, a stop included), tokens equal to the references. The oracle draft reads
    the host's view of each request, one round behind on this loop: its schedule checks run on
    the synchronous loop."""
    assert eng.input_update == "in_graph" and eng.queue_depth == 1
    one = SamplingParams(max_tokens=max_tokens[0], ignore_eos=True)
    got, _ = run_requests(eng, prompts[:1], [one], k)
    assert got == [refs[0]], "batch 1"
    got, _ = run_requests(eng, prompts, params, k)
    assert got == want, "mixed batch"


def stop_case(refs: list[list[int]], max_tokens, at: int):
    """Mixed batch params and expected tokens: request 0 stops at ``refs[0][at]``."""
    stop = refs[0][at]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    params[0] = SamplingParams(max_tokens=max_tokens[0], ignore_eos=True, stop_token_ids=(stop,))
    want = [list(r) for r in refs]
    want[0] = want[0][: want[0].index(stop) + 1]
    return params, want


class OracleDraft:
    """Replaces ``RoundRunner.draft_part``: drafts copy the reference for ``m`` positions,
    then a wrong token (``(t + 1) % vocab``); ``m`` cycles over ``0 .. k`` per request-round
    (eager CPU rounds: the host reads the batch). ``rounds[i]`` maps each request id of round
    ``i`` to the length it must accept (None past the reference's end, where the request stops
    first)."""

    def __init__(self, eng: Engine, refs: dict[tuple[int, ...], list[int]], k: int,
                 vocab: int):
        self.eng, self.refs, self.vocab = eng, refs, vocab
        self.cycle = itertools.cycle(range(k + 1))
        self.rounds: list[dict[int, int | None]] = []

    def __call__(self, x):
        bcap, k = x.bcap, x.k
        by_slot = {r.slot: r for r in self.eng._running}
        drafts = torch.zeros(bcap, k, dtype=torch.int64)
        plan = {}
        for b, slot in enumerate(x.host.slot_index.tolist()[: x.num_requests]):
            req = by_slot[slot]
            ref, n = self.refs[tuple(req.prompt)], len(req.output)
            m = next(self.cycle)
            for j in range(k):
                tok = ref[n + j] if n + j < len(ref) else 0
                drafts[b, j] = tok if j < m else (tok + 1) % self.vocab
            plan[req.rid] = m if n + m < len(ref) else None
        self.rounds.append(plan)
        return drafts, torch.full((bcap, k), 0.5)


def oracle_run(eng: Engine, prompts, refs: list[list[int]], params, k: int, vocab: int):
    """The mixed batch under an :class:`OracleDraft` at ``k``: ``(tokens per request, results,
    oracle)``; the engine's own draft part is restored afterwards."""
    oracle = OracleDraft(eng, {tuple(p): r for p, r in zip(prompts, refs, strict=True)}, k,
                         vocab)
    eng.runner.draft_part = oracle
    try:
        got, results = run_requests(eng, prompts, params, k)
    finally:
        del eng.runner.draft_part
    return got, results, oracle


def scheduled_accepts(results, oracle: OracleDraft, k: int) -> list[int]:
    """The accepted lengths of the request-rounds the oracle scheduled (one round per oracle
    call), each asserted equal to its schedule: exactly the scheduled length was accepted."""
    rounds = [r for r in results if r.round_index >= 0]
    assert len(rounds) == len(oracle.rounds)
    ms = []
    for res, plan in zip(rounds, oracle.rounds, strict=True):
        for rid, a in zip(res.request_ids, res.accepted.tolist(), strict=True):
            if plan[rid] is not None:
                assert a == plan[rid], (k, rid, plan[rid], a)
                ms.append(a)
    return ms


def greedy_refs(hf, prompts, max_tokens) -> list[list[int]]:
    """transformers' greedy tokens (``generate``, ``do_sample=False``, exactly ``max_tokens``
    each, batch 1) of every prompt."""
    refs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens, strict=True):
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


def assert_no_host_read(fn, *args):
    """Call ``fn(*args)`` once for real (the warm-up a capture makes: lazy state is built), then
    under ``FakeTensorMode`` (real inputs and parameters converted on use), where
    ``.item()`` / ``.tolist()`` / a Python branch on a tensor (``aten._local_scalar_dense``)
    and ops whose output shape depends on values (``nonzero``, ``bincount``, boolean masks)
    raise: the forward could sit in a captured CUDA graph. Returns the real output."""
    out = fn(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = fn(*args)
    assert fake.shape == out.shape
    return out


def target_rows_without_host_read(model, cfg) -> None:
    """The target ``model``'s forward (``cfg``: its ``ModelConfig``) on two requests' packed
    verify rows (3 + 1 and a padding row) over fresh paged caches of every layer's own shape
    (``ModelConfig.kv_cache_dims``), checked by :func:`assert_no_host_read`."""
    from tests.runner.test_fused_layer import _packed_meta

    meta, pos, nb = _packed_meta(ctx=[5, 11], rows=[3, 1])
    gen = torch.Generator().manual_seed(0)
    kv = []
    for i in range(cfg.num_hidden_layers):
        heads, kd, vd = cfg.kv_cache_dims(cfg.num_key_value_heads, i)
        kv.append(tuple(torch.randn(nb, 4, heads, d, generator=gen) for d in (kd, vd)))
    ids = torch.randint(0, cfg.vocab_size, pos.shape, generator=gen)
    path = model.path  # the capture-safe ops: a CPU's "auto" MoE reads counts on the host
    bind_path(model, path.with_(kernels=replace(path.kernels, backend="reference")))
    try:
        with torch.no_grad():
            assert_no_host_read(model, ids, pos, meta, kv)
    finally:
        bind_path(model, path)
