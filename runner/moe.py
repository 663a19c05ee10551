"""The routed mixture-of-experts MLP, shared by the dense decoder and the hybrid targets.

This module owns :class:`RoutedMoE` (router, SwiGLU experts, optional shared expert), the
router's selection rule :func:`route` and :class:`SwiGLU`. What it computes is data, a
:class:`~speccal.runner.moe_config.MoEConfig` (the module docstring there lists the families
and their keys). Parameter names are the checkpoints' (``gate.weight``,
``gate.e_score_correction_bias``, ``experts.E.{gate,up,down}_proj.weight``,
``shared_expert.*`` + ``shared_expert_gate.weight`` or ``shared_experts.*``), so a layer's
``mlp.`` prefix loads by name; a checkpoint that stacks its experts (``experts.gate_up_proj``
``[E, 2 I, H]``, ``experts.down_proj`` ``[E, H, I]``) is read through
``speccal.runner.expert_source``.

Forward on ``N`` flat rows ``[N, hidden]``: the router scores every row (float32), picks
``top_k`` experts per row (:func:`route`), and ``speccal.kernels.ops.fused_moe`` runs the
experts over the (row, expert) pairs sorted by expert into a block-aligned layout of static
worst-case size: no host read and no value-dependent shape, so the layer runs inside the
captured round graphs like any other. On CUDA the op takes the fused-MoE Triton kernels
(``kernels/fused_moe.py``: gate/up in one pass over the stacked ``[E, 2 I, hidden]`` weight,
blocks of no expert exit before reading weights) whatever the attention backend
(``KernelConfig.backend='reference'`` forces the reference); on CPU the pure-torch reference
(batched products over each block's gathered expert weights). Each row's weighted expert
outputs are added in ascending expert order, as transformers does. The experts' weights are
stacked once (:meth:`RoutedMoE.stack_experts`, at the first forward or ``fuse_weights``); the
per-expert parameters stay, as views of the stacks, so checkpoints load by name. The fused
dense layer still serves only dense MLPs (``DecoderLayer.can_fuse``): a routed layer runs
per op. Nothing here assumes an attention kind: the module sees rows of hidden states only.

Each module also records, on the device, which experts its forwards activated: a ``[2, E]``
bool tensor (allocated at the first forward, updated in place, so a captured forward updates
it too), row 0 since the last :meth:`RoutedMoE.take_activated` (which ``Engine.take_activated_experts``
reads), row 1 since the last :meth:`RoutedMoE.begin_round`: the engine starts one before each
round's forwards and counts it on the device after them (:func:`round_counts`), read with the
round's results at collect, so the count is per round on both round loops
(``RoundResult.experts_activated``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speccal.base.errors import UnsupportedError
from speccal.kernels import ops
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.runner.moe_config import MoEConfig
from speccal.runner.path import SKINNY_ROWS, PathBound


@torch.no_grad()
def interleave_rows(a: nn.Parameter, b: nn.Parameter) -> torch.Tensor:
    """One tensor whose rows alternate ``a[i], b[i]`` (``[2 n, ...]`` from two ``[n, ...]``),
    ``a`` and ``b`` becoming its even / odd row views (no second copy): the gate / up layout of
    the GEMV's SwiGLU epilogue (``ops.linear(epilogue="silu_mul")``)."""
    with torch.inference_mode(False):  # the parameters stay ordinary tensors
        both = torch.stack([a.data, b.data], dim=1).reshape(-1, *a.shape[1:])
    a.data, b.data = both[0::2], both[1::2]
    return both


@torch.no_grad()
def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of ``parts`` (parameters of one width) stacked along their rows, each part
    becoming its row view (no second copy): the fused q/k/v or projection GEMV's weight."""
    with torch.inference_mode(False):  # the parameters stay ordinary tensors
        whole = torch.cat([p.data for p in parts])
    start = 0
    for p in parts:
        rows = p.shape[0]
        p.data = whole[start:start + rows]
        start += rows
    return whole


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, torch products, no bias. :meth:`interleave` makes the
    gate / up weights row views of one ``gate_up_weight [2 I, hidden]`` whose rows alternate
    ``gate_i, up_i`` (the layout of the GEMV's SwiGLU epilogue, ``ops.linear(epilogue=
    "silu_mul")``) for callers that run the fused path (the hybrid layers)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by interleave

    @torch.no_grad()
    def interleave(self) -> None:
        """Stack gate / up into the interleaved ``gate_up_weight`` once (no second copy: the
        parameters become its even / odd rows)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = interleave_rows(self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The router's parameters: ``weight [E, hidden]`` and, for the sigmoid (noaux_tc) routers
    that have one, the selection bias ``e_score_correction_bias [E]``. A sigmoid router keeps
    both in float32 whatever the model's dtype (:attr:`is_float32`, read by the loader), as
    transformers keeps them (``_keep_in_fp32_modules_strict``): a bf16 bias would move the
    selection."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.is_float32 = moe.scoring == "sigmoid"
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.has_score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None


def route(
    x: torch.Tensor,  # [N, hidden]
    router: Router,
    moe: MoEConfig,
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, top_k] (float32 or x's dtype), ids [N, top_k]
    """Each row's experts and their weights: the router's product (softmax: in ``x``'s dtype;
    sigmoid: float32), then ``ops.moe_route`` (``reference.moe_route_ref`` states the rule:
    softmax probabilities or sigmoid scores with the selection bias and group limit, top-k,
    optional renormalisation, ``routed_scaling_factor``)."""
    if moe.scoring == "softmax":
        logits = F.linear(x, router.weight)  # [N, E]
    else:
        logits = F.linear(x.float(), router.weight.float())
    return ops.moe_route(logits, router.e_score_correction_bias, moe.top_k, moe.scoring,
                         num_groups=moe.num_groups, topk_groups=moe.topk_groups,
                         normalise=moe.is_topk_normalised, scale=moe.routed_scaling_factor,
                         tune=tune)


class RoutedMoE(PathBound, nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert (see the module docstring).

    Parameters
    ----------
    hidden : int
    moe : MoEConfig
    """

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self._init_path()
        self.moe = moe
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(SwiGLU(hidden, moe.expert_intermediate_size)
                                     for _ in range(moe.num_experts))
        self.shared_form = moe.shared_form if moe.shared_intermediate_size else None
        if self.shared_form is not None:
            setattr(self, self.shared_form, SwiGLU(hidden, moe.shared_intermediate_size))
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False) if moe.is_shared_gated
                                   else None)
        self.gate_up_weight: torch.Tensor | None = None  # [E, 2 I, hidden], stack_experts
        self.down_weight: torch.Tensor | None = None  # [E, hidden, I]
        self._stack_key: tuple[int, int] | None = None  # the parameters they were stacked from
        # [2, E] bool: row 0 since the last take_activated, row 1 since begin_round
        self.masks: torch.Tensor | None = None
        # [N] bool: the current forward's rows that belong to requests (bind_real_rows); None:
        # every row does
        self.real_rows: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        weights, ids = route(x, self.gate, self.moe, self.kx)  # [N, k]
        real = self.real_rows
        if real is not None and real.shape[0] != x.shape[0]:
            raise RuntimeError(f"RoutedMoE.real_rows: {real.shape[0]} rows bound, the forward "
                               f"has {x.shape[0]} (bind_real_rows before each forward)")
        if self.masks is None or self.masks.device != x.device:
            with torch.inference_mode(False):  # reset in place later, outside inference mode
                self.masks = torch.zeros(2, self.moe.num_experts, dtype=torch.bool,
                                         device=x.device)
        out, _ = ops.fused_moe(x, weights, ids, *self._stacked(), row_mask=real,
                               activated=self.masks, tune=self.kx)
        if self.shared_form is not None:
            mlp = getattr(self, self.shared_form)
            if (self.shared_expert_gate is None and mlp.gate_up_weight is not None
                    and self.path.fused(x) and x.shape[0] <= SKINNY_ROWS):
                # decode / verify rows on the fused path: the dense MLP's two GEMVs (SwiGLU
                # epilogue, then down adding into the routed sum), not five torch launches
                act = ops.linear(x.contiguous(), mlp.gate_up_weight, epilogue="silu_mul",
                                 tune=self.kx)
                ops.linear(act, mlp.down_proj.weight, residual=out, tune=self.kx)
                return out
            shared = mlp(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked expert weights, (re)built when the experts' parameters are no longer
        views of them (a load or a ``.to()`` replaced them; a host-side pointer check)."""
        if self._stack_key != self._param_key():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise UnsupportedError("the routed experts' weights changed since the last "
                                       "eager forward: stack them (stack_experts) before capture")
            self.stack_experts()
        return self.gate_up_weight, self.down_weight

    def _param_key(self) -> tuple[int, int]:
        return (self.experts[0].gate_proj.weight.data_ptr(),
                self.experts[-1].down_proj.weight.data_ptr())

    def stack_experts(self) -> None:
        """Stack the experts' weights into ``gate_up_weight [E, 2 I, hidden]`` (gate rows, then
        up rows) and ``down_weight [E, hidden, I]``, the fused-MoE op's layout; each expert's
        parameters become views of them (no second copy; in-place writes keep both in step)."""
        with torch.inference_mode(False), torch.no_grad():  # parameters stay writable
            gu = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight])
                              for e in self.experts])
            down = torch.stack([e.down_proj.weight for e in self.experts])
        inter = self.moe.expert_intermediate_size
        for i, e in enumerate(self.experts):
            e.gate_proj.weight.data = gu[i, :inter]
            e.up_proj.weight.data = gu[i, inter:]
            e.down_proj.weight.data = down[i]
        self.gate_up_weight, self.down_weight = gu, down
        self._stack_key = self._param_key()

    def take_activated(self) -> torch.Tensor | None:  # [E] bool, or None: no forward yet
        """The experts activated since the last call (all False when none ran), and reset."""
        if self.masks is None:
            return None
        out = self.masks[0].clone()
        self.masks[0].zero_()
        return out

    def begin_round(self) -> None:
        """Start the per-round mask (the engine calls it before a round's forwards)."""
        if self.masks is not None:
            self.masks[1].zero_()

    def fuse_weights(self) -> None:
        """Stack the experts' weights (:meth:`stack_experts`) for the fused-MoE op, and
        interleave the shared expert's gate / up for the GEMV's SwiGLU epilogue."""
        self.stack_experts()
        if self.shared_form is not None:
            getattr(self, self.shared_form).interleave()


def activated_counts(module: nn.Module) -> list[int]:
    """Per :class:`RoutedMoE` under ``module`` (module order), the distinct experts activated
    since the last read (0 when none ran), and reset; one host read per layer."""
    out = []
    for m in module.modules():
        if isinstance(m, RoutedMoE):
            hit = m.take_activated()
            out.append(0 if hit is None else int(hit.sum()))
    return out


def routed_modules(module: nn.Module) -> list[RoutedMoE]:
    """The :class:`RoutedMoE` modules under ``module`` (module order)."""
    return [m for m in module.modules() if isinstance(m, RoutedMoE)]


def bind_real_rows(model: nn.Module, slot_mapping: torch.Tensor,  # [N] int64
                   block_size: int) -> None:
    """Before a forward of ``model`` over rows writing KV slots ``slot_mapping``: its routed
    layers route only the rows that belong to requests (:attr:`RoutedMoE.real_rows`). A
    round's padding rows (padding requests of the bucket, rows past the verify rows) write the
    reserved sentinel block 0 (``speccal.runner.kv_cache``), every request row an allocated
    block, so the rows are those whose slot is past the first block: one comparison per
    forward, on the device, captured with it. The padding rows' tokens are stale (what their
    slot last held, which differs between eager and captured rounds and between the host and
    in-graph input updates): routed, they activated experts the requests did not, and read
    their weights."""
    routed = model.__dict__.get("_routed_cache")
    if routed is None:
        routed = routed_modules(model)
        model.__dict__["_routed_cache"] = routed
    if routed:
        real = slot_mapping >= block_size
        for m in routed:
            m.real_rows = real


def round_counts(modules: list[RoutedMoE]) -> torch.Tensor:  # [L] int64, on the modules' device
    """Distinct experts each module activated since its :meth:`RoutedMoE.begin_round`, counted on
    the device (no host read: the caller reads it with the round's results). A module that ran
    no forward counts 0."""
    counts = []
    for m in modules:
        counts.append(m.masks[1].sum() if m.masks is not None
                      else torch.zeros((), dtype=torch.int64, device=m.gate.weight.device))
    return torch.stack(counts)
