"""The engine of one rank of a tensor- x data-parallel run.

This module owns :class:`DistributedEngine`, an :class:`~speccal.runner.engine.Engine` whose
model is this rank's TP shard (``speccal.runner.distributed.load``) bound to its TP group
(``speccal.runner.distributed.tp``), whose KV cache holds only its KV heads, and whose
:meth:`~DistributedEngine.compatibility` records the topology (``tp``, ``dp``, ``world_size``
and every rank's device name). Everything else (requests, rounds, stop rules, pipelining) is
the base Engine's: every TP rank of a replica is given the same requests and plans, runs the
same rounds in lockstep (the collectives inside the model forward are the only
synchronisation) and emits the same tokens; DP replicas each run their own batch
(``speccal.runner.distributed.dp`` agrees their plans).

Refused under TP > 1 (``UnsupportedError``): the Triton backend (its fused decode layer and LM
head argmax have no TP reduction; the per-op path is unverified on GPUs) and captured graphs
(collectives inside CUDA graphs are unverified). DP with TP = 1 runs every path.
"""

from __future__ import annotations

from speccal.base.errors import UnsupportedError
from speccal.runner.device import device_name
from speccal.runner.distributed.comm import Comm
from speccal.runner.distributed.load import load_shard
from speccal.runner.distributed.tp import bind_tp
from speccal.runner.engine import Engine, EngineConfig


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
        self._device_names: list[str] | None = None  # every rank's, gathered on first use
        check_tp_path(config, comm.tp_size)
        super().__init__(config)

    def _load_model(self, dtype: str, max_len: int, max_positions: int):
        """This rank's shard (``load_shard``), bound to the TP group."""
        c, tp = self.config, self.comm.tp_size
        loaded, self.local_config = load_shard(
            c.model, rank=self.comm.tp_rank, tp=tp, device=self.device, dtype=dtype,
            seed=c.seed, max_model_len=max_len, max_positions=max_positions,
            need_draft=c.speculative, draft_family=c.draft_family,
        )
        for module in (loaded.target, loaded.draft):
            if module is not None:
                bind_tp(module, self.comm if tp > 1 else None)
        return loaded

    def _kv_heads(self) -> int:
        return self.local_config.num_key_value_heads

    @property
    def description(self) -> str:
        t = self.comm.topology
        return f"{self.loaded.description} (tp={t.tp}, dp={t.dp}, rank {self.comm.rank})"

    def device_names(self) -> list[str]:
        """Every rank's device name, in world-rank order.

        Gathered (a host-side collective: every rank calls) the first time, from then on the
        cached list: the first call of this or :meth:`compatibility` must be made by every
        rank at the same point (after construction, which runs no collective, so that a rank
        failing to build cannot leave its peers in this gather)."""
        if self._device_names is None:
            self._device_names = list(self.comm.all_gather_object(device_name(self.device)))
        return list(self._device_names)

    def compatibility(self) -> dict:
        """The base engine's compatibility with ``topology = {tp, dp, world_size, devices}`` of
        this run: ``tp``, ``dp`` and ``world_size`` semantic (a table of another topology is
        refused), ``devices`` (every rank's device name, world-rank order) performance-only;
        ``device.name`` is this rank's. Collective the first time (:meth:`device_names`)."""
        out = super().compatibility()
        t = self.comm.topology
        out["topology"] = {"tp": t.tp, "dp": t.dp, "world_size": t.world_size,
                           "devices": self.device_names()}
        return out
