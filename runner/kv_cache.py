"""Paged KV cache: block allocator, per-layer cache tensors, capacity accounting.

This module owns the KV memory of the target layers and the MTP head's layer. Layout per layer:
``k_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``v_cache`` the same with
``v_head_dim`` channels (``head_dim`` unless given: MLA layers cache one head of
``[latent | k_rope]`` as K and the DSA indexer's key, or nothing, as V; ``speccal.runner.mla``;
MiMo-V2-Flash values of ``v_head_dim``). ``layer_dims`` gives each layer its own
``(num_kv_heads, head_dim, v_head_dim)`` (``ModelConfig.kv_cache_dims``: MiMo-V2-Flash's sliding
layers have twice the KV heads of its full ones). Block 0 is
reserved: its slot 0 is the sentinel every padded row writes, and unused block-table entries
point at it. A request owns a list of blocks; token position ``p`` lives at slot
``blocks[p // block_size] * block_size + p % block_size`` in *every* layer (target and draft share
block ids and positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speccal.base.errors import CapacityError, InputError
from speccal.runner.device import check_memory

SENTINEL_SLOT = 0


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 (block 0 is the reserved sentinel block)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise CapacityError(f"KV cache needs at least 2 blocks (1 reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Slots usable by requests (the reserved block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> None:
        """Append blocks to ``blocks`` until it holds ``num_tokens`` positions."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return
        if need > len(self._free):
            raise CapacityError(
                f"KV cache full: need {need} more blocks of {self.block_size} tokens, "
                f"{len(self._free)} free (capacity {self.capacity_tokens} tokens); lower the "
                "batch or prompt lengths, or raise kv_capacity_tokens"
            )
        for _ in range(need):
            blocks.append(self._free.pop())

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()

    def sort_free(self) -> None:
        """Put the free list back in block order (the lowest block is handed out first).

        Requests growing side by side take their blocks from one free list in turn, and
        freeing them pushes those interleavings back, so after a few batches a new batch's
        blocks lie wherever the history left them. The KV gather of a CPU round reads whole
        block tables: on the 2-vCPU VM the same Bcap 8 shape cost 23.0-31.6 (probe ratio) over
        twelve batches with the history's layout and 23.1-26.7 from a sorted list
        (bench/RESULTS.md). ``Engine.reset`` calls this, so every fresh batch starts from one
        layout whatever ran before.
        """
        self._free.sort(reverse=True)


class KVCache:
    """Cache tensors of ``num_layers`` layers (target layers then the draft layer)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
        *,
        layer_dims: Sequence[tuple[int, int, int]] | None = None,
    ):
        dims = self.dims(num_layers, num_kv_heads, head_dim, v_head_dim, layer_dims)
        # a backstop: the engine checks first, naming the options that sized the cache
        need = self.nbytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                           v_head_dim, layer_dims=dims)
        check_memory(device, need, field="KV cache", value=f"{num_blocks} blocks of {block_size}",
                     what="K and V tensors")
        self.layers = [
            (
                torch.zeros((num_blocks, block_size, heads, k_dim), dtype=dtype, device=device),
                torch.zeros((num_blocks, block_size, heads, v_dim), dtype=dtype, device=device),
            )
            for heads, k_dim, v_dim in dims
        ]
        self.allocator = BlockAllocator(num_blocks, block_size)

    @staticmethod
    def dims(num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None,
             layer_dims: Sequence[tuple[int, int, int]] | None) -> list[tuple[int, int, int]]:
        """Each layer's ``(num_kv_heads, head_dim, v_head_dim)``: ``layer_dims`` (one entry per
        layer) or the one shape of every layer."""
        if layer_dims is None:
            v_dim = head_dim if v_head_dim is None else v_head_dim
            return [(num_kv_heads, head_dim, v_dim)] * num_layers
        if len(layer_dims) != num_layers:
            raise InputError("KVCache layer_dims", len(layer_dims),
                             f"{num_layers} entries (one per cached layer)")
        return [tuple(d) for d in layer_dims]

    @staticmethod
    def nbytes(
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
        *,
        layer_dims: Sequence[tuple[int, int, int]] | None = None,
    ) -> int:
        """Bytes of the K and V tensors of a cache of this shape (what ``__init__`` allocates)."""
        elem = torch.empty((), dtype=dtype).element_size()
        dims = KVCache.dims(num_layers, num_kv_heads, head_dim, v_head_dim, layer_dims)
        return sum(num_blocks * block_size * h * (k + v) * elem for h, k, v in dims)
