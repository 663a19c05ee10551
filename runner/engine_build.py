"""How an engine is built and what it reports: :class:`EngineBuild`, the base of
:class:`~speccal.runner.engine.Engine`.

Building loads the target and its MTP head (``speccal.runner.loader``), sizes and allocates the
paged KV cache (refused before allocation when it cannot fit), builds the hybrid state strategy
and the :class:`~speccal.runner.round.RoundRunner`, binds the execution path to every module,
fuses weights, precompiles and captures the graphs (``graph_mode="split"``) and, for a hybrid
target on CUDA, warms its prefill kernels; ``build_timings`` says where the time went. What it
reports: the compatibility block a cost table records, the :class:`BuildReport`, the routed
layers, the runtime versions. The prompt source (:meth:`EngineBuild.set_prompt_source`) is built
here too: one prefill whose KV later prompts copy. ``engine.py`` keeps the request lifecycle and
the round loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from speccal import __version__
from speccal.base.errors import InputError
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
)
from speccal.runner.engine_config import EngineConfig, check_declared_context
from speccal.runner.graphs import GraphKey
from speccal.runner.hybrid import HybridModel, HybridMTPHead
from speccal.runner.hybrid_state import make_strategy
from speccal.runner.kv_cache import KVCache
from speccal.runner.linear_attention import CHUNK_SIZE
from speccal.runner.loader import LoadedModel, load_model
from speccal.runner.moe import activated_counts
from speccal.runner.path import bind_path
from speccal.runner.prefill import prefill
from speccal.runner.presets import PRESETS
from speccal.runner.prompt_source import PromptSource
from speccal.runner.request import Request
from speccal.runner.round import RoundRunner
from speccal.runner.sampling import SamplingParams


class EngineBuild:
    """Construction and description of an engine (see the module docstring); subclassed by
    :class:`~speccal.runner.engine.Engine`, whose request and round state it initialises.
    A subclass may load another model (``_load_model``: a tensor-parallel rank's shard) and
    cache other heads (``_kv_heads``)."""

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
            score_informativeness=config.score_informativeness,
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
        self._init_requests(max_bucket)  # the request lifecycle's state (Engine)
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
        # the kernels that run: a model without linear-attention layers records that group at
        # the value the tables before it ran (KernelConfig.for_model)
        kx = self.path.kernels.for_model(linear_attention=self._has_state)
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
            "kernels": {"digest": kx.digest(), "config": kx.to_dict()},
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
