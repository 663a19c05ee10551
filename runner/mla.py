"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache, and the DSA indexer
(DeepSeek-V3.2's sparse attention), on the torch path.

This module owns :class:`MLAttention`, :class:`Indexer` and :class:`MLADecoderLayer` (the dense
decoder layer with MLA in place of GQA; :func:`decoder_layer` picks the class from the config).
Parameter names are transformers' (``self_attn.q_a_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``indexer.wq_b`` ...), so checkpoints load by prefix. Shapes and switches:
``speccal.runner.mla_config.MLAConfig``.

Paged latent cache (the engine's ``KVCache`` with per-layer shapes from
``ModelConfig.kv_cache_dims``; same blocks, block tables and slots as every layer): per token
one "head" of

- K: ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` holding
  ``[kv_a_layernorm(latent) | rotated k_rope]``, never the expanded per-head K / V;
- V: ``[num_blocks, block_size, 1, index_head_dim]``, the DSA indexer's rotated, normed key
  (0 channels for dense MLA: no V is cached).

Two attention forms over one key read and one mask (:func:`latent_keys`: each request's cached
``[latent | k_rope]`` and which keys each row sees). Decode and verify rows (the captured
round's rows) attend in the *absorbed* form (:func:`attend_latent`, MQA over the latent, as
DeepSeek's and vLLM's MLA decode): each head's no-rope query is multiplied into the latent
space by its block of ``kv_b_proj`` (``q_nope @ W_uk``), scored against ``[latent | k_rope]``
with ``[q_absorbed | q_rope]``, and the softmax-weighted latents are mapped to values by the
other block (``@ W_uv^T``): the cache is never expanded. Prefill chunks, many rows over the
same keys, attend in the *expanded* form (:func:`attend_expanded`, transformers'): each cached
latent through ``kv_b_proj`` into per-head keys and values, then multi-head attention. The
two are the same products summed in another order: fp32 results agree to rounding
(``tests/runner/test_mla_forms.py``). All three row layouts (prefill chunk, ``[B, R]`` grid,
packed verify rows) read keys and mask alike and make no host read, so the decode and verify
rows run inside captured graphs.

DSA: the indexer scores every visible key of a query (``sum_h w_h * relu(q_h . k * d^-0.5)``,
``w = weights_proj(x) * H^-0.5``), keeps the ``index_topk`` best (all when fewer are visible)
and the attention is masked to them. Exact keys tied at the ``topk`` boundary are chosen by
``torch.topk`` over a differently padded row than transformers' (the engine's block-table width
vs its cache length), so which of two exactly equal scores wins may differ; any other
selection is transformers'. GLM-5's sharing layers (``MLAConfig.index_shared``) have no indexer
and attend with the visibility the last earlier indexer layer computed in the same forward
(:func:`link_shared_index`, ``MLAttention.last_visible``).

The Triton backend runs these layers per op (:meth:`MLADecoderLayer.can_fuse` is False: the
fused layer is GQA's), with two Triton pieces: every forward's rotaries, latent-cache write and
query assembly in one launch (``ops.mla_rope_cache``: on the CPU its reference, the torch ops it
replaces), and the decode and verify rows of a layer without DSA attend through
``ops.mla_latent_attention`` (:func:`attend_latent_paged`: split-KV over the paged latent cache,
the keys read once for all heads up to each request's length); prefill chunks, DSA layers and
the CPU take the torch attention here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels import ops
from speccal.kernels._backend import use_triton
from speccal.kernels.config import KernelConfig
from speccal.kernels.reference import rotate_pairs
from speccal.runner.attention import AttnMeta
from speccal.runner.config import ModelConfig
from speccal.runner.layers import DecoderLayer, RMSNorm, linear_rows
from speccal.runner.mla_config import INDEXER_NORM_EPS, LATENT_NORM_EPS
from speccal.runner.path import SKINNY_ROWS, PathBound
from speccal.runner.rope import RotaryTable


class Indexer(nn.Module):
    """DSA indexer projections: per-head scoring queries from the q LoRA latent, one key and
    per-head weights from the layer input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mla = cfg.mla
        ix = mla.indexer
        self.num_heads, self.head_dim = ix.num_heads, ix.head_dim
        self.rope_dim = mla.qk_rope_head_dim
        self.is_rope_interleaved = ix.is_rope_interleaved
        self.topk = ix.topk
        self.wq_b = nn.Linear(mla.q_lora_rank, ix.num_heads * ix.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, ix.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(ix.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, ix.num_heads, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        q_resid: torch.Tensor,  # [N, q_lora_rank]: q_a_layernorm(q_a_proj(x))
        cos: torch.Tensor,  # [N, 1, rope_dim]
        sin: torch.Tensor,  # [N, 1, rope_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, Hi, Di], k [N, Di], w [N, Hi]
        n, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None]  # [N, 1, Di]
        inter = self.is_rope_interleaved
        q = torch.cat([rotate_pairs(q[..., :r], cos, sin, inter), q[..., r:]], -1)
        k = torch.cat([rotate_pairs(k[..., :r], cos, sin, inter), k[..., r:]], -1)
        w = self.weights_proj(x).float() * self.num_heads**-0.5
        return q, k[:, 0], w


class MLAttention(PathBound, nn.Module):
    """MLA self-attention (optional q LoRA, decoupled rotary key, optional DSA indexer) over the
    paged latent cache (module docstring)."""

    qkv_weight = None  # no fused q/k/v matrix: DecoderLayer.can_fuse reads it

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self._init_path()
        mla = cfg.mla
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.mla = mla
        self.num_heads = heads
        self.scale = mla.softmax_scale
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=mla.is_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.latent_dim, bias=mla.is_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank,
                                   heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=mla.is_bias)
        self.shares_index = mla.indexer is not None and mla.is_index_shared(layer)
        self.indexer = Indexer(cfg) if mla.indexer is not None and not self.shares_index else None
        # a sharing layer reads the visibility its source (the last earlier layer with an
        # indexer, :func:`link_shared_index`) computed in this forward; held in a tuple so the
        # source is not registered as a submodule
        self._index_source: tuple[MLAttention, ...] = ()
        self.last_visible: torch.Tensor | None = None  # [B, R, T] bool, this forward's

    def _lin(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return linear_rows(x, layer.weight, layer.bias, self.path)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],  # latent cache, indexer key cache of this layer
        rotary: RotaryTable,
        project: bool = True,  # False: the heads' outputs before o_proj, [N, H * v_head_dim]
    ) -> torch.Tensor:  # [N, hidden]
        m, n, heads = self.mla, x.shape[0], self.num_heads
        nope, lat = m.qk_nope_head_dim, m.kv_lora_rank
        q_resid = None
        if m.q_lora_rank is None:
            q = self._lin(x, self.q_proj)
        else:
            q_resid = self.q_a_layernorm(self._lin(x, self.q_a_proj))
            q = self._lin(q_resid, self.q_b_proj)
        q = q.view(n, heads, m.qk_head_dim)
        ckv = self._lin(x, self.kv_a_proj_with_mqa)  # [N, latent + rope]
        latent = self.kv_a_layernorm(ckv[:, :lat])  # [N, latent], the norm reads the view
        # the same rows for every layer of the forward (the value holds the tensors its key
        # names by id, so no other tensor can take their ids while it is kept)
        _, _, cos, sin = meta.once(("mla_rope", id(rotary), id(positions)), lambda: (
            positions, rotary,
            rotary.cos.index_select(0, positions)[:, None, :],  # [N, 1, rope]
            rotary.sin.index_select(0, positions)[:, None, :]))
        k_cache, v_cache = kv
        w_kv = self.kv_b_proj.weight.view(heads, nope + m.v_head_dim, lat)
        absorbed = meta.key_slots is None  # decode / verify rows (a prefill chunk expands)
        # the query's part before its rope channels: absorbed, each head's no-rope part in the
        # latent space (q_nope @ W_uk, [N, H, latent]); expanded, q_nope itself
        first = (torch.einsum("nhd,hdl->nhl", q[..., :nope], w_kv[:, :nope]) if absorbed
                 else q[..., :nope])
        # the heads' and the shared key's rope channels rotated in one pass, [latent | k_rot]
        # into the cache, [first | q_rot] returned: one launch on the Triton path
        qa = ops.mla_rope_cache(first, q[..., nope:], ckv[:, lat:], latent, cos[:, 0],
                                sin[:, 0], meta.slot_mapping, k_cache, m.is_rope_interleaved,
                                tune=self.kx)
        index = None
        if self.indexer is not None:
            iq, ik, iw = self.indexer(x, q_resid, cos, sin)
            v_cache.view(-1, m.index_dim).index_copy_(0, meta.slot_mapping,
                                                      ik.to(v_cache.dtype))
            index = (iq, iw, self.indexer.topk)
        shared = None
        if self.shares_index:
            if not self._index_source:
                raise UnsupportedError("a DSA layer sharing an earlier layer's top-k runs only "
                                       "inside its model (link_shared_index)")
            shared = self._index_source[0].last_visible
        # decode / verify rows without DSA on the Triton path read the keys in the kernel,
        # straight from the paged cache (no gather, no fp32 copy, no bias): no LatentKeys
        paged = (absorbed and index is None and shared is None
                 and use_triton(x, self.kx.backend) and ops.mla_rows_aligned(k_cache, lat))
        lk = None if paged else latent_keys(n, k_cache, v_cache, meta, index, visible=shared)
        self.last_visible = None if lk is None else lk.is_visible
        if not absorbed:  # a prefill chunk: many rows, expanding pays
            out = attend_expanded(qa, lk, w_kv, self.scale)  # [N, H, v_head_dim]
        else:  # qa [N, H, latent + rope]
            out = (attend_latent_paged(qa, k_cache, meta, self.scale, lat, self.kx) if paged
                   else attend_latent(qa, lk, self.scale, lat))  # [N, H, latent]
            out = torch.einsum("nhl,hvl->nhv", out, w_kv[:, nope:])  # [N, H, v_head_dim]
        flat = out.reshape(n, heads * m.v_head_dim)
        return self._lin(flat, self.o_proj) if project else flat

    def fuse_weights(self) -> None:
        """Nothing to fuse: MLA layers run per op (the fused layer is GQA's)."""


def _packed_grid_rows(meta: AttnMeta, num_rows: int) -> torch.Tensor:  # [N] int64
    """Packed row ``p`` (rows of request ``b`` are ``cu_q_lens[b] .. cu_q_lens[b + 1]``, the
    last ``q_len`` positions before ``seq_lens[b]``) -> its right-aligned ``[B, R]`` grid cell
    ``b * R + R - q_len + i`` (the grid's row ``j`` is position ``seq_lens[b] - R + j``); rows
    past ``cu_q_lens[B]`` -> the trash cell ``B * R``. Static shapes, no host read."""
    cu = meta.cu_q_lens.long()
    num_b, num_r = cu.shape[0] - 1, meta.num_q_rows
    p = torch.arange(num_rows, device=cu.device)
    b = torch.searchsorted(cu[1:], p, right=True).clamp(max=num_b - 1)
    q_len = cu[b + 1] - cu[b]
    return torch.where(p < cu[-1], b * num_r + num_r - q_len + p - cu[b], num_b * num_r)


def _to_grid(x: torch.Tensor, row_index: torch.Tensor, num_b: int, num_r: int) -> torch.Tensor:
    """``[N, ...]`` flat rows -> ``[B, R, ...]`` (cells no row fills are zeros)."""
    grid = x.new_zeros(num_b * num_r + 1, *x.shape[1:])
    grid.index_copy_(0, row_index, x)
    return grid[: num_b * num_r].view(num_b, num_r, *x.shape[1:])


@dataclass
class LatentKeys:
    """What both attention forms read for one forward: each request's cached ``[latent |
    k_rope]`` keys and which of them each query row sees, on the ``[B, R]`` query grid."""

    keys: torch.Tensor  # [B, T, latent + rope], the cache's dtype
    is_visible: torch.Tensor  # [B, R, T] bool: causal, and the DSA indexer's top-k when on
    grid: Callable[[torch.Tensor], torch.Tensor]  # [N, ...] flat rows -> [B, R, ...]
    rows: torch.Tensor | None  # [N] int64 grid cell of each flat row; None: grid == rows
    meta: AttnMeta  # the forward's metadata (the bias is shared through its memo)

    def bias(self, heads: int) -> torch.Tensor:  # [B, R * heads, T] float32: 0 or -inf
        """The visibility as an additive fp32 bias with the heads folded into the rows (row
        ``r * heads + h``), built once per forward and visibility (every layer of a forward
        without the DSA indexer shares one)."""
        vis = self.is_visible

        def make():
            b, r, t = vis.shape
            rows = vis[:, :, None, :].expand(b, r, heads, t).reshape(b, r * heads, t)
            return vis, torch.zeros(rows.shape, dtype=torch.float32, device=rows.device
                                    ).masked_fill_(~rows, float("-inf"))

        return self.meta.once(("mla_bias", heads, id(vis)), make)[1]

    def flat(self, out: torch.Tensor) -> torch.Tensor:  # [B * R, ...] -> [N, ...]
        """Grid cells back to the flat rows (rows of no cell give zeros)."""
        if self.rows is None:
            return out
        return torch.cat([out, out.new_zeros(1, *out.shape[1:])]).index_select(0, self.rows)


def latent_keys(
    num_rows: int,  # N
    k_cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    v_cache: torch.Tensor,  # [num_blocks, block_size, 1, index_dim]: the indexer's keys
    meta: AttnMeta,
    index: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # q [N, Hi, Di], w [N, Hi], topk
    visible: torch.Tensor | None = None,  # [B, R, T] bool: an earlier layer's visibility
) -> LatentKeys:
    """The rows' keys and visibility (see :func:`attend_latent` for the layouts); with
    ``index``, each row's keys are masked to the indexer's top-k; ``visible`` (a layer sharing
    an earlier layer's top-k, same rows and keys in this forward) is taken as it is."""
    n, dim = num_rows, k_cache.shape[-1]
    dev = k_cache.device
    ikeys = None  # [B, T, index_dim]: the indexer's keys (DSA only)
    if meta.key_slots is not None:
        keys = k_cache.view(-1, dim).index_select(0, meta.key_slots)[None]  # [1, T, D]
        if index is not None:
            ikeys = v_cache.view(-1, v_cache.shape[-1]).index_select(0, meta.key_slots)[None]
        num_b, num_r, t = 1, n, keys.shape[1]
        rows = None
        grid = lambda x: x[None]  # noqa: E731
    else:
        rows = meta.row_index
        if rows is None:  # the packed layout's grid cells: the same for every layer
            rows = meta.once(("mla_rows", n), lambda: _packed_grid_rows(meta, n))
        num_b, num_r = meta.block_table.shape[0], meta.num_q_rows
        blocks = meta.block_table.reshape(-1).long()
        t = meta.block_table.shape[1] * k_cache.shape[1]
        keys = k_cache.index_select(0, blocks).view(num_b, t, dim)
        if index is not None:
            ikeys = v_cache.index_select(0, blocks).view(num_b, t, v_cache.shape[-1])
        grid = lambda x: _to_grid(x, rows, num_b, num_r)  # noqa: E731
    if visible is not None:
        return LatentKeys(keys, visible, grid, rows, meta)

    def causal():  # [B, R, T]: the same for every layer of the forward
        if meta.key_slots is not None:
            q_pos = (t - n + torch.arange(n, device=dev))[None]  # [1, N]
        else:  # [B, R]
            q_pos = meta.seq_lens.long()[:, None] - num_r + torch.arange(num_r, device=dev)
        return torch.arange(t, device=dev)[None, None, :] <= q_pos.clamp_min(0)[:, :, None]

    is_visible = meta.once(("mla_visible", n, t), causal)
    if index is not None:
        iq, iw, topk = index
        scores = torch.einsum("brhd,btd->brht", grid(iq).float(), ikeys.float())
        scores = torch.relu(scores * iq.shape[-1] ** -0.5)
        total = torch.einsum("brh,brht->brt", grid(iw), scores)
        total = total.masked_fill(~is_visible, float("-inf"))
        chosen = total.topk(min(topk, t), dim=-1).indices  # [B, R, k]
        is_visible = is_visible & torch.zeros_like(is_visible).scatter_(-1, chosen, True)
    return LatentKeys(keys, is_visible, grid, rows, meta)


def attend_latent(
    q: torch.Tensor,  # [N, heads, latent + rope]: absorbed no-rope part | rotated rope part
    lk: LatentKeys,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [N, heads, latent]: softmax-weighted latents
    """The absorbed form: causal attention of the rows over their requests' cached ``[latent |
    k_rope]`` (MQA: one key head, the latent as value), masked as ``lk`` says.

    Three row layouts, one computation (:func:`latent_keys`): a prefill chunk
    (``meta.key_slots``: one request's keys by slot, its rows the last ``N`` positions), the
    ``[B, R]`` grid (``row_index``) and the packed verify rows (``cu_q_lens``, mapped onto the
    grid). A row at position ``p`` sees keys ``0 .. p``; rows of front padding (``p < 0``) see
    key 0 so their discarded output stays finite.
    """
    _, heads, dim = q.shape
    num_b, num_r, t = lk.is_visible.shape
    # heads folded into the query rows (row r * H + h): one key head, no expansion. Two
    # batched products in fp32 (scores, then the weighted latents) read each request's keys
    # once and split over the keys; the fused SDPA kernels parallelise over query rows, and
    # with every head folded into one key head a decode row gives them one program for all of
    # its keys (H100, moe-16b-a3b at B = 1: 148 us a layer, a third of the step).
    keys = lk.keys.float()  # [B, T, latent + rope]
    qg = lk.grid(q).reshape(num_b, num_r * heads, dim).float()
    # the mask as an additive bias (0 / -inf) inside the scores' product: one launch for
    # product, scale and mask
    scores = torch.baddbmm(lk.bias(heads), qg, keys.transpose(1, 2), alpha=scale)  # [B, RH, T]
    out = torch.matmul(torch.softmax(scores, dim=-1), keys[..., :latent_dim])
    return lk.flat(out.to(q.dtype).view(num_b * num_r, heads, latent_dim))


def attend_latent_paged(
    q: torch.Tensor,  # [N, heads, latent + rope]: absorbed no-rope part | rotated rope part
    k_cache: torch.Tensor,  # [num_blocks, block_size, 1, latent + rope]
    meta: AttnMeta,  # the grid or packed layout (not a prefill chunk)
    scale: float,
    latent_dim: int,
    tune: KernelConfig,
) -> torch.Tensor:  # [N, heads, latent]
    """:func:`attend_latent` for decode and verify rows on the Triton path:
    ``ops.mla_latent_attention`` over the paged cache, on the rows as they are (packed or the
    grid): its kernel reads each request's keys up to its length, once for all heads."""
    if meta.cu_q_lens is None and meta.row_index is not None:
        # the grid layout's rows onto their cells, and back (the packed layout needs neither)
        n, heads, dim = q.shape
        num_b, num_r = meta.block_table.shape[0], meta.num_q_rows
        grid = _to_grid(q, meta.row_index, num_b, num_r).reshape(num_b * num_r, heads, dim)
        out = ops.mla_latent_attention(grid, k_cache, meta.block_table, meta.seq_lens, None,
                                       num_r, latent_dim, scale, tune=tune)
        return torch.cat([out, out.new_zeros(1, heads, latent_dim)]).index_select(
            0, meta.row_index)
    return ops.mla_latent_attention(q, k_cache, meta.block_table, meta.seq_lens,
                                    meta.cu_q_lens, meta.num_q_rows, latent_dim, scale,
                                    tune=tune)


def attend_expanded(
    q: torch.Tensor,  # [N, heads, nope + rope]: no-rope part | rotated rope part
    lk: LatentKeys,
    w_kv: torch.Tensor,  # [heads, nope + v_head_dim, latent]: kv_b_proj's weight by head
    scale: float,
) -> torch.Tensor:  # [N, heads, v_head_dim]
    """The expanded (decompressed) form, transformers': every cached latent through
    ``kv_b_proj`` into per-head no-rope keys and values, the shared rotary key appended to
    each head's key, then multi-head attention masked as ``lk`` says. The same function as
    :func:`attend_latent` followed by ``W_uv``, summed in another order; it costs ``T x H x
    (nope + v) x latent`` products per request to expand the keys, which the absorbed form
    never pays: worth it only where the query rows are many (prefill chunks)."""
    _, heads, qk_dim = q.shape
    num_b, num_r, t = lk.is_visible.shape
    nope, lat = qk_dim - (lk.keys.shape[-1] - w_kv.shape[2]), w_kv.shape[2]
    keys = lk.keys.to(q.dtype)
    kv = torch.einsum("btl,hcl->bhtc", keys[..., :lat], w_kv)  # [B, H, T, nope + v]
    k_rope = keys[:, None, :, lat:].expand(num_b, heads, t, qk_dim - nope)
    k = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [B, H, T, qk]
    qg = lk.grid(q).transpose(1, 2)  # [B, H, R, qk]
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k, kv[..., nope:], attn_mask=lk.is_visible[:, None], scale=scale,
    )  # [B, H, R, v]
    return lk.flat(out.transpose(1, 2).reshape(num_b * num_r, heads, -1))


class MLADecoderLayer(DecoderLayer):
    """The pre-norm decoder layer with :class:`MLAttention` (SwiGLU MLP, RMSNorms as
    :class:`~speccal.runner.layers.DecoderLayer`)."""

    attention_class = MLAttention

    def can_fuse(self, x: torch.Tensor, rotary: RotaryTable) -> bool:
        """Never: the fused layer is GQA's (no Triton MLA kernels); MLA layers run per op."""
        return False

    def attend_residual_norm(self, h, residual, positions, meta, kv, rotary) -> torch.Tensor:
        """As :meth:`DecoderLayer.attend_residual_norm`, with the o projection's GEMV adding
        into ``residual`` (decode / verify rows, no o_proj bias): the projection, the add and
        the norm in two launches, not a split-K GEMV, its reduce and a norm."""
        att, ln2 = self.self_attn, self.post_attention_layernorm
        if att.o_proj.bias is not None or h.shape[0] > SKINNY_ROWS:
            return super().attend_residual_norm(h, residual, positions, meta, kv, rotary)
        flat = att(h, positions, meta, kv, rotary, project=False).contiguous()
        out = torch.empty_like(residual)
        ops.linear(flat, att.o_proj.weight, residual=residual,
                   norm=(ln2.weight, ln2.eps, out), tune=self.kx)
        return out


def link_shared_index(layers: Iterable[nn.Module]) -> None:
    """Point every layer that shares an earlier layer's DSA top-k (``MLAConfig.index_shared``)
    at the last earlier layer that runs its indexer (GLM-5's ``indexer_types``)."""
    source = None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, MLAttention):
            continue
        if attn.indexer is not None:
            source = attn
        elif attn.shares_index:
            if source is None:
                raise InputError("config.json:indexer_types", "shared first",
                                 "a 'full' layer before every 'shared' one")
            attn._index_source = (source,)


def decoder_layer(cfg: ModelConfig, layer: int = 0) -> DecoderLayer:
    """The decoder layer ``cfg`` describes: MLA (``cfg.mla``) or GQA."""
    return (MLADecoderLayer if cfg.mla is not None else DecoderLayer)(cfg, layer)
