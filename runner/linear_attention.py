"""Gated delta-net linear attention (Qwen3.5 / Qwen3-Next): the math, the layer, its state.

This module owns the recurrent token mixer of hybrid targets: the causal depthwise conv1d over
the fused ``q, k, v`` channels and the gated delta rule (Yang et al., "Gated Delta Networks"),
in pure torch, following transformers' torch fallbacks (``modeling_qwen3_5.py``), which are the
ground truth of the tests; the decode / verify math (conv1d, its per-row windows, the
recurrence, the gated norm) lives in ``speccal.kernels.reference``, as the references of the
fused kernels, and is imported here. The chunked delta rule of prefill stays here. On CUDA
the field's kernels (``flash-linear-attention``, ``causal-conv1d``; the ``hybrid`` extra) are
the intended path: :func:`cuda_kernels` imports them lazily and refuses clearly when absent;
the CPU path never imports them.

State layout (one row per request slot, the InfiniLM seed's "state rows"), per linear layer:

- ``conv_state [num_slots, conv_dim, conv_kernel - 1]``: the last ``kernel - 1`` conv inputs;
- ``ssm_state [num_slots, num_v_heads, head_k_dim, head_v_dim]`` float32: the delta-rule memory.

A forward runs on ``B`` requests of ``R`` rows each, flat and request-major (``N = B * R``), as
one prefill chunk (``B = 1``) or a decode / verify step (``R = 1 .. w + 1``). :class:`StateMeta`
says which slot each request *reads* its committed state from and which slot it *writes* the
new state to (equal for plain decoding; a scratch slot for speculative verification, so the
committed state survives rejection), how many of its rows are real (``num_valid``; trailing rows
are padding and leave the state untouched: zero decay, zero write strength), and optionally
where to store per-row snapshots (the state after each row: into per-layer buffers, or in
place into state rows, ``StateMeta.snapshot_rows``). Those are the primitives the state
strategies (``speccal.runner.hybrid_state``) build on; the strategies themselves live there.
Decode / verify forwards are static-shape torch code (masks, gathers, ``index_copy_``) and
``fla`` calls, captured in CUDA graphs (split graph mode; the H200 tests compare them with the
eager rounds token for token). Under ``KernelConfig.linear_attention.impl == "fused"``
(issue 38; ``fla`` is the default until validated on the H200) they are three
``speccal.kernels.ops`` launches per layer instead, for both state strategies: ``conv_update``
(conv1d + SiLU, the new window into the write slot, every row's window into the snapshots),
``delta_rule_verify`` (q/k l2norm in the kernel, the state read once and written once, every
row's state into the snapshots in the same launch) and ``rmsnorm_gated``; the scratch
strategy's :meth:`GatedDeltaNet.replay` takes the first two. Prefill stays chunked.

Written by hand rather than taken from ``fla``: the causal conv1d (``F.conv1d`` over the
concatenated ``[state | rows]``, any device: at decode / verify it is a few small ops, and its
state layout, the last ``K - 1`` inputs, is transformers'; ``fla``'s conv keeps ``K`` columns
of state and was not validated here), the per-position stores of the ``snapshots`` strategy
(``fla``'s fused recurrent kernel returns only the final state, so on the ``fla`` path it runs
once per row: :func:`_fla_delta_rule_per_row`; the fused path's ``delta_rule_verify`` stores
every row's state in one launch), and the CPU reference of both delta-rule forms (the ground
truth of the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speccal.base.errors import UnsupportedError
from speccal.kernels import ops
from speccal.kernels.reference import (
    causal_conv1d,
    conv_windows,
    delta_rule_inputs,
    recurrent_gated_delta_rule,
    rmsnorm_gated_ref,
    store_snapshot,
)
from speccal.runner.layers import SKINNY_ROWS
from speccal.runner.moe import concat_rows
from speccal.runner.path import PathBound

CHUNK_SIZE = 64  # the chunked delta rule's block length (transformers' and fla's default)


def cuda_kernels():
    """The ``fla`` delta-rule kernels for CUDA tensors, imported lazily (the ``hybrid`` extra).

    Returns
    -------
    (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from ``fla.ops.gated_delta_rule``.

    Raises
    ------
    UnsupportedError
        When ``flash-linear-attention`` is not installed.
    """
    try:
        from fla.ops.gated_delta_rule import (  # lazy: optional CUDA-only dependency
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError as exc:
        raise UnsupportedError(
            "hybrid linear-attention targets on CUDA need flash-linear-attention "
            "(pip install 'speccal[hybrid]'); the pure-torch path serves CPU only"
        ) from exc
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, R, Hk, Dk]
    k: torch.Tensor,  # [B, R, Hk, Dk]
    v: torch.Tensor,  # [B, R, Hv, Dv]
    g: torch.Tensor,  # [B, R, Hv]
    beta: torch.Tensor,  # [B, R, Hv]
    state: torch.Tensor,  # [B, Hv, Dk, Dv] float32 initial state
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, R, Hv, Dv], final state [B, Hv, Dk, Dv]
    """The gated delta rule in blocks of ``chunk_size`` (prefill): within a block the delta
    updates are condensed by a unit-lower-triangular solve (the WY / UT transform), across blocks
    the state is carried sequentially. Same result as :func:`recurrent_gated_delta_rule`."""
    dtype = q.dtype
    q, k, v, g, beta = delta_rule_inputs(q, k, v, g, beta)
    num_b, hv, length, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    num_c = (length + pad) // chunk_size
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(num_b, hv, num_c, chunk_size, -1) for t in
                            (q, k, k_beta, v_beta))
    cum = g.reshape(num_b, hv, num_c, chunk_size).cumsum(dim=-1)  # [B, Hv, C, L]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [B, Hv, C, L, L], unit diagonal implied
    intra = (q @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0)
    eye = torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system + eye, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]  # [B, Hv, C, 1, 1]
    s = state.float()
    out = torch.empty(num_b, hv, num_c, chunk_size, dv, dtype=s.dtype, device=s.device)
    for c in range(num_c):
        v_new = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q[:, :, c] @ s + intra[:, :, c] @ v_new
        s = s * block_decay[:, :, c] + k[:, :, c].transpose(-1, -2) @ v_new
    out = out.reshape(num_b, hv, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(dtype), s


class RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(z)`` per value head (normalise first, then gate;
    ``speccal.kernels.reference.rmsnorm_gated_ref``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., dim] each
        return rmsnorm_gated_ref(x, z, self.weight, self.eps)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shapes of one gated delta-net layer (``linear_*`` fields of the HF config).

    ``is_grouped_projection``: the checkpoint fuses ``q, k, v, z`` (and ``b, a``) per key-head
    group into ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next); otherwise they are separate
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5). Read from the
    checkpoint's tensor names, never from a model name.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    is_grouped_projection: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class StateMeta:
    """Which state rows a forward over ``B`` requests of ``R`` rows reads and writes."""

    read_slots: torch.Tensor  # [B] int64: committed state rows
    write_slots: torch.Tensor | None  # [B] int64: where the new state goes (== read for plain
    # decode, a scratch row for verification); None: not written (the per-position strategy
    # keeps only the snapshots)
    num_q_rows: int  # R
    num_valid: torch.Tensor | None = None  # [B] int64 real rows (None: all R)
    is_chunked: bool = False  # use the chunked delta rule (prefill) instead of the recurrence
    # per-row snapshots (per-position strategy), one pair per linear layer in layer order:
    # (conv [B, R, C, K-1], ssm [B, R, Hv, Dk, Dv]); see LinearState.snapshot_buffers
    snapshots: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # or, in place: [B, R] int64 state rows (every layer's) that take the state after each row
    snapshot_rows: torch.Tensor | None = None
    # the layers' inputs kept for a replay of a prefix (GatedDeltaNet.replay), one tuple per
    # linear layer in layer order (ReplaySaves.views): (conv input [B, R, C], conv output
    # [B, R, C], g [B, R, Hv] fp32, beta [B, R, Hv] the model's dtype), written by the forward
    replay_saves: list[tuple[torch.Tensor, ...]] | None = None
    # flat rows -> the [B, R] grid: [N] int64 into B * R (+1 trash row for padding rows), the
    # layout of AttnMeta.row_index; None: the N rows already are the grid (N = B * R)
    row_index: torch.Tensor | None = None
    # its inverse: [B * R] int64, the flat row of each grid cell (cells past a request's rows:
    # row 0, any finite row: the kernels mask past num_valid and their outputs are dropped);
    # None: derived by the forward from row_index
    grid_source: torch.Tensor | None = None


def grid_sources(row_index: torch.Tensor,  # [N] int64: each flat row's grid cell (+1 trash)
                 iota: torch.Tensor,  # [N] int64: 0 .. N - 1
                 cells: torch.Tensor,  # [B * R + 1] int64, written
                 ) -> torch.Tensor:  # [B * R]: StateMeta.grid_source, a view of ``cells``
    """The inverse of ``row_index``: each grid cell's flat row, cells no row fills (and the
    trash cell) row 0. Two launches into ``cells`` (a static buffer: no allocation)."""
    cells.zero_()
    cells.index_copy_(0, row_index, iota)
    return cells[:-1]


class GatedDeltaNet(PathBound, nn.Module):
    """One linear-attention token mixer with HF parameter names (``linear_attn.*``).

    Decode / verify (not chunked) under ``path.kernels.linear_attention.impl == "fused"`` run
    :meth:`_forward_fused`: four ``speccal.kernels.ops`` launches around the projections (the
    gates, the conv step, the delta rule, the gated norm; the Triton kernels on CUDA or under
    Triton's interpreter, their torch references elsewhere);
    otherwise the torch ops and ``fla`` calls below (the default)."""

    def __init__(self, hidden_size: int, cfg: LinearAttentionConfig, eps: float):
        super().__init__()
        self._init_path()
        self.cfg = cfg
        c = cfg
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim,
                                bias=False, padding=c.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(c.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_v_heads))
        self.decay: torch.Tensor | None = None  # -exp(A_log) in float32 once frozen
        self.proj_weight: torch.Tensor | None = None  # concat_projections (fused path)
        self.norm = RMSNormGated(c.head_v_dim, eps)
        self.out_proj = nn.Linear(c.value_dim, hidden_size, bias=False)
        if c.is_grouped_projection:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * c.key_dim + 2 * c.value_dim,
                                          bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * c.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, c.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, c.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, c.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, c.num_v_heads, bias=False)

    @torch.no_grad()
    def freeze(self) -> None:
        """Keep ``-exp(A_log)`` in float32 for serving (the values each forward computed: three
        launches fewer per call); ``A_log`` must not change afterwards. A second freeze keeps
        the first tensor (captured graphs of an engine sharing these weights read it)."""
        if self.decay is None:
            self.decay = -self.A_log.float().exp()

    @torch.no_grad()
    def concat_projections(self) -> None:
        """Qwen3.5's separate layout: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a`` become row views of one ``proj_weight [conv_dim + value_dim + 2 Hv,
        hidden]`` (no second copy), which the fused path's decode / verify rows project through
        in one GEMV (:meth:`_project`). The grouped layout (Qwen3-Next) is left as it is (its
        rows would need a permuted copy)."""
        if self.cfg.is_grouped_projection or self.proj_weight is not None:
            return
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        self.proj_weight = concat_rows([p.weight for p in parts])

    def _project(self, x: torch.Tensor, fused: bool = False):  # x [N, hidden]
        """``(qkv [N, conv_dim], z [N, Hv, Dv], b [N, Hv], a [N, Hv])`` from either layout;
        ``fused`` (the fused path's decode / verify rows): one GEMV through ``proj_weight``
        where :meth:`concat_projections` built it, the four results strided views of its
        output."""
        c = self.cfg
        if fused and self.proj_weight is not None and x.shape[0] <= SKINNY_ROWS:
            y = ops.linear(x.contiguous(), self.proj_weight, tune=self.kx)
            n, o1 = x.shape[0], c.conv_dim
            o2 = o1 + c.value_dim
            o3 = o2 + c.num_v_heads
            return (y[:, :o1], y[:, o1:o2].view(n, c.num_v_heads, c.head_v_dim), y[:, o2:o3],
                    y[:, o3:])
        n = x.shape[0]
        if not c.is_grouped_projection:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(n, c.num_v_heads, c.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        per = c.num_v_heads // c.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, c.num_k_heads, -1)  # per key-head group
        q, k, v, z = qkvz.split([c.head_k_dim, c.head_k_dim, per * c.head_v_dim,
                                 per * c.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(n, c.num_k_heads, 2 * per).split([per, per], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return (qkv, z.reshape(n, c.num_v_heads, c.head_v_dim), b.reshape(n, -1),
                a.reshape(n, -1))

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden], N = B * R request-major
        meta: StateMeta,
        state: tuple[torch.Tensor, torch.Tensor],  # conv [S, C, K-1], ssm [S, Hv, Dk, Dv]
        snapshot: tuple[torch.Tensor, torch.Tensor] | None = None,  # this layer's pair of
        # StateMeta.snapshots: (conv [B, R, C, K-1], ssm [B, R, Hv, Dk, Dv]), written
        save: tuple[torch.Tensor, ...] | None = None,  # this layer's StateMeta.replay_saves
        project: bool = True,  # False: the rows before out_proj [N, value_dim] (the caller
        # projects them: the hybrid layer's fused output GEMV)
    ) -> torch.Tensor:  # [N, hidden]
        c = self.cfg
        num_r = meta.num_q_rows
        num_b = x.shape[0] // num_r
        conv_state, ssm_state = state
        fused = self.kx.linear_attention.is_fused and not meta.is_chunked
        qkv, z, b, a = self._project(x, fused=fused and self.path.fused(x))
        decay = self.decay if self.decay is not None else -self.A_log.float().exp()
        if fused:  # the gates (one launch) into the replay's saves where there are
            out = (save[2].view(-1, c.num_v_heads), save[3].view(-1, c.num_v_heads)) if (
                save is not None) else None
            g, beta = ops.gated_decay(a, b, self.dt_bias, decay, out=out, tune=self.kx)
            out = self._forward_fused(qkv.view(num_b, num_r, c.conv_dim), g, beta, meta, state,
                                      snapshot, save)
            out = ops.rmsnorm_gated(out.view(-1, c.head_v_dim), z, self.norm.weight,
                                    self.norm.eps, tune=self.kx)
            out = out.view(x.shape[0], c.value_dim)
            return self.out_proj(out) if project else out
        beta = b.sigmoid()
        g = decay * F.softplus(a.float() + self.dt_bias)  # [N, Hv]
        if meta.num_valid is not None:  # padding rows: no decay, no write
            is_real = (torch.arange(num_r, device=x.device)[None, :]
                       < meta.num_valid[:, None]).reshape(-1, 1)
            beta = beta * is_real
            g = g * is_real
        qkv = qkv.view(num_b, num_r, c.conv_dim).transpose(1, 2)  # [B, C, R]
        conv_in = conv_state[meta.read_slots]
        mixed, new_conv = causal_conv1d(qkv, conv_in, self.conv1d.weight.squeeze(1),
                                        meta.num_valid)
        if snapshot is not None:
            snapshot[0].copy_(conv_windows(qkv, conv_in))
        rows = meta.snapshot_rows
        if rows is not None:
            windows = conv_windows(qkv, conv_in).reshape(-1, *conv_state.shape[1:])
            conv_state.index_copy_(0, rows.reshape(-1), windows.to(conv_state.dtype))
        mixed = mixed.transpose(1, 2)  # [B, R, C]
        if save is not None:  # qkv is [B, C, R] here
            for buf, src in zip(save, (qkv.transpose(1, 2), mixed, g.view(num_b, num_r, -1),
                                       beta.view(num_b, num_r, -1)), strict=True):
                buf.copy_(src)
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(num_b, num_r, c.num_k_heads, c.head_k_dim)
        k = k.reshape(num_b, num_r, c.num_k_heads, c.head_k_dim)
        v = v.reshape(num_b, num_r, c.num_v_heads, c.head_v_dim)
        g = g.view(num_b, num_r, -1)
        beta = beta.view(num_b, num_r, -1)
        s0 = ssm_state[meta.read_slots]
        per_row = snapshot is not None or rows is not None  # the recurrence, row by row
        snap = snapshot[1] if snapshot is not None else None
        pool = (ssm_state, rows) if rows is not None else None
        if x.is_cuda and per_row:  # fla's recurrent kernel one row at a time (snapshots)
            out, s = _fla_delta_rule_per_row(q, k, v, g, beta, s0, snap, pool)
        elif x.is_cuda:  # fla's kernels
            out, s = _fla_delta_rule(q, k, v, g, beta, s0, meta.is_chunked)
        elif meta.is_chunked and not per_row:
            out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
        else:
            out, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0, snap, pool)
        if meta.write_slots is not None:
            conv_state.index_copy_(0, meta.write_slots, new_conv.to(conv_state.dtype))
            ssm_state.index_copy_(0, meta.write_slots, s.to(ssm_state.dtype))
        out = self.norm(out.reshape(-1, c.head_v_dim), z.reshape(-1, c.head_v_dim))
        out = out.view(x.shape[0], c.value_dim)
        return self.out_proj(out) if project else out


    def _forward_fused(
        self,
        qkv: torch.Tensor,  # [B, R, conv_dim]
        g: torch.Tensor,  # [N, Hv] float32, not masked (the kernels mask past num_valid)
        beta: torch.Tensor,  # [N, Hv]
        meta: StateMeta,
        state: tuple[torch.Tensor, torch.Tensor],
        snapshot: tuple[torch.Tensor, torch.Tensor] | None,
        save: tuple[torch.Tensor, ...] | None,
    ) -> torch.Tensor:  # [B, R, Hv, Dv] the delta rule's output, before the gated norm
        """The conv step and the delta rule in one ``ops`` launch each, for either state
        strategy: the final state into ``meta.write_slots``, every row's state into the
        snapshot buffers / ``meta.snapshot_rows`` in the same launches. The replay saves hold
        ``g`` and ``beta`` unmasked (the replay masks past its own, shorter prefix)."""
        num_b, num_r, _ = qkv.shape
        conv_state, ssm_state = state
        snap_conv, snap_ssm = snapshot if snapshot is not None else (None, None)
        mixed = ops.conv_update(qkv, conv_state, self.conv1d.weight.squeeze(1), meta.read_slots,
                                meta.write_slots, num_valid=meta.num_valid, snapshots=snap_conv,
                                snapshot_rows=meta.snapshot_rows,
                                out=save[1] if save is not None else None, tune=self.kx)
        g = g.view(num_b, num_r, -1)
        beta = beta.view(num_b, num_r, -1)
        if save is not None:  # the gates and conv outputs are written there already
            save[0].copy_(qkv)
        return self._delta_rule_fused(mixed, g, beta, ssm_state, meta.read_slots,
                                      meta.write_slots, meta.num_valid, snap_ssm,
                                      meta.snapshot_rows)

    def _delta_rule_fused(self, mixed, g, beta, ssm_state, read_slots, write_slots, num_valid,
                          snapshots=None, snapshot_rows=None):  # mixed [B, R, conv_dim]
        """``ops.delta_rule_verify`` on q / k / v read in place from the conv output."""
        c = self.cfg
        num_b, num_r, _ = mixed.shape
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        return ops.delta_rule_verify(
            q.unflatten(-1, (c.num_k_heads, c.head_k_dim)),
            k.unflatten(-1, (c.num_k_heads, c.head_k_dim)),
            v.unflatten(-1, (c.num_v_heads, c.head_v_dim)), g, beta, ssm_state, read_slots,
            write_slots, num_valid=num_valid, snapshots=snapshots, snapshot_rows=snapshot_rows,
            tune=self.kx)

    def replay(
        self,
        state: tuple[torch.Tensor, torch.Tensor],  # conv [S, C, K-1], ssm [S, Hv, Dk, Dv]
        rows: torch.Tensor,  # [B] int64: the rows the forward read; read and written here
        num_valid: torch.Tensor,  # [B] int64: rows of the prefix to replay (0: leave as is)
        save: tuple[torch.Tensor, ...],  # the forward's StateMeta.replay_saves entry
    ) -> None:
        """Advance ``rows`` over the first ``num_valid`` rows of a forward that read them,
        from the inputs it saved: the state that forward held after row ``num_valid - 1``.

        No projection, no other layer: a layer's inputs do not depend on its own state, so
        the verify's inputs of the accepted rows are the accepted prefix's. The conv state is
        the window ending at the prefix (a gather); the delta rule reruns on the saved
        post-conv rows with the rows past the prefix masked (no decay, no write).
        """
        c = self.cfg
        qkv, mixed, g, beta = save  # qkv [B, R, C]
        if self.kx.linear_attention.is_fused:  # one conv launch, one delta-rule launch
            conv_state, ssm_state = state
            ops.conv_update(qkv, conv_state, self.conv1d.weight.squeeze(1), rows, rows,
                            num_valid=num_valid, tune=self.kx)
            self._delta_rule_fused(mixed, g, beta, ssm_state, rows, rows, num_valid)
            return
        qkv = qkv.transpose(1, 2)  # [B, C, R]
        num_b, _, num_r = qkv.shape
        is_real = (torch.arange(num_r, device=qkv.device)[None, :] < num_valid[:, None])
        conv_state, ssm_state = state
        km1 = conv_state.shape[-1]
        full = torch.cat([conv_state[rows].to(qkv.dtype), qkv], dim=-1)  # [B, C, K - 1 + R]
        idx = num_valid[:, None] + torch.arange(km1, device=qkv.device)
        new_conv = full.gather(2, idx[:, None, :].expand(num_b, qkv.shape[1], km1))
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(num_b, num_r, c.num_k_heads, c.head_k_dim)
        k = k.reshape(num_b, num_r, c.num_k_heads, c.head_k_dim)
        v = v.reshape(num_b, num_r, c.num_v_heads, c.head_v_dim)
        g = g * is_real[..., None]
        beta = beta * is_real[..., None]
        s0 = ssm_state[rows]
        if qkv.is_cuda:
            _, s = _fla_delta_rule(q, k, v, g, beta, s0, False)
        else:
            _, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
        conv_state.index_copy_(0, rows, new_conv.to(conv_state.dtype))
        ssm_state.index_copy_(0, rows, s.to(ssm_state.dtype))


def _fla_delta_rule(q, k, v, g, beta, state, is_chunked):  # shapes as the torch functions
    """The delta rule through ``fla`` (CUDA): same inputs and outputs as the torch functions;
    q/k heads are repeated to the value heads first (grouped value attention), as transformers
    does before calling the kernel."""
    chunk, recurrent = cuda_kernels()
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    fn = chunk if is_chunked else recurrent
    # the kernels index [B, T, H, D] from the shape: dense layouts (q / k / v are split views)
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta.to(q.dtype)))
    out, final = fn(q, k, v, g=g.float().contiguous(), beta=beta,
                    initial_state=state.float().contiguous(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return out.to(q.dtype), final


def _fla_delta_rule_per_row(q, k, v, g, beta, state, snapshots, snapshot_rows):
    """The snapshot strategy's recurrence on CUDA: ``fla``'s fused recurrent kernel once per
    row (``T = 1``), each call starting from the previous row's final state, which is stored
    after every row as :func:`recurrent_gated_delta_rule` stores it.

    One call per row because the fused kernel returns only the state after its last row. Row
    by row through the same kernel that plain decoding runs (one row per call, float32 state
    in and out, no rounding between calls), a verified row computes exactly what the plain
    step computes for that token; the torch recurrence (the CPU path) rounds differently, and
    on the H200 the snapshot strategy's K = 1 greedy left plain greedy at token 35 of 48 with
    it (bf16, qwen3.5-2b preset).
    """
    outs = []
    s = state
    for i in range(q.shape[1]):
        o, s = _fla_delta_rule(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                               beta[:, i:i + 1], s, False)
        outs.append(o)
        store_snapshot(i, s, snapshots, snapshot_rows)
    return torch.cat(outs, dim=1), s


class ReplaySaves:
    """What a verify forward keeps for a replay of an accepted prefix
    (:meth:`GatedDeltaNet.replay`), per linear layer: the conv inputs and outputs
    ``[B, R, C]`` (the model's dtype), ``g [B, R, Hv]`` (float32) and ``beta [B, R, Hv]`` (the
    model's dtype, as the forward used it). Flat storage for the largest round; :meth:`views`
    gives a round's ``[bcap, r]`` views, contiguous (the fused gates, ``ops.gated_decay``, and
    conv step, ``ops.conv_update``, write into them directly: no copies)."""

    def __init__(self, num_layers: int, max_cells: int, cfg: LinearAttentionConfig,
                 dtype: torch.dtype, device: torch.device):
        c, hv = cfg.conv_dim, cfg.num_v_heads
        self.widths = (c, c, hv, hv)
        dtypes = (dtype, dtype, torch.float32, dtype)
        self.flat = [tuple(torch.zeros(max_cells * w, dtype=dt, device=device)
                           for w, dt in zip(self.widths, dtypes, strict=True))
                     for _ in range(num_layers)]

    def views(self, bcap: int, r: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer ``(conv_in, conv_out, g, beta)``, each ``[bcap, r, width]`` contiguous."""
        n = bcap * r
        return [tuple(t[: n * w].view(bcap, r, w) for t, w in zip(layer, self.widths, strict=True))
                for layer in self.flat]

    def bytes_per_cell(self) -> int:
        """Bytes one request row of one round saves over every layer."""
        return sum(t.element_size() * w for layer in self.flat
                   for t, w in zip(layer, self.widths, strict=True))


class LinearState:
    """State rows of every linear layer: ``conv [S, C, K-1]`` and ``ssm [S, Hv, Dk, Dv]``.

    Row primitives the speculation strategies need: :meth:`copy_rows` (commit a scratch row, or
    seed a scratch row from the committed one), :meth:`snapshot` / :meth:`restore` (take and put
    back a copy of some rows), :meth:`reset_rows` (a new request starts from zeros).
    """

    def __init__(self, num_layers: int, num_slots: int, cfg: LinearAttentionConfig,
                 dtype: torch.dtype, device: torch.device):
        self.layers = [
            (torch.zeros(num_slots, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype,
                         device=device),
             torch.zeros(num_slots, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim,
                         dtype=torch.float32, device=device))
            for _ in range(num_layers)
        ]

    def replay_buffers(self, num_b: int, num_r: int, dtype: torch.dtype,
                       cfg: LinearAttentionConfig) -> ReplaySaves:
        """Zeroed :attr:`StateMeta.replay_saves` storage for up to ``B`` x ``R`` rows per
        layer."""
        return ReplaySaves(len(self.layers), num_b * num_r, cfg, dtype, self.layers[0][0].device)

    def snapshot_buffers(self, num_b: int, num_r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed per-row snapshot buffers for :attr:`StateMeta.snapshots` (``B`` x ``R``)."""
        return [(conv.new_zeros(num_b, num_r, *conv.shape[1:]),
                 ssm.new_zeros(num_b, num_r, *ssm.shape[1:])) for conv, ssm in self.layers]

    def bytes_per_slot(self) -> int:
        """State bytes one request row holds over all layers (what a copy or swap moves)."""
        return sum(t[0].element_size() * t.numel() // t.shape[0]
                   for layer in self.layers for t in layer)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # [M] int64 each
        for conv, ssm in self.layers:
            conv.index_copy_(0, dst, conv[src])
            ssm.index_copy_(0, dst, ssm[src])

    def snapshot(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(conv[rows].clone(), ssm[rows].clone()) for conv, ssm in self.layers]

    def restore(self, rows: torch.Tensor, snap: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (conv, ssm), (c, s) in zip(self.layers, snap, strict=True):
            conv.index_copy_(0, rows, c)
            ssm.index_copy_(0, rows, s)

    def reset_rows(self, rows: torch.Tensor) -> None:  # [M] int64
        for conv, ssm in self.layers:
            conv.index_fill_(0, rows, 0)
            ssm.index_fill_(0, rows, 0)
