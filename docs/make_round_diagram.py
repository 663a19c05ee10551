"""Draw docs/round.svg: one engine round on the host and the device, at queue depth 0 and 1.

Usage: python3 docs/make_round_diagram.py [--out docs/round.svg]

What it shows is ``speccal.runner.engine.Engine.step`` and ``speccal.runner.round.RoundRunner``
(docs/ARCHITECTURE.md, "Runner"): the host stages a round's facts into one of two staging slots
(``prepare``), the device derives the round's metadata from the per-slot state and runs the
draft graph, the verify allocation under a budget, the target graph (verify update, forward,
acceptance, slot advance) and the copy of the results into that staging slot; ``collect`` waits
for that copy and applies the stop rules. At depth 1 (``EngineConfig.pipeline``) round n + 1 is
prepared and queued before round n is collected, so the host work hides behind the device's.
The lengths are schematic, not measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

HOST = "#dbe8f5"
DEVICE = "#f6e0c8"
WAIT = "#eeeeee"

#: (label, start, length) of the device phases of one round, in schematic time units
DEVICE_PHASES = (("derive\ninputs", 0.0, 0.7), ("draft graph\nextend + k-1 steps", 0.7, 2.2),
                 ("verify\nalloc*", 2.9, 0.7), ("target graph: verify update,\nforward, "
                                                 "acceptance, slot advance", 3.6, 3.7),
                 ("copy to\nslot", 7.3, 0.7))
ROUND = 8.0  # device length of one round


def box(ax, x, y, w, h, label, color, size=None):
    size = size or (6.5 if w < 0.8 else 7.5)
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="#555555", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=size)


def device_round(ax, t0, y, n):
    for label, start, length in DEVICE_PHASES:
        box(ax, t0 + start, y, length, 0.8, label.replace("k-1", "k - 1"), DEVICE)
    ax.text(t0 + ROUND / 2, y + 0.95, f"round {n}", ha="center", fontsize=8, weight="bold")


def draw(out: Path) -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(16, 6.2), gridspec_kw={"height_ratios": [1, 1]})
    # ---- depth 0: prepare, execute, collect in sequence
    ax = axes[0]
    ax.set_title("queue depth 0 (--loop synchronous): each round collected before the next is "
                 "prepared", fontsize=9, loc="left")
    t = 0.0
    for n in (1, 2):
        box(ax, t, 2.0, 1.2, 0.8, f"admit, plan,\nprepare {n}\n(slot {n % 2})", HOST)
        device_round(ax, t + 1.2, 0.4, n)
        box(ax, t + 1.2, 2.0, ROUND, 0.8, "wait (the host is idle)", WAIT)
        box(ax, t + 1.2 + ROUND, 2.0, 1.0, 0.8, f"collect {n}\nstop rules", HOST)
        t += 1.2 + ROUND + 1.0
    # ---- depth 1: round n + 1 queued before round n is collected
    ax = axes[1]
    ax.set_title("queue depth 1 (default, EngineConfig.pipeline): round n + 1 prepared and "
                 "queued while round n runs; two staging slots", fontsize=9, loc="left")
    box(ax, 0.0, 2.0, 1.2, 0.8, "admit, plan,\nprepare 1\n(slot 1)", HOST)
    host = 1.2  # the host's clock: step n + 1 prepares and queues round n + 1, then collects n
    for n in (1, 2, 3):
        t0 = 1.2 + (n - 1) * ROUND
        device_round(ax, t0, 0.4, n)
        if n < 3:
            start = max(host, t0 + 0.2)
            box(ax, start, 2.0, 1.4, 0.8,
                f"admit, plan,\nprepare {n + 1}\n(slot {(n + 1) % 2})", HOST)
            box(ax, start + 1.4, 2.0, t0 + ROUND - start - 1.4, 0.8,
                f"collect {n}: wait for its copy", WAIT)
            box(ax, t0 + ROUND, 2.0, 1.0, 0.8, f"stop rules\nround {n}", HOST)
            host = t0 + ROUND + 1.0
    for ax in axes:
        ax.set_xlim(-0.3, 26.5)
        ax.set_ylim(0.1, 3.3)
        ax.set_yticks([0.8, 2.4], ["device\n(one stream)", "host"], fontsize=8)
        ax.set_xticks([])
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    fig.text(0.01, 0.01, "* verify alloc: only under a verify budget (adaptive target verify), "
             "on the device between the draft and the target graph. Schematic lengths; the "
             "measured ones: bench/bench_round_phases.py (prepare, execute, collect, wall / "
             "device).", fontsize=7.5)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "round.svg"))
    print(draw(Path(ap.parse_args().out)))


if __name__ == "__main__":
    main()
