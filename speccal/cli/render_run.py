"""How the runner's commands print (``generate``, ``bench``, ``bench --policy``): Rich on stderr,
``--json`` documents on stdout.

Each ``print_*`` takes the library's document (``speccal.live.generate.run_generate``,
``speccal.live.bench.bench``, ``speccal.live.bench.run_policy_bench``) with NaN already None.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speccal.base.progress import ProgressReporter
from speccal.base.rich_tables import make_console, print_table
from speccal.cli.render_replay import kv_spread_line, spread_is_wide

err_console = make_console()


def print_generate(doc: dict) -> None:
    """The generated ids (and text) of every request, and the acceptance of a speculative run."""
    for i, item in enumerate(doc["outputs"]):
        err_console.print(f"[bold]request {i}[/] ids: {escape(str(item['output_ids']))}",
                          soft_wrap=True)
        if "text" in item:
            err_console.print(f"  text: {item['text']!r}", soft_wrap=True, markup=False)
    stats = doc["stats"]
    if stats:
        err_console.print(
            f"k={doc['num_draft_steps']}: acceptance rate {stats['acceptance_rate']:.3f}, mean "
            f"accepted length {stats['mean_accepted_length']:.3f}, accepted-length histogram "
            f"{stats['accepted_length_hist']}",
            markup=False,
        )


@contextmanager
def status_bar(console: Console | None = None) -> Iterator[Callable[[str], None]]:
    """A transient status line on stderr (log lines when it is not a terminal); yields
    ``report(message)``. ``console``: a rank's (silent on ranks other than 0)."""
    with ProgressReporter("bench", console=console or err_console, transient=True) as bar:
        yield lambda msg: bar.update(phase=msg)


def _random_weights(eng: dict) -> bool:
    """Label a random-weight preset; True when it was one."""
    if eng["is_random_weights"]:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {escape(eng['description'])}",
                          soft_wrap=True)
    return eng["is_random_weights"]


def print_bench(res: dict, model: str, as_json: bool) -> None:
    """Print a ``speccal.live.bench.bench`` result."""
    if as_json:
        typer.echo(json.dumps(res, allow_nan=False, sort_keys=True))
        return
    eng = res["engine"]["spec"]
    setup = res["setup"]
    if not _random_weights(eng):
        err_console.print(eng["description"], markup=False)
    topo = setup.get("topology")
    where = eng["compatibility"]["device"]["name"]
    if topo is not None:  # a torchrun run: the tokens/s are the whole world's
        names = sorted(set(topo["devices"]))
        where = (f"{topo['world_size']} ranks (tp={topo['tp']}, dp={topo['dp']}; "
                 f"{', '.join(names)})")
    table = Table(
        title=f"{model} on {where}, k={setup['num_draft_steps']}, {setup['num_requests']} requests"
    )
    for col in ("mode", "tokens/s", "decode tok/s", "TPOT ms", "acceptance", "mean accepted"):
        table.add_column(col)
    for name in ("plain", "spec"):
        r = res[name]
        table.add_row(
            name,
            f"{r['tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['tpot_ms']:.2f}",
            _fmt(r.get("acceptance_rate"), ".3f"),
            _fmt(r.get("mean_accepted_length"), ".3f"),
        )
    print_table(err_console, table)
    err_console.print(
        f"speed-up {res['speedup']:.2f}x tokens/s, {res['tpot_speedup']:.2f}x TPOT; "
        f"outputs equal: {res['outputs_equal']}",
        markup=False,
    )


def print_policy_bench(doc: dict, model: str, as_json: bool) -> None:
    """Print a ``speccal.live.bench.run_policy_bench`` document (its ``runs`` dropped)."""
    # lazy: speccal.live imports torch (loaded already: the bench ran)
    from speccal.live.bench import coverage

    repeats = doc.get("repeats", 1)
    setup = doc["setup"]
    if as_json:
        typer.echo(json.dumps(doc, allow_nan=False, sort_keys=True))
        return
    _random_weights(doc["engine"])
    for msg in doc["table_warnings"]:
        err_console.print(f"[yellow]warning[/]: {escape(msg)}", soft_wrap=True)
    title = (
        f"{model} live policies, {setup['num_requests']} requests x {setup['max_tokens']} tokens"
    )
    if repeats > 1:
        title += f", median of {repeats} interleaved runs"
    table = Table(title=title)
    cols = ["policy", "tokens/s"] + (["min-max"] if repeats > 1 else [])
    for col in (
        *cols,
        "TPOT ms",
        "acceptance",
        "mean accepted",
        "mean k",
        "vs best fixed",
        "replay tok/s",
        *(["replay err % (median)"] if repeats > 1 else []),
        "priced rounds",
    ):
        table.add_column(col)
    for s in doc["policies"]:
        gain = s.get("gain_vs_best_fixed_pct")
        pred = (s.get("replay") or {}).get("predicted_tokens_per_s")
        spread = s.get("spread", {}).get("round_tokens_per_s")
        extra = [f"{spread[0]:.1f}-{spread[1]:.1f}"] if repeats > 1 else []
        table.add_row(
            s["policy"],
            f"{s['round_tokens_per_s']:.1f}",
            *extra,
            f"{s['tpot_ms']:.2f}",
            _fmt(s["acceptance_rate"], ".3f"),
            _fmt(s["mean_accepted_length"], ".3f"),
            f"{s['mean_k']:.2f}",
            "-" if gain is None else f"{gain:+.1f}%",
            _fmt(pred, ".1f"),
            *([_fmt((s.get("replay") or {}).get("error_pct"), ".1f")] if repeats > 1 else []),
            coverage(s),
        )
    print_table(err_console, table)
    short = [s["policy"] for s in doc["policies"] if s.get("rounds_uncalibrated")]
    if short:
        err_console.print(
            f"[yellow]warning[/]: {escape(', '.join(short))} ran rounds the table does not "
            "price (a batch past its request buckets or KV span: run at full width, "
            "uncalibrated); calibrate the engine's captured buckets",
            soft_wrap=True,
        )
    spreads = [s["kv_spread"] for s in doc["policies"] if s.get("kv_spread")]
    if spreads:
        widest = max(spreads, key=lambda x: x["rounds_past_1_5x_pct"])
        if spread_is_wide(widest) and not doc.get("table_spread_priced"):
            err_console.print(f"[yellow]warning[/]: {escape(kv_spread_line(widest))}",
                              soft_wrap=True)
    if repeats > 1:
        err_console.print(
            "run order (" + doc["order"]["scheme"] + "): " + " ".join(doc["order"]["sequence"]),
            soft_wrap=True,
            markup=False,
        )
    for s in doc["policies"]:
        if s["policy"].startswith("adaptive"):
            err_console.print(
                escape(
                    f"{s['policy']} timeline [start, stop, k, g]: {s['timeline'][:12]}"
                    + (" ..." if len(s["timeline"]) > 12 else "")
                ),
                soft_wrap=True,
            )
    for name, path in doc["traces"].items():
        err_console.print(f"trace of {name}: {path}", markup=False)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
