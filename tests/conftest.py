"""Shared pytest configuration: the ``cuda`` marker skips itself on machines without a GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

# ``python3 -m pytest`` puts the working directory (the repository root) first on sys.path, where
# the source folders ``kernels/``, ``runner/``, ... would shadow installed distributions of the
# same name: transformers (5.25+) imports the hub's ``kernels`` package whenever it is installed,
# and found this repository's folder instead. speccal itself is installed (``pip install -e``:
# ``speccal.kernels`` maps to the folder), so the root is taken off the path before any test
# imports transformers.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# Rich fixes a console's width when it is built with COLUMNS set, and the CLI builds its consoles
# at import: the width a test pins with ``CliRunner().invoke(..., env={"COLUMNS": ...})`` holds
# only if COLUMNS was unset when ``speccal.cli`` was first imported. GNU readline exports
# COLUMNS=80 LINES=24 when it loads (a pytest-xdist worker loads it before this file), which made
# the human-output tests wrap at 80 columns under ``-n 2``; every test pins its own width.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# Under pytest-xdist the workers share the cores: one worker's OpenMP/BLAS threads spin-waiting
# behind another's makes torch and numpy code several times slower. Each worker (and every
# subprocess it starts) gets its share of the cores unless the caller chose a thread count.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(max(1, _share)))


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


def _shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture of its own module (a calibrated table, two
    launched ranks, an executed notebook: set up once per worker that runs one of its tests)."""
    module = item.nodeid.split("::")[0]
    return any(defs[-1].scope == "module" and defs[-1].baseid == module
               for defs in item._fixtureinfo.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    # one xdist worker runs all of such a module's tests: its expensive setup runs once, not
    # once on each worker; every other test is spread test by test
    for item in items:
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if _has_cuda() or _interpreting_on_cpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
