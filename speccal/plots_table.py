"""Cost-table plots (matplotlib figures, PNG files): what a table measured and what it fitted.

Every figure is titled with the table's identity (:func:`table_title`: model architecture and a
shortened weight fingerprint, device kind and name, fitted model and mode), and draws one panel
per context interval (KV range) so a reader never mixes costs of different contexts.

- :func:`plot_fit`: full-step cost (ms) against target rows G, one colour per request bucket
  Bcap: every measured window (small dots), the median of each point (the value the fit used,
  large markers) and the fitted cost at every captured G of that Bcap (line). A captured G the
  table cannot price (uncalibrated) leaves a gap in the line.
- :func:`plot_residuals`: the residual map, a Bcap x G heatmap of ``measured - fitted`` in ms and
  in % of the measured cost (blank cell: point not measured).
- :func:`plot_components`: the additive parameters, ``alpha(Bcap)`` and ``theta(G)`` in ms, with
  the reference level (smallest Bcap, smallest G: fixed at 0) marked. Additive tables only.
- :func:`write_table_plots`: the applicable figures into one directory.

Each ``plot_*`` writes the figure its ``*_figure`` twin builds (the figure functions let tests
and notebooks inspect what is drawn).

Replay figures (decision timeline, throughput per policy) live in ``speccal.plots_replay``.
Pure matplotlib/numpy on a ``speccal.costmodel.table_schema.CostTable``: no torch. PNGs are rendered
to memory and written atomically (``speccal.base.atomic``).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

from speccal.base.atomic import ensure_dir, write_bytes_atomic
from speccal.base.errors import InputError
from speccal.costmodel.table_schema import ContextFit, CostTable

#: Residual maps annotate each cell with its value up to this many G columns.
MAX_ANNOTATED_COLUMNS = 16
FIT_PNG = "table_fit.png"
RESIDUALS_PNG = "table_residuals.png"
COMPONENTS_PNG = "table_components.png"
BCAP_LINESTYLES = ("-", (0, (6, 2)), (0, (2, 1.5)), (0, (6, 2, 1.5, 2)))


def save_png(fig: Figure, path: str | Path) -> Path:
    """Render ``fig`` to PNG in memory and write it atomically (the plots' one writer)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return write_bytes_atomic(Path(path), buf.getvalue())


def short_fingerprint(fingerprint: str, keep: int = 12) -> str:
    """``fingerprint`` cut to ``keep`` characters of its digest (an ellipsis marks the cut).

    A scheme prefix (``sha256:``, ``preset:``) is kept whole and not counted, so the title
    shows ``keep`` characters that tell two weights apart, not mostly the scheme name.
    """
    scheme, sep, digest = fingerprint.partition(":")
    if not (sep and digest and scheme.isalnum() and len(scheme) <= 16):
        scheme, sep, digest = "", "", fingerprint
    return fingerprint if len(digest) <= keep else f"{scheme}{sep}{digest[:keep]}\u2026"


def table_title(table: CostTable) -> str:
    """One line naming what the table is valid for: model, fingerprint, device, fit."""
    c = table.compatibility
    m = c.model
    return (
        f"{m.architecture} (fingerprint {short_fingerprint(m.fingerprint)}, {m.dtype}) on "
        f"{c.device.kind} '{c.device.name}' \u00b7 {table.model} fit, {table.mode}, "
        f"w={table.draft_width}"
    )


def _context_label(fit: ContextFit) -> str:
    return f"KV {fit.min_kv_length}\u2013{fit.max_kv_length} (prefill {fit.prefill_tokens})"


def _bcap_colors(bcaps: list[int]) -> dict[int, tuple]:
    cmap = matplotlib.colormaps["viridis"]
    n = max(len(bcaps) - 1, 1)
    # Stop short of viridis' pale yellow end, which vanishes on a white background.
    return {b: cmap(0.9 * i / n) for i, b in enumerate(bcaps)}


def _g_axis(ax, g_levels: list[int]) -> None:
    """Log2 G axis with a tick at each measured G (buckets are multiples of Bcap)."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(g_levels))
    if len(ticks) > 14:  # keep tick labels readable: every other level, always the ends
        ticks = sorted(set(ticks[::2]) | {ticks[-1]})
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())


def _panels(n: int, width: float, height: float, ncols: int = 1):
    fig = Figure(figsize=(width, height * n))
    return fig, fig.subplots(n, ncols, squeeze=False)


def fit_figure(table: CostTable):
    """Figure of measured vs fitted full-step cost by G, one line per Bcap, one panel per context.

    Each panel holds, per Bcap, a line labelled ``Bcap <b>`` through the table's cost at every
    captured G of that Bcap (NaN where uncalibrated), a scatter of the measured windows and a
    scatter of the point medians. Returns a ``matplotlib.figure.Figure``.
    """
    geom = table.geometry()
    surface = table.cost_surface()
    by_k = table.lookup().depends_on_k  # a line through the full batches, each at its own k
    ks = np.arange(1, table.draft_width + 1)
    all_windows = table.measurements()
    fig, axes = _panels(len(table.fits), 11.0, 4.6)
    for ax, fit in zip(axes[:, 0], table.fits, strict=True):
        windows = all_windows[all_windows["context_index"] == fit.context_index]
        points = {(p.bcap, p.g, p.k): p for p in fit.diagnostics.points}
        bcaps = sorted(fit.bcap_levels())
        colors = _bcap_colors(bcaps)
        kv = float(fit.min_kv_length)
        for i, b in enumerate(bcaps):
            col = colors[b]
            w = windows[windows["bcap"] == b]
            ax.scatter(w["g"], w["step_ms"], s=9, color=col, alpha=0.35, linewidths=0)
            pts = sorted((g, p.step_ms) for (bb, g, _), p in points.items() if bb == b)
            if pts:
                ax.scatter(
                    *zip(*pts, strict=True),
                    s=36,
                    color=col,
                    edgecolors="black",
                    linewidths=0.5,
                    zorder=3,
                )
            if by_k:
                gs = (b * (ks + 1)).astype(np.float64)
                fitted = surface(b, gs, kv, ks)
            else:
                gs = np.asarray(geom.target_rows.get(b, ()), dtype=np.float64)
                fitted = surface(b, gs, kv) if gs.size else gs
            # Own dash pattern per Bcap: nearly equal alpha(Bcap) puts two lines on top of
            # each other, and colour alone does not show the one underneath.
            ax.plot(
                gs,
                fitted,
                color=col,
                linewidth=1.6,
                linestyle=BCAP_LINESTYLES[i % len(BCAP_LINESTYLES)],
                label=f"Bcap {b}",
            )
        _g_axis(ax, sorted({g for b in bcaps for g in geom.target_rows.get(b, ())}))
        ax.set_xlabel("target rows G (rows, log scale)")
        ax.set_ylabel("full-step cost (ms)")
        ax.set_title(_context_label(fit), fontsize=10)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        handles += [
            Line2D([], [], marker="o", linestyle="", color="grey", alpha=0.5, markersize=4),
            Line2D(
                [],
                [],
                marker="o",
                linestyle="",
                color="grey",
                markeredgecolor="black",
                markersize=7,
            ),
        ]
        labels += ["measured window", "point median (fitted on)"]
        # Outside the axes: small-G points sit top left, where an inside legend would hide them.
        ax.legend(
            handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    fig.suptitle(f"Measured vs fitted cost by G\n{table_title(table)}", fontsize=11)
    fig.tight_layout()
    return fig


def plot_fit(table: CostTable, path: str | Path) -> Path:
    """Write :func:`fit_figure` as a PNG at ``path`` (atomically); returns the path."""
    return save_png(fit_figure(table), path)


def _residual_grid(fit: ContextFit) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
    bcaps = sorted({p.bcap for p in fit.diagnostics.points})
    gs = sorted({p.g for p in fit.diagnostics.points})
    ms = np.full((len(bcaps), len(gs)), np.nan)
    pct = np.full_like(ms, np.nan)
    for p in fit.diagnostics.points:
        i, j = bcaps.index(p.bcap), gs.index(p.g)
        ms[i, j] = np.nan if p.residual_ms is None else p.residual_ms
        pct[i, j] = np.nan if p.residual_pct is None else p.residual_pct
    return bcaps, gs, ms, pct


def _heatmap(fig, ax, data: np.ndarray, bcaps: list[int], gs: list[int], unit: str, fmt: str):
    lim = float(np.nanmax(np.abs(data))) if np.isfinite(data).any() else 1.0
    lim = lim if lim > 0 else 1.0
    # Unmeasured cells in a mid grey: a near-white "0.0" and "not measured" must not look alike.
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#b0b0b0")
    im = ax.imshow(
        np.ma.masked_invalid(data), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", origin="lower"
    )
    ax.set_xticks(range(len(gs)), [str(g) for g in gs], rotation=90 if len(gs) > 10 else 0)
    ax.set_yticks(range(len(bcaps)), [str(b) for b in bcaps])
    ax.set_xlabel("target rows G (rows); grey cell: not measured")
    ax.set_ylabel("request bucket Bcap (requests)")
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(f"measured \u2212 fitted ({unit})")
    if len(gs) <= MAX_ANNOTATED_COLUMNS:
        for i in range(len(bcaps)):
            for j in range(len(gs)):
                v = data[i, j]
                if math.isfinite(v):
                    dark = abs(v) > 0.6 * lim
                    ax.text(
                        j,
                        i,
                        _signed(v, fmt),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )


def _signed(v: float, fmt: str) -> str:
    """``v`` with its sign; an exact zero (up to float round-off) as a plain ``0``."""
    return "0" if abs(v) < 1e-9 else format(v, fmt)


def residuals_figure(table: CostTable):
    """Residual map: Bcap x G heatmaps of ``measured - fitted`` in ms and in %, per context.

    One row of two panels (ms, %) per context interval; image rows are Bcap levels, columns G
    levels. Grey cells were not measured. Values are written in the cells when there are at
    most :data:`MAX_ANNOTATED_COLUMNS` G levels. Returns a ``matplotlib.figure.Figure``.
    """
    fig, axes = _panels(len(table.fits), 13.0, 3.8, ncols=2)
    for row, fit in zip(axes, table.fits, strict=True):
        bcaps, gs, ms, pct = _residual_grid(fit)
        _heatmap(fig, row[0], ms, bcaps, gs, "ms", "+.3f")
        _heatmap(fig, row[1], pct, bcaps, gs, "% of measured", "+.1f")
        e = fit.diagnostics.leave_one_point_out
        held = "-" if e.mean_abs_pct is None else f"{e.mean_abs_pct:.2f}%"
        row[0].set_title(f"{_context_label(fit)}: residual (ms)", fontsize=10)
        row[1].set_title(f"residual (%); leave-one-point-out mean |error| {held}", fontsize=10)
    fig.suptitle(f"Residual map (measured \u2212 fitted)\n{table_title(table)}", fontsize=11)
    fig.tight_layout()
    # A residual of exactly 0 is not luck: the point is the only evidence for one of its levels,
    # so the fit passes through it (and leave-one-point-out cannot evaluate it).
    fig.text(
        0.01,
        -0.01,
        "0 (exactly): the point alone determines its Bcap or G level, so the "
        "fit passes through it and no held-out error exists for it.",
        fontsize=8,
        ha="left",
        va="top",
    )
    return fig


def plot_residuals(table: CostTable, path: str | Path) -> Path:
    """Write :func:`residuals_figure` as a PNG at ``path`` (atomically); returns the path."""
    return save_png(residuals_figure(table), path)


def components_figure(table: CostTable):
    """Additive components ``alpha(Bcap)`` and ``theta(G)`` (ms), reference level marked.

    Two panels (alpha by Bcap, theta by G), one line per context interval in each; the legend
    gives each context's bias (the cost of the reference cell: smallest Bcap, smallest G), and
    a red ring marks the reference level fixed at 0 ms. Returns a ``matplotlib.figure.Figure``.

    Raises
    ------
    InputError
        The table is not an additive table (SPS tables have no components).
    """
    if table.model != "additive":
        raise InputError("table.model", table.model, "an additive table (sps has no components)")
    fig = Figure(figsize=(13.0, 4.4))
    ax_a, ax_t = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["tab10"]
    all_b: set[int] = set()
    all_g: set[int] = set()
    for i, fit in enumerate(table.fits):
        p = fit.additive
        col = cmap(i % 10)
        label = f"{_context_label(fit)}, bias {p.bias_ms:.3f} ms"
        ax_a.plot(p.bcap_levels, p.alpha_ms, marker="o", color=col, label=label)
        ax_t.plot(p.g_levels, p.theta_ms, marker="o", color=col, label=label)
        all_b.update(p.bcap_levels)
        all_g.update(p.g_levels)
    ref_b, ref_g = min(all_b), min(all_g)
    for ax, ref, name in ((ax_a, ref_b, "Bcap"), (ax_t, ref_g, "G")):
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.scatter(
            [ref],
            [0.0],
            s=160,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            zorder=4,
            label=f"reference level: {name} = {ref} fixed at 0 ms",
        )
        ax.grid(alpha=0.3)
        # Below the axes: the reference level sits at the top left corner of each panel.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, frameon=False)
    _g_axis(ax_a, sorted(all_b))
    _g_axis(ax_t, sorted(all_g))
    ax_a.set_xlabel("request bucket Bcap (requests, log scale)")
    ax_a.set_ylabel("alpha(Bcap) (ms)")
    ax_a.set_title("alpha: cost added by the request bucket", fontsize=10)
    ax_t.set_xlabel("target rows G (rows, log scale)")
    ax_t.set_ylabel("theta(G) (ms)")
    ax_t.set_title("theta: cost added by the target rows", fontsize=10)
    fig.suptitle(
        "Additive components: cost = bias + alpha(Bcap) + theta(G)\n" + table_title(table),
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def plot_components(table: CostTable, path: str | Path) -> Path:
    """Write :func:`components_figure` as a PNG at ``path`` (atomically); returns the path.

    Raises ``InputError`` for a table that is not additive.
    """
    return save_png(components_figure(table), path)


def write_table_plots(table: CostTable, directory: str | Path) -> list[Path]:
    """Write the applicable table figures into ``directory`` (created if missing).

    ``table_fit.png`` and ``table_residuals.png`` always; ``table_components.png`` for additive
    tables. Returns the written paths.
    """
    d = ensure_dir(directory, "out")  # OutputError: a file there, or no permission
    out = [plot_fit(table, d / FIT_PNG), plot_residuals(table, d / RESIDUALS_PNG)]
    if table.model == "additive":
        out.append(plot_components(table, d / COMPONENTS_PNG))
    return out
