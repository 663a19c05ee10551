"""The engine of one rank of a tensor- x data-parallel run.

This module owns :class:`DistributedEngine`, an :class:`~speccal.runner.engine.Engine` whose
model is this rank's TP shard (``speccal.runner.distributed.load``) bound to its TP group
(``speccal.runner.distributed.tp``), whose KV cache holds only its KV heads, and whose
:meth:`~DistributedEngine.compatibility` records the topology. Everything else (requests,
rounds, stop rules, pipelining) is the base Engine's: every TP rank of a replica is given the
same requests and plans, runs the same rounds in lockstep (the collectives inside the model
forward are the only synchronisation) and emits the same tokens; DP replicas each run their
own batch (``speccal.runner.distributed.dp`` agrees their plans).

Refused under TP > 1 (``UnsupportedError``): the Triton backend (its fused decode layer and LM
head argmax have no TP reduction; the per-op path is unverified on GPUs) and captured graphs
(collectives inside CUDA graphs are unverified). DP with TP = 1 runs every path.
"""

from __future__ import annotations

import itertools

import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.runner.device import default_dtype, device_name, resolve_device
from speccal.runner.distributed.comm import Comm
from speccal.runner.distributed.load import load_shard
from speccal.runner.distributed.tp import bind_tp
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.kv_cache import KVCache
from speccal.runner.path import bind_path
from speccal.runner.presets import PRESETS
from speccal.runner.round import RoundRunner
from speccal.runner.stats import SpecStats


def check_tp_path(config: EngineConfig, tp: int) -> None:
    """Refuse the execution paths a TP > 1 engine cannot keep correct (module docstring)."""
    if tp == 1:
        return
    if config.path.attention_backend == "triton":
        raise UnsupportedError(
            f"attention_backend='triton' with tp={tp}: the fused Triton decode layer and LM-head "
            "argmax have no tensor-parallel reduction; use --attention-backend torch")
    if config.path.graph_mode != "eager":
        raise UnsupportedError(
            f"graph_mode={config.path.graph_mode!r} with tp={tp}: collectives inside captured "
            "graphs are not supported yet; use --graph-mode eager")


class DistributedEngine(Engine):
    """One rank's engine of a ``comm.topology`` run (see module docstring).

    Every rank builds it collectively (the TP ranks of a replica load their shards; no
    collective runs during construction). ``config.seed`` must be the same on every rank of a
    replica (identical preset weights and generator draws).
    """

    def __init__(self, config: EngineConfig, comm: Comm):
        self.comm = comm
        tp = comm.tp_size
        check_tp_path(config, tp)
        # Engine.__init__ with the shard loader in place of load_model and local KV heads;
        # keep in step with it (docs/distributed.md lists the hook that would remove this copy).
        self.config = config
        self.device = resolve_device(config.device)
        self.path = config.path
        self.path.check_device(self.device)
        preset = PRESETS.get(config.model)
        dtype = config.dtype or (
            default_dtype(self.device) if preset is None or self.device.type != "cpu" else "float32"
        )
        self.dtype_name = dtype
        w = config.draft_width
        self._lag_slots = w + 1 if config.pipeline else 0
        max_len = config.max_model_len or 4096
        self.loaded, self.local_config = load_shard(
            config.model, rank=comm.tp_rank, tp=tp, device=self.device, dtype=dtype,
            seed=config.seed, max_model_len=max_len,
            max_positions=max_len + w + 2 + self._lag_slots, need_draft=config.speculative,
            draft_family=config.draft_family,
        )
        for module in (self.loaded.target, self.loaded.draft):
            if module is not None:
                bind_tp(module, comm if tp > 1 else None)
        mcfg = self.loaded.config
        self._has_state = False  # TP shards are dense targets (load_shard refuses hybrid ones)
        if config.max_model_len is None:
            max_len = min(mcfg.max_position_embeddings, 4096)
        elif config.max_model_len > mcfg.max_position_embeddings:
            raise InputError("max_model_len", config.max_model_len,
                             f"<= the model's max_position_embeddings={mcfg.max_position_embeddings}")
        self.max_model_len = max_len
        buckets = config.request_buckets
        max_bucket = max(buckets) if buckets else 0
        bs = config.block_size
        cap = config.kv_capacity_tokens or max_bucket * (max_len + w + 1 + self._lag_slots)
        num_blocks = -(-cap // bs) + 1
        self.geometry = Geometry(
            draft_width=w, request_buckets=buckets, target_rows=dict(config.target_rows or {}),
            kv_capacity_tokens=(num_blocks - 1) * bs, max_model_len=max_len, block_size=bs,
        )
        torch_dtype = next(self.loaded.target.parameters()).dtype
        num_layers = mcfg.num_hidden_layers + (1 if self.loaded.draft is not None else 0)
        self.kv = KVCache(num_layers, num_blocks, bs, self.local_config.num_key_value_heads,
                          mcfg.head_dim, torch_dtype, self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        profile = None
        if config.acceptance_profile is not None:
            profile = torch.tensor(config.acceptance_profile, dtype=torch.float32,
                                   device=self.device)
        self.runner = RoundRunner(
            self.loaded.target, self.loaded.draft, self.kv, draft_width=w,
            max_bucket=max_bucket, max_blocks_per_seq=-(-(max_len + w + 2 + self._lag_slots) // bs),
            acceptance=config.acceptance, profile=profile, generator=self.generator,
            device=self.device, dtype=torch_dtype, path=self.path, max_model_len=max_len,
            pipeline=config.pipeline,
        )
        for module in (self.loaded.target, self.loaded.draft):
            if module is not None:
                bind_path(module, self.path)
        if self.path.attention_backend == "triton" and self.device.type == "cuda":
            self.loaded.target.fuse_weights()
            if self.loaded.draft is not None:
                self.loaded.draft.layer.self_attn.fuse_weights()
                self.loaded.draft.layer.mlp.fuse_weights()
        if self.path.graph_mode == "split":
            self._capture_graphs()
        self.stats = SpecStats(w)
        self._ids = itertools.count()
        self._waiting = []
        self._running = []
        self._free_slots = list(range(max_bucket - 1, -1, -1))
        self.requests = {}
        self._early_finished = []
        self._round_index = 0
        self._inflight = []

    @property
    def description(self) -> str:
        t = self.comm.topology
        return f"{self.loaded.description} (tp={t.tp}, dp={t.dp}, rank {self.comm.rank})"

    def device_names(self) -> list[str]:
        """Every rank's device name, in world-rank order (collective: every rank calls)."""
        return self.comm.all_gather_object(device_name(self.device))

    def compatibility(self) -> dict:
        """The base engine's compatibility with ``topology = {tp, dp}`` of this run (semantic:
        a table of another topology is refused). Every rank's device name is in
        :meth:`device_names`; ``device.name`` is this rank's."""
        out = super().compatibility()
        out["topology"] = {"tp": self.comm.tp_size, "dp": self.comm.dp_size}
        return out
