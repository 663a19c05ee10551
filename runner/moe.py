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
``top_k`` experts per row (:func:`route`), and each expert runs on the rows routed to it
(gathered: one host read of the per-expert row counts, so the MLP runs eager, never inside a
captured CUDA graph, and with torch products; the fused Triton layer serves only dense MLPs,
``DecoderLayer.can_fuse``). Each expert's output, times its weight, is added into the result
in ascending expert order, as transformers does. Nothing here assumes an attention kind: the
module sees rows of hidden states only.

Each module also records which experts its forwards activated since the last
:meth:`RoutedMoE.take_activated` (a ``[E]`` bool tensor on the rows' device, no extra host
read), which ``Engine.take_activated_experts`` reads, and, in a second mask, since the last
:meth:`RoutedMoE.begin_round`: the engine starts one before each round's forwards and counts it
on the device after them (:func:`round_counts`), read with the round's results at collect, so
the count is per round on both round loops (``RoundResult.experts_activated``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speccal.base.errors import UnsupportedError
from speccal.runner.moe_config import MoEConfig

#: added to the chosen sigmoid weights' sum before renormalising (transformers' DeepSeek-V3)
SIGMOID_NORM_EPS = 1e-20


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, torch products, no bias."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

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
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, top_k] (float32 or x's dtype), ids [N, top_k]
    """Each row's experts and their weights.

    softmax: probabilities over all experts (float32, from logits in ``x``'s dtype), the
    ``top_k`` largest, optionally renormalised, cast to ``x``'s dtype. sigmoid: per-expert
    scores from float32 logits; the selection score adds ``e_score_correction_bias``; with
    groups, only the ``topk_groups`` groups whose two best selection scores sum highest are
    eligible; the weights are the *unbiased* scores of the chosen experts, optionally
    renormalised (+ :data:`SIGMOID_NORM_EPS`), times ``routed_scaling_factor`` (float32).
    """
    if moe.scoring == "softmax":
        logits = F.linear(x, router.weight)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.is_topk_normalised:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights.to(logits.dtype), ids
    scores = torch.sigmoid(F.linear(x.float(), router.weight.float()))  # [N, E]
    choice = scores
    if router.e_score_correction_bias is not None:
        choice = scores + router.e_score_correction_bias.float()
    if moe.num_groups > 1:
        n, g = choice.shape[0], moe.num_groups
        grouped = choice.view(n, g, moe.num_experts // g)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = torch.topk(group_score, moe.topk_groups, dim=-1, sorted=False).indices
        eligible = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~eligible[:, :, None], float("-inf")).view(n, -1)
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if moe.is_topk_normalised:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    return weights * moe.routed_scaling_factor, ids


class RoutedMoE(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert (see the module docstring).

    Parameters
    ----------
    hidden : int
    moe : MoEConfig
    """

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(SwiGLU(hidden, moe.expert_intermediate_size)
                                     for _ in range(moe.num_experts))
        self.shared_form = moe.shared_form if moe.shared_intermediate_size else None
        if self.shared_form is not None:
            setattr(self, self.shared_form, SwiGLU(hidden, moe.shared_intermediate_size))
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False) if moe.is_shared_gated
                                   else None)
        self.activated: torch.Tensor | None = None  # [E] bool, since the last take_activated
        self.round_activated: torch.Tensor | None = None  # [E] bool, since begin_round

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise UnsupportedError(
                "the routed-expert MLP gathers each expert's rows (data-dependent shapes): "
                "it runs eager (graph_mode='eager'), not inside a captured CUDA graph")
        weights, ids = route(x, self.gate, self.moe)  # [N, k]
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [N k]: by expert, rows ascending within
        counts = torch.bincount(flat, minlength=self.moe.num_experts)  # [E]
        hit = counts > 0
        self.activated = hit if self.activated is None else self.activated | hit
        self.round_activated = hit if self.round_activated is None else self.round_activated | hit
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):  # the one host read
            if n:
                pick = order[start:start + n]
                rows = pick // k
                y = self.experts[e](x[rows]) * weights.reshape(-1)[pick, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += n
        if self.shared_form is not None:
            shared = getattr(self, self.shared_form)(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def take_activated(self) -> torch.Tensor | None:  # [E] bool, or None: no forward since
        """The experts activated since the last call (None when none ran), and reset."""
        out, self.activated = self.activated, None
        return out

    def begin_round(self) -> None:
        """Start the per-round mask (the engine calls it before a round's forwards)."""
        self.round_activated = None

    def fuse_weights(self) -> None:
        """Nothing to fuse: the experts run torch products (no fused-MoE kernel)."""


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


def round_counts(modules: list[RoutedMoE]) -> torch.Tensor:  # [L] int64, on the modules' device
    """Distinct experts each module activated since its :meth:`RoutedMoE.begin_round`, counted on
    the device (no host read: the caller reads it with the round's results). A module that ran
    no forward counts 0."""
    counts = []
    for m in modules:
        hit = m.round_activated
        counts.append(hit.sum() if hit is not None
                      else torch.zeros((), dtype=torch.int64, device=m.gate.weight.device))
    return torch.stack(counts)
