"""Which terms a draft-step cost model needs, judged on a calibration journal's own points.

Usage: python3 bench/fit_terms.py JOURNAL.jsonl [JOURNAL.jsonl ...] [--json OUT.json]

Per journal and context interval, the points (median step ms of each point's windows) are fitted
by ordinary least squares in several additive forms, one-hot ``alpha(Bcap)`` and ``theta(G)``
as in ``speccal.costmodel.additive``, plus:

- ``per_bcap``: ``(k - 1) * delta(Bcap)`` (the draft-forward term as tables have it);
- ``shared``: ``(k - 1) * delta``;
- ``+rows``: ``rho * G / (k + 1)``, the requests one verify serves (a partly filled bucket's
  padded requests): the verify's attention reads each request's KV once, whatever its rows, so
  at a fixed KV interval part of the cost follows the requests, not ``G`` or ``Bcap``;
- ``+requests``: ``rho * B`` with ``B`` the real requests of the point (what a lookup by
  ``(Bcap, G, k)`` cannot know: the upper bound on what ``+rows`` can reach).

For each form: the leave-one-point-out mean absolute error in % (a point whose removal makes a
level unidentifiable is skipped, as the calibration's own diagnostic does) and the in-sample
worst residual. A diagnostic for bench/RESULTS.md (issue 35's held-out bound); the tables'
model is ``speccal.costmodel``'s.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

FORMS = ("per_bcap", "shared", "per_bcap+rows", "shared+rows", "per_bcap+requests",
         "shared+requests")


def points(path: str) -> list[tuple[int, int, int, int, int, float]]:
    """``(context, bcap, g, k, requests, median step ms)`` per point of a journal."""
    windows: dict[tuple, list[float]] = defaultdict(list)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("kind") == "window":
                r = rec["row"]
                key = (r["context_index"], r["bcap"], r["g"], r["k"], r["num_requests"])
                windows[key].append(r["step_ms"])
    return [(*key, float(np.median(v))) for key, v in sorted(windows.items())]


def design(pts: list[tuple], form: str) -> np.ndarray:
    bl = sorted({p[1] for p in pts})
    gl = sorted({p[2] for p in pts})
    rows = []
    for _, b, g, k, n, _ in pts:
        x = [1.0] + [float(b == v) for v in bl[1:]] + [float(g == v) for v in gl[1:]]
        x += ([(k - 1.0) * (b == v) for v in bl] if form.startswith("per_bcap") else [k - 1.0])
        if form.endswith("+rows"):
            x.append(g / (k + 1.0))
        elif form.endswith("+requests"):
            x.append(float(n))
        rows.append(x)
    return np.asarray(rows)


def errors(pts: list[tuple], form: str) -> dict[str, float]:
    X, y = design(pts, form), np.asarray([p[-1] for p in pts])
    rank = np.linalg.matrix_rank(X)
    held = []
    for i in range(len(pts)):
        keep = np.arange(len(pts)) != i
        if np.linalg.matrix_rank(X[keep]) < rank:
            continue
        coef = np.linalg.lstsq(X[keep], y[keep], rcond=None)[0]
        held.append(abs(X[i] @ coef - y[i]) / y[i] * 100)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    return {"lopo_mean_pct": float(np.mean(held)) if held else float("nan"),
            "lopo_points": len(held),
            "fit_max_pct": float(np.max(np.abs(X @ coef - y) / y * 100)),
            "parameters": int(rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("journals", nargs="+")
    ap.add_argument("--json", default=None, help="write every figure here too")
    args = ap.parse_args()
    out: dict[str, dict] = {}
    for path in args.journals:
        pts = points(path)
        per: dict[str, dict] = {}
        for c in sorted({p[0] for p in pts}):
            sub = [p for p in pts if p[0] == c]
            per[f"context {c}"] = {form: errors(sub, form) for form in FORMS}
        out[path] = per
        print(path)
        print(f"  {'form':18s}" + "".join(f"{c:>24s}" for c in per))
        for form in FORMS:
            cells = "".join(f"{per[c][form]['lopo_mean_pct']:10.2f} % ({per[c][form]['fit_max_pct']:4.1f} % max)"
                            for c in per)
            worst = max(per[c][form]["lopo_mean_pct"] for c in per)
            print(f"  {form:18s}{cells}   worst {worst:.2f} %")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
