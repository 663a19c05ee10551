"""Two gloo ranks on CPU: TP=2 and DP=2 emit exactly the TP=1 greedy tokens, a 2-rank calibration
writes one table with its topology, a simulated rank skew refuses, and an error on one rank is
reported naming it, also when its peer is blocked in a collective with it (the last scenario:
the ranks leave the group).

One pair of worker processes (this file run as a script, with the environment ``torchrun`` sets:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) runs every scenario once
(:func:`_scenarios`) and writes each rank's results to JSON; the tests read them. The references
(TP=1 engines) run in the test process. float32, the ``tiny`` preset (tied embeddings, q/k norm)
and a small Qwen2 checkpoint written by transformers' ``save_pretrained`` (q/k/v bias, untied LM
head) with a MiMo-layout MTP head added.
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from speccal.live.generate import generate
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [7, 1, 8], [100, 200, 30, 40, 50]]
NEW = 12
SAMPLED = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.9, top_p=0.95)
BASE = dict(request_buckets=(1, 2, 4), max_model_len=96, block_size=4, prefill_chunk=8)
SMALL_CAL = {
    "request_buckets": [1],
    "target_graph_rows": {"1": [2]},
    "contexts": [{"prefill_tokens": 16, "min_kv_length": 1, "max_kv_length": 64}],
    "warmup_steps": 1,
    "window_steps": 2,
    "windows_per_point": 2,
}
HF_SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


# ---------------------------------------------------------------- the worker (one per rank)


def _greedy(engine, prompts=PROMPTS, k=3):
    return generate(engine, prompts, SamplingParams(max_tokens=NEW, ignore_eos=True), k)


#: Two buckets (draft_step mode, a flag) with the spread points on (Bcap 2 has one per context).
SPREAD_CAL = {
    "request_buckets": [1, 2],
    "target_graph_rows": {"1": [2, 3, 4], "2": [4, 6, 8]},
    "contexts": [{"prefill_tokens": 16, "min_kv_length": 1, "max_kv_length": 64}],
    "warmup_steps": 1,
    "window_steps": 2,
    "windows_per_point": 2,
    "kv_spread": True,
}


def _cal_opts(work: Path, name: str, config: str = "cal.json", buckets=(1,), flags=None):
    from speccal.calibrate.pipeline import CalibrateOptions

    return CalibrateOptions(model="tiny", config_path=work / config, out=work / name,
                            request_buckets=buckets, max_model_len=128, progress=False,
                            accept_noisy=True, remeasure_rounds=0, overwrite=True,
                            flags=flags or {})


def _scenarios(work: Path, ckpt: Path):
    """``name -> callable`` run in order on every rank; each returns JSON-able results."""
    from rich.console import Console

    from speccal.calibrate.ranks import calibrate_ranks, rank_engine_factory
    from speccal.runner.distributed.comm import Comm, Topology, init_comm
    from speccal.runner.distributed.dp import DataParallelRunner
    from speccal.runner.distributed.engine import DistributedEngine
    from speccal.runner.distributed.tp import vocab_argmax, vocab_token_probability
    from speccal.runner.sampling import draft_token_probability

    tp2 = init_comm(Topology(tp=2, timeout_s=120), dict(os.environ))
    dp2 = Comm.create(Topology(dp=2, timeout_s=120))
    quiet = Console(file=io.StringIO())

    def tp_tiny():
        out = {}
        for update in ("host", "in_graph"):
            eng = DistributedEngine(EngineConfig.flat(**BASE, input_update=update), tp2)
            out[update] = _greedy(eng)
        eng = DistributedEngine(EngineConfig(**BASE, pipeline=True), tp2)
        out["pipelined"] = _greedy(eng)
        out["kv_heads"] = eng.kv.layers[0][0].shape[2]
        eng = DistributedEngine(EngineConfig(**BASE, acceptance="sample", seed=5), tp2)
        out["sample"] = generate(eng, PROMPTS, SAMPLED, 3)
        out["compat_topology"] = eng.compatibility()["topology"]
        return out

    def tp_hf():
        deadline = time.monotonic() + 120  # the test process writes it while the ranks start
        while not (ckpt / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        eng = DistributedEngine(EngineConfig(model=str(ckpt), **BASE), tp2)
        plain = DistributedEngine(EngineConfig(model=str(ckpt), speculative=False, **BASE), tp2)
        q = eng.loaded.target.model.layers[0].self_attn.q_proj
        replica = DistributedEngine(EngineConfig(model=str(ckpt), **BASE), dp2)
        dp = DataParallelRunner(replica, dp2).generate(
            PROMPTS[dp2.dp_rank::2], SamplingParams(max_tokens=NEW, ignore_eos=True))
        return {"spec": _greedy(eng), "plain": _greedy(plain, k=0),
                "q_shape": list(q.weight.shape), "q_bias": q.bias.tolist(), "dp": dp}

    def tp_argmax():
        # ties across and within shards: the lowest global index wins, as torch.argmax
        g = torch.Generator().manual_seed(7)
        full = torch.randint(-3, 4, (64, 10), generator=g).float()
        full[0] = 0.0
        full[1, [2, 7]] = 9.0
        half = full.shape[1] // 2
        local = full[:, tp2.tp_rank * half:(tp2.tp_rank + 1) * half].contiguous()
        tok = vocab_argmax(local, tp2)
        prob = vocab_token_probability(local, tok, tp2)
        eng = DistributedEngine(EngineConfig(**BASE), tp2)
        normed = torch.randn(5, 64, generator=g)
        draft_tok, draft_p = eng.loaded.draft.greedy_draft(eng.loaded.target, normed)
        gathered = eng.loaded.draft.logits(eng.loaded.target, normed)
        return {"tok_ok": bool(torch.equal(tok, full.argmax(-1))),
                "prob_err": float((prob - draft_token_probability(full, tok)).abs().max()),
                "draft_tok_ok": bool(torch.equal(draft_tok, gathered.argmax(-1))),
                "draft_p_err": float((draft_p - draft_token_probability(gathered, draft_tok))
                                     .abs().max())}

    def tp_gathers():
        # argmax-only rounds reduce across the vocabulary shards: no [N, V] gather in a greedy
        # round (draft tokens and scores, host and in-graph target tokens); sampling gathers
        calls = []
        gather = tp2.all_gather_tp

        def counting(x, dim=-1):
            calls.append(tuple(x.shape))
            return gather(x, dim)

        out = {}
        for name, cfg, params in (
            ("host", EngineConfig.flat(**BASE, input_update="host"), None),
            ("in_graph", EngineConfig.flat(**BASE, input_update="in_graph"), None),
            ("sample", EngineConfig(**BASE, acceptance="sample", seed=5), SAMPLED),
        ):
            eng = DistributedEngine(cfg, tp2)
            params = params or SamplingParams(max_tokens=NEW, ignore_eos=True)
            rids = [eng.add_request(p, params) for p in PROMPTS]
            eng.prefill_pending()  # the first token is sampled from gathered logits (prefill)
            tp2.all_gather_tp = counting
            try:
                while eng.has_unfinished():
                    eng.step(RoundPlan(3))
            finally:
                del tp2.all_gather_tp  # the bound method again
            out[name] = {"gathers": len(calls),
                         "tokens": [list(eng.requests[r].output) for r in rids]}
            calls.clear()
        return out

    def bench_ranks():  # speccal bench --tp/--dp's library call, and an error on rank 1
        from speccal.base.errors import InputError
        from speccal.live.bench import bench, timed_run_ranks

        cfg = EngineConfig(**BASE)
        kw = dict(num_requests=3, prompt_len=6, max_tokens=6, num_draft_steps=3, repeats=1)
        out = {name: bench(cfg, comm=c, **kw) for name, c in (("tp2", tp2), ("dp2", dp2))}
        res = {name: {"setup": r["setup"], "outputs_equal": r["outputs_equal"],
                      "tokens": [r["plain"]["tokens_per_run"], r["spec"]["tokens_per_run"]],
                      "rounds": r["spec"]["rounds"], "accepted": r["spec"]["accepted"]}
               for name, r in out.items()}
        eng = DistributedEngine(cfg, tp2)
        if tp2.rank == 1:
            def refuse(*_):
                raise InputError("prompt", "rank 1's", "a test refusal")
            eng.add_request = refuse
        try:
            timed_run_ranks(eng, PROMPTS, SamplingParams(max_tokens=2), 3, tp2)
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            res["error"] = {"type": type(exc).__name__, "message": str(exc),
                            "exit_code": getattr(exc, "exit_code", None)}
        return res

    def dp_tiny():
        eng = DistributedEngine(EngineConfig(**BASE), dp2)
        mine = PROMPTS[dp2.dp_rank::2]
        runner = DataParallelRunner(eng, dp2)
        out = runner.generate(mine, SamplingParams(max_tokens=NEW, ignore_eos=True))
        return {"tokens": out, "rounds": [[a.k, list(a.g), a.common] for a in runner.rounds],
                "physical": runner.physical}

    def generate_ranks():  # speccal generate --tp/--dp's library call: every prompt, in order
        from speccal.live.generate import generate_on_ranks

        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        return {"tp2": generate_on_ranks(DistributedEngine(EngineConfig(**BASE), tp2), PROMPTS,
                                         params, 3, tp2),
                "dp2": generate_on_ranks(DistributedEngine(EngineConfig(**BASE), dp2), PROMPTS,
                                         params, 3, dp2)}

    def calibrate_tp2():
        s = calibrate_ranks(_cal_opts(work, "t.json"), tp2, engine_factory=rank_engine_factory(tp2),
                            max_rank_skew_pct=25.0, console=quiet)
        return {"status": s["status"], "topology": s["topology"], "sha": s["table_sha256"],
                "skew": s["rank_skew"]}

    def calibrate_tp2_spread():
        s = calibrate_ranks(_cal_opts(work, "spread.json", "spread_cal.json", (1, 2),
                                      {"mode": "draft_step"}), tp2,
                            engine_factory=rank_engine_factory(tp2), max_rank_skew_pct=1e6,
                            console=quiet)
        return {"sha": s["table_sha256"], "skew": s["rank_skew"]}

    def calibrate_dp2():  # DP replicas on 2 shared cores skew naturally: a loose bound here
        s = calibrate_ranks(_cal_opts(work, "dp.json"), dp2, engine_factory=rank_engine_factory(dp2),
                            max_rank_skew_pct=1e6, console=quiet)
        return {"topology": s["topology"], "sha": s["table_sha256"]}

    def calibrate_skewed():
        # TP ranks run in lockstep, so their own skew is ~1 %: rank 1's clock running 3x fast
        # is the only cause beyond the default 5 % bound (a DP pair on 2 busy cores is not)
        clock = (lambda: 3.0 * time.perf_counter()) if tp2.rank == 1 else time.perf_counter
        try:
            calibrate_ranks(_cal_opts(work, "skewed.json"), tp2,
                            engine_factory=rank_engine_factory(tp2), console=quiet, clock=clock)
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None}

    def rank_error():
        def fail():
            if tp2.rank == 1:
                raise ValueError("rank one's own failure")
            return "ok"

        def both_fail():
            raise ValueError(f"rank {tp2.rank} fails too")

        out = {}
        for name, fn in (("one", fail), ("both", both_fail)):
            try:
                tp2.agree("a test phase", fn)
                out[name] = {"error": None}
            except Exception as exc:  # noqa: BLE001
                out[name] = {"error": type(exc).__name__, "message": str(exc),
                             "exit_code": getattr(exc, "exit_code", None),
                             "agreed": getattr(exc, "agreed", None)}
        out["usable"] = tp2.all_gather_object(tp2.rank)  # an agreed failure keeps the group
        return out

    def rank_leaves():  # last: the ranks leave the group
        comm = Comm.create(Topology(tp=2, timeout_s=120, failure_grace_s=0.5))  # default store
        x = torch.ones(4)

        def phase():
            if comm.rank == 1:
                raise ValueError("rank one fails while rank 0 is in an all-reduce")
            comm.all_reduce_tp(x)  # rank 0 waits here for a rank that never comes

        t0 = time.perf_counter()
        try:
            comm.agree("a collective phase", phase)
            out = {"error": None}
        except Exception as exc:  # noqa: BLE001
            out = {"error": type(exc).__name__, "message": str(exc),
                   "exit_code": getattr(exc, "exit_code", None),
                   "agreed": getattr(exc, "agreed", None),
                   "failures": [f.rank for f in getattr(exc, "failures", [])]}
        out["seconds"] = time.perf_counter() - t0
        try:
            comm.agree("after leaving", lambda: None)
        except Exception as exc:  # noqa: BLE001
            out["after"] = str(exc)
        return out

    return {"tp_tiny": tp_tiny, "tp_hf": tp_hf, "tp_argmax": tp_argmax, "dp_tiny": dp_tiny,
            "generate_ranks": generate_ranks, "tp_gathers": tp_gathers, "bench_ranks": bench_ranks,
            "calibrate_tp2": calibrate_tp2, "calibrate_tp2_spread": calibrate_tp2_spread,
            "calibrate_dp2": calibrate_dp2,
            "calibrate_skewed": calibrate_skewed,
            "rank_error": rank_error, "rank_leaves": rank_leaves}


def _worker(work: Path, ckpt: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, fn in _scenarios(work, ckpt).items():
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": fn()}
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"failed": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t0
    (work / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------- the test process


def _hf_checkpoint(path: Path) -> Path:
    """A random Qwen2 (q/k/v bias, untied) saved by transformers, with a MiMo MTP head added."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_SMALL)).eval()
    with torch.no_grad():  # decisive logits: fp32 op-order noise cannot flip an argmax
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    h = HF_SMALL["hidden_size"]
    pre = "model.mtp_layers.0."
    for key, t in list(weights.items()):
        if key.startswith("model.layers.0."):
            weights[pre + key[len("model.layers.0."):]] = torch.randn(t.shape, generator=g) * (
                0.3 if t.dim() > 1 else 0.1) + (1.0 if key.endswith("norm.weight") else 0.0)
    weights |= {pre + "token_layernorm.weight": torch.ones(h),
                pre + "hidden_layernorm.weight": torch.ones(h),
                pre + "input_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.3,
                pre + "final_layernorm.weight": torch.ones(h)}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every scenario (one launch of two worker processes)."""
    work = tmp_path_factory.mktemp("ranks")
    ckpt = work / "ckpt"
    (work / "cal.json").write_text(json.dumps(SMALL_CAL))
    (work / "spread_cal.json").write_text(json.dumps(SPREAD_CAL))
    # This process holds the rendezvous store, as torchrun's agent does (the ranks join it as
    # clients): bound to a port the kernel picks and held until the ranks are done, so no other
    # process (another xdist worker's launch) can take the port between choosing and binding it.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(work), str(ckpt)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    try:  # written while the ranks import and run the first scenario
        _hf_checkpoint(ckpt)
    finally:
        (ckpt / "ready").touch()
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)], work, ckpt


def _ok(ranks, name):
    results, *_ = ranks
    for r, res in enumerate(results):
        assert "failed" not in res[name], f"rank {r} {name}:\n{res[name]['failed']}"
    return [res[name]["ok"] for res in results]


@functools.cache
def _reference(model="tiny", k=3, **kw):
    torch.set_num_threads(1)
    return _greedy(Engine(EngineConfig(model=model, **BASE, **kw)), k=k)


def test_tp2_tiny_greedy_equals_tp1(ranks):
    ref = _reference()
    assert len({t for out in ref for t in out}) > 5  # varied output: a real comparison
    # the same seed draws the same numbers on every rank; the gathered logits are TP=1's up
    # to float32 summation order (the tokens are deterministic, so this cannot flake)
    sampled = generate(Engine(EngineConfig(**BASE, acceptance="sample", seed=5)), PROMPTS,
                       SAMPLED, 3)
    assert sampled != ref
    for r, out in enumerate(_ok(ranks, "tp_tiny")):
        assert out["host"] == ref, f"rank {r} host update"
        assert out["in_graph"] == ref, f"rank {r} in-graph update (argmax across shards)"
        assert out["pipelined"] == ref, f"rank {r} pipelined loop"
        assert out["sample"] == sampled, f"rank {r} rejection sampling (gathered logits)"
        assert out["kv_heads"] == 1  # the tiny preset's 2 KV heads, one per rank
        topo = out["compat_topology"]
        assert (topo["tp"], topo["dp"], topo["world_size"]) == (2, 1, 2)
        assert len(topo["devices"]) == 2 and all(topo["devices"])


def test_tp2_and_dp2_hf_checkpoint_greedy_equal_tp1(ranks):
    _, _, ckpt = ranks
    spec, plain = _reference(str(ckpt)), _reference(str(ckpt), k=0, speculative=False)
    assert spec == plain  # greedy speculative decoding is lossless on one rank too
    full_bias = Engine(EngineConfig(model=str(ckpt), **BASE)).loaded.target.model.layers[
        0].self_attn.q_proj.bias
    out = _ok(ranks, "tp_hf")
    for r, o in enumerate(out):
        assert o["spec"] == spec and o["plain"] == plain, f"rank {r}"
        assert o["q_shape"] == [2 * 8, 32]  # 2 of 4 query heads of head_dim 8
        assert torch.allclose(torch.tensor(o["q_bias"]), full_bias[r * 16:(r + 1) * 16])
        assert o["dp"] == spec[r::2], f"DP replica {r}"  # its share of the prompts


def test_vocab_parallel_argmax_and_draft_score_match_gathered(ranks):
    for o in _ok(ranks, "tp_argmax"):
        assert o["tok_ok"] and o["draft_tok_ok"]
        assert o["prob_err"] < 1e-6 and o["draft_p_err"] < 1e-6


def test_dp2_replicas_give_tp1_tokens_and_agree_on_one_bucket(ranks):
    ref = _reference()
    r0, r1 = _ok(ranks, "dp_tiny")
    assert r0["tokens"] == ref[0::2] and r1["tokens"] == ref[1::2]
    assert r0["rounds"] == r1["rounds"] and r0["rounds"]  # the same agreed plan every round
    for i, (k, g, common) in enumerate(r0["rounds"]):
        assert k == 3 and common
        live = [x for x in g if x]
        assert len(set(live)) == 1  # one target bucket for every active replica
        # ... and each engine ran exactly that bucket (0: the replica had no batch)
        assert [r0["physical"][i], r1["physical"][i]] == g


def test_tp2_greedy_rounds_gather_no_logits_and_keep_tp1_tokens(ranks):
    ref = _reference()
    sampled = generate(Engine(EngineConfig(**BASE, acceptance="sample", seed=5)), PROMPTS,
                       SAMPLED, 3)
    for r, out in enumerate(_ok(ranks, "tp_gathers")):
        assert out["host"]["gathers"] == 0 and out["in_graph"]["gathers"] == 0, f"rank {r}"
        assert out["host"]["tokens"] == ref and out["in_graph"]["tokens"] == ref, f"rank {r}"
        assert out["sample"]["gathers"] > 0  # rejection sampling needs the whole distribution
        assert out["sample"]["tokens"] == sampled, f"rank {r}"


def test_bench_on_ranks_reports_the_world_and_names_a_failing_rank(ranks):
    a, b = _ok(ranks, "bench_ranks")
    for name, (tp, dp) in (("tp2", (2, 1)), ("dp2", (1, 2))):
        assert a[name] == b[name], name  # every rank returns the same result
        topo = a[name]["setup"]["topology"]
        assert (topo["tp"], topo["dp"], topo["world_size"]) == (tp, dp, 2)
        assert len(topo["devices"]) == 2
        assert a[name]["outputs_equal"]  # greedy: spec == plain
        assert a[name]["tokens"] == [3 * 6, 3 * 6]  # every replica's tokens, not rank 0's
    assert a["dp2"]["rounds"] > 0
    for o in (a, b):
        assert o["error"]["type"] == "RankError" and o["error"]["exit_code"] == 2
        assert ("bench: timed run: add the requests failed on 1 rank(s): rank 1: InputError: "
                "prompt: got "
                "\"rank 1's\", expected a test refusal") in o["error"]["message"]


def test_generate_on_ranks_returns_every_prompt_in_order_on_every_rank(ranks):
    ref = _reference()
    for r, out in enumerate(_ok(ranks, "generate_ranks")):
        assert out["tp2"] == ref and out["dp2"] == ref, f"rank {r}"


def test_two_rank_calibration_writes_one_table_with_topology(ranks):
    from speccal.base.errors import CompatibilityError
    from speccal.calibrate.ranks import table_digest
    from speccal.costmodel.table import load_table

    _, work, _ = ranks
    a, b = _ok(ranks, "calibrate_tp2")
    assert a["status"] == b["status"] == "calibrated"
    assert a["sha"] == b["sha"] == table_digest((work / "t.json").read_text())
    assert a["topology"]["world_size"] == 2 and a["topology"]["tp"] == 2
    assert [d["rank"] for d in a["topology"]["devices"]] == [0, 1]
    assert {s["bcap"] for s in a["skew"]} == {1}
    table = load_table(work / "t.json")
    topo = table.compatibility.topology
    assert (topo.tp, topo.dp, topo.world_size) == (2, 1, 2)
    assert topo.devices == [d["name"] for d in a["topology"]["devices"]]  # both ranks', in order
    assert len(topo.devices) == 2
    journal = (work / "t.json.journal.jsonl").read_text().splitlines()
    assert {json.loads(x)["row"]["rank"] for x in journal[1:]} == {0, 1}
    one = Engine(EngineConfig(model="tiny", acceptance="forced", request_buckets=(1,),
                              max_model_len=128, pipeline=True))
    with pytest.raises(CompatibilityError, match=r"topology\.tp: expected 1, found 2"):
        load_table(work / "t.json", expect=one.compatibility())


def test_two_rank_calibration_measures_the_spread_points_on_every_rank(ranks):
    """kv_spread on a TP pair: the spread points measured on both ranks (journal), left out of
    the rank skew (grid points only), fitted into the one table both ranks hold."""
    from speccal.costmodel.table import load_table

    _, work, _ = ranks
    a, b = _ok(ranks, "calibrate_tp2_spread")
    assert a["sha"] == b["sha"]
    table = load_table(work / "spread.json")
    assert table.kv_spread is not None
    assert [(p.context_index, p.bcap) for p in table.kv_spread.points] == [(0, 2)]
    rows = [json.loads(x)["row"] for x in
            (work / "spread.json.journal.jsonl").read_text().splitlines()[1:]]
    spread = [r for r in rows if r.get("layout") == "two_level"]
    assert {r["rank"] for r in spread} == {0, 1} and len(spread) == 2 * 2  # 2 windows x 2 ranks
    # the skew of the spread point's calibrated twin is over the grid's windows alone
    (twin,) = [s for s in a["skew"] if (s["bcap"], s["g"], s["k"]) == (2, 4, 1)]
    for rank in (0, 1):
        grid = [r["step_ms"] for r in rows if r["rank"] == rank and "layout" not in r
                and (r["bcap"], r["g"], r["k"]) == (2, 4, 1)]
        assert twin["step_ms"][rank] == pytest.approx(float(np.median(grid)))


def test_two_dp_replicas_calibrate_one_table_recording_dp(ranks):
    from speccal.costmodel.table import load_table

    _, work, _ = ranks
    a, b = _ok(ranks, "calibrate_dp2")
    assert a["sha"] == b["sha"] and (a["topology"]["tp"], a["topology"]["dp"]) == (1, 2)
    topo = load_table(work / "dp.json").compatibility.topology
    assert (topo.tp, topo.dp) == (1, 2)


def test_rank_skew_refuses_naming_rank_and_points(ranks):
    _, work, _ = ranks
    for o in _ok(ranks, "calibrate_skewed"):
        assert o["error"] == "RankSkewError"
        assert "beyond the 5 % bound on 2 of 2 points" in o["message"]
        assert "point (context 0, Bcap 1, G 2, k 3): rank 1" in o["message"]
        assert "point (context 0, Bcap 1, G 4, k 3): rank 1" in o["message"]
    assert not (work / "skewed.json").exists()
    assert (work / "skewed.json.journal.jsonl").exists()  # the windows are kept


def test_error_on_one_rank_is_reported_on_every_rank_naming_it(ranks):
    for o in _ok(ranks, "rank_error"):
        one, both = o["one"], o["both"]
        assert one["error"] == "RankError" and one["exit_code"] == 1 and one["agreed"]
        assert one["message"] == (
            "a test phase failed on 1 rank(s): rank 1: ValueError: rank one's own failure")
        # ranks failing together find each other at the barrier: one agreed error, both named
        assert both["agreed"] and both["message"] == (
            "a test phase failed on 2 rank(s): rank 0: ValueError: rank 0 fails too; "
            "rank 1: ValueError: rank 1 fails too")
        assert o["usable"] == [0, 1]


def test_rank_failing_while_its_peer_is_in_a_collective_is_named_within_the_grace(ranks):
    # without leaving, rank 0 would wait in the all-reduce for the group's 120 s timeout
    r0, r1 = _ok(ranks, "rank_leaves")
    root = ("a collective phase failed on {n} rank(s), first on rank 1: rank 1: ValueError: "
            "rank one fails while rank 0 is in an all-reduce")
    assert r1["error"] == "RankError" and not r1["agreed"] and r1["failures"] == [1]
    assert r1["message"].startswith(root.format(n=1) + " (not every rank reached")
    assert r0["error"] == "RankError" and not r0["agreed"] and r0["failures"] == [1, 0]
    assert r0["message"].startswith(root.format(n=2) + "; rank 0: ")  # then its broken collective
    assert r0["exit_code"] == r1["exit_code"] == 1
    for o in (r0, r1):
        assert o["seconds"] < 30  # the 0.5 s grace, plus a busy host's scheduling
        assert "this rank has left the process group" in o["after"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
