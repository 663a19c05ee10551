"""Small builders shared by the cost-model tests."""

from __future__ import annotations

import copy

from speccal.costmodel.synthetic import make_measurements

COMPAT = {
    "draft_width": 3,
    "model": {
        "architecture": "tiny-mtp",
        "fingerprint": "sha256:abc",
        "dtype": "float32",
        "quantization": "none",
    },
    "topology": {"tp": 1, "dp": 1},
    "graph_mode": "split",
    "verification_mode": "forced",
    "device": {"kind": "cpu", "name": "test-cpu"},
}

BCAPS = (1, 2, 4, 8)
W = 3
GS = tuple(sorted({b * j for b in BCAPS for j in range(1, W + 2)}))
BIAS = 4.0
ALPHA = {1: 0.0, 2: 0.25, 4: 0.8, 8: 2.1}
# Non-linear in G on purpose: the additive model must not assume a shape.
THETA = {g: 0.04 * g + (0.3 if g % 3 == 0 else 0.0) for g in GS}


def compat(**changes) -> dict:
    """COMPAT with dotted-key changes, e.g. compat(**{"model.dtype": "bfloat16"})."""
    out = copy.deepcopy(COMPAT)
    for key, value in changes.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def measurements(**kw):
    args = dict(
        bias_ms=BIAS, alpha_ms=ALPHA, theta_ms=THETA, draft_width=W, window_steps=16, seed=0
    )
    args.update(kw)
    return make_measurements(**args)
