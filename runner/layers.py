"""Decoder building blocks of the Llama / Mistral / Qwen2 / Qwen3 / MiMo family: RMSNorm, GQA
attention, SwiGLU (or, where the config routes a layer's MLP, ``speccal.runner.moe.RoutedMoE``).

This module owns one decoder layer (:class:`DecoderLayer`) shared by the target and the MTP draft
head. Parameter names match Hugging Face checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``...), so a layer's ``state_dict`` loads by prefix. Layers run on ``N`` flat
token rows ``[N, hidden]``; attention reads and writes the paged KV cache through
``speccal.runner.attention`` (layout documented there). Each module is :class:`PathBound`: it
dispatches on the engine's execution path (``self.path``: Triton ops on CUDA tensors under the
``triton`` backend, each op given ``path.kernels``) and never on process state.

Biases (``ModelConfig.is_qkv_bias`` / ``is_o_bias`` / ``is_mlp_bias``) are added after each
product; the row-parallel o and down biases after the TP reduction (once, not once per rank).
The fused decode / verify layer (:meth:`DecoderLayer.forward_fused_to_next`) adds only the q/k/v
bias: a layer with an o or MLP bias runs the per-op path (:meth:`DecoderLayer.can_fuse`). A
sliding window (``ModelConfig.sliding_windows``) is masked by the torch attention; the Triton
attention has no window, so :meth:`Attention.fuse_weights` (the engine's step into the Triton
path) refuses it naming the key.
"""

from __future__ import annotations

import torch
from torch import nn

from speccal.base.errors import UnsupportedError
from speccal.kernels import ops
from speccal.runner.attention import AttnMeta, attend_rows, write_kv
from speccal.runner.config import ModelConfig
from speccal.runner.distributed.tp import TPBound, reduce_partial
from speccal.runner.moe import RoutedMoE, concat_rows, interleave_rows
from speccal.runner.path import SKINNY_ROWS, ExecutionPath, PathBound
from speccal.runner.rope import RotaryTable


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            path: ExecutionPath) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the split-K Triton GEMV when ``path`` fuses ``x``."""
    if not path.fused(x) or x.shape[0] > SKINNY_ROWS:  # prefill chunks: cuBLAS
        return nn.functional.linear(x, weight, bias)
    y = ops.linear(x.contiguous(), weight, tune=path.kernels)
    return y if bias is None else y + bias


class RMSNorm(PathBound, nn.Module):
    """``x / rms(x) * weight``, computed in float32 as the HF models do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self._init_path()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        # a row-strided [N, dim] view (MLA's latent part of its projection) needs no copy
        if self.path.fused(x) and (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1)):
            return ops.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps,
                                   tune=self.kx).view(x.shape)
        dtype = x.dtype
        if dtype == torch.float32 and x.is_cpu:  # one op, bitwise equal to the steps below
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(TPBound, PathBound, nn.Module):
    """GQA self-attention with optional q/k/v and o biases, per-head q/k RMSNorm (before RoPE),
    an optional sliding window (``window`` keys, 0: full) and, where the config gives ``layer``
    them (``ModelConfig.swa``: MiMo-V2-Flash's sliding layers), its own KV head count, per-head
    sink logits (``attention_sink_bias``, ``[num_heads]``) and RoPE; value heads of
    ``ModelConfig.value_dim`` channels."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self._init_path()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.kv_heads(layer)
        self.head_dim = d
        self.v_head_dim = cfg.value_dim
        self.scale = d**-0.5
        self.window = cfg.window(layer)
        self.is_sliding_rope = cfg.is_swa(layer)  # RotaryTable.for_layer picks its table
        self.value_scale = cfg.value_scale  # MiMo-V2-Flash's attention_value_scale (1: none)
        dv = self.v_head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.is_qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.is_qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * dv, bias=cfg.is_qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * dv, h, bias=cfg.is_o_bias)
        # the checkpoint's name (transformers' module calls it ``sinks``)
        self.attention_sink_bias = (nn.Parameter(torch.zeros(self.num_heads))
                                    if cfg.has_sinks(layer) else None)
        if cfg.is_qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_weights (views, not copies)
        self.qkv_bias: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache of this layer
        rotary: RotaryTable,
    ) -> torch.Tensor:  # [N, hidden]
        n = x.shape[0]
        hq, hk, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        path = self.path
        rotary = rotary.for_layer(self.is_sliding_rope)
        if self.qkv_weight is not None and path.fused(x):
            qkv = linear_rows(x, self.qkv_weight, self.qkv_bias, path)  # [N, (hq + hk) d + hk dv]
            q, k, v = qkv.split([hq * d, hk * d, hk * dv], dim=-1)
            q, k, v = q.reshape(n, hq, d), k.reshape(n, hk, d), v.reshape(n, hk, dv)
        else:
            q = linear_rows(x, self.q_proj.weight, self.q_proj.bias, path).view(n, hq, d)
            k = linear_rows(x, self.k_proj.weight, self.k_proj.bias, path).view(n, hk, d)
            v = linear_rows(x, self.v_proj.weight, self.v_proj.bias, path).view(n, hk, dv)
        if self.value_scale != 1.0:  # before the cache, as transformers scales them
            v = v * self.value_scale
        if self.q_norm is not None:
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        cos_sin = rotary.cos_sin_cache if path.fused(x) else None
        if cos_sin is not None:  # rotary on q in place; rotated k and v straight into the cache
            ops.rotary_kv_write(q, k, v, positions, cos_sin, meta.slot_mapping, kv[0], kv[1],
                                   tune=path.kernels)
        else:
            q, k = rotary(q, k, positions)
            write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        out = attend_rows(q, kv[0], kv[1], meta, self.scale, path, window=self.window,
                          sinks=self.attention_sink_bias)  # [N, heads, v_head_dim]
        # row-parallel o: each TP rank's heads give a partial sum; the bias is added once
        y = reduce_partial(linear_rows(out.reshape(n, hq * dv), self.o_proj.weight, None, path),
                           self.tp)
        return y if self.o_proj.bias is None else y + self.o_proj.bias

    def fuse_weights(self) -> None:
        """Make q/k/v weights views of one ``[(hq + 2 hk) d, hidden]`` matrix (one GEMV launch).

        Called when an engine serves this layer on the Triton path, whose attention kernel has
        no sliding window, no sink logits and one head width for keys and values: such a layer
        is refused here.

        Raises
        ------
        UnsupportedError
            This layer has sink logits (``self_attn.attention_sink_bias``), value heads of
            another width (``config.json:v_head_dim``), or a sliding window
            (``config.json:sliding_window``) smaller than the engine's ``max_model_len``
            (``ModelConfig.for_context`` drops the others).
        """
        if self.attention_sink_bias is not None:
            raise UnsupportedError(
                "checkpoint tensor self_attn.attention_sink_bias: attention sinks are not in "
                "the Triton attention kernels; serve this model with attention_backend='torch'")
        if self.v_head_dim != self.head_dim:
            raise UnsupportedError(
                f"config.json:v_head_dim={self.v_head_dim}: the Triton attention kernels read "
                f"values of head_dim={self.head_dim} channels; serve this model with "
                "attention_backend='torch'")
        if self.window:
            raise UnsupportedError(
                f"config.json:sliding_window={self.window}: the Triton attention kernels have "
                "no sliding window; serve this model with attention_backend='torch', or with "
                f"max_model_len <= {self.window} (where the window holds every position)")
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = concat_rows([p.weight for p in parts])
        if self.q_proj.bias is not None:
            self.qkv_bias = concat_rows([p.bias for p in parts])


class MLP(TPBound, PathBound, nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, each product with an optional bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._init_path()
        b = cfg.is_mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_weights
        self.gate_up_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        path = self.path
        if self.gate_up_weight is not None and path.fused(x):
            # [N, 2 inter], (gate_i, up_i)
            gate_up = linear_rows(x, self.gate_up_weight, self.gate_up_bias, path)
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate = linear_rows(x, self.gate_proj.weight, self.gate_proj.bias, path)
            up = linear_rows(x, self.up_proj.weight, self.up_proj.bias, path)
        out = linear_rows(nn.functional.silu(gate) * up, self.down_proj.weight, None, path)
        out = reduce_partial(out, self.tp)  # row-parallel down: partial sums over TP ranks
        return out if self.down_proj.bias is None else out + self.down_proj.bias

    def fuse_weights(self) -> None:
        """Make gate/up weights views of one ``[2 inter, hidden]`` matrix whose rows interleave
        ``gate_i, up_i`` (the GEMV's SwiGLU epilogue finds both halves of an output in one tile);
        the parameters become row-strided views of it."""
        self.gate_up_weight = interleave_rows(self.gate_proj.weight, self.up_proj.weight)
        if self.gate_proj.bias is not None:
            self.gate_up_bias = interleave_rows(self.gate_proj.bias, self.up_proj.bias)


class DecoderLayer(PathBound, nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the MLP is the
    routed-expert one (``speccal.runner.moe.RoutedMoE``) where ``cfg`` says ``layer`` is sparse,
    else the dense SwiGLU.

    ``attention_class`` builds ``self_attn`` (GQA here; ``speccal.runner.mla.MLADecoderLayer``
    puts multi-head latent attention in its place, same call)."""

    attention_class = Attention

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self._init_path()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_sparse = cfg.is_sparse(layer)
        self.mlp = RoutedMoE(cfg.hidden_size, cfg.moe) if self.is_sparse else MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
    ) -> torch.Tensor:  # [N, hidden]
        if self.can_fuse(x, rotary):
            return self.forward_fused(x.clone(), positions, meta, kv, rotary)
        out, residual = self.forward_residual(x, None, positions, meta, kv, rotary)
        return out + residual

    def can_fuse(self, x: torch.Tensor, rotary: RotaryTable) -> bool:
        """Whether :meth:`forward_fused` serves ``x``: Triton ops on, fused weights, skinny rows,
        full rotary (the fused rotary kernel's table), no o or MLP bias (the fused layer's
        epilogues have none; such a layer runs the per-op path, which adds them), a dense MLP
        (a routed-expert layer runs the per-op path: Triton norms and attention, torch
        experts), no value scale, and the attention of a plain layer (no sink logits, values as
        wide as keys, the model's one RoPE table: :meth:`Attention.fuse_weights` refuses the
        others). Only ``x``'s device and row count are read, so the rows' token ids ``[N]``
        answer as their hidden states would."""
        attn = self.self_attn
        return (
            not self.is_sparse
            and attn.value_scale == 1.0
            and attn.attention_sink_bias is None
            and attn.v_head_dim == attn.head_dim
            and rotary.for_layer(attn.is_sliding_rope) is rotary
            and self.path.fused(x)
            and self.self_attn.o_proj.bias is None
            and self.mlp.down_proj.bias is None
            and self.self_attn.tp is None  # the fused layer has no TP reduction
            and self.mlp.tp is None
            and x.shape[0] <= SKINNY_ROWS
            and rotary.cos_sin_cache is not None
            and self.self_attn.qkv_weight is not None
            and self.mlp.gate_up_weight is not None
        )

    def forward_fused(self, h: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # h
        """:meth:`forward_fused_to_next` (same arguments), returning the residual stream ``h``
        (updated in place)."""
        self.forward_fused_to_next(h, *args, **kwargs)
        return h

    def forward_fused_to_next(
        self,
        h: torch.Tensor,  # [N, hidden] contiguous: the residual stream, updated in place
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
        fuse_rope: bool = False,
        *,
        normed=None,  # [N, hidden] input_layernorm(h), or a DeferredNorm of it; None: computed
        next_norm: tuple | None = None,  # (norm, out [N, hidden] | None: deferred)
    ):  # the next layer's input: out, a DeferredNorm (next_norm's out None), or None
        """The decode/verify layer in five to eight Triton launches (bench/KERNEL_NOTES.md).

        norm (unless ``normed`` is given), QKV GEMV, attention (split + reduce, or one launch
        where the merge folds into the split kernel; with ``fuse_rope`` and the packed layout the
        split kernel also does q/k norm + rotary + the new rows' KV write, else one more launch
        does them first), o GEMV with the residual add in its epilogue and the post-attention
        norm deferred into it and into the gate/up GEMV (``NormFusion.defer``; else a norm
        launch), gate/up GEMV with SwiGLU in its epilogue (interleaved rows), down GEMV +
        residual add (split-K reduce), which with ``next_norm`` also writes that norm of the
        result into its ``out`` (the next layer's ``normed``, or the final norm). With
        ``next_norm=(norm, None)`` that norm is deferred instead (``ops.linear_deferred_norm``:
        the down GEMV's last program per column tile adds the residual and writes ``h * weight``
        and sums of squares; the next QKV GEMV scales its rows) and returned. ``fuse_rope``
        requires ``positions`` to be the packed rows' own positions (``seq_lens - q_len + i``),
        as the target's verify/decode metadata is.
        """
        kx = self.kx
        att, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        n = h.shape[0]
        hq, hk, d = att.num_heads, att.num_kv_heads, att.head_dim
        if isinstance(normed, ops.DeferredNorm):
            qkv = ops.linear(normed.xw, att.qkv_weight, row_scale=normed, tune=kx)
        else:
            x = normed if normed is not None else ops.rms_norm(h, ln1.weight, ln1.eps, tune=kx)
            qkv = ops.linear(x, att.qkv_weight, tune=kx)  # [N, (hq + 2 hk) d]
        if att.qkv_bias is not None:
            qkv = qkv + att.qkv_bias
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(n, hq, d), k.view(n, hk, d), v.view(n, hk, d)
        qk_norm = None
        if att.q_norm is not None:
            qk_norm = (att.q_norm.weight, att.k_norm.weight, att.q_norm.eps)
        defer_post = kx.norm.defer_post  # the post-attention norm into the o / gate-up GEMVs
        signal = None
        if fuse_rope and meta.cu_q_lens is not None:  # rotary + KV write inside attention
            if defer_post:  # the o projection may start on attention's flag
                signal = ops.attention_signal(h, att.o_proj.weight, kx)
            out = ops.paged_attention(
                q, kv[0], kv[1], meta.block_table, meta.seq_lens, meta.num_q_rows, att.scale,
                cu_q_lens=meta.cu_q_lens, tiling=meta.tiling, plan=meta.plan,
                rope=(k, v, rotary.cos_sin_cache, qk_norm), meta_settled=True, signal=signal,
                successor_panel=ops.residual_panel(h, att.o_proj.weight, kx), tune=kx,
            )  # [N, hq, d]; the launch before (QKV GEMV or its bias add) writes no metadata
        else:
            q_out = torch.empty(n, hq, d, dtype=h.dtype, device=h.device)
            ops.rotary_kv_write(q, k, v, positions, rotary.cos_sin_cache, meta.slot_mapping,
                                kv[0], kv[1], q_out=q_out, qk_norm=qk_norm, tune=kx)
            out = attend_rows(q_out, kv[0], kv[1], meta, att.scale, self.path)  # [N, hq, d]
        # h was last written three launches back (the previous down reduce or, in layer 0, the
        # embedding + norm launch), so the o GEMV may read it before its PDL wait
        if defer_post:  # the norm's row factor applied in the gate/up GEMV
            dn = ops.linear_deferred_norm(out.reshape(n, hq * d), att.o_proj.weight, h,
                                          ln2.weight, ln2.eps, residual_settled=True,
                                          after=signal, tune=kx)
            act = ops.linear(dn.xw, mlp.gate_up_weight, epilogue="silu_mul", row_scale=dn,
                             tune=kx)
        else:
            ops.linear(out.reshape(n, hq * d), att.o_proj.weight, residual=h,
                       residual_settled=True, tune=kx)
            x = ops.rms_norm(h, ln2.weight, ln2.eps, tune=kx)
            act = ops.linear(x, mlp.gate_up_weight, epilogue="silu_mul", tune=kx)  # [N, inter]
        if next_norm is not None and next_norm[1] is None:
            return ops.linear_deferred_norm(act, mlp.down_proj.weight, h, next_norm[0].weight,
                                            next_norm[0].eps, tune=kx)
        nrm = None if next_norm is None else (next_norm[0].weight, next_norm[0].eps, next_norm[1])
        ops.linear(act, mlp.down_proj.weight, residual=h, norm=nrm, tune=kx)
        return None if next_norm is None else next_norm[1]

    def attend_residual_norm(
        self,
        h: torch.Tensor,  # [N, hidden]: the input norm's rows
        residual: torch.Tensor,  # [N, hidden]: the running sum, attention's output added in place
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
    ) -> torch.Tensor:  # [N, hidden]: the post-attention norm of the updated sum (the MLP's input)
        """The fused path's attention step of :meth:`forward_residual`: attention, its output
        added into ``residual`` and normed in one launch (``ops.rms_norm`` with a residual)."""
        ln2 = self.post_attention_layernorm
        a = self.self_attn(h, positions, meta, kv, rotary)
        return ops.rms_norm(a, ln2.weight, ln2.eps, residual=residual, tune=self.kx)

    def forward_residual(
        self,
        x: torch.Tensor,  # [N, hidden]: last layer's MLP output (or the embedding)
        residual: torch.Tensor | None,  # [N, hidden]: the running sum before x (None: first layer)
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output, residual); hidden = their sum
        """vLLM-style residual stream: the add of each sub-block folds into the next norm."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if self.path.fused(x):
            kx = self.kx
            if residual is None:
                residual = x.clone()
                h = ops.rms_norm(x, ln1.weight, ln1.eps, tune=kx)
            else:
                h = ops.rms_norm(x, ln1.weight, ln1.eps, residual=residual, tune=kx)  # += x
            h = self.attend_residual_norm(h, residual, positions, meta, kv, rotary)  # += attn
            return self.mlp(h), residual
        residual = x if residual is None else residual + x
        residual = residual + self.self_attn(ln1(residual), positions, meta, kv, rotary)
        return self.mlp(ln2(residual)), residual
