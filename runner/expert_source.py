"""Stacked routed-expert tensors read as per-expert ones.

This module owns :class:`PerExpertView`, a :class:`~speccal.runner.checkpoint.TensorSource`
wrapper. Checkpoints store a layer's routed experts either one by one
(``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj`` ``[I, H]``, ``down_proj``
``[H, I]``: what transformers 5.25's ``save_pretrained`` writes, reverting its in-memory
fusion) or stacked as transformers holds them in memory (``mlp.experts.gate_up_proj``
``[E, 2 I, H]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``). The view
lists every stacked tensor as the per-expert keys it holds and slices them on read, so the
model modules (``speccal.runner.moe``) and the strict loader see one layout: a stacked tensor
is consumed when all of its slices are, and one of another shape stays listed as itself (no
module consumes it, so the strict loader refuses it by name).
"""

from __future__ import annotations

import re

import torch

from speccal.runner.checkpoint import TensorSource

_STACKED = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<kind>gate_up_proj|down_proj)$")


class PerExpertView:
    """``source`` with its stacked expert tensors presented as per-expert keys."""

    def __init__(self, source: TensorSource):
        self.source = source
        self._virtual: dict[str, tuple[str, int, slice]] = {}  # key -> (stacked key, e, rows)
        kept = []
        for key in source.keys():
            m = _STACKED.match(key)
            shape = tuple(source.shape(key)) if m is not None else ()
            if m is None or len(shape) != 3 or (m["kind"] == "gate_up_proj" and shape[1] % 2):
                kept.append(key)
                continue
            pre = m["prefix"]
            for e in range(shape[0]):
                if m["kind"] == "down_proj":
                    self._virtual[f"{pre}{e}.down_proj.weight"] = (key, e, slice(None))
                else:
                    half = shape[1] // 2
                    self._virtual[f"{pre}{e}.gate_proj.weight"] = (key, e, slice(0, half))
                    self._virtual[f"{pre}{e}.up_proj.weight"] = (key, e, slice(half, None))
        self._keys = sorted(kept + list(self._virtual))
        self._recent: dict[tuple, torch.Tensor] = {}  # the stacked tensors read last (2)

    def __getattr__(self, name: str):  # config, path, fingerprint ... of the wrapped folder
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._virtual:
            return tuple(self.source.shape(key))
        stacked, _, rows = self._virtual[key]
        full = tuple(self.source.shape(stacked))[1:]
        return (len(range(full[0])[rows]), *full[1:])

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        if key not in self._virtual:
            return self.source.get(key, shape, dtype, device)
        stacked, e, rows = self._virtual[key]
        tag = (stacked, dtype, device)
        if tag not in self._recent:  # the loader reads a layer's experts in turn
            if len(self._recent) >= 2:
                self._recent.pop(next(iter(self._recent)))
            self._recent[tag] = self.source.get(stacked, tuple(self.source.shape(stacked)),
                                                dtype, device)
        return self._recent[tag][e, rows].contiguous()


def per_expert(source: TensorSource) -> TensorSource:
    """``source`` itself when it stacks no experts, else a :class:`PerExpertView` of it."""
    if any(_STACKED.match(k) for k in source.keys()):
        return PerExpertView(source)
    return source
