"""Hybrid linear-attention targets (Qwen3.5 / Qwen3-Next text models): config, layers, model.

This module owns :class:`HybridConfig` (parsed from an HF ``config.json`` and the checkpoint's
tensor names) and :class:`HybridModel`, a decoder whose layers are described by data: each
entry of ``layer_types`` names a token mixer in :data:`TOKEN_MIXERS` (``linear_attention``: the
gated delta-net of ``speccal.runner.linear_attention``, with recurrent state rows;
``full_attention``: gated GQA attention over the paged KV cache of ``speccal.runner.attention``),
and the MLP kind (dense SwiGLU or a routed mixture of experts with a gated shared expert) comes
from the config's expert fields. No code here tests a model name. Parameter names match the
HF checkpoints (``model.layers.N.linear_attn.*``, ``model.layers.N.self_attn.*``,
``model.layers.N.mlp.experts.E.*``), so a folder loads by name.

Structure shared by both families (transformers' ``Qwen3_5ForCausalLM`` /
``Qwen3NextForCausalLM`` are the reference): zero-centred RMSNorm (``x / rms(x) * (1 + w)``)
for the layer, final and q/k norms; full attention projects ``q`` and an output gate per head
(``q_proj`` is ``[heads * 2 * head_dim, hidden]``), normalises q and k per head, rotates the
first ``partial_rotary_factor * head_dim`` channels, and multiplies the attention output by
``sigmoid(gate)`` before ``o_proj``.

Forward layout: ``N = B * R`` flat rows, request-major; full-attention layers take the usual
:class:`~speccal.runner.attention.AttnMeta` (``kv_caches`` holds one ``(k, v)`` per
*full-attention* layer, in layer order), linear layers a
:class:`~speccal.runner.linear_attention.StateMeta` and one state pair per *linear* layer
(:class:`~speccal.runner.linear_attention.LinearState`).

Serving (issue 22): :class:`HybridModel` has the target calling convention of
``speccal.runner.model.TargetModel`` plus the state pair (``forward(ids, positions, attn_meta,
kv_caches, state_meta, state)``, ``logits``, :attr:`HybridModel.capabilities` declaring the
recurrent state); the linear layers read the flat rows in the ``[B, R]`` grid of
``StateMeta.row_index`` (the host update's ``AttnMeta.row_index``, or derived from the in-graph
update's ``cu_q_lens`` by the state strategy). Which state rows a forward
reads and writes, and how a rejected draft's state is undone, is the state strategy's
(``speccal.runner.hybrid_state``). :class:`HybridMTPHead` is the ``qwen3_5_mtp`` head: the
fusion block of the draft-family descriptor around one gated full-attention layer of this
module, with zero-centred norms. On CUDA the delta rule runs ``fla``'s kernels
(``speccal.runner.linear_attention``; or, under ``KernelConfig.linear_attention.impl ==
"fused"``, four Triton launches per linear layer, ``speccal.kernels.gated_delta``) and the
step is captured in CUDA graphs like a dense target's. On the fused plan (``linear_attention``
``fused``, off by default) every zero-centred norm
is one ``ops.rms_norm`` launch with the residual add folded in (:class:`OffsetRMSNorm`) or is
folded into the GEMV before it: a mixer's output projection adds into the stream and writes the
post-attention norm (:meth:`HybridLayer.out_to_norm`), a dense MLP is two GEMVs, the second
writing the next norm (:meth:`HybridLayer.mlp_to_next`); the gated attention's q/k/v products,
rotary and gate are torch ops. Before these, a B = 1 decode step was launch-bound: 1,757 kernels, 4.2 ms on the H200 for the qwen3.5-2b
preset before :func:`freeze_constants` and the fused norms (4.7x its HBM floor; transformers
under ``torch.compile`` decoded 1.29x faster, bench/RESULTS.md, 2026-12-02 02:45).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels import ops
from speccal.runner.attention import AttnMeta, attend_rows, write_kv
from speccal.runner.config import ModelConfig, config_from_hf
from speccal.runner.draft_families import DraftFamily
from speccal.runner.layers import SKINNY_ROWS, linear_rows
from speccal.runner.linear_attention import (
    GatedDeltaNet,
    LinearAttentionConfig,
    LinearState,
    StateMeta,
    grid_sources,
)
from speccal.runner.model import ModelCapabilities, fused_head
from speccal.runner.moe import RoutedMoE, SwiGLU, bind_real_rows, concat_rows
from speccal.runner.moe_config import MoEConfig
from speccal.runner.path import PathBound
from speccal.runner.rope import RotaryTable

TOKEN_MIXERS = {  # layer_types entry -> (module attribute, holds recurrent state)
    "linear_attention": ("linear_attn", True),
    "full_attention": ("self_attn", False),
}


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid target: shared shapes (``base``), the layer-type descriptor, the mixer shapes."""

    base: ModelConfig
    layer_types: tuple[str, ...]
    linear: LinearAttentionConfig
    moe: MoEConfig | None = None
    is_attn_output_gated: bool = True

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.base.num_hidden_layers:
            raise InputError("config.json:layer_types", len(self.layer_types),
                             f"{self.base.num_hidden_layers} entries (num_hidden_layers)")
        odd = sorted(set(self.layer_types) - set(TOKEN_MIXERS))
        if odd:
            raise UnsupportedError(f"config.json:layer_types contains {odd}: hybrid targets "
                                   f"support {sorted(TOKEN_MIXERS)}")
        if self.linear.num_v_heads % self.linear.num_k_heads:
            raise InputError("config.json:linear_num_value_heads", self.linear.num_v_heads,
                             f"a multiple of linear_num_key_heads={self.linear.num_k_heads}")
        dense = self.dense_mlp_layers()
        if dense and self.base.intermediate_size < 1:
            raise InputError("config.json:intermediate_size", None,
                             f"a value: layers {dense} have a dense SwiGLU MLP")
        if any(self.base.sliding_windows):
            raise UnsupportedError(
                f"config.json:sliding_window={max(self.base.sliding_windows)}: the hybrid "
                "target's gated attention has no sliding window, expected null")

    def dense_mlp_layers(self) -> list[int]:
        """Indices of the layers whose MLP is the dense SwiGLU (not routed experts)."""
        return [i for i in range(self.base.num_hidden_layers)
                if self.moe is None or not self.moe.is_sparse(i)]

    def __getattr__(self, name: str) -> Any:
        """The shared shapes (``hidden_size``, ``num_key_value_heads`` ...) read through to
        :attr:`base`, so the round runner reads a hybrid config as it reads a dense one."""
        if name == "base" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def layers_of(self, kind: str) -> list[int]:
        """Indices of the layers whose token mixer is ``kind``."""
        return [i for i, t in enumerate(self.layer_types) if t == kind]


def is_hybrid_config(cfg: Mapping[str, Any]) -> bool:
    """Whether an HF config describes a hybrid target (a ``linear_attention`` layer type)."""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    return "linear_attention" in (cfg.get("layer_types") or ())


def hybrid_config_from_hf(cfg: Mapping[str, Any],
                          key_names: Iterable[str] | None = None) -> HybridConfig:
    """Build a :class:`HybridConfig` from an HF ``config.json`` dictionary.

    Parameters
    ----------
    cfg : mapping
        The parsed ``config.json`` (a nested ``text_config`` is used when present).
    key_names : iterable of str, optional
        The checkpoint's tensor names: the linear layers' projection layout (separate
        ``in_proj_qkv`` or grouped ``in_proj_qkvz``) is read from them.

    Raises
    ------
    InputError
        A missing field (named) or inconsistent head counts.
    UnsupportedError
        A layer type outside :data:`TOKEN_MIXERS`, or a non-default RoPE type with mRoPE
        sections that differ per axis for text (only equal positions are served).
    """
    base = config_from_hf(cfg, key_names, allow_hybrid=True)
    raw = base.extra
    names = set(key_names) if key_names is not None else set()
    layer_types = raw.get("layer_types")
    if not layer_types:
        raise InputError("config.json:layer_types", None, "the per-layer token mixer list")

    def need(name: str) -> int:
        value = raw.get(name)
        if value is None:
            raise InputError(f"config.json:{name}", None, "a value (hybrid linear attention)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"config.json:{name}", value, "an integer")
        return value

    grouped = any(".linear_attn.in_proj_qkvz." in k for k in names)
    linear = LinearAttentionConfig(
        num_k_heads=need("linear_num_key_heads"),
        num_v_heads=need("linear_num_value_heads"),
        head_k_dim=need("linear_key_head_dim"),
        head_v_dim=need("linear_value_head_dim"),
        conv_kernel=need("linear_conv_kernel_dim"),
        is_grouped_projection=grouped,
    )
    return HybridConfig(base=base, layer_types=tuple(layer_types), linear=linear, moe=base.moe,
                        is_attn_output_gated=bool(raw.get("attn_output_gate", True)))


def _fused_plan(path, x: torch.Tensor) -> bool:
    """Whether the hybrid layers run their fused launch plan on ``x``: the fused path (Triton
    ops on CUDA) with ``KernelConfig.linear_attention.impl == "fused"``, the switch that stays
    off until the H200 confirms the plan end to end (``fla``, the default, keeps the torch
    layers the H200 validated)."""
    return path.kernels.linear_attention.is_fused and path.fused(x)


class OffsetRMSNorm(PathBound, nn.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)`` in float32 (weights init to 0).

    :meth:`freeze` keeps ``1 + weight`` in float32 (``scale``) for serving: the same values,
    two launches fewer per call (the cast and the add). The weights must not change after it
    (the engine freezes once its weights are loaded and on their device). A second freeze
    keeps the first tensor: graphs captured by an engine sharing these weights read it.

    Frozen, on the fused plan (:func:`_fused_plan`: Triton ops on CUDA, ``linear_attention``
    ``fused``), it is one
    ``ops.rms_norm`` launch with ``scale`` as its float32 weight (the same formula: the fp32 row
    times rsqrt(mean + eps) times the weight, then the cast) instead of six torch ops, and
    :meth:`add_norm` adds the residual in the same launch (the sum's norm taken in fp32 before
    the sum is rounded to the stream's dtype: equal in fp32, within a rounding in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self._init_path()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None

    @torch.no_grad()
    def freeze(self) -> None:
        if self.scale is None:
            self.scale = 1.0 + self.weight.float()

    def _fused(self, x: torch.Tensor) -> bool:
        return self.scale is not None and _fused_plan(self.path, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self._fused(x):
            shape = x.shape
            return ops.rms_norm(x.reshape(-1, shape[-1]), self.scale, self.eps,
                                tune=self.kx).view(shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        return (xf * scale).type_as(x)

    def add_norm(self, delta: torch.Tensor,  # [N, dim]
                 residual: torch.Tensor) -> torch.Tensor:  # [N, dim], updated in place
        """``residual += delta`` in place, then the norm of the sum (one launch when fused)."""
        if self._fused(residual) and residual.is_contiguous() and delta.stride(-1) == 1:
            return ops.rms_norm(delta, self.scale, self.eps, residual=residual, tune=self.kx)
        residual.add_(delta)
        return self(residual)


class GatedAttention(nn.Module):
    """GQA attention with a per-head output gate, q/k norm and partial rotary, paged KV."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        b = cfg.base
        h, d = b.hidden_size, b.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (b.num_attention_heads,
                                                            b.num_key_value_heads, d)
        self.is_gated = cfg.is_attn_output_gated
        self.scale = d**-0.5
        mult = 2 if self.is_gated else 1
        self.q_proj = nn.Linear(h, self.num_heads * d * mult, bias=b.is_qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=b.is_qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=b.is_qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=b.is_o_bias)
        self.q_norm = OffsetRMSNorm(d, b.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, b.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # concat_qkv: the fused plan's one GEMV

    def concat_qkv(self) -> None:
        """``q_proj`` (with its per-head gate rows), ``k_proj``, ``v_proj`` become row views of
        one ``qkv_weight [(hq * mult + 2 hk) d, hidden]`` (no second copy): the fused plan
        projects decode / verify rows in one GEMV. Left as it is with q/k/v biases (the plan
        would need one more launch to add them) or norms that differ in eps."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if (self.qkv_weight is not None or any(p.bias is not None for p in parts)
                or self.q_norm.eps != self.k_norm.eps):
            return
        self.qkv_weight = concat_rows([p.weight for p in parts])

    def _fused_rows(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                    kv: tuple[torch.Tensor, torch.Tensor], rotary: RotaryTable, path,
                    ) -> torch.Tensor:  # [N, hq * d]: attention rows times the gate
        """The fused plan's attention rows in five or six launches: the q/k/v GEMV
        (``qkv_weight``), one ``ops.rotary_kv_write`` (the per-head q/k norms with the frozen
        ``1 + weight``, partial rotary, k and v into their slots, q to its own buffer), the
        attention (one or two: split keys), and the gate (sigmoid, product)."""
        n = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        mult = 2 if self.is_gated else 1
        qkv = linear_rows(x, self.qkv_weight, None, path)  # [N, (hq * mult + 2 hk) d]
        qg, k, v = qkv.split([hq * d * mult, hk * d, hk * d], dim=-1)
        qg = qg.view(n, hq, mult * d)  # per head: [q (d) | gate (d)] when gated
        q_out = torch.empty(n, hq, d, dtype=x.dtype, device=x.device)
        ops.rotary_kv_write(qg[..., :d], k.view(n, hk, d), v.view(n, hk, d), positions,
                            rotary.rope_cache, meta.slot_mapping, kv[0], kv[1], q_out=q_out,
                            qk_norm=(self.q_norm.scale, self.k_norm.scale, self.q_norm.eps),
                            tune=path.kernels)
        out = attend_rows(q_out, kv[0], kv[1], meta, self.scale, path)  # [N, hq, d]
        if self.is_gated:
            out = out * torch.sigmoid(qg[..., d:])
        return out.reshape(n, hq * d)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache of this layer
        rotary: RotaryTable,
        path,
        project: bool = True,  # False: the rows before o_proj (the caller projects them)
    ) -> torch.Tensor:  # [N, hidden]
        if (self.qkv_weight is not None and self.q_norm.scale is not None
                and _fused_plan(path, x)):
            out = self._fused_rows(x, positions, meta, kv, rotary, path)
            return self.o_proj(out) if project else out
        n = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x)
        if self.is_gated:  # per head: [q (d) | gate (d)]
            q, gate = qg.view(n, hq, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(n, hq * d)
        else:
            q, gate = qg.view(n, hq, d), None
        q = self.q_norm(q.contiguous())
        k = self.k_norm(self.k_proj(x).view(n, hk, d))
        v = self.v_proj(x).view(n, hk, d)
        q, k = rotary(q, k, positions)
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        out = attend_rows(q, kv[0], kv[1], meta, self.scale, path).reshape(n, hq * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out) if project else out


def freeze_constants(module: nn.Module) -> None:
    """Freeze every submodule's weight-derived constants (``OffsetRMSNorm.freeze``,
    ``GatedDeltaNet.freeze``): the values each forward computed from the weights, computed once
    where the weights now live; routed layers stack their experts (``RoutedMoE.stack_experts``:
    at the build, not in the first captured graph's warm-up); under the fused plan (the path
    bound before this call, :func:`_fused_plan`) the dense MLPs interleave gate / up
    (``SwiGLU.interleave``, :meth:`HybridLayer.mlp_to_next`), the linear layers concatenate
    their projections (``GatedDeltaNet.concat_projections``) and the attention layers their
    q/k/v (``GatedAttention.concat_qkv``). Call after the weights are loaded
    and moved; they must not change afterwards."""
    for m in module.modules():
        if isinstance(m, (OffsetRMSNorm, GatedDeltaNet)):
            m.freeze()
        elif isinstance(m, RoutedMoE):
            m.stack_experts()
        elif (isinstance(m, HybridLayer) and isinstance(m.mlp, SwiGLU)
              and _fused_plan(m.input_layernorm.path, m.mlp.gate_proj.weight)):
            m.mlp.interleave()  # the fused plan's gate/up GEMV (the bound path's)
        if isinstance(m, GatedDeltaNet) and _fused_plan(m.path, m.A_log):
            m.concat_projections()  # the fused plan's one projection GEMV
        if (isinstance(m, HybridLayer) and not m.has_state
                and _fused_plan(m.input_layernorm.path, m.self_attn.q_proj.weight)):
            m.self_attn.concat_qkv()  # the fused plan's q/k/v GEMV


class HybridLayer(nn.Module):
    """Pre-norm layer: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``; the mixer by type."""

    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        b = cfg.base
        self.kind = cfg.layer_types[index]
        attr, self.has_state = TOKEN_MIXERS[self.kind]
        mixer = (GatedDeltaNet(b.hidden_size, cfg.linear, b.rms_norm_eps) if self.has_state
                 else GatedAttention(cfg))
        setattr(self, attr, mixer)
        self.mixer = attr
        self.input_layernorm = OffsetRMSNorm(b.hidden_size, b.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(b.hidden_size, b.rms_norm_eps)
        if cfg.moe is not None and cfg.moe.is_sparse(index):
            self.mlp = RoutedMoE(b.hidden_size, cfg.moe)
        else:
            self.mlp = SwiGLU(b.hidden_size, b.intermediate_size)

    @property
    def out_proj(self) -> nn.Linear:
        """The mixer's output projection (``o_proj`` / ``out_proj``)."""
        mixer = getattr(self, self.mixer)
        return mixer.out_proj if self.has_state else mixer.o_proj

    def fuses_out(self, h: torch.Tensor, path) -> bool:
        """Whether the fused path projects the mixer's rows in one GEMV that adds into ``h``
        and writes the post-attention norm (:meth:`out_to_norm`): frozen norm, no bias,
        decode / verify rows."""
        return (_fused_plan(path, h) and h.shape[0] <= SKINNY_ROWS and h.is_contiguous()
                and self.post_attention_layernorm.scale is not None
                and self.out_proj.bias is None)

    def out_to_norm(self, o: torch.Tensor,  # [N, heads * head_dim]: the mixer's rows
                    h: torch.Tensor, path) -> torch.Tensor:  # [N, hidden]: normed
        """``h += out_proj(o)`` and the post-attention norm of the sum in one GEMV launch."""
        norm = self.post_attention_layernorm
        xn = torch.empty_like(h)
        ops.linear(o.contiguous(), self.out_proj.weight, residual=h,
                   norm=(norm.scale, norm.eps, xn), tune=path.kernels)
        return xn

    def mlp_to_next(self, xn: torch.Tensor,  # [N, hidden]: the post-attention normed rows
                    h: torch.Tensor,  # [N, hidden]: the residual stream, updated in place
                    next_norm: OffsetRMSNorm,
                    path) -> torch.Tensor | None:  # [N, hidden]: the next norm's output
        """The dense MLP on the fused path in two GEMV launches: gate/up with the SwiGLU
        epilogue, then down adding into ``h`` with ``next_norm`` (the next layer's input norm,
        or the final norm) in the same launch. None where the per-op path serves: a routed
        MLP, weights not interleaved (``freeze_constants``), the norm not frozen, rows past the
        GEMV's range (prefill chunks), not the fused path."""
        mlp = self.mlp
        if (not isinstance(mlp, SwiGLU) or mlp.gate_up_weight is None or next_norm.scale is None
                or not _fused_plan(path, xn) or xn.shape[0] > SKINNY_ROWS
                or not h.is_contiguous()):
            return None
        act = ops.linear(xn.contiguous(), mlp.gate_up_weight, epilogue="silu_mul",
                         tune=path.kernels)
        out = torch.empty_like(h)
        ops.linear(act, mlp.down_proj.weight, residual=h,
                   norm=(next_norm.scale, next_norm.eps, out), tune=path.kernels)
        return out


class _Body(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        b = cfg.base
        self.embed_tokens = nn.Embedding(b.vocab_size, b.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(b.num_hidden_layers))
        self.norm = OffsetRMSNorm(b.hidden_size, b.rms_norm_eps)


class HybridModel(PathBound, nn.Module):
    """Hybrid decoder-only LM: gated delta-net and gated full-attention layers by descriptor."""

    def __init__(self, cfg: HybridConfig, max_positions: int, max_model_len: int):
        super().__init__()
        self._init_path()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.base.hidden_size, cfg.base.vocab_size, bias=False)
        if cfg.base.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(cfg.base, max_positions, max_model_len)
        # verification rows are a causal chunk; the in-graph update's packed rows reach the
        # recurrence through the grid map the state strategy derives from cu_q_lens
        self.capabilities = ModelCapabilities(requires_causal_chunked_prefill=True,
                                              supports_in_graph_input_update=True,
                                              has_recurrent_state=True)

    @property
    def num_state_layers(self) -> int:
        return sum(layer.has_state for layer in self.model.layers)

    @property
    def num_kv_layers(self) -> int:
        return len(self.model.layers) - self.num_state_layers

    def linear_mixers(self) -> list[GatedDeltaNet]:
        """The linear layers' token mixers, in layer order (one per ``LinearState`` pair)."""
        return [getattr(layer, layer.mixer) for layer in self.model.layers if layer.has_state]

    def new_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> LinearState:
        """Zeroed state rows for ``num_slots`` request slots (plus any scratch rows)."""
        return LinearState(self.num_state_layers, num_slots, self.config.linear, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, N = B * R request-major
        positions: torch.Tensor,  # [N] int64
        attn_meta: AttnMeta,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one per full-attention layer
        state_meta: StateMeta,
        state: LinearState,
    ) -> torch.Tensor:  # [N, hidden], after the final norm
        if kv_caches:  # the rows of requests, for the routed layers (none without a KV layer)
            bind_real_rows(self, attn_meta.slot_mapping, kv_caches[0][0].shape[1])
        h = self.model.embed_tokens(input_ids)
        kv_iter, state_iter = iter(kv_caches), iter(state.layers)
        snap_iter = iter(state_meta.snapshots) if state_meta.snapshots is not None else None
        saves = state_meta.replay_saves
        save_iter = iter(saves) if saves is not None else None
        rows = state_meta.row_index
        if rows is not None:  # flat rows <-> the [B, R] grid: one gather each way per layer
            num_grid = state_meta.read_slots.shape[0] * state_meta.num_q_rows
            to_grid = state_meta.grid_source
            if to_grid is None:  # a StateMeta built without it (the strategies give it)
                to_grid = grid_sources(rows, torch.arange(rows.shape[0], device=rows.device),
                                       rows.new_empty(num_grid + 1))
            # padding rows (the trash cell) read the last cell's row: finite, dropped later
            to_flat = rows.clamp(max=num_grid - 1)
        layers = self.model.layers
        pending = None  # the last MLP's output: the next norm adds it into h (one launch fused)
        ready = None  # or the next norm's output, written by the fused MLP's down projection
        for i, layer in enumerate(layers):
            norm = layer.input_layernorm
            x = (ready if ready is not None else norm(h) if pending is None
                 else norm.add_norm(pending, h))
            mixer = getattr(layer, layer.mixer)
            project = not layer.fuses_out(h, self.path)  # else out_to_norm projects
            if layer.has_state:
                snap = next(snap_iter) if snap_iter is not None else None
                save = next(save_iter) if save_iter is not None else None
                if rows is None:
                    x = mixer(x, state_meta, next(state_iter), snap, save, project=project)
                else:  # flat rows -> [B, R] grid and back
                    out = mixer(x.index_select(0, to_grid), state_meta, next(state_iter), snap,
                                save, project=project)
                    x = out.index_select(0, to_flat)
            else:
                x = mixer(x, positions, attn_meta, next(kv_iter), self.rotary, self.path,
                          project=project)
            xn = (layer.post_attention_layernorm.add_norm(x, h) if project
                  else layer.out_to_norm(x, h, self.path))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            ready = layer.mlp_to_next(xn, h, nxt, self.path)
            pending = layer.mlp(xn) if ready is None else None
        if ready is not None:
            return ready
        return self.model.norm(h) if pending is None else self.model.norm.add_norm(pending, h)

    def fuse_weights(self) -> None:
        """Serving constants computed once (:func:`freeze_constants`): same values, fewer
        launches per forward."""
        freeze_constants(self)

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]``, float32 unless ``upcast`` is False (argmax-only); on
        the fused GEMV kernels on the fused plan, at the rows the dense model's head takes them
        (:meth:`_fused_head`)."""
        if self._fused_head(hidden):
            out = ops.linear(hidden.contiguous(), self.lm_head.weight, tune=self.kx)
        else:
            out = self.lm_head(hidden)
        return out.float() if upcast else out

    def _fused_head(self, hidden: torch.Tensor) -> bool:  # hidden [N, hidden]
        """The LM head on the fused GEMV kernels: the fused plan (:func:`_fused_plan`) and the
        rows the dense model's head takes them at (``model.fused_head``)."""
        return _fused_plan(self.path, hidden) and fused_head(hidden, self.path)

    def argmax_partials(self, hidden: torch.Tensor,  # [N, hidden]
                        keys: torch.Tensor | None = None):  # as TargetModel.argmax_partials
        """Each row's argmax for ``ops.verify_accept``, as the dense model's
        (``TargetModel.argmax_partials``): on the fused kernels the LM head GEMV's packed keys
        (``keys`` given) or per-tile partials, no logits written; else ``[N]`` tokens from
        :meth:`logits`."""
        if self._fused_head(hidden):
            return ops.linear_argmax(hidden.contiguous(), self.lm_head.weight, keys=keys,
                                     tune=self.kx)
        return self.logits(hidden, upcast=False).argmax(dim=-1)


class HybridMTPHead(PathBound, nn.Module):
    """The MTP head of a hybrid target (``qwen3_5_mtp``): one depth, run ``k`` times.

    ``h' = layer(proj(cat(order of [embed_norm(embed(token)), hidden_norm(hidden)])))`` with
    the target's embedding, then ``normed = final_norm(h')`` and logits through the target's LM
    head; ``layer`` is a full-attention layer of this module (gated attention, q/k norm,
    partial rotary; a dense SwiGLU, or the routed MoE when the checkpoint's head keys name a
    router), every norm zero-centred. The head keeps its own paged KV layer. Same calling
    convention as ``speccal.runner.mtp.MTPHead``; parameter names map to checkpoint keys
    through the family descriptor (:meth:`param_key_map`).
    """

    def __init__(self, cfg: HybridConfig, family: DraftFamily):
        super().__init__()
        self._init_path()
        b = cfg.base
        h = b.hidden_size
        self.family = family
        self.embed_norm = OffsetRMSNorm(h, b.rms_norm_eps)
        self.hidden_norm = OffsetRMSNorm(h, b.rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        moe = None if cfg.moe is None else dataclasses.replace(cfg.moe, sparse_layers=(0,))
        one = dataclasses.replace(b, num_hidden_layers=1, moe=moe)
        self.layer = HybridLayer(dataclasses.replace(cfg, base=one, layer_types=(
            "full_attention",), moe=moe), 0)
        self.final_norm = OffsetRMSNorm(h, b.rms_norm_eps)

    def forward(
        self,
        target: HybridModel,
        hidden: torch.Tensor,  # [N, hidden]: target hidden (or this head's previous output)
        input_ids: torch.Tensor,  # [N] int64: the token after the hidden's position
        positions: torch.Tensor,  # [N] int64: the hidden's position
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # feedback [N, hidden], normed [N, hidden]
        bind_real_rows(self, meta.slot_mapping, kv[0].shape[1])
        e = self.embed_norm(target.model.embed_tokens(input_ids))
        parts = {"embed": e, "hidden": self.hidden_norm(hidden)}
        x = self.proj(torch.cat([parts[name] for name in self.family.concat_order], dim=-1))
        layer = self.layer
        project = not layer.fuses_out(x, self.path)
        a = layer.self_attn(layer.input_layernorm(x), positions, meta, kv, target.rotary,
                            self.path, project=project)
        xn = (layer.post_attention_layernorm.add_norm(a, x) if project  # x += a
              else layer.out_to_norm(a, x, self.path))
        normed = layer.mlp_to_next(xn, x, self.final_norm, self.path)  # x += mlp, fused
        if normed is None:
            normed = self.final_norm.add_norm(layer.mlp(xn), x)  # x += m
        return (normed if self.family.is_feedback_normed else x), normed

    def fuse_weights(self) -> None:
        """As :meth:`HybridModel.fuse_weights`, for the head's own modules."""
        freeze_constants(self)

    def logits(self, target: HybridModel, normed: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 through the target's LM head
        (:meth:`HybridModel.logits`: the fused GEMV where it applies)."""
        return target.logits(normed)

    def param_key_map(self, num_target_layers: int) -> dict[str, str]:
        """Module parameter name -> checkpoint key, from the family descriptor."""
        fam = self.family
        stems = {"embed_norm": fam.embed_norm, "hidden_norm": fam.hidden_norm,
                 "proj": fam.proj, "final_norm": fam.final_norm}
        out = {}
        for name, _ in self.named_parameters():
            first, _, rest = name.partition(".")
            key_stem = rest if first == "layer" else f"{stems[first]}.{rest}"
            out[name] = fam.key_for(key_stem, num_target_layers)
        return out
