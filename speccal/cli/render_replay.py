"""How the replay-side commands print (``replay``, ``trace``, ``plot``, ``export``, ``import``):
Rich on stderr; ``--json`` documents go to stdout from the commands themselves.

Each ``print_*`` takes the library's document (``speccal.replay_run.replay_doc``,
``speccal.interop.export.run_export``'s report, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from speccal.base.rich_tables import make_console, print_table
from speccal.replay_run import state_traffic_line

err_console = make_console()


def _fmt(v: float | None, spec: str, none: str = "-") -> str:
    """``v`` formatted with ``spec``; ``none`` when the document has no value (None)."""
    return none if v is None else format(v, spec)


def print_export(report: dict, out: Path, sidecar: Path) -> None:
    """``export``: per bucket the predicted tokens/s of every ``k``, the best and the exported
    ``k``, the workload's gain, the engine rules and caveats applied, and the files written."""
    w = report["table"]["draft_width"]
    buckets = report["buckets"]
    if buckets:
        t = Table(
            title=f"{report['engine']['name']} {report['engine']['format']}: predicted tokens/s "
            f"per bucket (table {report['table']['mode']}, w={w})",
            title_justify="left",
        )
        for col in ("Bcap", *(f"k={k}" for k in range(w + 1)), "best", "exported", "margin %"):
            t.add_column(col, justify="right")
        for b in buckets:
            tps = b["tokens_per_s"]
            decisive = {True: "", False: " (within error)", None: ""}[b["decisive"]]
            t.add_row(
                str(b["bcap"]),
                *(_fmt(tps.get(str(k)), ",.0f") for k in range(w + 1)),
                "uncalibrated" if b["uncalibrated"] else str(b["best_k"]),
                str(b["exported_k"]),
                _fmt(b["margin_pct"], ".2f") + decisive,
            )
        print_table(err_console, t)
    held = report["table"]["heldout"]
    if held["metric"]:
        err_console.print(
            f"table held-out error: {held['pct']:.2f} % ({held['metric']})", markup=False
        )
    wl = report["workload"]
    if wl and "schedule_tokens_per_s" in wl:
        where = f"{wl['rounds']:,} rounds" if "rounds" in wl else "equal time per bucket"
        err_console.print(
            f"workload ({where}): exported schedule "
            f"{wl['schedule_tokens_per_s']:,.1f} tokens/s, "
            f"{wl['gain_vs_best_fixed_pct']:+.2f} % over the best single fixed k "
            f"(k={wl['best_fixed_k']})",
            markup=False,
        )
    elif wl and wl.get("adaptive_gain_vs_best_fixed_pct") is not None:
        err_console.print(
            f"workload ({wl['rounds']:,} rounds): {wl['adaptive_policy']} (the planner's "
            f"analogue) {wl['adaptive_gain_vs_best_fixed_pct']:+.2f} % over {wl['best_fixed']}",
            markup=False,
        )
    for a in report["adjustments"]:
        err_console.print(
            f"engine rule: Bcap {a['bcap']} exported k={a['exported_k']} (best {a['best_k']}, "
            f"{_fmt(a['tokens_per_s_lost_pct'], '.2f')} % tokens/s lost): {a['why']}",
            markup=False,
        )
    pb = report.get("per_bucket")
    if pb and pb["gain_pct"] is not None:
        err_console.print(
            f"per batch size vs per bucket: {pb['tokens_per_s']:,.1f} vs "
            f"{pb['per_bucket_tokens_per_s']:,.1f} tokens/s ({pb['gain_pct']:+.2f} %, at most "
            f"{pb['max_gain_pct']:+.2f} % at one batch size; {len(report['ranges'])} ranges; "
            f"batch sizes whose k differs: {pb['batch_sizes_differing'] or 'none'})",
            markup=False,
        )
    for c in report.get("caveats", []):
        if c["applies"]:
            err_console.print(
                f"warning: {report['engine']['name']} {c['id']}: {c['changes']} "
                f"({', '.join(c['sources'])})",
                markup=False,
                soft_wrap=True,
            )
    fid = report["fidelity"]
    if fid:
        err_console.print(
            f"engine reading vs table: max {_fmt(fid['max_abs_diff_pct'], '.2f')} % over "
            f"{fid['points']} priced (num_reqs, M) points",
            markup=False,
        )
    err_console.print(f"wrote {out} and {sidecar}", markup=False)


def print_import(summary: dict) -> None:
    """``import``: the trace written, its rounds and per-position acceptance, on one line."""
    p = ", ".join(f"{v:.3f}" for v in summary["prefix_acceptance"])
    err_console.print(
        f"wrote {summary['path']}: {summary['steps']:,} steps of {summary['format']} as "
        f"{summary['rounds']:,} rounds, w={summary['draft_width']}, per-position acceptance [{p}]"
        + ("" if summary["exact"] else " (scaled to --max-rows)")
        + (f"; shape {summary['shape']}" if "shape" in summary else "")
        + ("; estimated per position over several draft lengths" if "estimator" in summary else ""),
        markup=False,
        soft_wrap=True,  # one line, whatever the path's length
    )


def print_replay(d: dict[str, Any]) -> None:
    """``replay``: the adaptive-step settings, a row per policy, the table's state handling, the
    per-phase oracle and each adaptive policy's gain over the best fixed ``k``."""
    verify = d["mode"] == "target_verify"
    c = d["config"]
    if any(p.startswith("adaptive-step") for p in c["policies"]):
        err_console.print(
            f"adaptive step: window {c['window_size']}, update interval {c['update_interval']}, "
            f"switch min gain {c['switch_min_gain']:g} ({c.get('step_source', 'default')})",
            markup=False)
    t = Table(
        title=f"replay: {d['rounds']:,} rounds, mode {d['mode']}, w={d['draft_width']}, best fixed {d['best_fixed']}",
        title_justify="left",
    )
    for col in (
        "policy",
        "tokens/s",
        "TPOT ms",
        "accept rate",
        "mean accepted",
        "mean G" if verify else "mean k",
        "switches",
        "gain vs best fixed %",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in d["policies"]:
        if not p["priced"]:
            unpriced = p["rounds"] - p["rounds_priced"]
            t.add_row(p["name"], f"uncalibrated ({unpriced}/{p['rounds']} rounds)", "-", "-", "-",
                      "-", "-", "-")
            continue
        # Any metric may be None (no finite value, e.g. no priced baseline to compare with).
        t.add_row(
            p["name"],
            _fmt(p.get("tokens_per_s"), ",.1f", "n/a"),
            _fmt(p.get("tpot_ms"), ".3f", "n/a"),
            _fmt(p.get("acceptance_rate"), ".3f", "n/a"),
            _fmt(p.get("mean_accepted_length"), ".3f", "n/a"),
            _fmt(p.get("mean_g" if verify else "mean_k"), ".2f", "n/a"),
            str(p["switches"]),
            _fmt(p.get("gain_vs_best_fixed_pct"), "+.2f", "n/a"),
        )
    print_table(err_console, t)
    strategy = d.get("table", {}).get("state_strategy", "none")
    if strategy != "none":
        err_console.print(f"recurrent-state strategy: {strategy} (its cost is inside every "
                          "round cost the table measured)", markup=False)
    traffic = d.get("table", {}).get("state_traffic")
    if traffic:
        err_console.print(state_traffic_line(traffic), soft_wrap=True)
    err_console.print(f"per-phase oracle choice: {d['oracle_per_phase']}", markup=False)
    line = kv_spread_line(d.get("kv_spread"), d["policies"], priced=bool(d.get("spread_priced")))
    if line:
        err_console.print(line, markup=False, soft_wrap=True)
    for p in d["policies"]:
        gain = p.get("gain_vs_best_fixed_pct")
        if p["name"].startswith("adaptive") and gain is not None:
            err_console.print(
                f"{p['name']}: {gain:+.2f} % tokens/s over the best fixed k ({d['best_fixed']}), "
                f"{p['switches']} switch(es)",
                markup=False,
            )


def print_plot(summary: dict[str, Any]) -> None:
    """``plot``: the files written and, with a replay, each adaptive policy's gain."""
    for p in summary["plots"]:
        err_console.print(f"wrote {p}", markup=False)
    if "replay" in summary:
        r = summary["replay"]
        gains = ", ".join(
            f"{k} " + ("n/a (not priced on every round)" if v is None else f"{v:+.2f}%")
            for k, v in r["gain_vs_best_fixed_pct"].items()
        )
        err_console.print(
            f"replay: best fixed {r['best_fixed']}; gain vs best fixed: {gains}", markup=False
        )


#: the share of rounds (%) whose longest request sits past 1.5x the batch's mean KV above which
#: the replay cautions that its prices are low there
SPREAD_CAUTION_PCT = 10.0


def spread_is_wide(spread: dict | None) -> bool:
    """Whether more than :data:`SPREAD_CAUTION_PCT` % of the rounds spread past 1.5x."""
    return bool(spread) and spread["rounds_past_1_5x_pct"] > SPREAD_CAUTION_PCT


def kv_spread_line(spread: dict | None, policies: list[dict] | None = None, *,
                   priced: bool = False) -> str | None:
    """One line on how far the rounds' KV lengths spread past the mean each is priced at
    (``RoundTrace.kv_spread``), with a caution where many rounds spread far and, there, each
    policy's tokens/s priced at every round's longest request (the other end of the range the
    truth lies in); None without it. ``priced``: the table's spread term priced the rounds
    (``speccal.costmodel.spread``): said instead of the caution."""
    if not spread:
        return None
    line = (f"KV spread: the longest request at {spread['median_max_over_mean']:.2f}x its "
            f"round's mean KV (median; 90th percentile {spread['p90_max_over_mean']:.2f}x), "
            f"{spread['rounds_past_1_5x_pct']:.0f} % of rounds past 1.5x")
    if priced:
        line += ("; priced by the table's spread term (measured per request bucket with half "
                 "the requests short and half long; one request far longer than the rest can "
                 "still cost more)")
    elif spread_is_wide(spread):
        line += (". Rounds are priced at their mean KV and the calibration measures batches "
                 "of near-equal KV lengths: a batch whose KV spreads costs more than its mean "
                 "(most where one request is much longer than the rest; "
                 "bench/bench_kv_spread.py measures it), so read these rounds' predicted "
                 "tokens/s as optimistic")
        ends = [f"{p['name']} {p['tokens_per_s_at_longest_kv']:,.1f}"
                for p in policies or () if p.get("tokens_per_s_at_longest_kv") is not None]
        if ends:
            line += ("; priced as if every request were its round's longest (a floor): "
                     + ", ".join(ends) + " tokens/s")
    return line
