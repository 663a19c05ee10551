"""What an engine is built from: :class:`EngineConfig` (frozen, validated on construction).

``Engine`` (``speccal.runner.engine``) takes one; the CLI, calibration and the live runs build
it from their options (``speccal.calibrate.pipeline.engine_config``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speccal.base.errors import InputError, SchemaError, UnsupportedError
from speccal.base.geometry import served_request_buckets
from speccal.base.run_spec import RunSpec
from speccal.base.vocab import ACCEPTANCE_MODES, STATE_STRATEGIES
from speccal.runner.checkpoint import read_config
from speccal.runner.path import ExecutionPath
from speccal.runner.presets import HYBRID_PRESETS, PRESETS


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`Engine` is built from.

    Attributes
    ----------
    model : a preset name (``tiny``, ``dense-0.5b``, ``dense-2b``, ``mimo-7b``) or an HF folder.
    device : ``cpu``, ``cuda[:N]`` or ``npu[:N]``; validated, never a silent fallback.
    dtype : ``float32`` / ``bfloat16`` / ``float16``; None = float32 on CPU, bfloat16 elsewhere.
    draft_width : ``w``, the most draft tokens per round.
    request_buckets : physical draft request buckets ``Bcap`` (ascending); None = the device
        kind's served set (``speccal.base.geometry.SERVED_REQUEST_BUCKETS``: 1..64 on cuda /
        npu, 1..8 on cpu), the same for calibrate, bench and generate.
    target_rows : optional ``{Bcap: (G, ...)}``; default ``Bcap * j`` for ``j = 1 .. w + 1``.
    acceptance : ``greedy`` | ``sample`` | ``synthetic`` | ``forced``.
    acceptance_profile : ``synthetic`` only: conditional acceptance per draft position (``w``).
    score_informativeness : ``synthetic`` only, in ``[0, 1]``: how much a draft's reported score
        says about its acceptance (``speccal.runner.sampling.synthetic_draft_scores``; 0: every
        score is its position's profile value, 1: the score is the outcome).
    seed : seeds the sampling generator and preset weights.
    max_model_len : prompt + generated tokens per request; None = min(model limit, 4096).
    block_size : tokens per KV block.
    kv_capacity_tokens : KV slots for requests; None = ``max bucket * (max_model_len + w + 1)``.
    prefill_chunk : most prompt tokens per prefill forward (chunked prefill).
    speculative : False runs plain decoding (``k = 0`` rounds, no draft head loaded).
    path : the program measured (:class:`~speccal.runner.path.ExecutionPath`: graph mode,
        attention backend, input update, kernel configuration); recorded in
        :meth:`Engine.compatibility`. ``path.graph_mode="split"`` captures a draft graph per
        (Bcap, k) and a target graph per (Bcap, k, G) at construction (cuda/npu only).
    draft_family : presets only: key layout of the random MTP head.
    state_strategy : how a hybrid target's recurrent state stays consistent under rejected
        drafts (``speccal.runner.hybrid_state``): ``scratch_swap`` (verify writes a scratch
        row; full acceptance swaps row indices, partial acceptance replays the accepted
        prefix) or ``snapshots`` (a state per verified position, the accepted one selected).
        Recorded in :meth:`Engine.compatibility` (``none`` for targets without such state).
    pipeline : the round loop's queue depth (``Engine.queue_depth``): False (default) 0, the
        synchronous loop (admit -> prepare -> execute -> collect -> bookkeeping in series).
        True 1, pipelined rounds (SPEC section 7): ``Engine.step`` queues round ``n + 1``
        before it collects round ``n`` and returns round ``n``'s result (one step late;
        ``Engine.drain`` collects the rest). Every round's metadata is derived on the device
        from the per-slot state the previous round advanced there; at depth 1 stop rules are
        discovered one round late (the extra round's tokens are discarded).
        Each request may then need ``w + 1`` more KV slots and positions, which the engine
        reserves (``max_positions``, block table width, the default KV capacity).
    """

    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    draft_width: int = 3
    request_buckets: tuple[int, ...] | None = None
    target_rows: Mapping[int, Sequence[int]] | None = None
    acceptance: str = "greedy"
    acceptance_profile: tuple[float, ...] | None = None
    score_informativeness: float = 0.0
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_capacity_tokens: int | None = None
    prefill_chunk: int = 512
    speculative: bool = True
    path: ExecutionPath = field(default_factory=ExecutionPath)
    draft_family: str | None = None
    pipeline: bool = False
    state_strategy: str = "scratch_swap"

    @classmethod
    def flat(cls, **kw: Any) -> EngineConfig:
        """Build from one flat keyword set: ``graph_mode``, ``attention_backend``,
        ``input_update`` and ``kernels`` go into ``path`` (the form benches and tests write)."""
        fields_ = {"graph_mode", "attention_backend", "input_update", "kernels"}
        path = kw.pop("path", None) or ExecutionPath()
        changes = {k: kw.pop(k) for k in fields_ & kw.keys()}
        return cls(path=path.with_(**changes), **kw)

    def __post_init__(self) -> None:
        if not isinstance(self.draft_width, int) or self.draft_width < 1:
            raise InputError("draft_width", self.draft_width, "an integer >= 1")
        if self.acceptance not in ACCEPTANCE_MODES:
            raise InputError("acceptance", self.acceptance, f"one of {', '.join(ACCEPTANCE_MODES)}")
        if not isinstance(self.path, ExecutionPath):
            raise InputError("path", type(self.path).__name__, "an ExecutionPath")
        if self.path.graph_mode == "split" and not self.device.startswith(("cuda", "npu")):
            raise UnsupportedError(
                f"graph_mode='split' captures CUDA/NPU graphs; device {self.device!r} runs 'eager'"
            )
        buckets = self.request_buckets
        if buckets is None:  # the device kind's served set (speccal.base.geometry)
            buckets = served_request_buckets(self.device)
        object.__setattr__(self, "request_buckets", tuple(int(b) for b in buckets))
        if self.acceptance == "synthetic":
            prof = self.acceptance_profile
            if prof is None or len(prof) != self.draft_width:
                raise InputError(
                    "acceptance_profile",
                    prof,
                    f"{self.draft_width} per-position acceptance probabilities (draft_width)",
                )
            for i, p in enumerate(prof):
                if not 0.0 <= float(p) <= 1.0:
                    raise InputError(f"acceptance_profile[{i}]", p, "a probability in [0, 1]")
            object.__setattr__(self, "acceptance_profile", tuple(float(p) for p in prof))
        elif self.acceptance_profile is not None:
            raise InputError(
                "acceptance_profile", self.acceptance_profile, "None unless acceptance='synthetic'"
            )
        lam = self.score_informativeness
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam <= 1.0:
            raise InputError("score_informativeness", lam, "a number in [0, 1]")
        if lam != 0.0 and self.acceptance != "synthetic":
            raise InputError("score_informativeness", lam,
                             "0 unless acceptance='synthetic' (other modes report the draft's "
                             "own probabilities)")
        object.__setattr__(self, "score_informativeness", float(lam))
        if not isinstance(self.pipeline, bool):
            raise InputError("pipeline", self.pipeline, "a bool")
        if self.state_strategy not in STATE_STRATEGIES:
            raise InputError("state_strategy", self.state_strategy,
                             f"one of {', '.join(STATE_STRATEGIES)}")
        for name in ("block_size", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputError(name, v, "an integer >= 1")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise InputError("max_model_len", self.max_model_len, "an integer >= 2")


def check_declared_context(model: str, max_model_len: int | None) -> None:
    """Refuse ``max_model_len`` above the context the model declares before anything is
    loaded: the loader allocates rotary tables of that many positions, so the check after
    the load (``Engine._build``) would come after an allocation of any size. Reads a preset's
    config or a folder's ``config.json``; says nothing when neither declares a limit (the
    loader then reports the folder)."""
    if max_model_len is None:
        return
    preset = PRESETS.get(model) or HYBRID_PRESETS.get(model)
    if preset is not None:
        cfg: Any = preset.config
    else:
        try:
            cfg = read_config(model)
        except (InputError, SchemaError, OSError):
            return  # the loader names what is wrong with the folder
    if not isinstance(cfg, dict):
        return
    text = cfg.get("text_config")
    limit = cfg.get("max_position_embeddings",
                    text.get("max_position_embeddings") if isinstance(text, dict) else None)
    if isinstance(limit, int) and not isinstance(limit, bool) and max_model_len > limit:
        raise InputError(
            "max_model_len", max_model_len, f"<= the model's max_position_embeddings={limit}"
        )


def from_spec(spec: RunSpec) -> EngineConfig:
    """The one conversion of a run's options (``speccal.base.run_spec.RunSpec``) into an
    :class:`EngineConfig`: the path served on the spec's device with its kernels (split graphs
    and Triton on CUDA), its graph mode / attention backend where the spec names them, eager
    graphs and the torch backend under tensor parallelism (the only TP path), the loop as the
    queue depth; unset fields keep the engine's defaults."""
    from speccal.runner.path import KernelConfig, served_path

    kernels = KernelConfig() if spec.kernels is None else KernelConfig.from_dict(spec.kernels)
    served = served_path(spec.device, kernels)
    if spec.tp > 1:
        served = served.with_(graph_mode="eager", attention_backend="torch")
    kw: dict[str, Any] = {
        "model": spec.model,
        "device": spec.device,
        "dtype": spec.dtype,
        "acceptance": spec.acceptance,
        "acceptance_profile": spec.acceptance_profile,
        "score_informativeness": spec.score_informativeness,
        "seed": spec.seed,
        "speculative": spec.speculative,
        "pipeline": spec.pipelined,
        "state_strategy": spec.state_strategy,
        "request_buckets": spec.request_buckets,
        "max_model_len": spec.max_model_len,
        "path": served.with_(graph_mode=spec.graph_mode or served.graph_mode,
                             attention_backend=spec.attention_backend
                             or served.attention_backend),
    }
    if spec.draft_width is not None:
        kw["draft_width"] = spec.draft_width
    if spec.prefill_chunk is not None:
        kw["prefill_chunk"] = spec.prefill_chunk
    return EngineConfig(**{**kw, **dict(spec.extra)})
