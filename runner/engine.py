"""The embedded speculative-decoding engine: requests in, rounds out.

This module owns :class:`EngineConfig` (frozen, validated), :class:`RoundPlan`,
:class:`RoundResult` and :class:`Engine`, the API calibration and the CLI drive (see
docs/ARCHITECTURE.md). ``Engine.step`` prefills newly admitted requests (chunked), then queues one
round over the running batch through :class:`~speccal.runner.round.RoundRunner`
(prepare -> execute) and collects rounds (collect, stop rules on the host) until at most
:attr:`Engine.queue_depth` stay queued.

Batching: at most ``max(request_buckets)`` requests run at once (others wait, admitted in
arrival order as slots free up); the physical batch is ``geometry.bcap_for(B)``; target rows are
``sum(verify + 1)`` padded to ``geometry.g_for(bcap, rows)``, or, under
``RoundPlan.verify_budget``, the budget's bucket ``G`` with the verify lengths allocated on the
device from the round's own draft scores (see :class:`RoundPlan`).

One loop, two queue depths: 0 (the synchronous loop, the default) collects each round in the
step that queued it; 1 (``EngineConfig.pipeline=True``, the pipelined loop) queues round
``n + 1`` before it collects round ``n`` and returns round ``n``'s result (one step late;
``Engine.drain`` collects what is still queued). Stop rules are
discovered one round late: a finished request's row in the extra round is discarded
(``RoundResult.num_discarded``; ``RoundResult.physical`` keeps what the device computed for it),
and its KV blocks and slot are freed once no queued round writes them. See :meth:`Engine.step`.

Hybrid linear-attention targets (``ModelCapabilities.has_recurrent_state``: Qwen3.5 /
Qwen3-Next, recognised by their config's ``layer_types``): the KV cache holds only their
full-attention layers (``LoadedModel.num_kv_layers``) and the head's; each slot also owns
recurrent state rows kept consistent under rejected drafts by ``EngineConfig.state_strategy``
(``speccal.runner.hybrid_state``), whose prefill fills them. ``RoundResult.state_bytes`` is
the state traffic of the round's shape; the strategy is part of :meth:`Engine.compatibility`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from speccal import __version__
from speccal.base.errors import CapacityError, InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.base.runner_face import BuildReport, Routing
from speccal.kernels.precompile import CompilePool, triton_cache_is_empty
from speccal.runner.device import (
    check_memory,
    default_dtype,
    device_name,
    driver_version,
    keep_host_heap,
    resolve_device,
    synchronize,
)

# re-exported: the engine's API in one import (``from speccal.runner.engine import ...``)
from speccal.runner.engine_config import (  # noqa: F401 (ACCEPTANCE_MODES: re-exported)
    ACCEPTANCE_MODES,
    EngineConfig,
    check_declared_context,
)
from speccal.runner.graphs import GraphKey
from speccal.runner.hybrid import HybridModel, HybridMTPHead
from speccal.runner.hybrid_state import make_strategy
from speccal.runner.kv_cache import KVCache
from speccal.runner.linear_attention import CHUNK_SIZE
from speccal.runner.loader import LoadedModel, load_model
from speccal.runner.moe import RoutedMoE, activated_counts, round_counts, routed_modules
from speccal.runner.path import bind_path
from speccal.runner.prefill import prefill
from speccal.runner.presets import PRESETS
from speccal.runner.prompt_source import PromptSource
from speccal.runner.request import Request
from speccal.runner.results import PlanFn, RoundPlan, RoundResult, RoundState
from speccal.runner.round import RoundRunner
from speccal.runner.sampling import SamplingParams, check_supported
from speccal.runner.stats import SpecStats

__all__ = ["Engine", "EngineConfig", "PlanFn", "RoundPlan", "RoundResult", "RoundState"]


class Engine:
    """Target model + MTP head + paged KV + batch of requests. See the module docstring."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_host_heap()  # a round's freed temporaries stay mapped (runner.device)
        self.path = config.path
        self.path.check_device(self.device)
        preset = PRESETS.get(config.model)
        dtype = config.dtype or (
            default_dtype(self.device) if preset is None or self.device.type != "cpu" else "float32"
        )
        self.dtype_name = dtype
        # where the build's time goes (speccal calibrate prints it: cold start is a product goal)
        t_build = time.perf_counter()
        self.build_timings: dict[str, float] = {}
        # on a cold host the Triton precompile workers start now: their start-up (torch + Triton
        # imports) runs beside the model load, not in front of the first compile
        # (speccal.kernels.precompile; with a warm cache the dry pass starts a pool if it needs one)
        pool = (CompilePool.start(RoundRunner.precompile_workers)
                if config.path.graph_mode == "split"
                and RoundRunner.will_precompile(self.device, self.path)
                and triton_cache_is_empty() else None)
        try:
            self._build(config, dtype, t_build, pool)
        finally:
            if pool is not None:
                pool.shutdown()

    def _build(self, config: EngineConfig, dtype: str, t_build: float,
               pool: CompilePool | None) -> None:
        """The rest of ``__init__``: model, KV cache, runner, fused weights, captured graphs."""
        marks = [t_build]

        def lap(name: str) -> None:  # the time since the previous phase ended
            marks.append(time.perf_counter())
            self.build_timings[name] = marks[-1] - marks[-2]

        if self.device.type == "cuda":  # the context's creation, apart from the model load
            torch.zeros(1, device=self.device)
            lap("device_s")
        w = config.draft_width
        # a request may run one round past its stop per queued round: w + 1 more positions / KV
        # slots each
        self._lag_slots = (w + 1) * self.queue_depth
        max_len = config.max_model_len or 4096
        check_declared_context(config.model, config.max_model_len)  # before the rotary tables
        self.loaded: LoadedModel = self._load_model(dtype, max_len,
                                                    max_len + w + 2 + self._lag_slots)
        mcfg = self.loaded.config
        self._has_state = self.loaded.capabilities.has_recurrent_state
        lap("load_s")
        if config.max_model_len is None:
            max_len = min(mcfg.max_position_embeddings, 4096)
        elif config.max_model_len > mcfg.max_position_embeddings:
            raise InputError(
                "max_model_len",
                config.max_model_len,
                f"<= the model's max_position_embeddings={mcfg.max_position_embeddings}",
            )
        self.max_model_len = max_len
        buckets = config.request_buckets
        max_bucket = max(buckets) if buckets else 0
        bs = config.block_size
        cap = config.kv_capacity_tokens or max_bucket * (max_len + w + 1 + self._lag_slots)
        num_blocks = -(-cap // bs) + 1
        self.geometry = Geometry(
            draft_width=w,
            request_buckets=buckets,
            target_rows=dict(config.target_rows or {}),
            kv_capacity_tokens=(num_blocks - 1) * bs,
            max_model_len=max_len,
            block_size=bs,
        )
        torch_dtype = next(self.loaded.target.parameters()).dtype
        num_layers = self.loaded.num_kv_layers + (1 if self.loaded.draft is not None else 0)
        layer_dims = self._kv_layer_dims()  # MLA: one latent head; MiMo: per-layer heads
        kv_heads, k_dim, v_dim = layer_dims[0]
        # refuse a cache that cannot fit before allocating it, naming what sized it
        check_memory(
            self.device,
            KVCache.nbytes(num_layers, num_blocks, bs, kv_heads, k_dim, torch_dtype, v_dim,
                           layer_dims=layer_dims),
            field="kv_capacity_tokens" if config.kv_capacity_tokens else
            "max_model_len x max(request_buckets)",
            value=config.kv_capacity_tokens or f"{max_len} x {max_bucket}",
            what=f"KV cache ({(num_blocks - 1) * bs} tokens, {num_layers} layers)",
        )
        self.kv = KVCache(
            num_layers,
            num_blocks,
            bs,
            kv_heads,
            k_dim,
            torch_dtype,
            self.device,
            v_dim,
            layer_dims=layer_dims,
        )
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        profile = None
        if config.acceptance_profile is not None:
            profile = torch.tensor(
                config.acceptance_profile, dtype=torch.float32, device=self.device
            )
        state = None
        if self._has_state:  # one committed row per slot (+ the strategy's own rows)
            state = make_strategy(config.state_strategy, self.loaded.target,
                                  num_slots=max_bucket + 1, draft_width=w,
                                  max_bucket=max_bucket, dtype=torch_dtype, device=self.device)
        self.runner = RoundRunner(
            self.loaded.target,
            self.loaded.draft,
            self.kv,
            draft_width=w,
            max_bucket=max_bucket,
            max_blocks_per_seq=-(-(max_len + w + 2 + self._lag_slots) // bs),
            acceptance=config.acceptance,
            profile=profile,
            generator=self.generator,
            device=self.device,
            dtype=torch_dtype,
            path=self.path,
            max_model_len=max_len,
            state=state,
        )
        lap("setup_s")
        for module in (self.loaded.target, self.loaded.draft):
            if module is not None:
                bind_path(module, self.path)
        # the dense layers' fused weights (a hybrid target's layers run their own products:
        # theirs keep the constants each forward computed from the weights, on every device)
        if self._has_state:
            for module in (self.loaded.target, self.loaded.draft):
                if isinstance(module, (HybridModel, HybridMTPHead)):
                    module.fuse_weights()
        elif self.path.attention_backend == "triton" and self.device.type == "cuda":
            self.loaded.target.fuse_weights()
            if self.loaded.draft is not None:
                self.loaded.draft.layer.self_attn.fuse_weights()
                self.loaded.draft.layer.mlp.fuse_weights()
        lap("fuse_s")
        if self.path.graph_mode == "split":
            self.runner.compile_pool = pool
            self._capture_graphs()  # precompile (CUDA + Triton) and capture
            self.runner.compile_pool = None
            lap("graphs_s")
        self.stats = SpecStats(w)
        self._ids = itertools.count()
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._free_slots = list(range(max_bucket - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self._early_finished: list[int] = []
        self._round_index = 0
        self._inflight: list[_Flight] = []  # queued rounds not yet collected, oldest first
        self.prompt_source: PromptSource | None = None
        # routed-expert layers: the target's are counted per round, the head's only reset
        self._routed: list[RoutedMoE] = routed_modules(self.loaded.target)
        self._routed_all = self._routed + (routed_modules(self.loaded.draft)
                                           if self.loaded.draft is not None else [])
        for m in self._routed_all:  # the captures' warm-up forwards activated no request's
            m.take_activated()
        if self._has_state and self.device.type == "cuda":
            self.warm_prefill()
            lap("prefill_warmup_s")
        self.build_timings["total_s"] = time.perf_counter() - t_build

    def warm_prefill(self) -> None:
        """Prefill one synthetic prompt and forget it: the engine is left as it was (no request,
        fresh statistics, the sampling generator's state restored).

        A hybrid target's chunked delta rule (flash-linear-attention) autotunes its kernels at
        their first launch, compiling every candidate configuration one after the other; on a
        fresh CUDA host that happens inside the first request's prefill (a calibration's first
        window: on the H200 a qwen3.5-2b-shape calibration's first transition had not returned
        after 45 s). The engine build calls this for such targets, so the cost is paid, timed
        and reported with the build (``build_timings["prefill_warmup_s"]``). The prompt spans
        two delta-rule chunks and a tail; the autotune keys are head shapes and block sizes, not
        the prompt's length.
        """
        n = max(1, min(2 * CHUNK_SIZE + 1, self.max_model_len - self.config.draft_width - 2))
        saved = self.generator.get_state()
        self.add_request([0] * n, SamplingParams(max_tokens=1, ignore_eos=True))
        try:
            self.prefill_pending()
            self.synchronize()
        finally:
            self.reset()  # releases the request
            self.generator.set_state(saved)

    def _load_model(self, dtype: str, max_len: int, max_positions: int) -> LoadedModel:
        """The target and head this engine serves (a subclass loads its shard instead)."""
        c = self.config
        return load_model(c.model, device=self.device, dtype=dtype, seed=c.seed,
                          max_model_len=max_len, max_positions=max_positions,
                          need_draft=c.speculative, draft_family=c.draft_family)

    def _kv_heads(self) -> int:
        """KV heads this engine's cache holds per layer (a tensor-parallel rank: its own)."""
        return self.loaded.config.num_key_value_heads

    def _kv_layer_dims(self) -> list[tuple[int, int, int]]:
        """``(heads, k channels, v channels)`` of each cached layer: the target's KV layers,
        then the MTP head's (its own config: a sliding layer for ``mimo_v2_mtp``)."""
        cfg, heads = self.loaded.config, self._kv_heads()
        dims = [cfg.kv_cache_dims(heads, i) for i in range(self.loaded.num_kv_layers)]
        if self.loaded.draft is not None:
            head_cfg = getattr(self.loaded.draft, "config", None) or cfg
            dims.append(head_cfg.kv_cache_dims(heads, 0))
        return dims

    def _capture_graphs(self) -> None:
        """Capture every (Bcap, k[, G]) graph the geometry allows, largest first (one pool)."""
        runner = self.runner
        ks = range(1, self.config.draft_width + 1) if self.config.speculative else [0]
        keys = []
        for bcap in self.geometry.request_buckets:
            for k in ks:
                if k > 0:
                    keys.append(GraphKey("draft", bcap, k))
                legal = {self.geometry.g_for(bcap, r) for r in range(1, bcap * (k + 1) + 1)}
                for g in sorted(x for x in legal if x is not None):
                    keys.append(GraphKey("target", bcap, k, g, runner.resolve_update(bcap, k, g)))

        def make_inputs(key):
            none = np.zeros(0, np.int64)
            x = runner.prepare([], key.bcap, key.k, none, key.g or key.bcap)
            x.update = key.update or x.update
            return x

        runner.capture(keys, make_inputs)

    # ------------------------------------------------------------------ info

    @property
    def is_random_weights(self) -> bool:
        return self.loaded.is_random

    @property
    def description(self) -> str:
        return self.loaded.description

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.config.vocab_size)

    @property
    def routing(self) -> Routing | None:
        """The target's routed-expert layers (experts, top-k, how many), None for a dense
        target. Every routed layer of one target routes alike (one ``MoEConfig``)."""
        if not self._routed:
            return None
        moe = self._routed[0].moe
        return Routing(experts=moe.num_experts, top_k=moe.top_k, layers=len(self._routed))

    def build_report(self) -> BuildReport:
        """How this engine was built (``speccal.base.runner_face.BuildReport``)."""
        rep, graphs = self.runner.precompile_report, self.runner.graphs
        return BuildReport(
            timings=dict(self.build_timings),
            precompile=None if rep is None else rep.to_dict(),
            graphs=0 if graphs is None else len(graphs.graphs),
            capture_s=0.0 if graphs is None else float(graphs.capture_s),
            state_traffic=self.state_traffic(),
        )

    def state_traffic(self) -> list[dict] | None:
        """The recurrent-state bytes a round moves, per captured bucket and ``k`` in ``1..w``
        (``StateStrategy.round_traffic``; recorded in a calibrated table), or None for a target
        without recurrent state."""
        state = self.runner.state
        if state is None:
            return None
        return [{"bcap": bcap, "k": k, **asdict(state.round_traffic(bcap, k))}
                for bcap in self.geometry.request_buckets
                for k in range(1, self.config.draft_width + 1)]

    def compatibility(self) -> dict:
        """Compatibility metadata (docs/ARCHITECTURE.md) of this engine. ``state_strategy``
        only where the target keeps recurrent state (a table without it means ``none``, the
        form a dense target's table has always had)."""
        name = device_name(self.device)
        out = {
            "draft_width": self.config.draft_width,
            "model": {
                "architecture": self.loaded.architecture,
                "fingerprint": self.loaded.fingerprint,
                "dtype": self.dtype_name,
                "quantization": "none",
            },
            # one rank: DistributedEngine records the whole world's layout and device names
            "topology": {"tp": 1, "dp": 1, "world_size": 1, "devices": [name]},
            "graph_mode": self.path.graph_mode,
            "verification_mode": self.config.acceptance,
            "device": {"kind": self.device.type, "name": name},
            "attention_backend": self.path.attention_backend,
            "input_update": self.input_update,
            "kernels": {"digest": self.path.kernels.digest(),
                        "config": self.path.kernels.to_dict()},
            "loop": "pipelined" if self.config.pipeline else "synchronous",
        }
        if self.runner.state is not None:
            out["state_strategy"] = self.state_strategy
        return out

    @property
    def state_strategy(self) -> str:
        """The recurrent-state strategy rounds run (``none``: the target keeps no such state)."""
        return self.runner.state.name if self.runner.state is not None else "none"

    def _state_bytes(self, bcap: int, k: int) -> int:
        state = self.runner.state
        return 0 if state is None else state.round_traffic(bcap, k).total

    @property
    def input_update(self) -> str:
        """The verify-input update the full-width rounds take (``in_graph`` or ``host``):
        ``path.input_update`` resolved by the capability contract (``RoundRunner.resolve_update``)."""
        bcap = max(self.geometry.request_buckets)
        k = self.config.draft_width if self.config.speculative else 0
        return self.runner.resolve_update(bcap, k, bcap * (k + 1))

    def runtime_versions(self) -> dict[str, str | None]:
        """speccal/torch/driver versions of this process (performance-only table metadata)."""
        return {
            "speccal_version": __version__,
            "torch_version": torch.__version__,
            "driver_version": driver_version(self.device),
        }

    def running_ids(self) -> list[int]:
        return [r.rid for r in self._running]

    def kv_lengths(self) -> np.ndarray:
        """KV length (tokens in the target cache) of each running request, in :meth:`running_ids` order."""
        return np.array([r.num_computed for r in self._running], dtype=np.int64)

    def take_activated_experts(self) -> dict[str, list[int]]:
        """Distinct routed experts each MoE layer activated since the last call, per module
        (``{"target": [per routed layer], "draft": [...]}``, empty lists for dense models), and
        reset. Called after each :meth:`step` of the synchronous loop it is that round's (its
        prefill included); on the pipelined loop a step's forwards overlap the next round's.
        One host read per layer (the rounds keep ``[E]`` device masks, no sync of their own).
        Per round on either loop, prefill excluded: ``RoundResult.experts_activated``."""
        return {name: activated_counts(module) if module is not None else []
                for name, module in (("target", self.loaded.target),
                                     ("draft", self.loaded.draft))}

    @property
    def num_free_kv_tokens(self) -> int:
        return self.kv.allocator.num_free * self.kv.allocator.block_size

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (pipelined) a queued round not yet collected."""
        return bool(self._waiting or self._running or self._inflight)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Refuses bad ids, unsupported options, impossible sizes."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError("params", params, "a SamplingParams")
        check_supported(params)
        if self.config.acceptance == "greedy" and not params.is_greedy:
            raise UnsupportedError(
                f"temperature={params.temperature}: acceptance='greedy' verifies greedily; use acceptance='sample'"
            )
        prompt = [int(t) for t in prompt_ids]
        vocab = self.loaded.config.vocab_size
        if not prompt:
            raise InputError("prompt_ids", prompt, "at least one token id")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError("prompt_ids", bad[:5], f"token ids in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InputError(
                "prompt length + max_tokens", total, f"<= max_model_len={self.max_model_len}"
            )
        need = total + self.config.draft_width + 1 + self._lag_slots
        if need > self.geometry.kv_capacity_tokens:
            raise CapacityError(
                f"request needs up to {need} KV slots but the cache holds {self.geometry.kv_capacity_tokens}; "
                "raise kv_capacity_tokens"
            )
        rid = next(self._ids)
        req = Request(rid, prompt, params, eos_token_ids=self.loaded.config.eos_token_ids)
        self.requests[rid] = req
        self._waiting.append(req)
        return rid

    def _finish(self, req: Request) -> None:
        self.kv.allocator.free(req.blocks)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)

    def release(self, rid: int) -> None:
        """Drop a request (running or waiting) and free its KV blocks and slot."""
        req = self.requests.pop(rid, None)
        if req is None:
            raise InputError(
                "request id", rid, f"one of the engine's requests {sorted(self.requests)[:8]}"
            )
        if req.finish_reason is None:
            req.finish_reason = "released"
        if req.num_inflight:  # a queued round still writes its KV and slot: freed at collect
            if req in self._running:
                self._running.remove(req)
            return
        self._finish(req)

    def reset(self) -> None:
        """Release every request (the KV cache and slots become free); pipelined engines drain
        their queued rounds first (results dropped)."""
        self.drain()
        for rid in list(self.requests):
            self.release(rid)
        self.kv.allocator.sort_free()  # a fresh batch's block layout does not depend on history
        self._early_finished = []
        self._round_index = 0
        self.stats = SpecStats(self.config.draft_width)
        if self.runner.state is not None:
            self.runner.state.reset_traffic()

    def set_acceptance_profile(self, profile: Sequence[float]) -> None:
        """``synthetic`` only: replace the per-position acceptance profile (``w`` values) in place
        (phase changes of a synthetic workload)."""
        if self.config.acceptance != "synthetic":
            raise UnsupportedError(
                f"set_acceptance_profile: acceptance={self.config.acceptance!r} (needs 'synthetic')"
            )
        w = self.config.draft_width
        vals = [float(p) for p in profile]
        if len(vals) != w or not all(0.0 <= p <= 1.0 for p in vals):
            raise InputError("acceptance_profile", list(profile), f"{w} probabilities in [0, 1]")
        self.runner.profile.copy_(torch.tensor(vals, dtype=torch.float32))

    @property
    def round_index(self) -> int:
        """Index the next round over a non-empty batch will get."""
        return self._round_index

    def synchronize(self) -> None:
        synchronize(self.device)

    # ------------------------------------------------------------------ the step

    def prefill_pending(self) -> dict[int, int]:
        """Admit waiting requests into free slots and prefill them now; returns their first tokens.

        :meth:`step` does this itself; calling it first separates prefill from round timing.
        """
        first: dict[int, int] = {}
        _, finished = self._admit(first)
        self._early_finished.extend(finished)
        return first

    @property
    def supports_prompt_source(self) -> bool:
        """Whether :meth:`set_prompt_source` can serve this engine's target: every target can;
        a hybrid target's source needs the prompt lengths it will admit (``lengths``)."""
        return True

    @property
    def prompt_source_needs_lengths(self) -> bool:
        """Whether :meth:`set_prompt_source` needs ``lengths`` (a target with recurrent state:
        its state after each admissible prefix is kept)."""
        return self.runner.state is not None

    def set_prompt_source(self, tokens: Sequence[int] | None,
                          lengths: Sequence[int] | None = None) -> None:
        """Prefill ``tokens`` once and admit later prompts that are prefixes of them by copying
        their KV (``speccal.runner.prompt_source``); ``None`` drops the source.

        Calibration uses it so that a window's transition costs a copy instead of a prefill per
        request. ``lengths``: the prompt lengths to be admitted. A hybrid target needs them:
        its recurrent state after each of them is kept (one state row per length; other
        prefixes take the normal prefill); a dense target admits every prefix and ignores them.
        On CUDA the kept states take at most half the free device memory: lengths beyond that
        (the longest first) are left to the normal prefill. Refused for a source longer than
        the model context or the KV cache, and for lengths outside ``[1, len(tokens)]``.
        """
        self.prompt_source = None
        if tokens is None:
            return
        toks = [int(t) for t in tokens]
        vocab = self.loaded.config.vocab_size
        if not toks or not all(0 <= t < vocab for t in toks):
            raise InputError("prompt source", f"{len(toks)} tokens", f"token ids in [0, {vocab})")
        if len(toks) > self.max_model_len or len(toks) > self.num_free_kv_tokens:
            raise InputError("prompt source", f"{len(toks)} tokens",
                             f"<= max_model_len {self.max_model_len} and <= the free KV "
                             f"({self.num_free_kv_tokens} tokens)")
        state = self.runner.state
        if state is not None and lengths is None:
            raise InputError("prompt source lengths", None,
                             "the prompt lengths to admit (a hybrid target keeps its recurrent "
                             "state after each of them)")
        want = sorted({int(n) for n in lengths or ()})
        if want and not 1 <= want[0] <= want[-1] <= len(toks):
            raise InputError("prompt source lengths", [want[0], want[-1]],
                             f"lengths in [1, {len(toks)}] (the source's tokens)")
        if state is not None and not self._free_slots:
            raise InputError("prompt source", "no free slot",
                             "a free request slot to prefill the source in (call reset first)")
        if state is not None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            want = want[: max(0, int(free // 2 // max(1, state.bytes_per_row)))]
        req = Request(-1, toks, SamplingParams())
        rows: list[torch.Tensor] = []
        states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        try:
            if state is None:
                prefill(req, self.runner.target, self.runner.draft, self.kv,
                        chunk=self.config.prefill_chunk, generator=self.generator,
                        device=self.device, hidden_out=rows)
            else:  # in a free slot's state row, reset again below
                req.slot = self._free_slots[-1]
                states = {}
                state.prefill(req, self.runner.target, self.runner.draft, self.kv,
                              chunk=self.config.prefill_chunk, generator=self.generator,
                              device=self.device, hidden_out=rows, states_at=want,
                              states_out=states)
            self.prompt_source = PromptSource(np.asarray(toks), self.kv, req.blocks,
                                              torch.cat(rows, dim=0), states)
        finally:
            self.kv.allocator.free(req.blocks)
            if state is not None:
                state.reset_slot(req.slot)

    def _admit(self, result_first: dict[int, int]) -> tuple[int, list[int]]:
        admitted = []
        while self._waiting and self._free_slots:
            req = self._waiting.pop(0)
            req.slot = self._free_slots.pop()
            self._running.append(req)
            admitted.append(req)
        src = self.prompt_source
        copied = [r for r in admitted if src is not None and src.covers(r.prompt)]
        filled = dict(zip((r.rid for r in copied),
                          src.admit(copied, self.runner.target, self.kv, self.generator,
                                    self.device, self.runner.state) if copied else [],
                          strict=True))
        num_tokens = 0
        finished = []
        for req in admitted:
            if req.rid in filled:
                tok, hidden = filled[req.rid]
            else:
                # a hybrid target's prefill also fills the slot's state rows
                fill = prefill if self.runner.state is None else self.runner.state.prefill
                tok, hidden = fill(
                    req,
                    self.runner.target,
                    self.runner.draft,
                    self.kv,
                    chunk=self.config.prefill_chunk,
                    generator=self.generator,
                    device=self.device,
                )
            num_tokens += len(req.prompt)
            result_first[req.rid] = tok
            self.runner.set_slot(req, tok, hidden)
            req.append([tok])
            if req.is_finished:
                finished.append(req.rid)
                self._finish(req)
        return num_tokens, finished

    def _check_plan(self, plan: RoundPlan, n: int) -> tuple[int, np.ndarray | None]:
        """``(k, verify_tokens [B])``; verify_tokens is None under a verify budget (device)."""
        k = plan.num_draft_steps
        w = self.config.draft_width
        if self.config.speculative:
            if not isinstance(k, int) or not 1 <= k <= w:
                raise InputError("num_draft_steps", k, f"an integer in [1, {w}] (draft_width)")
        elif k != 0:
            raise InputError(
                "num_draft_steps", k, "0 (the engine was built with speculative=False)"
            )
        if plan.verify_budget is not None:
            self._check_budget(plan, k, n)
            return k, None
        if plan.verify_tokens is None:
            return k, np.full(n, k, dtype=np.int64)
        nv = np.asarray(list(plan.verify_tokens), dtype=np.int64)
        if nv.shape != (n,) or (nv < 0).any() or (nv > k).any():
            raise InputError(
                "verify_tokens",
                list(plan.verify_tokens),
                f"{n} integers in [0, {k}] (one per running request)",
            )
        return k, nv

    def _check_budget(self, plan: RoundPlan, k: int, n: int) -> None:
        budget = plan.verify_budget
        if plan.verify_tokens is not None:
            raise InputError(
                "verify_budget", budget, "None when verify_tokens is given (one or the other)"
            )
        if not isinstance(budget, (int, np.integer)) or budget < n:
            raise InputError(
                "verify_budget", budget, f"an integer >= {n} target rows (one per request)"
            )
        w = self.config.draft_width
        if k != w:
            raise InputError(
                "num_draft_steps",
                k,
                f"{w} (draft_width) with verify_budget: the draft runs full width",
            )

    def _budget_rows(self, budget: int, n: int, bcap: int) -> tuple[int | None, int]:
        """``(G, draft rows)`` of a verify budget: the largest target bucket of ``bcap`` that
        fits ``budget`` (else the smallest holding the ``n`` bonus rows) and ``min(G, budget) - n``."""
        g = self.geometry.g_within(bcap, int(budget), n)
        return g, (min(g, int(budget)) - n if g is not None else 0)

    def _resolve(self, plan: RoundPlan | PlanFn, batch: list[Request]) -> tuple[RoundPlan, int, np.ndarray | None]:
        """The round's plan (callback called for a non-empty batch) and its ``(k, verify [B])``."""
        n = len(batch)
        if callable(plan):
            if n == 0:
                plan = RoundPlan(self.config.draft_width if self.config.speculative else 0)
            else:
                kv = float(np.mean([r.num_computed for r in batch]))
                state = RoundState(self._round_index, n, kv, tuple(r.rid for r in batch))
                plan = plan(state)
                if not isinstance(plan, RoundPlan):
                    raise InputError("plan callback result", plan, "a RoundPlan")
        k, nv = self._check_plan(plan, n)
        return plan, k, nv

    def _shape(self, plan: RoundPlan, n: int, k: int, nv: np.ndarray | None) -> tuple[int, int, int | None]:
        """``(Bcap, G, budget draft rows or None)`` of a round over ``n`` requests."""
        bcap = self.geometry.bcap_for(n)
        if bcap is None:
            raise CapacityError(f"no captured request bucket for {n} requests")
        budget_rows = None
        if nv is None:  # verify budget: allocated on the device from this round's scores
            g, budget_rows = self._budget_rows(plan.verify_budget, n, bcap)
            rows = n
        else:
            rows = int((nv + 1).sum())
            g = self.geometry.g_for(bcap, rows) if k > 0 else self.geometry.g_for(bcap, bcap)
        if g is None:
            raise CapacityError(f"no captured target bucket for {n} requests / {rows} target rows")
        return bcap, g, budget_rows

    @staticmethod
    def _empty_result(k: int, first: dict[int, int], finished: list[int], num_prefill: int) -> RoundResult:
        # keyword-only (RoundResult is kw_only): this empty result was once built by position
        # and shifted three fields (kv_lengths got the accept matrix, num_prefill_tokens an
        # array, state_bytes the prefill count)
        empty = np.zeros(0, dtype=np.int64)
        return RoundResult(
            num_requests=0, bcap=0, g=0, k=k, request_ids=[], accepted=empty,
            num_verify=empty, emitted=[[first[r]] for r in first], finished=finished,
            draft_scores=np.zeros((0, k), np.float32), kv_lengths=empty,
            num_prefill_tokens=num_prefill, first_tokens=first,
        )

    @property
    def queue_depth(self) -> int:
        """Rounds left queued, not collected, when :meth:`step` returns: 0 (the synchronous
        loop: a round is collected before the next is prepared) or 1 (``EngineConfig.pipeline``:
        round ``n + 1`` is queued before round ``n`` is collected; two staging slots)."""
        return 1 if self.config.pipeline else 0

    def step(self, plan: RoundPlan | PlanFn) -> RoundResult:
        """Admit and prefill waiting requests, queue one round over the running batch, then
        collect rounds until at most :attr:`queue_depth` stay queued; return the oldest
        collected round's result (depth 0: this step's round).

        ``plan`` is a :class:`RoundPlan` or a callback ``plan(RoundState) -> RoundPlan`` called
        after admission (so a policy sees the round's batch size and mean KV length); it is not
        called when the batch is empty.

        Order: admit + prefill waiting requests into free slots; plan the round over the
        running batch (every request not yet *known* finished; at depth 1 stop rules are
        discovered one round late, when its round is collected, except a request whose queued
        rounds surely reach ``max_tokens``, one token each at least, which sits the round out)
        and queue it (host facts staged into a staging slot, metadata derived on the device
        from the per-slot state, results copied to pinned memory at its end); then collect
        (wait for the oldest queued round's result copy, stop rules, bookkeeping).

        Depth 1: results are reported one step late. The first call after an idle pipeline
        returns an empty result (``round_index == -1``, ``num_requests == 0``, prefill facts
        only when no round was queued). A round's first tokens / prefill-finished ids are those
        of the requests admitted just before it was queued. Rows of requests that finished in
        an earlier round (the extra round a lagged stop costs, or a request released while
        queued) are dropped from the result: arrays, ``request_ids`` and ``emitted`` hold the
        live rows only; ``num_discarded`` counts the others; their tokens are never appended.
        A finished request's KV blocks and slot are freed once no queued round writes them
        (``Request.num_inflight == 0``), so a slot is reused only after that. The plan callback
        sees ``RoundState.kv_length`` as of the collected rounds (lagged by the round in
        flight); adaptive policies get feedback with the pipeline's lag. A prefill (admission)
        runs on the same stream behind the queued round and reads its first token back, so it
        waits for that round.
        """
        first: dict[int, int] = {}
        num_prefill, finished = self._admit(first)
        finished = self._early_finished + finished
        self._early_finished = []
        # a request whose queued rounds surely reach max_tokens (each emits >= 1 token) sits
        # this round out: no wasted row for a length stop the host can foresee
        batch = [r for r in self._running
                 if len(r.output) + r.num_inflight < r.params.max_tokens]
        n = len(batch)
        plan, k, nv = self._resolve(plan, batch)
        if n > 0:
            bcap, g, budget_rows = self._shape(plan, n, k, nv)
            bound = np.array(
                [r.num_computed + sum(f.k + 1 for f in self._inflight if r.rid in f.rids)
                 for r in batch],
                dtype=np.int64,
            )
            x = self.runner.prepare(batch, bcap, k, nv, g, budget_rows, bound)
            for m in self._routed_all:  # the round's own experts, not the prefill's
                m.begin_round()
            self.runner.execute(x)
            experts = round_counts(self._routed) if self._routed else None
            for r in batch:
                r.num_inflight += 1
            self._inflight.append(
                _Flight(x, batch, first, finished, num_prefill, self._round_index, g, experts))
            self._round_index += 1
            first, finished, num_prefill = {}, [], 0
        res = None
        if len(self._inflight) > self.queue_depth or (n == 0 and self._inflight):
            res = self._collect(self._inflight.pop(0))
        if res is None:
            return self._empty_result(k, first, finished, num_prefill)
        res.first_tokens.update(first)
        res.finished.extend(finished)
        res.num_prefill_tokens += num_prefill
        return res

    def _collect(self, f: _Flight) -> RoundResult:
        """Collect one queued round: lagged stop rules, bookkeeping, deferred frees."""
        x = f.x
        k = x.k
        accepted, nv, out_tokens, scores = self.runner.collect(x)
        keep: list[int] = []
        emitted = []
        finished = list(f.finished)
        num_emitted = 0
        for b, req in enumerate(f.batch):
            req.num_inflight -= 1
            if req.is_finished:  # stopped in an earlier round or released: discard
                continue
            keep.append(b)
            a = int(accepted[b])
            req.num_computed += a + 1
            req.num_extend = a + 1
            kept = req.append([int(t) for t in out_tokens[b, : a + 1]])
            num_emitted += len(kept)
            emitted.append(([f.first[req.rid]] if req.rid in f.first else []) + kept)
            if req.is_finished:
                finished.append(req.rid)
        live = [f.batch[b] for b in keep]
        kv_lens = np.array([r.num_computed for r in live], dtype=np.int64)
        for req in f.batch:
            if req.is_finished:
                if req in self._running:
                    self._running.remove(req)
                if req.num_inflight == 0:
                    self._finish(req)
        idx = np.array(keep, dtype=np.int64)
        gone = (np.setdiff1d(np.arange(len(f.batch)), idx) if len(keep) < len(f.batch)
                else idx[:0])  # nothing discarded (every round but a stop's): no set op
        d_kv = np.array([f.batch[b].num_computed + int(accepted[b]) + 1 for b in gone], np.int64)
        d_acc, d_nv, d_sc = accepted[gone], nv[gone], scores[gone]
        accepted, nv, scores = accepted[idx], nv[idx], scores[idx]
        if k > 0:
            self.stats.add(nv, accepted, num_emitted)
        return RoundResult(
            num_requests=len(live),
            bcap=x.bcap,
            g=f.g,
            k=k,
            request_ids=[r.rid for r in live],
            accepted=accepted,
            num_verify=nv,
            emitted=emitted,
            finished=finished,
            draft_scores=scores,
            kv_lengths=kv_lens,
            num_prefill_tokens=f.num_prefill,
            first_tokens=dict(f.first),
            round_index=f.round_index,
            state_bytes=self._state_bytes(x.bcap, k),
            num_discarded=len(f.batch) - len(live),
            discarded_accepted=d_acc,
            discarded_num_verify=d_nv,
            discarded_draft_scores=d_sc,
            discarded_kv_lengths=d_kv,
            # the round is complete (collected above): a read of L integers
            experts_activated=() if f.experts is None else tuple(f.experts.tolist()),
        )

    def drain(self) -> list[RoundResult]:
        """Collect every queued round (oldest first) and return their results; the queue is
        then empty (depth 0: always ``[]``)."""
        out = []
        while self._inflight:
            out.append(self._collect(self._inflight.pop(0)))
        return out

    @property
    def num_inflight(self) -> int:
        """Rounds queued and not yet collected (pipelined engines: 0 or 1 between steps)."""
        return len(self._inflight)


@dataclass
class _Flight:
    """One queued (pipelined) round: its inputs, batch and the prefill facts reported with it."""

    x: Any  # RoundInputs
    batch: list[Request]
    first: dict[int, int]
    finished: list[int]
    num_prefill: int
    round_index: int
    g: int
    experts: Any = None  # [L] int64 device tensor: distinct experts per routed target layer
    rids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.rids = frozenset(r.rid for r in self.batch)

    @property
    def k(self) -> int:
        return self.x.k
