"""Shared pytest configuration: the ``cuda`` marker skips itself on machines without a GPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _interpreting_on_cpu() -> bool:
    """Kernel tests through Triton's CPU interpreter (``TRITON_INTERPRET=1`` and
    ``SPECCAL_KERNEL_TEST_DEVICE=cpu``): the ``cuda`` tests then run instead of skipping."""
    return (os.environ.get("TRITON_INTERPRET") == "1"
            and os.environ.get("SPECCAL_KERNEL_TEST_DEVICE") == "cpu")


def pytest_collection_modifyitems(config, items):
    if _has_cuda() or _interpreting_on_cpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
