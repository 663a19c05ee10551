"""Replay plots (matplotlib, Agg backend, PNG files): decision timeline and throughput by policy.

``plot_timeline``: one step line per adaptive policy (and the per-phase oracle) of ``k`` (draft
step) or padded target rows ``G`` (target verify) against the round index, phase boundaries as
vertical lines; long traces are reduced to at most ``max_points`` rounds per line by taking
every n-th round (decisions are piecewise constant, so the shape survives).
``plot_throughput``: horizontal bars of predicted tokens/s per policy, best fixed ``k`` marked.
Both write atomically (PNG rendered to memory, then ``speccal.atomic``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from speccal.atomic import write_bytes_atomic
from speccal.replay import ReplayReport


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return write_bytes_atomic(path, buf.getvalue())


def plot_timeline(report: ReplayReport, path: str | Path, max_points: int = 20_000) -> Path:
    """Decision timeline PNG (see module docstring)."""
    plt = _pyplot()
    verify = report.mode == "target_verify"
    fig, ax = plt.subplots(figsize=(10, 4))
    shown = [r for r in report.runs if r.kind in ("adaptive-step", "adaptive-verify", "oracle")]
    shown.append(report.run(report.best_fixed))
    for run in shown:
        y = run.g if verify else run.k
        stride = max(1, y.size // max_points)
        x = np.arange(0, y.size, stride)
        ax.step(x, y[::stride], where="post", label=run.name, linewidth=1.2)
    phase = report.runs[0].phase
    for edge in np.flatnonzero(np.diff(phase)) + 1:
        ax.axvline(edge, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("round index (rounds)")
    ax.set_ylabel("padded target rows G (rows)" if verify else "draft steps k (forwards per round)")
    ax.set_title(f"Decision timeline ({report.mode})")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, Path(path))


def plot_throughput(report: ReplayReport, path: str | Path) -> Path:
    """Predicted tokens/s per policy PNG (see module docstring)."""
    plt = _pyplot()
    runs = [r for r in report.runs if r.priced]
    names = [r.name for r in runs]
    tps = [r.totals()["tokens_per_s"] for r in runs]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.2))
    colors = [
        "tab:orange"
        if n == report.best_fixed
        else ("tab:blue" if not n.startswith("fixed") else "tab:grey")
        for n in names
    ]
    ax.barh(names, tps, color=colors)
    for yi, v in enumerate(tps):
        ax.text(v, yi, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted throughput (output tokens/s)")
    ax.set_ylabel("policy")
    ax.set_title(f"Throughput by policy ({report.mode}; orange = best fixed k)")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, Path(path))


def write_plots(report: ReplayReport, directory: str | Path) -> list[Path]:
    """Write ``replay_timeline.png`` and ``replay_throughput.png`` into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return [
        plot_timeline(report, d / "replay_timeline.png"),
        plot_throughput(report, d / "replay_throughput.png"),
    ]
