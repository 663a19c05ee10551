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
