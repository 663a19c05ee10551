"""Small builders shared by the cost-model tests."""

from __future__ import annotations

import copy
import math

import numpy as np

from speccal.costmodel.compat import kernel_digest, make_compatibility
from speccal.costmodel.synthetic import make_measurements

#: A kernel configuration shaped like the runner's (``KernelConfig.to_dict()``): groups of
#: scalars and lists; the tests treat it as an opaque nested JSON object.
KERNELS = {
    "backend": "triton",
    "prewait": True,
    "pdl": {"mode": "late"},
    "gemv": {"panel_max_rows": 16, "stages": 3, "overrides": ["qkv:2-8:64x256x3"]},
    "attention": {"m_tile": 2, "fold_reduce": True},
    "norm": {"defer_input": True},
    "precision": {"fp32_dot": "ieee"},
}

#: The compatibility of the tables these tests build (the one shared builder:
#: ``speccal.costmodel.compat.make_compatibility``).
COMPAT = make_compatibility(
    draft_width=3,
    architecture="tiny-mtp",
    fingerprint="sha256:abc",
    dtype="float32",
    quantization="none",
    attention_backend="triton",
    input_update="in_graph",
    kernel_config=KERNELS,
    verification_mode="forced",
    device_name="test-cpu",
)

BCAPS = (1, 2, 4, 8)
W = 3
GS = tuple(sorted({b * j for b in BCAPS for j in range(1, W + 2)}))
BIAS = 4.0
ALPHA = {1: 0.0, 2: 0.25, 4: 0.8, 8: 2.1}
# Non-linear in G on purpose: the additive model must not assume a shape.
THETA = {g: 0.04 * g + (0.3 if g % 3 == 0 else 0.0) for g in GS}


def compat(*, kernels: dict | None = None, **changes) -> dict:
    """COMPAT with dotted-key changes, e.g. compat(**{"model.dtype": "bfloat16"}).

    ``kernels`` replaces the kernel config (its digest recomputed).
    """
    out = copy.deepcopy(COMPAT)
    if kernels is not None:
        out["kernels"] = {"digest": kernel_digest(kernels), "config": copy.deepcopy(kernels)}
    for key, value in changes.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def kernels_with(**dotted) -> dict:
    """KERNELS with dotted-key changes, e.g. kernels_with(**{"gemv.stages": 4})."""
    out = copy.deepcopy(KERNELS)
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def measurements(**kw):
    args = dict(
        bias_ms=BIAS, alpha_ms=ALPHA, theta_ms=THETA, draft_width=W, window_steps=16, seed=0
    )
    args.update(kw)
    return make_measurements(**args)


#: Context 1 medians (Bcap, G) -> ms of :func:`nonadditive_measurements`. The one cycle of the
#: grid, (1, 2) - (1, 4) - (2, 2) + (2, 4) = 39 ms, is 0 for any additive cost, so least squares
#: spreads 39 / 4 ms over those four points: the fit predicts 1 - 9.75 = -8.75 ms at (1, 2).
NONADDITIVE_MS = {(1, 1): 5.0, (1, 2): 1.0, (1, 3): 5.0, (1, 4): 1.0}
NONADDITIVE_MS |= {(2, 2): 1.0, (2, 4): 40.0, (2, 6): 5.0, (2, 8): 5.0}
NONADDITIVE_PREDICTED_12 = -8.75


def nonadditive_measurements():
    """Rows (w = 3, Bcaps 1 and 2) whose additive fit is physical in context 0 (KV 1-1024:
    ``2 + 0.5 * G`` ms) and predicts a negative cost at (Bcap 1, G 2) in context 1 (KV
    1025-4096, medians :data:`NONADDITIVE_MS`)."""
    gs = (1, 2, 3, 4, 6, 8)
    df = make_measurements(
        bias_ms=1.0,
        alpha_ms={1: 0.0, 2: 0.0},
        theta_ms={g: 0.0 for g in gs},
        draft_width=W,
        contexts=((512, 1, 1024), (2048, 1025, 4096)),
        window_steps=16,
    )
    clean = 2.0 + 0.5 * df["g"]
    cycle = [NONADDITIVE_MS[(b, g)] for b, g in zip(df["bcap"], df["g"], strict=True)]
    df["step_ms"] = np.where(df["context_index"] == 0, clean, cycle)
    df["elapsed_s"] = df["step_ms"] * df["window_steps"] / 1000.0
    return df


def assert_same_fits(got, want, rel: float = 1e-9, abs_: float = 1e-12) -> None:
    """Fits equal field by field, floats within ``rel`` (or ``abs_`` near zero): a least-squares
    fit of the same points rounds its last bits by the host's BLAS kernels (an AVX-512 host
    and an AVX2 one differ there); everything else exactly."""

    def walk(a, b, where):
        if isinstance(a, dict):
            assert isinstance(b, dict) and a.keys() == b.keys(), where
            for k in a:
                walk(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert isinstance(b, (list, tuple)) and len(a) == len(b), where
            for i, (u, v) in enumerate(zip(a, b, strict=True)):
                walk(u, v, f"{where}[{i}]")
        elif isinstance(a, float) and isinstance(b, float):
            assert math.isclose(a, b, rel_tol=rel, abs_tol=abs_), (where, a, b)
        else:
            assert a == b, (where, a, b)

    walk([f.model_dump() for f in got], [f.model_dump() for f in want], "fits")

