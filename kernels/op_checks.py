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
