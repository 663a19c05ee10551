"""Tensor-parallel reductions of the sharded model modules (Megatron layout).

This module owns the math a sharded module runs across its TP group: the vocabulary-parallel
embedding (:func:`vocab_embed`), the LM head's greedy argmax across vocabulary shards without
gathering logits (:func:`vocab_argmax`), the draft score of that token (:func:`vocab_token_probability`)
and the full-logits gather where sampling needs the whole distribution (:func:`vocab_gather`).
:class:`TPBound` is the mixin of modules that take part (``tp`` is None on one rank) and
:func:`bind_tp` gives a whole model its group. Layout per rank ``r`` of ``t``: vocabulary rows
``[r V/t, (r + 1) V/t)``; q/k/v and gate/up output columns and o/down input columns the same
contiguous ``1/t`` slice (``speccal.runner.distributed.load`` shards the weights).

Every reduction is exact or rank-symmetric, so all ranks hold identical activations: the
embedding adds one real row to zeros, the argmax reduces packed integer keys with MAX (ties to
the lowest global index, as ``torch.argmax``), and sums are all-reduced (identical on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_LOW = 0x7FFFFFFF  # index field of a packed argmax key: _LOW - index (max picks the lowest)


class TPBound:
    """Mixin of modules whose forward reduces over a TP group once one is bound.

    ``tp`` is a :class:`~speccal.runner.distributed.comm.Comm` (``tp_rank``, ``tp_size``,
    ``all_reduce_tp``, ``all_gather_tp``) or None (one rank: no reduction).
    """

    tp: Any = None


def bind_tp(module: nn.Module, comm: Any) -> None:
    """Give every :class:`TPBound` submodule of ``module`` (itself included) the group ``comm``."""
    for m in module.modules():
        if isinstance(m, TPBound):
            m.tp = comm


def reduce_partial(x: torch.Tensor, tp: Any) -> torch.Tensor:
    """Sum a row-parallel projection's partial outputs ``[N, hidden]`` over the TP group."""
    return x if tp is None else tp.all_reduce_tp(x.contiguous())


def vocab_embed(embedding: nn.Embedding, ids: torch.Tensor, tp: Any) -> torch.Tensor:
    """Rows of a vocabulary-parallel embedding ``[N, hidden]`` for global token ``ids [N]``.

    Each rank looks up the ids in its range (others read row 0 and are zeroed), then the
    partial rows are summed: each row is one rank's value plus zeros, so the sum is exact.
    """
    if tp is None or tp.tp_size == 1:
        return embedding(ids)
    n = embedding.num_embeddings
    local = ids - tp.tp_rank * n
    inside = (local >= 0) & (local < n)  # [N]
    x = embedding(local.clamp(0, n - 1)) * inside[:, None].to(embedding.weight.dtype)
    return tp.all_reduce_tp(x)


def _packed_keys(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as ``(value, -index)``: float32 bits made order-preserving as a
    signed int32 (negative values' magnitude bits flipped) in the high word, ``_LOW - index``
    in the low word."""
    v = values.float() + 0.0  # -0.0 -> +0.0: equal values get equal keys, as argmax sees them
    bits = v.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ _LOW, bits).to(torch.int64)
    return (ordered << 32) | (_LOW - index.to(torch.int64))


def vocab_argmax(local_logits: torch.Tensor, tp: Any) -> torch.Tensor:  # [N] int64
    """Greedy token of each row from this rank's logits shard ``[N, V/t]``, without a gather.

    Per shard the max and its first index; one MAX all-reduce of the packed ``(max, index)``
    keys picks, across shards, the largest value and on ties the lowest global index: exactly
    ``torch.argmax`` of the concatenated logits (NaN rows excepted).
    """
    best, idx = local_logits.float().max(dim=-1)  # first index of the max per row
    if tp is None or tp.tp_size == 1:
        return idx
    key = _packed_keys(best, idx + tp.tp_rank * local_logits.shape[-1])
    tp.all_reduce_tp(key, op="max")
    return _LOW - (key & 0xFFFFFFFF)


def vocab_token_probability(local_logits: torch.Tensor, token: torch.Tensor,
                            tp: Any) -> torch.Tensor:  # [N] float32
    """``softmax(logits)[token]`` of each row from the vocabulary shards ``[N, V/t]``.

    A MAX all-reduce of the row maxima and a SUM all-reduce of ``exp(l - max)``: two ``[N]``
    reductions instead of a ``[N, V]`` gather. ``token [N]`` holds global ids.
    """
    x = local_logits.float()
    m = x.max(dim=-1).values
    if tp is not None and tp.tp_size > 1:
        tp.all_reduce_tp(m, op="max")
    s = torch.exp(x - m[:, None]).sum(dim=-1)
    n = x.shape[-1]
    rank = tp.tp_rank if tp is not None else 0
    local = token - rank * n
    inside = (local >= 0) & (local < n)
    picked = x.gather(1, local.clamp(0, n - 1)[:, None])[:, 0]
    num = torch.where(inside, torch.exp(picked - m), torch.zeros_like(m))
    if tp is not None and tp.tp_size > 1:
        both = torch.stack([s, num])
        tp.all_reduce_tp(both)
        s, num = both[0], both[1]
    return num / s


def vocab_gather(local_logits: torch.Tensor, tp: Any) -> torch.Tensor:  # [N, V]
    """Every shard's logits concatenated in vocabulary order (sampling needs all of them)."""
    if tp is None or tp.tp_size == 1:
        return local_logits
    return tp.all_gather_tp(local_logits, dim=-1)
