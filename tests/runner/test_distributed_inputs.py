"""Tensor/data-parallel inputs refused with field, value and expectation; the shard layout and the
DP round rule, in one process (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.runner.config import config_from_hf
from speccal.runner.distributed.comm import Topology, check_world, rank_env
from speccal.runner.distributed.dp import ReplicaState, agree_round
from speccal.runner.distributed.engine import check_tp_path
from speccal.runner.distributed.load import ShardedSource, local_config, split_dim
from speccal.runner.distributed.tp import vocab_argmax
from speccal.runner.engine import EngineConfig
from speccal.runner.presets import PRESETS

TINY = config_from_hf({**PRESETS["tiny"].config, "architectures": ["preset:tiny"]})
ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}


@pytest.mark.parametrize("field,value,also", [
    ("num_attention_heads", 3, {"num_key_value_heads": 1}),
    ("num_key_value_heads", 3, {"num_attention_heads": 6}),
    ("intermediate_size", 129, {}), ("vocab_size", 511, {})])
def test_tp_must_divide_every_sharded_size(field, value, also):
    cfg = dataclasses.replace(TINY, **{field: value, **also})
    with pytest.raises(InputError) as err:
        local_config(cfg, 2)
    assert str(err.value).startswith(f"config.{field}: got {value}, expected a multiple of tp=2")


def test_local_config_divides_the_sharded_sizes_only():
    local = local_config(TINY, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.vocab_size) == (2, 1, 64, 256)
    assert (local.hidden_size, local.head_dim, local.rope) == (64, 16, TINY.rope)


def test_world_size_must_be_tp_times_dp():
    with pytest.raises(InputError, match=r"got 2, expected tp \* dp = 2 \* 2 = 4"):
        check_world(Topology(tp=2, dp=2), 2)
    check_world(Topology(tp=2), 2)


@pytest.mark.parametrize("kw,field", [({"tp": 0}, "tp"), ({"dp": 1.5}, "dp"),
                                      ({"backend": "mpi"}, "backend"),
                                      ({"timeout_s": 0}, "timeout_s")])
def test_topology_is_validated(kw, field):
    with pytest.raises(InputError, match=f"^{field}: got"):
        Topology(**kw)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_missing_launcher_variable_is_named(missing):
    env = {k: v for k, v in ENV.items() if k != missing}
    with pytest.raises(InputError, match=f"^environment variable {missing}: got None, expected "
                                         "set by torchrun"):
        rank_env(env)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(InputError, match=r"RANK: got 2, expected an integer in \[0, 2\)"):
        rank_env({**ENV, "RANK": "2"})
    assert rank_env(ENV) == (0, 2, 0)


def test_tp_refuses_paths_without_a_reduction():
    with pytest.raises(UnsupportedError, match="attention_backend='triton' with tp=2"):
        check_tp_path(EngineConfig.flat(attention_backend="triton"), 2)
    check_tp_path(EngineConfig.flat(attention_backend="triton"), 1)  # DP-only: any path


def test_split_dims_follow_the_megatron_layout():
    assert [split_dim(n) for n in ("model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.1.self_attn.k_proj.bias",
                                   "model.layers.0.self_attn.o_proj.weight",
                                   "layer.mlp.down_proj.weight", "lm_head.weight",
                                   "model.layers.0.input_layernorm.weight", "proj.weight")] == [
        0, 0, 1, 1, 0, None, None]


class _Full:
    def __init__(self, tensors):
        self.t = tensors

    def keys(self):
        return sorted(self.t)

    def shape(self, key):
        return tuple(self.t[key].shape)

    def get(self, key, shape, dtype, device):
        assert tuple(shape) == self.shape(key)
        return self.t[key].to(dtype)


def test_sharded_source_returns_each_ranks_contiguous_slice():
    full = _Full({"w": torch.arange(24.0).view(4, 6), "n": torch.ones(6)})
    parts = [ShardedSource(full, {"w": 1}, r, 3) for r in range(3)]
    assert [p.shape("w") for p in parts] == [(4, 2)] * 3
    got = torch.cat([p.get("w", (4, 2), torch.float32, "cpu") for p in parts], dim=1)
    assert torch.equal(got, full.t["w"])
    assert parts[1].shape("n") == (6,)
    with pytest.raises(InputError, match="dimension 0 a multiple of tp=3"):
        ShardedSource(full, {"w": 0}, 0, 3).shape("w")


def test_vocab_argmax_on_one_rank_is_torch_argmax():
    x = torch.tensor([[1.0, 3.0, 3.0], [-0.0, 0.0, -1.0]])
    assert vocab_argmax(x, None).tolist() == x.argmax(-1).tolist() == [1, 0]


def _state(rank, n, bcap, lag=(0, 0)):
    return ReplicaState(rank, n, bcap, 10.0, n > 0, *lag)


GEOM = Geometry(draft_width=3, request_buckets=(1, 2, 4))


def test_dp_round_rule_picks_one_common_bucket_from_pooled_lagged_feedback():
    # Bcap 2 {2, 3, 4, 6, 8} and Bcap 4 {4, 6, 8, 12, 16} share {4, 6, 8}.
    # No feedback yet: full width, v = 3 -> 4 rows per request; want 12 > 8: the largest, 8
    a = agree_round([_state(0, 2, 2), _state(1, 3, 4)], GEOM, speculative=True)
    assert (a.k, a.g, a.common, a.verify_rows) == (3, (8, 8), True, 4)
    # pooled feedback, 0 of 2 and 3 of 3 accepted: a = 0.6, v = 2 -> 3 rows; want 9 -> 8
    a = agree_round([_state(0, 2, 2, (2, 0)), _state(1, 3, 4, (3, 3))], GEOM, speculative=True)
    assert (a.g, a.verify_rows) == ((8, 8), 3)
    # acceptance 0: v = 1 -> 2 rows; want 6 -> the smallest common bucket holding it, 6;
    # with one replica of 2 and one of 1 (Bcap 1 {1, 2, 3, 4}): want 4 -> 4
    a = agree_round([_state(0, 2, 2, (2, 0)), _state(1, 3, 4, (3, 0))], GEOM, speculative=True)
    assert (a.g, a.verify_rows) == ((6, 6), 2)
    a = agree_round([_state(0, 2, 2, (2, 0)), _state(1, 1, 1, (1, 0))], GEOM, speculative=True)
    assert a.g == (4, 4)


def test_dp_round_rule_idle_replicas_and_no_common_bucket():
    a = agree_round([_state(0, 0, 0), _state(1, 2, 2)], GEOM, speculative=True)
    assert a.g == (0, 8) and a.common  # want 2 * 4 = 8
    apart = Geometry(draft_width=3, request_buckets=(1, 2), target_rows={1: (2, 4), 2: (6, 8)})
    a = agree_round([_state(0, 1, 1), _state(1, 2, 2)], apart, speculative=True)
    assert not a.common and a.g == (4, 8)  # no shared bucket: each its own g_for
    assert agree_round([_state(0, 1, 1)], GEOM, speculative=False).k == 0


def test_sharding_a_built_preset_equals_loading_the_shard():
    """Shards of one full tiny model (built on one rank from seed 0) are the shard loader's,
    and together hold the whole model."""
    from speccal.runner.distributed.load import load_shard, shard_loaded
    from speccal.runner.loader import load_model

    kw = dict(device=torch.device("cpu"), dtype="float32", max_model_len=64, max_positions=80)
    full = load_model("tiny", **kw)
    for rank in range(2):
        mine, local = shard_loaded(full, rank=rank, tp=2, max_model_len=64, max_positions=80)
        ref, _ = load_shard("tiny", rank=rank, tp=2, **kw)
        assert local.num_attention_heads == 2 and mine.fingerprint == full.fingerprint
        for part in ("target", "draft"):
            a = dict(getattr(mine, part).named_parameters())
            b = dict(getattr(ref, part).named_parameters())
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a), part
        q = mine.target.model.layers[1].self_attn.q_proj.weight
        assert torch.equal(q, full.target.model.layers[1].self_attn.q_proj.weight[rank * 32:
                                                                                (rank + 1) * 32])
        down = mine.draft.layer.mlp.down_proj.weight
        assert torch.equal(down, full.draft.layer.mlp.down_proj.weight[:, rank * 64:
                                                                       (rank + 1) * 64])


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo group in this process (torch.distributed's file store), torn down after."""
    import torch.distributed as dist

    from speccal.runner.distributed.comm import Comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield Comm.create(Topology())
    finally:
        dist.destroy_process_group()


def test_distributed_engine_keeps_in_step_with_engine(one_rank):
    """DistributedEngine builds itself as Engine.__init__ does (a copy, until Engine has a load
    hook): every attribute Engine sets exists, and at tp = dp = 1 the tokens are Engine's."""
    from speccal.live.generate import generate
    from speccal.runner.distributed.engine import DistributedEngine
    from speccal.runner.engine import Engine
    from speccal.runner.sampling import SamplingParams

    cfg = EngineConfig(request_buckets=(1, 2), max_model_len=64, block_size=4)
    base, dist_eng = Engine(cfg), DistributedEngine(cfg, one_rank)
    assert set(vars(base)) - set(vars(dist_eng)) == set()
    assert set(vars(base.runner)) == set(vars(dist_eng.runner))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10]]
    assert generate(dist_eng, prompts, params, 3) == generate(base, prompts, params, 3)
    name = base.compatibility()["device"]["name"]
    want = {**base.compatibility(),
            "topology": {"tp": 1, "dp": 1, "world_size": 1, "devices": [name]}}
    assert dist_eng.compatibility() == want


def test_one_rank_agree_keeps_the_group_and_finds_the_default_store(one_rank):
    from speccal.runner.distributed.comm import RankError

    assert one_rank.notes is not None  # the file store of the group, found without init_comm
    with pytest.raises(RankError) as info:
        one_rank.agree("a phase", lambda: int("x"))
    assert info.value.agreed and str(info.value).startswith(
        "a phase failed on 1 rank(s): rank 0: ValueError: invalid literal")
    assert one_rank.notes.read() == []  # an agreed failure withdraws its note
    assert one_rank.agree("next phase", lambda: 7) == 7


# ------------------------------------------------- failure notes in the store (no process group)


def _notes(store, rank, world=2, comm_id="c"):
    from speccal.runner.distributed.failure import Notes

    return Notes(store, comm_id, rank, world)


def _failure(rank, msg="boom", phase="p", code=1):
    from speccal.runner.distributed.failure import Failure

    return Failure(rank, "ValueError", msg, code, phase)


def test_notes_read_every_rank_first_noted_first_and_per_comm():
    import torch.distributed as dist

    store = dist.HashStore()
    a, b = _notes(store, 0), _notes(store, 1)
    b.post(_failure(1, "root cause"))
    a.post(_failure(0, "consequence"))
    assert [(f.rank, f.message, f.order) for f in a.read()] == [
        (1, "root cause", 1), (0, "consequence", 2)]
    assert _notes(store, 0, comm_id="other").read() == []  # another Comm's keys
    b.withdraw()
    assert [f.rank for f in a.read()] == [0]


def test_wait_arrivals_true_when_all_arrive_false_after_grace_or_at_once_when_one_left():
    import time

    import torch.distributed as dist

    store = dist.HashStore()
    a, b, c = (_notes(store, r, world=3) for r in range(3))
    b.arrive(1)
    t0 = time.monotonic()
    assert not a.wait_arrivals(1, 0.2)  # rank 2 is missing: the whole grace
    assert time.monotonic() - t0 >= 0.2
    c.arrive(1)
    assert a.wait_arrivals(1, 0.2)
    c.leave()
    t0 = time.monotonic()
    assert not a.wait_arrivals(2, 30.0)  # rank 2 left: it will never arrive, no waiting
    assert time.monotonic() - t0 < 5.0


def test_notes_fall_back_when_the_store_is_gone():
    class Gone:
        def __getattr__(self, name):
            def fail(*_a, **_k):
                raise RuntimeError("store unreachable")
            return fail

    n = _notes(Gone(), 0)
    n.post(_failure(0))  # no error of its own on top of the one being reported
    n.arrive(1)
    n.leave()
    assert n.read() == [] and not n.wait_arrivals(1, 5.0)


def test_rank_error_names_ranks_root_cause_first_and_trims_broken_collectives():
    from speccal.runner.distributed.failure import RankError

    agreed = RankError("p", [_failure(0, code=2), _failure(1, "other", code=1)])
    assert agreed.agreed and agreed.exit_code == 2
    assert str(agreed) == "p failed on 2 rank(s): rank 0: ValueError: boom; rank 1: ValueError: other"
    broken = ("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. "
              "This is typically caused by a remote worker crashing.")
    left = RankError("q", [_failure(1, "root. cause", phase="build"), _failure(0, broken, "q")],
                     agreed=False)
    assert not left.agreed and left.first_rank == 1
    assert str(left) == (
        "q failed on 2 rank(s), first on rank 1: rank 1 (in build): ValueError: root. cause; "
        "rank 0: ValueError: Connection closed by peer [127.0.0.1]:1 (not every rank reached "
        "the error barrier: the ranks left the process group)")


def test_failure_grace_is_validated():
    with pytest.raises(InputError, match="^failure_grace_s: got 0"):
        Topology(failure_grace_s=0)
