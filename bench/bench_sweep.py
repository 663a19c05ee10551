"""A fidelity sweep the grid did not choose: live policies vs their replay over many workloads.

Run: ``python3 bench/bench_sweep.py --table PATH [--model tiny] [--device cpu] [--dtype D]
[--workloads A,B,..] [--repeats 3] [--max-tokens N] [--prompt-lens SHORT,LONG] [--json-out PATH]
[--plot PATH] [--record]`` (on the H200: ``--model dense-2b --device cuda --dtype bfloat16
--table tables/dense-2b-h200-draft-step.json`` for adaptive-step, ``--table
tables/dense-2b-h200.json`` for adaptive-verify; both tables hold buckets 1..8, so the counts are
3, 5, 6 and 7: a table calibrated to 64 requests spreads them over 3..62). Each workload is a
fresh process (engine build and graph capture included): ``--workloads`` runs a subset.

The table decides the policies: a ``draft_step`` table runs ``fixed:1..w`` and
``adaptive-step``, a ``target_verify`` table ``fixed:1..w`` and ``adaptive-verify``. It also
decides, unless given, the engine's request buckets, graph mode, attention backend and round
loop (``compatibility.loop == "pipelined"`` -> ``EngineConfig(pipeline=True)``) and, on the
CPU, the torch threads, so the live engine is the one the table was calibrated on.

Every workload of :data:`WORKLOADS` (or ``--workloads``) runs in its own child process
(``bench_sweep.py --one NAME ...``, its JSON written to ``--child-out``): build the engine, load
the table against it (``bench_live_policy.load_checked_table``), warm every ``k`` up, run every
policy ``--repeats`` times interleaved and replay a fresh twin on each run's own trace
(``bench_live_policy.run_and_replay``). A workload is

* a request count that is not a bucket: ``requests_of_64`` is the count on a 1..64 bucket range
  (3, 5, 6, 12, 24, 40, 48, 56, 62), scaled to the table's largest bucket and moved to the
  nearest count that is not a bucket (:func:`scaled_count`; buckets 1, 2, 4, 8 give 3, 5, 6
  and 7);
* per-request ``max_tokens`` (fractions of ``--max-tokens``, cycled over the requests), so
  requests finish at different rounds and the batch shrinks mid-run;
* prompt lengths (``short`` / ``long`` of ``--prompt-lens``, cycled over the requests);
* acceptance: one level (constant) or two, the change at ``--phase-at`` of the workload's tokens
  (easy -> hard and hard -> easy); :func:`profile` turns a level into ``w`` probabilities. The
  draws are common random numbers: run ``c`` of every policy starts the engine's generator at
  the same seed (``run_interleaved(seed=)``), so two policies that decide alike accept alike
  and the gains compare policies, not acceptance luck (at 0a2c622 on an H100, adaptive-step
  deciding k = 3 in every round of n3-short-easy "lost" 6.3 % to fixed:3 on luck alone:
  acceptance 0.72-0.76 against 0.76-0.82); ``--independent-draws`` turns that off. The draft
  scores the engine reports are the synthetic acceptance's own (``--score-informativeness``,
  ``speccal.runner.sampling.synthetic_draft_scores``): each draft's score is the probability
  it is accepted with, its mean the profile's, so adaptive verify's survival curves and its
  ranking of drafts see what a real draft head's probabilities would tell it (before
  19bbf29 the scores were the random-weight draft's probabilities, unrelated to the
  acceptance).

Per workload and policy (``workloads[].policies`` of the JSON): live decode tokens/s (median
over the runs, every run listed), the replay prediction from the run's own trace, the error
``|predicted - live| / live`` per run, whether the decisions matched, rounds priced and
uncalibrated, and for the adaptive policy its gain over the best fixed ``k`` (median tokens/s)
and over the per-phase oracle: for each acceptance phase the best fixed ``k``'s live rate in
that phase (its runs' tokens over their time in the phase), combined over the adaptive runs'
tokens per phase (oracle time = sum over phases of tokens / best rate).

Sweep metrics (``metrics`` of the JSON; ``--record`` appends them to ``bench/results.jsonl``):
``replay_vs_live_error_pct_sweep_max`` (every workload, policy and run; unpriced runs are
counted apart, ``unpriced_runs``), ``uncalibrated_rounds_pct_sweep_max`` (0 expected: every
workload sits inside the table's buckets), and for ``A`` = ``adaptive_step`` or
``adaptive_verify``: ``A_vs_best_fixed_pct_sweep_min``, ``A_vs_best_fixed_pct_phased_min`` (the
phased workloads), ``A_vs_phase_oracle_pct_sweep_min`` and ``A_vs_phase_oracle_pct_phased_min``.
``--plot PATH`` draws the worst replay error per workload x policy (PNG).

**Disturbed runs** (:func:`flag_disturbed`): a run whose live rate fell more than
:data:`DISTURBED_PCT` below the median of its policy's runs while its replay (the same table on
the run's own trace) explains less than :data:`EXPLAINED_SHARE` of that fall ran about the same
work slower: something outside the table's model ran during that run (on an H100 at 98963ed
each disturbed run held one 0.11-0.14 s stall, a full collection of Python's cyclic garbage
collector; the live loop and the calibration windows now run with it paused,
``speccal.base.gcpause``, and 3965b8d's sweeps had no disturbed run).
Such runs stay in every figure above (judged by the worst); they are listed in
``context.disturbed_runs`` and ``replay_vs_live_error_pct_sweep_max_undisturbed`` is the worst
over the others, so a reader can tell a model error from a disturbance. Each run also carries
its host probe (:class:`HostProbe`), its phases and ``k`` timeline, its longest round against
its median, and where its live time departs from its replay (:func:`round_residuals`: rounds
after a batch-size change against steady ones, per bucket and per mean-KV bin), summed over the
sweep in ``context.residual_breakdown``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from results import append_results, git_commit

HERE = Path(__file__).resolve().parent

#: A run this much slower (%) than its policy's median run, with the same replayed work, is
#: flagged disturbed (module docstring).
DISTURBED_PCT = 10.0
#: ... where "the same work" means its replay prediction moved less than this share of the
#: live rate's fall (an adaptive run's own decisions move its replay a little).
EXPLAINED_SHARE = 0.25

#: Acceptance levels: position ``i`` of the profile accepts with ``level - 0.05 * i``.
LEVELS = {"easy": 0.9, "mid": 0.6, "hard": 0.3}


@dataclass(frozen=True)
class Workload:
    """One sweep workload (see the module docstring)."""

    name: str
    requests_of_64: int  # request count on a 1..64 bucket range; scaled by scaled_count
    prompts: tuple[str, ...]  # "short" / "long" per request, cycled
    max_tokens: tuple[float, ...]  # fractions of --max-tokens per request, cycled
    acceptance: tuple[str, ...]  # one level (constant) or two (phase change at --phase-at)

    @property
    def phased(self) -> bool:
        return len(self.acceptance) > 1


WORKLOADS = (
    Workload("n3-short-easy", 3, ("short",), (1.0, 0.5, 0.25), ("easy",)),
    Workload("n5-long-hard", 5, ("long",), (1.0, 0.6, 0.3), ("hard",)),
    Workload("n6-short-easy-to-hard", 6, ("short",), (1.0, 0.75, 0.5, 0.25), ("easy", "hard")),
    Workload("n12-long-hard-to-easy", 12, ("long",), (1.0, 0.5), ("hard", "easy")),
    Workload("n24-mixed-mid", 24, ("short", "long"), (1.0, 0.7, 0.4), ("mid",)),
    Workload("n40-long-easy-to-hard", 40, ("long",), (1.0, 0.8, 0.6, 0.4, 0.2), ("easy", "hard")),
    Workload("n48-mixed-easy-to-hard", 48, ("long", "short"), (0.3, 1.0, 0.6), ("easy", "hard")),
    Workload("n56-short-hard-to-easy", 56, ("short",), (1.0, 0.5, 0.25), ("hard", "easy")),
    Workload("n62-mixed-easy", 62, ("short", "long"), (1.0, 0.9, 0.6, 0.3), ("easy",)),
)
BY_NAME = {w.name: w for w in WORKLOADS}


def scaled_count(requests_of_64: int, buckets: tuple[int, ...]) -> int:
    """The request count of a workload on ``buckets``: ``requests_of_64`` scaled from a 1..64
    range to ``1..max(buckets)``, then the nearest count below the largest bucket that is not a
    bucket (ties: the smaller). Buckets without such a count give the scaled count."""
    top = max(buckets)
    n = min(max(round(requests_of_64 * top / 64), 1), top)
    free = [m for m in range(1, top) if m not in buckets]
    return min(free, key=lambda m: (abs(m - n), m)) if free else n


def profile(level: str, width: int) -> tuple[float, ...]:
    """``width`` per-position acceptance probabilities of an acceptance level."""
    base = LEVELS[level]
    return tuple(round(max(0.02, base - 0.05 * i), 4) for i in range(width))


def resolve(w: Workload, buckets: tuple[int, ...], max_tokens: int,
            prompt_lens: tuple[int, int]) -> dict:
    """The concrete workload: request count, per-request prompt lengths and ``max_tokens``."""
    n = scaled_count(w.requests_of_64, buckets)
    lens = {"short": prompt_lens[0], "long": prompt_lens[1]}
    return {
        "name": w.name,
        "num_requests": n,
        "is_bucket": n in buckets,
        "prompt_lens": [lens[w.prompts[i % len(w.prompts)]] for i in range(n)],
        "max_tokens": [max(1, round(w.max_tokens[i % len(w.max_tokens)] * max_tokens))
                       for i in range(n)],
        "acceptance": list(w.acceptance),
        "phased": w.phased,
        "definition": asdict(w),
    }


def table_facts(path: Path) -> dict:
    """What the sweep takes from a table document (no torch needed)."""
    doc = json.loads(Path(path).read_text())
    cal, compat = doc.get("calibration") or {}, doc.get("compatibility") or {}
    return {
        "mode": cal.get("mode", "draft_step"),
        "request_buckets": tuple(int(b) for b in cal["request_buckets"]),
        "draft_width": int(cal["draft_width"]),
        "pipeline": compat.get("loop") == "pipelined",
        "graph_mode": compat.get("graph_mode"),
        "attention_backend": compat.get("attention_backend"),
        "threads": cal.get("threads"),
    }


def score_informativeness(given: float | None, mode: str) -> float:
    """The live engine's ``score_informativeness``: ``given``, else 0.5 on a target_verify table
    (adaptive verify ranks the drafts by their scores: under synthetic acceptance they must say
    something about each draft, as a real draft head's probabilities do) and 0 on a draft_step
    one (adaptive step reads accepted lengths only; 0 keeps the profile's own draws).
    ``ValueError`` naming the flag outside ``[0, 1]``."""
    if given is None:
        return 0.5 if mode == "target_verify" else 0.0
    if not 0.0 <= given <= 1.0:
        raise ValueError(f"--score-informativeness: got {given}, expected a number in [0, 1]")
    return float(given)


def adaptive_name(mode: str) -> str:
    return "adaptive-verify" if mode == "target_verify" else "adaptive-step"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="cost table; its mode picks the policies")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--request-buckets", default=None, help="default: the table's")
    ap.add_argument("--graph-mode", default=None, help="default: the table's")
    ap.add_argument("--attention-backend", default=None, help="default: the table's")
    ap.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                    help="pipelined rounds (default: the table's loop)")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated names (default: all): " + ", ".join(BY_NAME))
    ap.add_argument("--repeats", type=int, default=3, help="runs per policy, interleaved")
    ap.add_argument("--max-tokens", type=int, default=192, help="the 1.0 of the fractions")
    ap.add_argument("--prompt-lens", default="64,512", help="SHORT,LONG prompt tokens")
    ap.add_argument("--phase-at", type=float, default=0.5, help="token fraction of the change")
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--window-size", type=int, default=20)
    ap.add_argument("--update-interval", type=int, default=5)
    ap.add_argument("--switch-min-gain", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score-informativeness", type=float, default=None,
                    help="synthetic acceptance: what a draft's score says about its acceptance "
                    "(EngineConfig.score_informativeness); default 0.5 on a target_verify table "
                    "(adaptive verify ranks drafts by their scores), 0 on a draft_step one "
                    "(the scores are unused; 0 keeps the profile's own draws)")
    ap.add_argument("--independent-draws", action="store_true",
                    help="let the synthetic acceptance stream run on from run to run (default: "
                    "common random numbers, run c of every policy seeded alike)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads on the CPU (default: the table's calibration)")
    ap.add_argument("--json-out", default=None, help="write the full result JSON here")
    ap.add_argument("--save-runs", default=None,
                    help="write every timed run here (DIR/<workload>/<i>-<policy>.*) for "
                    "bench/sweep_runs.py to replay against another table")
    ap.add_argument("--plot", default=None, help="write a PNG of the replay errors here")
    ap.add_argument("--device-label", default=None)
    ap.add_argument("--record", action="store_true", help="append the metrics to --results")
    ap.add_argument("--results", default=None, help="default: bench/results.jsonl")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DOC",
                    help="no runs: the sweep's metrics over workload documents already written "
                    "(the --json-out PATH.<workload>.json of one or several calls; a workload "
                    "given twice is refused), printed, plotted and recorded as a sweep's")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one workload
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap


#: Options a child gets from its parent (everything that shapes a run).
CHILD_OPTIONS = ("table", "model", "device", "dtype", "request_buckets", "graph_mode",
                 "attention_backend", "repeats", "max_tokens", "prompt_lens", "phase_at",
                 "warmup_tokens", "window_size", "update_interval", "switch_min_gain", "seed",
                 "threads", "save_runs", "score_informativeness")


def child_argv(args: argparse.Namespace, name: str, out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--child-out", str(out)]
    for dest in CHILD_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    if args.pipeline is not None:
        argv.append("--pipeline" if args.pipeline else "--no-pipeline")
    if args.independent_draws:
        argv.append("--independent-draws")
    return argv


# ------------------------------------------------------------------ child: one workload


def phase_rates(runs: list) -> dict[int, tuple[float, float]]:
    """Phase -> (round tokens, seconds) summed over ``runs`` (``LiveRun``)."""
    import numpy as np

    out: dict[int, tuple[float, float]] = {}
    for run in runs:
        for ph in np.unique(run.phase).tolist():
            sel = run.phase == ph
            tok, s = out.get(ph, (0.0, 0.0))
            out[ph] = (tok + float(run.round_tokens[sel].sum()),
                       s + float(run.round_ms[sel].sum()) / 1000.0)
    return out


def oracle_tokens_per_s(adaptive_runs: list, fixed_runs: dict[str, list]) -> dict:
    """The per-phase oracle of live runs (:func:`phase_oracle` of their :func:`phase_rates`)."""
    return phase_oracle(phase_rates(adaptive_runs),
                        {name: phase_rates(runs) for name, runs in fixed_runs.items()})


def phase_oracle(adaptive: dict, fixed: dict[str, dict]) -> dict:
    """The per-phase oracle: in each phase the best fixed ``k``'s rate there, weighted by the
    adaptive runs' tokens in that phase. ``adaptive``: phase -> (tokens, seconds) summed over
    its runs; ``fixed``: policy -> the same (``bench/sim_sweep.py`` passes its simulated runs')."""
    rates = {name: {ph: tok / s for ph, (tok, s) in totals.items() if s > 0}
             for name, totals in fixed.items()}
    best, time_s, tokens = {}, 0.0, 0.0
    for ph, (tok, _) in sorted(adaptive.items()):
        have = {n: r[ph] for n, r in rates.items() if ph in r}
        if not have:
            return {"tokens_per_s": math.nan, "best_per_phase": {}}
        name = max(have, key=have.get)
        best[str(ph)] = name
        time_s += tok / have[name]
        tokens += tok
    return {"tokens_per_s": tokens / time_s if time_s > 0 else math.nan,
            "best_per_phase": best}


def run_phases(run) -> list[dict]:
    """Per acceptance phase of one run: rounds, round tokens, seconds, tokens/s and mean ``k``."""
    import numpy as np

    out = []
    for ph in np.unique(run.phase).tolist():
        sel = run.phase == ph
        tok, s = float(run.round_tokens[sel].sum()), float(run.round_ms[sel].sum()) / 1000.0
        out.append({"phase": int(ph), "rounds": int(sel.sum()), "tokens": tok, "seconds": s,
                    "tokens_per_s": tok / s if s > 0 else None,
                    "mean_k": float(run.k[sel].mean()),
                    "mean_batch": float(run.num_requests[sel].mean())})
    return out


#: Mean-KV bins of the residual breakdown (tokens; the last is open).
KV_BINS = (256, 512, 1024, 2048)


def round_residuals(run, predicted_ms, cost) -> dict:
    """Where a run's live round time departs from its replay's price: live and predicted ms
    summed over the rounds that follow a change of batch size (and the first round: a new shape,
    its graph and caches cold) and over the steady rest, per request bucket and per mean-KV bin
    (:data:`KV_BINS`: where the KV model interpolates between contexts). ``excess_ms``
    = live - predicted; the sweep adds them up over every run (``residual_breakdown``)."""
    import numpy as np

    live = np.asarray(run.round_ms, dtype=np.float64)
    pred = np.asarray(predicted_ms, dtype=np.float64)
    b = np.asarray(run.num_requests)
    if live.size == 0 or pred.shape != live.shape:
        return {}
    change = np.concatenate(([True], b[1:] != b[:-1]))
    bcap = np.asarray(cost.bcap(b))

    def part(sel) -> dict:
        lv, pr = float(live[sel].sum()), float(pred[sel].sum())
        return {"rounds": int(np.count_nonzero(sel)), "live_ms": round(lv, 4),
                "replay_ms": round(pr, 4), "excess_ms": round(lv - pr, 4)}

    kv = np.asarray(run.trace.kv_length, dtype=np.float64)
    edges = np.searchsorted(KV_BINS, kv, side="right")  # bin i: [KV_BINS[i-1], KV_BINS[i])
    names = [f"{lo}-{hi}" for lo, hi in zip((0, *KV_BINS), (*KV_BINS, "inf"), strict=True)]
    return {"transition": part(change), "steady": part(~change),
            "by_bcap": {str(int(x)): part(bcap == x) for x in np.unique(bcap).tolist()},
            "by_kv": {names[i]: part(edges == i) for i in np.unique(edges).tolist()}}


def residual_breakdown(docs: list[dict]) -> dict:
    """The runs' :func:`round_residuals` summed per policy kind (fixed / adaptive) and over all:
    how much of the live time the replay missed sits in transition rounds, in steady rounds and
    in each bucket (``excess_pct`` = excess over the replay's ms of that part)."""
    out: dict[str, dict] = {}

    def add(into: dict, part: dict) -> None:
        for key in ("rounds", "live_ms", "replay_ms", "excess_ms"):
            into[key] = into.get(key, 0) + part[key]

    for d in docs:
        for name, p in d["policies"].items():
            for r in p["runs"]:
                res = r.get("residual") or {}
                if not res:
                    continue
                for group in ("all", "adaptive" if name == d["adaptive"] else "fixed"):
                    g = out.setdefault(group, {"transition": {}, "steady": {}, "by_bcap": {},
                                               "by_kv": {}})
                    add(g["transition"], res["transition"])
                    add(g["steady"], res["steady"])
                    for axis in ("by_bcap", "by_kv"):
                        for key, part in res[axis].items():
                            add(g[axis].setdefault(key, {}), part)
    for g in out.values():
        parts = [g["transition"], g["steady"], *g["by_bcap"].values(), *g["by_kv"].values()]
        for part in parts:
            if part.get("replay_ms"):
                part["excess_pct"] = round(100.0 * part["excess_ms"] / part["replay_ms"], 3)
            for key in ("live_ms", "replay_ms", "excess_ms"):
                if key in part:
                    part[key] = round(part[key], 3)
    return out


def k_timeline(k) -> list[list[int]]:
    """Run-length ``[first_round, rounds, k]`` segments of a run's decisions."""
    out: list[list[int]] = []
    for i, v in enumerate(k.tolist()):
        if out and out[-1][2] == v:
            out[-1][1] += 1
        else:
            out.append([i, 1, int(v)])
    return out


class HostProbe:
    """What the machine did between two marks (around each live run, outside its timed rounds):
    this process's CPU seconds, cyclic-collector passes and context switches (``getrusage``: involuntary switches mean
    the scheduler took the CPU away), the load average, and on CUDA the GPU's SM clock, power,
    temperature and active clock-event (throttle) reasons from ``nvidia-smi`` at each mark. A
    disturbed run (:func:`flag_disturbed`) can then be told apart: host contention shows as
    involuntary switches or CPU seconds, a slowed GPU as its clock or throttle reasons."""

    QUERY = ("clocks.sm,clocks.mem,power.draw,temperature.gpu,"
             "clocks_event_reasons.active")

    def __init__(self, device: str):
        import gc

        self.cuda = device.startswith("cuda")
        self.marks: list[dict] = []
        self.gc_ms = [0.0, 0.0, 0.0]  # collector time per generation, running totals
        self.gc_n = [0, 0, 0]
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            g = int(info["generation"])
            self.gc_n[g] += 1
            self.gc_ms[g] += 1000.0 * (time.perf_counter() - self._gc_t0)

    def _gpu(self) -> dict | None:
        if not self.cuda:
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=" + self.QUERY,
                                  "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": str(e)}
        parts = [x.strip() for x in out.stdout.strip().split(",")]
        if out.returncode != 0 or len(parts) != 5:
            return {"error": (out.stderr or out.stdout).strip()[:200]}
        return dict(zip(("sm_mhz", "mem_mhz", "power_w", "temp_c", "event_reasons"), parts,
                        strict=True))

    def mark(self) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append({"t": time.perf_counter(), "cpu_s": ru.ru_utime + ru.ru_stime,
                           "nivcsw": ru.ru_nivcsw, "nvcsw": ru.ru_nvcsw,
                           "load1": os.getloadavg()[0], "gpu": self._gpu(),
                           "gc_n": list(self.gc_n), "gc_ms": list(self.gc_ms)})

    def between(self) -> list[dict]:
        """One record per pair of consecutive marks."""
        out = []
        for a, b in zip(self.marks[:-1], self.marks[1:], strict=True):
            wall = b["t"] - a["t"]
            out.append({"wall_s": round(wall, 4),
                        "cpu_s": round(b["cpu_s"] - a["cpu_s"], 4),
                        "cpu_share": round((b["cpu_s"] - a["cpu_s"]) / wall, 4) if wall else None,
                        "involuntary_switches": b["nivcsw"] - a["nivcsw"],
                        "voluntary_switches": b["nvcsw"] - a["nvcsw"],
                        "load1_after": b["load1"], "gpu_before": a["gpu"], "gpu_after": b["gpu"],
                        # cyclic-collector passes per generation and their milliseconds (the
                        # live rounds run with it paused: speccal.base.gcpause)
                        "gc_collections": [y - x for x, y in zip(a["gc_n"], b["gc_n"], strict=True)],
                        "gc_ms": [round(y - x, 2) for x, y in zip(a["gc_ms"], b["gc_ms"],
                                                                   strict=True)]})
        return out


def flag_disturbed(rows: list[dict]) -> None:
    """Mark each run of one policy (``live_tokens_per_s``, ``replay_tokens_per_s``) with
    ``disturbed``: live more than :data:`DISTURBED_PCT` below the runs' median live rate while
    the replay's distance from their median replay is under :data:`EXPLAINED_SHARE` of that
    fall; and with
    ``live_vs_median_pct`` (its live rate against the median, %). Fewer than three runs: none is
    flagged (no majority to compare with)."""
    import statistics

    live = [r["live_tokens_per_s"] for r in rows]
    rep = [r["replay_tokens_per_s"] for r in rows]
    ok = len(rows) >= 3 and all(math.isfinite(x) and x > 0 for x in live + rep)
    mid_live = statistics.median(live) if ok else math.nan
    mid_rep = statistics.median(rep) if ok else math.nan
    for r in rows:
        if not ok:
            r["live_vs_median_pct"], r["disturbed"] = None, False
            continue
        slower = 100.0 * (1.0 - r["live_tokens_per_s"] / mid_live)
        moved = abs(100.0 * (r["replay_tokens_per_s"] / mid_rep - 1.0))
        same = moved < EXPLAINED_SHARE * slower
        r["live_vs_median_pct"] = -slower
        r["disturbed"] = bool(slower > DISTURBED_PCT and same)


def run_one(args: argparse.Namespace) -> dict:
    """One workload in this process: engine, table, live runs, replays; the JSON-ready result."""
    import numpy as np
    import torch
    from bench_live_policy import build_live_engine, load_checked_table, run_and_replay, warm_up
    from rich.console import Console

    from speccal.live.policies import Phase, live_cost_model
    from speccal.policy import AdaptiveStepConfig, CostModel

    console = Console(stderr=True)
    facts = table_facts(Path(args.table))
    threads = args.threads or (facts["threads"] if args.device == "cpu" else None)
    if threads:  # tiny on 2 cores: 2 threads ran some runs 40x slower than 1 (the table's)
        torch.set_num_threads(int(threads))
    buckets = (tuple(int(b) for b in args.request_buckets.split(","))
               if args.request_buckets else facts["request_buckets"])
    w = facts["draft_width"]
    wl = BY_NAME[args.one]
    prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    spec = resolve(wl, facts["request_buckets"], args.max_tokens, prompt_lens)
    phases = [Phase(0.0, profile(wl.acceptance[0], w))]
    if wl.phased:
        phases.append(Phase(args.phase_at, profile(wl.acceptance[1], w)))
    pipeline = facts["pipeline"] if args.pipeline is None else args.pipeline
    common = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "draft_width": w,
        "request_buckets": buckets,
        "seed": args.seed,
        "graph_mode": args.graph_mode or facts["graph_mode"] or "eager",
        "attention_backend": args.attention_backend or facts["attention_backend"] or "torch",
        "score_informativeness": score_informativeness(args.score_informativeness, facts["mode"]),
    }
    t0 = time.perf_counter()
    engine = build_live_engine(common, phases[0].profile, pipeline)
    table, table_warnings, _ = load_checked_table(Path(args.table), engine)
    build_s = time.perf_counter() - t0
    cost = live_cost_model(table)  # the policies' lookups, cached (same values)
    replay_cost = CostModel.from_table(table)  # the replay's own, uncached
    names = [f"fixed:{k}" for k in range(1, w + 1)] + [adaptive_name(cost.mode)]
    step_cfg = AdaptiveStepConfig(args.window_size, args.update_interval, args.switch_min_gain)
    rng = np.random.default_rng([args.seed, zlib.crc32(wl.name.encode())])
    vocab = engine.loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in spec["prompt_lens"]]
    warmup_s = warm_up(engine, cost, prompts, max_tokens=args.warmup_tokens)

    host = HostProbe(args.device)

    def announce(i, total, name):
        host.mark()
        console.print(f"[{wl.name}] live {name} ({i + 1}/{total}) ...")

    # where each run's live time departs from its replay, round by round (run_and_replay's own
    # prediction of the run: its per-round prices)
    resid_of: dict[str, list[dict]] = {n: [] for n in names}

    def on_replay(tr, pred):
        resid_of[tr.policy].append(round_residuals(tr.run, pred["predicted_round_ms"],
                                                   replay_cost))

    t0 = time.perf_counter()
    timed, per_policy, run_log = run_and_replay(
        engine, names, cost, replay_cost, prompts, spec["max_tokens"], step_cfg=step_cfg,
        phases=phases, repeats=args.repeats, meta={"workload": wl.name, "seed": args.seed},
        on_run=announce,
        on_replay=on_replay,
        # common random numbers: run c of every policy draws acceptance from one stream
        seed=None if args.independent_draws else (args.seed + 1) * 1_000_003
        + zlib.crc32(wl.name.encode()) % 1_000_003,
    )
    live_s = time.perf_counter() - t0
    host.mark()
    if args.save_runs:
        from sweep_runs import save_run

        for i, tr in enumerate(timed):
            save_run(tr.run, Path(args.save_runs) / wl.name / f"{i:02d}-{tr.policy.replace(':', '_')}",
                     {"workload": wl.name, "index": i})
    probes = host.between()  # probes[i]: what the machine did while run i (of timed) ran
    runs_of = {n: [tr.run for tr in timed if tr.policy == n] for n in names}
    probe_of = {n: [probes[i] for i, tr in enumerate(timed) if tr.policy == n] for n in names}
    policies = {}
    for n in names:
        rows = []
        for run, s, probe, resid in zip(runs_of[n], per_policy[n], probe_of[n], resid_of[n],
                                        strict=True):
            rep = s["replay"]
            rows.append({
                "live_tokens_per_s": s["round_tokens_per_s"],
                "replay_tokens_per_s": rep["predicted_tokens_per_s"],
                "error_pct": rep["error_pct"],
                "priced": rep["priced"],
                "decisions_match": rep["decisions_match"],
                "verified_match": rep["verified_match"],
                "rounds": s["rounds"],
                "rounds_priced": s["rounds_priced"],
                "rounds_uncalibrated": s["rounds_uncalibrated"],
                "uncalibrated_pct": 100.0 * (s["rounds_uncalibrated"] or 0) / max(s["rounds"], 1),
                "batch_max": int(run.num_requests.max()) if run.num_requests.size else 0,
                "batch_min": int(run.num_requests.min()) if run.num_requests.size else 0,
                # how far the rounds' longest request sat past the mean KV they are priced at
                "kv_spread": run.trace.kv_spread(),
                "mean_k": s["mean_k"],
                "acceptance_rate": s["acceptance_rate"],
                "output_tokens": s["output_tokens"],
                "phases": run_phases(run),
                # one stalled round stands out against the median
                "round_ms_median": float(np.median(run.round_ms)) if run.round_ms.size else None,
                "round_ms_max": float(run.round_ms.max()) if run.round_ms.size else None,
                "k_timeline": k_timeline(run.k),
                "host": probe,
                "residual": resid,
            })
        flag_disturbed(rows)
        errs = [r["error_pct"] for r in rows]  # NaN: a run the table could not price
        policies[n] = {
            "live_tokens_per_s": float(np.median([r["live_tokens_per_s"] for r in rows])),
            "replay_tokens_per_s": float(np.median([r["replay_tokens_per_s"] for r in rows])),
            "error_pct_max": (max(errs) if len(_finite(errs)) == len(errs) else math.nan),
            "error_pct_median": float(np.median([r["error_pct"] for r in rows])),
            "decisions_match": all(r["decisions_match"] for r in rows),
            "rounds": sum(r["rounds"] for r in rows),
            "rounds_priced": sum(r["rounds_priced"] or 0 for r in rows),
            "uncalibrated_pct_max": max(r["uncalibrated_pct"] for r in rows),
            "runs": rows,
        }
    ad = names[-1]
    fixed = names[:-1]
    best = max(fixed, key=lambda n: policies[n]["live_tokens_per_s"])
    oracle = oracle_tokens_per_s(runs_of[ad], {n: runs_of[n] for n in fixed})
    ad_tps = policies[ad]["live_tokens_per_s"]
    return {
        "workload": spec,
        "phases": [p.name for p in phases],
        "mode": cost.mode,
        "adaptive": ad,
        "policies": policies,
        "best_fixed": best,
        "gain_vs_best_fixed_pct": 100.0 * (ad_tps / policies[best]["live_tokens_per_s"] - 1.0),
        "oracle": oracle,
        "gain_vs_phase_oracle_pct": 100.0 * (ad_tps / oracle["tokens_per_s"] - 1.0),
        "run_log": run_log,
        "table_warnings": table_warnings,
        "engine": engine.description,
        "compatibility": engine.compatibility(),
        "setup": {**common, "request_buckets": list(buckets), "pipeline": pipeline,
                  "repeats": args.repeats, "threads": threads, "max_tokens": args.max_tokens,
                  "prompt_lens": args.prompt_lens, "phase_at": args.phase_at},
        "timings_s": {"build": build_s, "warmup": warmup_s, "live": live_s},
    }


# ------------------------------------------------------------------ parent: the sweep


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def sweep_metrics(docs: list[dict]) -> dict:
    """The sweep metrics of the workloads' results (see the module docstring)."""
    errors, unpriced, uncal, worst = [], 0, [], None
    calm, disturbed = [], []
    for d in docs:
        for name, p in d["policies"].items():
            for i, r in enumerate(p["runs"]):
                e = r["error_pct"]
                if e is None or not math.isfinite(e):
                    unpriced += 1
                else:
                    errors.append(e)
                    if worst is None or e > worst[0]:
                        worst = (e, d["workload"]["name"], name, i)
                    if r.get("disturbed"):
                        disturbed.append({"workload": d["workload"]["name"], "policy": name,
                                          "run": i, "error_pct": round(e, 3),
                                          "live_vs_median_pct": round(r["live_vs_median_pct"], 3),
                                          "host": r.get("host")})
                    else:
                        calm.append(e)
                uncal.append(r["uncalibrated_pct"])
    prefix = docs[0]["adaptive"].replace("-", "_") if docs else "adaptive"
    gains = [d["gain_vs_best_fixed_pct"] for d in docs]
    phased = [d for d in docs if d["workload"]["phased"]]
    oracle = [d["gain_vs_phase_oracle_pct"] for d in docs]
    out = {
        "replay_vs_live_error_pct_sweep_max": max(errors) if errors else math.nan,
        "replay_vs_live_error_pct_sweep_max_undisturbed": max(calm) if calm else math.nan,
        "uncalibrated_rounds_pct_sweep_max": max(uncal) if uncal else math.nan,
        f"{prefix}_vs_best_fixed_pct_sweep_min": min(_finite(gains), default=math.nan),
        f"{prefix}_vs_best_fixed_pct_phased_min": min(
            _finite(d["gain_vs_best_fixed_pct"] for d in phased), default=math.nan),
        f"{prefix}_vs_phase_oracle_pct_sweep_min": min(_finite(oracle), default=math.nan),
        f"{prefix}_vs_phase_oracle_pct_phased_min": min(
            _finite(d["gain_vs_phase_oracle_pct"] for d in phased), default=math.nan),
    }
    context = {
        "unpriced_runs": unpriced,
        "disturbed_runs": disturbed,
        "worst_error": None if worst is None else
        {"workload": worst[1], "policy": worst[2], "run": worst[3]},
        "decisions_match": all(p["decisions_match"] for d in docs for p in d["policies"].values()),
        "by_workload": {d["workload"]["name"]: _workload_line(d) for d in docs},
        "residual_breakdown": residual_breakdown(docs),
    }
    return {"metrics": out, "context": context}


def _workload_line(d: dict) -> dict:
    """One workload's figures for a record line (rounded; NaN as None)."""
    def num(x):
        return round(float(x), 3) if x is not None and math.isfinite(float(x)) else None

    ps = d["policies"].values()
    errs = [p["error_pct_max"] for p in ps]
    return {
        "num_requests": d["workload"]["num_requests"],
        "phased": d["workload"]["phased"],
        "error_pct_max": num(max(errs)) if len(_finite(errs)) == len(errs) else None,
        "uncalibrated_pct_max": num(max(p["uncalibrated_pct_max"] for p in ps)),
        "best_fixed": d["best_fixed"],
        "gain_vs_best_fixed_pct": num(d["gain_vs_best_fixed_pct"]),
        "gain_vs_phase_oracle_pct": num(d["gain_vs_phase_oracle_pct"]),
        "decisions_match": all(p["decisions_match"] for p in ps),
    }


def plot_errors(docs: list[dict], path: Path) -> Path:
    """A heat map of the worst replay error (%) per workload x policy, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [d["workload"]["name"] for d in docs]
    policies = list(docs[0]["policies"]) if docs else []
    err = np.array([[d["policies"][p]["error_pct_max"] for p in policies] for d in docs],
                   dtype=float).reshape(len(docs), len(policies))
    fig, ax = plt.subplots(figsize=(1.6 * len(policies) + 3, 0.45 * len(names) + 1.6))
    im = ax.imshow(np.nan_to_num(err, nan=0.0), cmap="YlOrRd", aspect="auto")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_yticks(range(len(names)),
                  [f"{n} (B={d['workload']['num_requests']})" for n, d in zip(names, docs,
                                                                             strict=True)])
    for i in range(err.shape[0]):
        for j in range(err.shape[1]):
            ax.text(j, i, "unpriced" if not np.isfinite(err[i, j]) else f"{err[i, j]:.1f}",
                    ha="center", va="center", color="k", fontsize=8)
    ax.set_title("replay vs live error, % (worst of the runs)")
    fig.colorbar(im, ax=ax, label="%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: got {args.repeats}, expected an integer >= 1")
    names = [n.strip() for n in args.workloads.split(",")] if args.workloads else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        ap.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(BY_NAME)}")
    if not args.merge and not Path(args.table).is_file():
        ap.error(f"--table: {args.table} is not a file")
    try:
        score_informativeness(args.score_informativeness, "draft_step")
    except ValueError as e:
        ap.error(str(e))
    if args.one is not None:  # child
        doc = run_one(args)
        text = json.dumps(doc, sort_keys=True, default=float)
        if args.child_out:
            Path(args.child_out).write_text(text)
        else:
            print(text)
        return 0

    t_start = time.perf_counter()
    docs, failures = [], []
    if args.merge:
        docs = merged_docs(args.merge, ap)
        return report(args, argv, docs, failures, t_start)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            t0 = time.perf_counter()
            rc = subprocess.run(child_argv(args, name, out)).returncode
            if rc != 0 or not out.is_file():
                failures.append({"workload": name, "exit": rc})
                print(f"[{name}] child failed (exit {rc})", file=sys.stderr)
                continue
            doc = json.loads(out.read_text())
            doc["timings_s"]["process"] = time.perf_counter() - t0
            docs.append(doc)
            if args.json_out:  # each workload as it finishes: a sweep cut short keeps them
                Path(args.json_out).with_suffix(f".{name}.json").write_text(
                    json.dumps(doc, sort_keys=True, default=float))
    return report(args, argv, docs, failures, t_start)


#: What the workloads merged into one sweep must share (their ``setup``).
MERGE_SAME = ("model", "device", "dtype", "request_buckets", "pipeline", "repeats", "graph_mode",
              "attention_backend", "score_informativeness", "max_tokens", "prompt_lens",
              "phase_at")


def merged_docs(paths: list[str], ap: argparse.ArgumentParser) -> list[dict]:
    """The workload documents of ``--merge``, in the sweep's workload order."""
    docs: dict[str, dict] = {}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            ap.error(f"--merge: {path} is not a file")
        try:
            doc = json.loads(p.read_text())
            name = doc["workload"]["name"]
            doc["policies"], doc["adaptive"]  # noqa: B018 - a workload document has both
        except (ValueError, KeyError, TypeError):
            ap.error(f"--merge: {path} is not a sweep workload document "
                     "(bench_sweep --json-out PATH writes them as PATH.<workload>.json)")
        if name in docs:
            ap.error(f"--merge: workload {name} given twice (the second in {path})")
        docs[name] = doc
    first = next(iter(docs.values()))
    for name, doc in docs.items():
        for key in MERGE_SAME:
            if doc["setup"].get(key) != first["setup"].get(key):
                ap.error(f"--merge: workload {name} ran with {key} = "
                         f"{doc['setup'].get(key)!r}, {first['workload']['name']} with "
                         f"{first['setup'].get(key)!r} (one sweep runs one setup)")
        if doc["mode"] != first["mode"]:
            ap.error(f"--merge: workload {name} is a {doc['mode']} sweep, "
                     f"{first['workload']['name']} a {first['mode']} one")
    order = {n: i for i, n in enumerate(BY_NAME)}
    return sorted(docs.values(), key=lambda d: order.get(d["workload"]["name"], len(order)))


def report(args: argparse.Namespace, argv: list[str] | None, docs: list[dict],
           failures: list[dict], t_start: float) -> int:
    """Print, write, plot and record the sweep over ``docs``; the exit status."""
    summary = sweep_metrics(docs)
    for d in docs:
        wl = d["workload"]
        print(f"{wl['name']} (B={wl['num_requests']}, {', '.join(d['phases'])}): best fixed "
              f"{d['best_fixed']}, {d['adaptive']} {d['gain_vs_best_fixed_pct']:+.1f} % vs best "
              f"fixed, {d['gain_vs_phase_oracle_pct']:+.1f} % vs phase oracle", file=sys.stderr)
        for pname, p in d["policies"].items():
            print(f"  {pname:16s} live {p['live_tokens_per_s']:10.1f} tok/s  replay "
                  f"{p['replay_tokens_per_s']:10.1f}  err max {p['error_pct_max']:6.2f} %  "
                  f"priced {p['rounds_priced']}/{p['rounds']}  decisions match "
                  f"{p['decisions_match']}", file=sys.stderr)
    result = {
        **summary,
        "workloads": docs,
        "failures": failures,
        "table": str(args.table),
        "setup": {k: getattr(args, k) for k in CHILD_OPTIONS} | {"pipeline": args.pipeline},
        "command": "python3 bench/bench_sweep.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "timings_s": {"total": time.perf_counter() - t_start},
    }
    text = json.dumps(result, indent=1, sort_keys=True, default=float)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(json.dumps({**summary, "failures": failures}, indent=1, sort_keys=True, default=float))
    if args.plot and docs:
        plot_errors(docs, Path(args.plot))
    if args.record and docs:
        setup = docs[0]["setup"] if args.merge else {"model": args.model, "device": args.device,
                                                       "repeats": args.repeats}
        label = args.device_label or (
            f"cpu ({os.cpu_count()} cores)" if setup["device"] == "cpu"
            else docs[0]["compatibility"]["device"]["name"]
        )
        record = {} if args.results is None else {"path": Path(args.results)}
        append_results(
            ({
                "metric": metric,
                "value": round(value, 3) if math.isfinite(value) else None,
                "unit": "%",
                "device": label,
                "commit": result["commit"],
                "date": result["date"][:10],
                "command": result["command"],
                "model": setup["model"],
                "table": str(args.table),
                "table_mode": docs[0]["mode"],
                "repeats": setup["repeats"],
                "workloads": [d["workload"]["name"] + f" (B={d['workload']['num_requests']})"
                              for d in docs],
                "failed_workloads": [f["workload"] for f in failures],
                **summary["context"],
            }
             for metric, value in summary["metrics"].items()),
            **record,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
