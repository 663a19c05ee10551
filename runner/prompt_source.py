"""A prefilled source sequence whose prefixes are admitted by copying KV, not by a forward.

Calibration measures rounds, not prefill: every window starts with fresh requests at the
interval's KV lengths, and before this module each of them was prefilled (for the default H200
grid, 228 windows of up to 8 prompts of up to 4,096 tokens: most of a cold calibration's wall
time). :class:`PromptSource` prefills one source sequence once, keeps its KV (every KV layer, the
MTP head's included) and its target hidden rows in a side buffer, and admits a request whose
prompt is a prefix of the source by

1. copying the prefix's KV blocks from the side buffer into the request's blocks (one
   ``index_copy_`` per layer tensor for all the requests admitted together),
2. sampling the first token from the target's logits of the source's hidden row ``n - 1``,
   with the request's own sampling parameters, as :func:`speccal.runner.prefill.prefill` does.

What a request gets equals what its own prefill computes, up to floating-point rounding of the
longer forward (causal attention: position ``i`` depends on tokens ``0..i`` only), so round
timing is unchanged. Prompts that are not a prefix of the source take the normal prefill.

A hybrid linear-attention target also carries a recurrent state per request, and the state
after ``n`` tokens cannot be read off a longer sequence's. Its source is prefilled with a chunk
ending at each prompt length the caller names (``Engine.set_prompt_source``'s ``lengths``:
calibration knows every prompt of its grid in advance), the state rows are copied after each of
those chunks (``states``), and a prefix is admitted only at one of those lengths: its KV as
above, its state rows from that copy (``StateStrategy.admit_states``). The chunked delta rule
over other chunk boundaries rounds differently from the prompt's own prefill, again without
changing any shape a round runs.
"""

from __future__ import annotations

import numpy as np
import torch

from speccal.runner import sampling
from speccal.runner.hybrid_state import StateStrategy
from speccal.runner.kv_cache import KVCache
from speccal.runner.model import TargetModel
from speccal.runner.path import prefill_path, rebound
from speccal.runner.request import Request


class PromptSource:
    """KV and hidden rows of one prefilled source sequence (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, kv: KVCache, blocks: list[int], hidden: torch.Tensor,
                 states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None):
        """``blocks``: the source request's KV blocks (copied out here; the caller frees them);
        ``hidden [len(tokens), hidden]``: the target's hidden row of every source position;
        ``states``: a hybrid target's state rows after each admissible prefix length (None:
        the target has no recurrent state, every prefix is admissible)."""
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.states = states
        n_blocks = kv.allocator.blocks_for(len(self.tokens))
        src = torch.as_tensor(blocks[:n_blocks], dtype=torch.long, device=hidden.device)
        # side buffer: the source's blocks of every layer, in the pool's block layout
        self.layers = [(k.index_select(0, src), v.index_select(0, src)) for k, v in kv.layers]
        self.hidden = hidden
        self.block_size = kv.allocator.block_size

    @property
    def nbytes(self) -> int:
        """Device bytes the source holds (KV side buffer + hidden rows)."""
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)
        states = sum(t.numel() * t.element_size() for st in (self.states or {}).values()
                     for pair in st for t in pair)
        return kv + states + self.hidden.numel() * self.hidden.element_size()

    def covers(self, prompt: list[int]) -> bool:
        """Whether ``prompt`` is a non-empty prefix of the source (for a hybrid target: of one
        of the lengths whose state was kept)."""
        n = len(prompt)
        if self.states is not None and n not in self.states:
            return False
        return 0 < n <= len(self.tokens) and np.array_equal(
            np.asarray(prompt, dtype=np.int64), self.tokens[:n])

    def admit(self, reqs: list[Request], target: TargetModel, kv: KVCache,
              generator: torch.Generator, device: torch.device,
              state: StateStrategy | None = None) -> list[tuple[int, torch.Tensor]]:
        """KV of each request's prompt (a prefix :meth:`covers` accepted: the caller checks)
        copied into its blocks, and for a hybrid target (``state``, the engine's state
        strategy) its state rows into its slot's committed row; its first token sampled;
        returns ``(token, hidden row)`` per request, as ``prefill`` would. Sets
        ``num_computed`` / ``is_prefilled`` like ``prefill``."""
        if (self.states is None) != (state is None):
            raise ValueError("PromptSource.admit: state rows need the engine's state strategy "
                             "and a source prefilled with them")
        dst, src = [], []
        for req in reqs:
            n = len(req.prompt)
            kv.allocator.grow(req.blocks, n)
            m = kv.allocator.blocks_for(n)
            dst += req.blocks[:m]
            src += range(m)
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=device)
        src_t = torch.as_tensor(src, dtype=torch.long, device=device)
        for (k, v), (sk, sv) in zip(kv.layers, self.layers, strict=True):
            k.index_copy_(0, dst_t, sk.index_select(0, src_t))
            v.index_copy_(0, dst_t, sv.index_select(0, src_t))
        if state is not None:
            slots = torch.as_tensor([r.slot for r in reqs], dtype=torch.long, device=device)
            state.admit_states(slots, [self.states[len(r.prompt)] for r in reqs])
        rows = torch.as_tensor([len(r.prompt) - 1 for r in reqs], dtype=torch.long, device=device)
        hid = self.hidden.index_select(0, rows)  # [R, hidden]
        with rebound([target], prefill_path(target.path)):  # eager rows: no new Triton shapes
            logits = target.logits(hid)  # [R, V]
        ps = [r.params for r in reqs]
        tokens = sampling.sample_plain(
            logits,
            torch.tensor([p.temperature for p in ps], device=device),
            torch.tensor([p.top_k for p in ps], device=device),
            torch.tensor([p.top_p for p in ps], device=device),
            torch.tensor([p.min_p for p in ps], device=device),
            generator,
        ).tolist()
        out = []
        for i, req in enumerate(reqs):
            req.num_computed = len(req.prompt)
            req.is_prefilled = True
            out.append((int(tokens[i]), hid[i]))
        return out
