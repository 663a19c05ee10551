"""Chunked prefill of one request: target and draft KV for the prompt, then the first token.

This module owns :func:`prefill`. The prompt ``t_0 .. t_{n-1}`` is processed in chunks of at
most ``chunk`` tokens. Chunk ``[p0, p1)`` runs the target on positions ``p0 .. p1-1`` and the MTP
head on positions ``p0-1 .. p1-2`` (row ``i`` pairs target hidden ``h_i`` with token ``t_{i+1}``;
the last hidden of a chunk is carried to the next one). After the last chunk the first token
``t_n`` is sampled from the last row; the pair ``(h_{n-1}, t_n)`` becomes the slot's single
pending draft-extend row, consumed by the first round. Prefill is eager and not captured, and runs on the torch backend (``path.prefill_path``: cuBLAS
products and torch attention whatever the engine's path; the Triton kernels serve the rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import torch

from speccal.runner import sampling
from speccal.runner.attention import AttnMeta
from speccal.runner.kv_cache import KVCache
from speccal.runner.model import TargetModel
from speccal.runner.mtp import MTPHead
from speccal.runner.path import prefill_path, rebound
from speccal.runner.request import Request


def _meta(
    blocks: list[int], positions: np.ndarray, block_size: int, seq_len: int, device
) -> tuple[torch.Tensor, AttnMeta]:
    bt = np.asarray(blocks, dtype=np.int64)
    slots = bt[positions // block_size] * block_size + positions % block_size
    keys = np.arange(seq_len)
    key_slots = bt[keys // block_size] * block_size + keys % block_size
    n = len(positions)
    meta = AttnMeta(
        slot_mapping=torch.as_tensor(slots, device=device),
        row_index=torch.arange(n, device=device),
        block_table=torch.as_tensor(
            bt[None, : -(-seq_len // block_size)].astype(np.int32), device=device
        ),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        num_q_rows=n,
        key_slots=torch.as_tensor(key_slots, device=device),
    )
    return torch.as_tensor(positions, device=device), meta


@torch.inference_mode()
def prefill(
    req: Request,
    target: TargetModel,
    draft: MTPHead | None,
    kv: KVCache,
    *,
    chunk: int,
    generator: torch.Generator,
    device: torch.device,
    num_kv_layers: int | None = None,
    target_chunk: Callable[[torch.Tensor, torch.Tensor, AttnMeta, int, int], torch.Tensor]
    | None = None,
    hidden_out: list[torch.Tensor] | None = None,
    cuts: Collection[int] = (),
) -> tuple[int, torch.Tensor]:
    """Fill the KV caches for ``req.prompt`` and sample the first token.

    ``num_kv_layers``: target layers with a KV cache (default: every layer); the head's KV is
    the next one. ``target_chunk(ids, positions, meta, p0, p1) -> hidden`` runs the target on
    chunk ``[p0, p1)`` (default: ``target(ids, positions, meta, its KV layers)``; a hybrid
    target's state strategy passes its own, which also carries the recurrent state).
    ``hidden_out``: when given, each chunk's target hidden rows are appended to it (the rows of
    every prompt position, in order; ``speccal.runner.prompt_source`` keeps them).
    ``cuts``: prompt lengths at which a chunk also ends (:func:`chunk_ends`), so that a
    ``target_chunk`` sees ``p1`` equal to each of them (a hybrid prompt source snapshots the
    recurrent state there).

    Returns
    -------
    token : int
        The first generated token.
    hidden : torch.Tensor
        ``[hidden]`` target hidden state of the last prompt position.
    """
    num_kv = target.config.num_hidden_layers if num_kv_layers is None else num_kv_layers
    if target_chunk is None:
        def target_chunk(ids, pos, meta, p0, p1):
            return target(ids, pos, meta, kv.layers[:num_kv])
    with rebound([target, draft], prefill_path(target.path)):
        return _prefill(req, target, draft, kv, num_kv, target_chunk, chunk=chunk,
                        generator=generator, device=device, hidden_out=hidden_out, cuts=cuts)


def chunk_ends(n: int, chunk: int, cuts: Collection[int] = ()) -> list[int]:
    """End positions of the prefill chunks of an ``n``-token prompt: every multiple of
    ``chunk`` below ``n``, ``n`` itself, and each cut in ``(0, n)`` (a cut only splits a chunk,
    so no chunk is longer than ``chunk``)."""
    return sorted(set(range(chunk, n, chunk)) | {n} | {int(c) for c in cuts if 0 < c < n})


def _prefill(req: Request, target: TargetModel, draft: MTPHead | None, kv: KVCache, num_kv: int,
             target_chunk, *, chunk: int, generator: torch.Generator, device: torch.device,
             hidden_out: list[torch.Tensor] | None, cuts: Collection[int] = ()):
    prompt = req.prompt
    n = len(prompt)
    bs = kv.allocator.block_size
    kv.allocator.grow(req.blocks, n)
    ids = torch.as_tensor(prompt, dtype=torch.int64, device=device)
    carry = None  # [1, hidden]: last hidden of the previous chunk
    h = None
    ends = chunk_ends(n, chunk, cuts)
    for p0, p1 in zip([0, *ends[:-1]], ends, strict=True):
        pos, meta = _meta(req.blocks, np.arange(p0, p1), bs, p1, device)
        h = target_chunk(ids[p0:p1], pos, meta, p0, p1)  # [p1 - p0, hidden]
        if hidden_out is not None:
            hidden_out.append(h.clone())  # later chunks may reuse the forward's buffers
        if draft is None:
            continue
        hid = h[:-1] if carry is None else torch.cat([carry, h[:-1]], dim=0)
        if hid.shape[0] > 0:
            d0 = p0 if carry is None else p0 - 1
            dpos, dmeta = _meta(req.blocks, np.arange(d0, p1 - 1), bs, p1 - 1, device)
            draft(target, hid, ids[d0 + 1 : p1], dpos, dmeta, kv.layers[num_kv])
        carry = h[-1:]
    logits = target.logits(h[-1:])  # [1, V]
    p = req.params
    token = sampling.sample_plain(
        logits,
        torch.tensor([p.temperature], device=device),
        torch.tensor([p.top_k], device=device),
        torch.tensor([p.top_p], device=device),
        torch.tensor([p.min_p], device=device),
        generator,
    )
    req.num_computed = n
    req.is_prefilled = True
    return int(token.item()), h[-1]
