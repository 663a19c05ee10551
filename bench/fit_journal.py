"""Fit a table from a calibration journal that did not finish (a run killed by a deadline).

Usage: python3 bench/fit_journal.py JOURNAL.jsonl --out TABLE.json [--windows-per-point N]

Selects the grid's windows as a calibration does (``speccal.calibrate.gate.select_windows``:
every complete round of each point, pooled; N default the journal's ``windows_per_point``),
fits the additive model (and the KV-aware model when the journal holds three or more contexts)
with the journal header's compatibility and calibration config, fits the KV spread term from
the spread points' windows (rows with a ``layout``, kept apart from the grid's: they share its
keys) as calibrate does (``speccal.costmodel.spread.fit_spread``), writes the table and prints
the spreads and the KV model's held-out errors.
A diagnostic for bench/RESULTS.md; `speccal calibrate --resume` is the user's way to finish a
run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import pandas as pd

from speccal.calibrate.gate import GateConfig, select_windows
from speccal.calibrate.grid import GridPoint
from speccal.costmodel.spread import fit_spread, split_windows
from speccal.costmodel.table import save_table
from speccal.costmodel.table_build import assemble_table, fit_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("journal")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows-per-point", type=int, default=None,
                    help="default: the journal's calibration config's")
    args = ap.parse_args()
    lines = [json.loads(line) for line in open(args.journal, encoding="utf-8")]
    head, windows = lines[0], [x["row"] for x in lines[1:] if x.get("kind") == "window"]
    config = head.get("config") or {}
    w = args.windows_per_point or int(config.get("windows_per_point", 3))
    rows, spread_rows = split_windows(windows)
    # select_windows looks points up by (context, Bcap, G, k) only
    points = [GridPoint(*key, None) for key in
              sorted({(r["context_index"], r["bcap"], r["g"], r["k"]) for r in rows})]
    sel = select_windows(rows, points, w, GateConfig.resolve(
        head["compatibility"]["device"]["kind"]))
    kept = sel.rows
    first = [q.spreads[0] for q in sel.points if q.spreads and q.spreads[0] is not None]
    print(f"{len(points)} points, {len(kept)} windows kept; first-round spread median "
          f"{statistics.median(first):.1f} % max {max(first):.1f} %; pooled rounds' max "
          f"{sel.spread_max_pct:.1f} %")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = fit_table(pd.DataFrame(kept), model="additive",
                          compatibility=head["compatibility"], calibration=config or None)
        spread = fit_spread(kept, spread_rows) if spread_rows else None
        table = assemble_table(parts, kv_spread=spread)
    print(f"{len(spread_rows)} spread windows: "
          f"{len((spread or {}).get('points', []))} spread points fitted")
    save_table(table, args.out)
    doc = json.load(open(args.out, encoding="utf-8"))
    km = doc.get("kv_model")
    if km:
        pts = [p for p in km["points"] if p.get("loco_ms") is not None]
        loco = [abs(p["loco_ms"] - p["step_ms"]) / p["step_ms"] * 100 for p in pts]
        print(f"KV model {km['kv_term']}: leave-one-context-out median "
              f"{statistics.median(loco):.2f} % mean {statistics.mean(loco):.2f} % over "
              f"{len(loco)} points; leave-one-point-out mean "
              f"{km['leave_one_point_out']['mean_abs_pct']:.2f} %")


if __name__ == "__main__":
    main()
