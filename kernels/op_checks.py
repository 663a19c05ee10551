"""Host-side argument checks shared by the kernel ops (``ops``, ``ops_moe``, ``ops_linear``):
static facts only (shapes, dtypes, strides), each failure an ``InputError`` naming the field,
the value and what was expected."""

from __future__ import annotations

import torch

from speccal.base.errors import InputError

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int32, torch.int64)


def need(cond: bool, field: str, value, expected: str) -> None:
    if not cond:
        raise InputError(field, value, expected)


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_int(t: torch.Tensor, field: str, shape: tuple[int, ...], dtypes=INTS) -> None:
    """An integer tensor of ``shape`` and one of ``dtypes``."""
    need(isinstance(t, torch.Tensor), field, type(t).__name__, "a torch.Tensor")
    need(t.dtype in dtypes, f"{field}.dtype", t.dtype, " or ".join(map(str, dtypes)))
    need(shape_of(t) == shape, f"{field}.shape", shape_of(t), str(list(shape)))


def check_slot_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Caches a kernel can address by slot (``slot = block * block_size + offset``)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        need(c.stride(0) == c.shape[1] * c.stride(1) and c.stride(-1) == 1, name, "strided",
              "blocks and slots contiguous (slot = block * block_size + offset)")


def check_qk_norm(qk_norm, d: int, field: str) -> None:
    """``(q_weight [d], k_weight [d], eps > 0)`` or None."""
    if qk_norm is not None:
        need(len(qk_norm) == 3 and all(shape_of(w) == (d,) for w in qk_norm[:2]) and qk_norm[2] > 0,
              field, tuple(shape_of(w) for w in qk_norm[:2]) + tuple(qk_norm[2:]),
              f"(q_weight [{d}], k_weight [{d}], eps > 0)")
