"""Replay plots (matplotlib figures, PNG files): decision timeline and throughput by policy.

- :func:`timeline_figure`: ``k`` (draft step) or padded target rows ``G`` (target verify)
  against the round index, one step line per adaptive policy, the per-phase oracle and the best
  fixed ``k``. Policies that decide alike would draw the very same line (the oracle hidden under
  the best fixed ``k``), so each line has its own colour, line style and marker and is drawn
  with a small vertical offset (at most :data:`OFFSET_FRACTION` of the spacing between levels,
  stated in the legend). The y axis has integer ticks only (``G``: the levels drawn). Phase
  boundaries are dotted vertical lines, phase names label the top axis. Long traces are reduced
  to at most ``max_points`` rounds per line by taking every n-th round (decisions are piecewise
  constant, so the shape survives).
- :func:`throughput_figure`: horizontal bars of predicted tokens/s per policy with the value and
  the gain vs the best fixed ``k`` at each bar (the x axis is widened so the labels fit), the
  best fixed ``k`` marked by colour and a dashed line; a policy the table cannot price on every
  round gets no bar and says so.

Both take an optional ``title`` (a second title line; ``speccal.plots_table.table_title`` names
the table's model fingerprint and device). Each ``plot_*`` writes the figure its ``*_figure``
twin builds, atomically (``speccal.plots_table.save_png``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, MaxNLocator

from speccal.base.atomic import ensure_dir
from speccal.plots_table import save_png
from speccal.replay import PolicyRun, ReplayReport

#: Largest vertical offset between two timeline lines, as a fraction of the level spacing.
OFFSET_FRACTION = 0.08
#: Markers per timeline line (staggered between lines so they never sit on each other).
MARKERS_PER_LINE = 10
#: Phase names label the top axis up to this many phases.
MAX_PHASE_LABELS = 24
TIMELINE_PNG = "replay_timeline.png"
THROUGHPUT_PNG = "replay_throughput.png"
#: (colour, line style, marker) per kind of run; one colour per kind in both figures.
STYLE = {
    "adaptive-step": ("tab:blue", "-", "o"),
    "adaptive-verify": ("tab:blue", "-", "o"),
    "oracle": ("tab:purple", "--", "s"),
    "best": ("tab:orange", ":", "^"),
    "fixed": ("tab:grey", "-", None),
}


def _title(text: str, title: str | None) -> str:
    return text if not title else f"{text}\n{title}"


def _style(report: ReplayReport, run: PolicyRun) -> tuple[str, str, str | None]:
    if run.name == report.best_fixed:
        return STYLE["best"]
    return STYLE.get(run.kind, STYLE["fixed"])


def _phase_name(report: ReplayReport, ph: int) -> str:
    return report.phase_names[ph] if ph < len(report.phase_names) else str(ph)


def timeline_figure(report: ReplayReport, max_points: int = 20_000, title: str | None = None):
    """Decision timeline figure (see module docstring); returns a ``matplotlib.figure.Figure``.

    Lines are labelled ``<policy name>`` plus the offset they are drawn with (``drawn +0.08``);
    the y data of each line is its decision plus that offset.
    """
    verify = report.mode == "target_verify"
    fig = Figure(figsize=(11, 4.2))
    ax = fig.subplots()
    shown = [r for r in report.runs if r.kind in ("adaptive-step", "adaptive-verify", "oracle")]
    shown.append(report.run(report.best_fixed))
    values = [np.asarray(r.g if verify else r.k) for r in shown]
    levels = np.unique(np.concatenate([v[v > 0] for v in values] + [np.zeros(0, dtype=int)]))
    spacing = float(np.min(np.diff(levels))) if levels.size > 1 else 1.0
    spacing = spacing if verify else 1.0
    n = len(shown)
    unit = "rows" if verify else "k"
    for i, (run, y) in enumerate(zip(shown, values, strict=True)):
        off = (i - (n - 1) / 2) * OFFSET_FRACTION * spacing
        stride = max(1, y.size // max_points)
        x = np.arange(0, y.size, stride)
        every = max(1, x.size // MARKERS_PER_LINE)
        color, ls, marker = _style(report, run)
        label = run.name + (f" (drawn {off:+.2g} {unit})" if off else "")
        if run.name == report.best_fixed:
            label = label.replace(run.name, f"{run.name} (best fixed)", 1)
        ax.step(
            x,
            y[::stride] + off,
            where="post",
            label=label,
            color=color,
            linestyle=ls,
            linewidth=1.6,
            marker=marker,
            markersize=5,
            markevery=(min(i * every // n, x.size - 1), every),
        )
    phase = report.runs[0].phase
    edges = np.flatnonzero(np.diff(phase)) + 1
    for edge in edges:
        ax.axvline(edge, color="grey", linestyle=":", linewidth=1)
    bounds = np.concatenate(([0], edges, [phase.size]))
    if 1 < bounds.size - 1 <= MAX_PHASE_LABELS:
        top = ax.secondary_xaxis("top")
        top.xaxis.set_major_locator(FixedLocator(((bounds[:-1] + bounds[1:]) / 2).tolist()))
        top.set_xticklabels([_phase_name(report, int(phase[a])) for a in bounds[:-1]], fontsize=8)
        top.tick_params(length=0)
        top.set_xlabel("phase", fontsize=8)
    if verify:
        ax.set_ylabel("padded target rows G (rows)")
        if 0 < levels.size <= 12:
            ax.yaxis.set_major_locator(FixedLocator(levels.tolist()))
        else:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        pad = max(spacing * 0.5, 1.0)
        if levels.size:
            ax.set_ylim(levels[0] - pad, levels[-1] + pad)
    else:
        ax.set_ylabel("draft steps k (forwards per round)")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0.5, report.draft_width + 0.5)
    ax.set_xlabel("round index (rounds)")
    # A small margin: round 0 (the warm-up decision) would otherwise sit on the axis spine.
    span = max(int(r.k.size) for r in shown)
    ax.set_xlim(-0.01 * span, 1.01 * span)
    ax.set_title(_title(f"Decision timeline ({report.mode})", title), fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
        title=f"lines offset vertically\n(at most \u00b1{OFFSET_FRACTION * spacing * (n - 1) / 2:.2g}"
        f" {unit}) so equal\ndecisions stay visible",
        title_fontsize=8,
        alignment="left",
    )
    fig.tight_layout()
    return fig


def plot_timeline(
    report: ReplayReport, path: str | Path, max_points: int = 20_000, title: str | None = None
) -> Path:
    """Write :func:`timeline_figure` as a PNG at ``path`` (atomically); returns the path."""
    return save_png(timeline_figure(report, max_points, title), Path(path))


def throughput_figure(report: ReplayReport, title: str | None = None):
    """Predicted tokens/s per policy (see module docstring); returns a ``Figure``.

    Bars in report order (policies, oracle, fixed ``k``); each priced bar is labelled
    ``<tokens/s> (<gain vs best fixed>%)``; unpriced policies are labelled ``not priced``.
    """
    runs = report.runs
    best = report.run(report.best_fixed).totals()["tokens_per_s"]
    tps = [r.totals()["tokens_per_s"] if r.priced else 0.0 for r in runs]
    fig = Figure(figsize=(9, 0.45 * len(runs) + 1.6))
    ax = fig.subplots()
    ax.barh([r.name for r in runs], tps, color=[_style(report, r)[0] for r in runs])
    ax.axvline(best, color=STYLE["best"][0], linestyle="--", linewidth=1, zorder=2)
    labels = []
    for yi, (run, v) in enumerate(zip(runs, tps, strict=True)):
        if not run.priced:
            text = " not priced on every round (no tokens/s)"
        elif run.name == report.best_fixed:
            text = f" {v:,.0f} (best fixed)"
        else:
            text = f" {v:,.0f} ({100.0 * (v / best - 1.0):+.1f}%)"
        # White box: the dashed best-fixed line must not run through a label.
        labels.append(
            ax.text(
                v,
                yi,
                text,
                va="center",
                fontsize=8,
                zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.9},
            )
        )
    ax.invert_yaxis()
    ax.set_xlabel("predicted throughput (output tokens/s)")
    ax.set_ylabel("policy")
    ax.set_title(_title(f"Throughput by policy ({report.mode})", title), fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    kinds = {_style(report, r)[0] for r in runs}
    names = {
        STYLE["adaptive-step"][0]: "adaptive policy",
        STYLE["oracle"][0]: "per-phase oracle (hindsight)",
        STYLE["best"][0]: "best fixed k (dashed line)",
        STYLE["fixed"][0]: "other fixed k",
    }
    ax.legend(
        handles=[Patch(color=c, label=names[c]) for c in names if c in kinds],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    # Widen the x axis so every label ends inside the axes. A label is a fixed number of pixels
    # wide whatever the limits, so with the axes W pixels wide, a bar ending at v fits its
    # label when v * W / x_max + label_px <= W / 1.03 (3% air), i.e. x_max >= v * W / (W / 1.03
    # - label_px). Measured after tight_layout, which fixes W.
    fig.tight_layout()
    fig.canvas.draw()
    axes_px = ax.get_window_extent().width
    need = [
        v * axes_px / max(axes_px / 1.03 - t.get_window_extent().width, 1.0)
        for v, t in zip(tps, labels, strict=True)
    ]
    ax.set_xlim(0, max(max(need), max(tps) * 1.02))
    return fig


def plot_throughput(report: ReplayReport, path: str | Path, title: str | None = None) -> Path:
    """Write :func:`throughput_figure` as a PNG at ``path`` (atomically); returns the path."""
    return save_png(throughput_figure(report, title), Path(path))


def write_plots(
    report: ReplayReport, directory: str | Path, title: str | None = None
) -> list[Path]:
    """Write ``replay_timeline.png`` and ``replay_throughput.png`` into ``directory``.

    ``title``: a second title line for both figures (e.g. ``table_title(table)``).
    """
    d = ensure_dir(directory, "out")  # OutputError: a file there, or no permission
    return [
        plot_timeline(report, d / TIMELINE_PNG, title=title),
        plot_throughput(report, d / THROUGHPUT_PNG, title=title),
    ]
