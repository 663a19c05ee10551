"""Where a speculative round's wall time goes: host phases vs device time, per acceptance mode.

Usage (H200): python3 bench/bench_round_phases.py --model dense-2b --device cuda --out DIR
Usage (CPU smoke): python3 bench/bench_round_phases.py --model tiny --device cpu --graph-mode eager

For each acceptance mode (``forced``, as calibration measures, and ``synthetic`` at a high and a
low per-position acceptance, as the live benchmark runs) one engine is built; ``--batch``
requests of ``--prompt`` tokens are prefilled, then for each ``k`` in ``--ks`` the engine runs
``--warmup`` untimed rounds and ``--rounds`` timed ones, each round timed alone (as the live loop
does) and then ``--rounds`` more back to back in one window (as the calibration driver does).
Per round: wall time of ``Engine.step``; its host phases (``prepare``, the device launches of
``execute``, the wait inside ``collect``, the rest: admission, planning and per-request
bookkeeping); and on CUDA the device span of ``execute`` (CUDA events around it). Medians.
Writes ``DIR/round_phases.json``; prints a table. A diagnostic: no results.jsonl line.

``--pipeline on|both`` builds the engines with ``EngineConfig(pipeline=True)`` (``both``: each
mode twice, synchronous then pipelined, the pipelined rows named ``MODE+pipe``). A pipelined
``Engine.step`` queues round ``n + 1`` and collects round ``n``: ``wall`` is then the
steady-state round time, ``window_mean`` the same over one window, and on CUDA
``wall_over_device`` = ``window_mean / device_execute`` (the issue-21 target: <= 1.05);
``both`` adds ``pipelined_speedup`` (synchronous / pipelined ``window_mean`` per mode and k:
forced acceptance emits the same tokens per round, so it is the decode tokens/s ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from speccal.base.gcpause import paused_gc
from speccal.kernels.config import KernelConfig
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams


class _Timer:
    """Wraps ``runner.prepare / execute / collect`` and accumulates per-round phase times; on
    CUDA also a pair of events and the ``(bcap, k)`` of every ``execute``. One per runner
    (:meth:`of`), so a runner is never wrapped twice."""

    def __init__(self, runner, cuda: bool) -> None:
        self.cuda = cuda
        self.phase: dict[str, float] = {}
        self.records: list[tuple[object, object, tuple[int, int]]] = []  # start, end, shape
        for name in ("prepare", "execute", "collect"):
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    @classmethod
    def of(cls, runner, cuda: bool) -> _Timer:
        if not isinstance(getattr(runner, "_phase_timer", None), cls):
            runner._phase_timer = cls(runner, cuda)
        return runner._phase_timer

    def _wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            if name == "execute" and self.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                out = fn(*a, **kw)
                ev[1].record()
                x = a[0] if a else kw.get("x")
                self.records.append((*ev, (int(x.bcap), int(x.k))))
            else:
                out = fn(*a, **kw)
            self.phase[name] = self.phase.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
            return out

        return timed

    def take(self) -> dict[str, float]:
        p, self.phase = self.phase, {}
        return p

    def reset(self) -> None:
        self.phase = {}
        self.records.clear()

    def device_ms(self) -> list[tuple[float, tuple[int, int]]]:
        """``(device ms, (bcap, k))`` of every recorded ``execute`` (synchronises), then reset."""
        torch.cuda.synchronize()
        out = [(a.elapsed_time(b), shape) for a, b, shape in self.records]
        self.reset()
        return out


def measure_mode(args, acceptance: str, profile: tuple[float, ...] | None, eng=None) -> dict:
    eng = eng or Engine(
        EngineConfig.flat(kernels=KernelConfig.from_env(),
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            draft_width=max(args.ks),
            request_buckets=(args.batch,),
            acceptance=acceptance,
            acceptance_profile=profile,
            graph_mode=args.graph_mode,
            attention_backend=args.attention_backend,
            pipeline=getattr(args, "pipelined", False),
        )
    )
    cuda = args.device.startswith("cuda")
    timer = _Timer.of(eng.runner, cuda)
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}
    variants = [(k, False) for k in args.ks]
    if getattr(args, "trim", False):  # each request verifies k - 1 drafts: a trimmed target G
        variants += [(k, True) for k in args.ks]
    for k, trim in variants:
        eng.reset()
        need = (args.warmup + 2 * args.rounds + 1) * (k + 1) + 1
        for _ in range(args.batch):
            eng.add_request(
                rng.integers(0, vocab, args.prompt).tolist(),
                SamplingParams(max_tokens=need, ignore_eos=True),
            )
        eng.prefill_pending()
        plan = RoundPlan(num_draft_steps=k,
                         verify_tokens=[k - 1] * args.batch if trim else None)
        for _ in range(args.warmup):
            eng.step(plan)
        eng.synchronize()
        timer.reset()
        rows: list[dict[str, float]] = []
        with paused_gc():  # as the live loop and the calibration windows run
            for _ in range(args.rounds):  # one round per timing (the live loop)
                t0 = time.perf_counter()
                eng.step(plan)
                wall = 1e3 * (time.perf_counter() - t0)
                ph = timer.take()
                ph["wall"] = wall
                ph["other"] = wall - sum(ph.get(n, 0.0)
                                         for n in ("prepare", "execute", "collect"))
                rows.append(ph)
            if cuda:
                dev = [ms for ms, _ in timer.device_ms()]
            eng.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.rounds):  # one window (the calibration driver)
                eng.step(plan)
            eng.synchronize()
            window = 1e3 * (time.perf_counter() - t0) / args.rounds
        timer.reset()
        med = {n: statistics.median(r.get(n, 0.0) for r in rows) for n in rows[0]}
        if cuda:
            med["device_execute"] = statistics.median(dev)
            med["wall_over_device"] = window / med["device_execute"]
        med["window_mean"] = window
        if trim:
            med["target_rows"] = eng.geometry.g_for(args.batch, args.batch * k)
        out[f"k{k}" + ("_trim" if trim else "")] = med
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return out


def calibration_check(args) -> dict:
    """Calibrate twice in one process on one engine (as ``bench_live_policy.py`` does), with
    the device time of every round recorded, then time single rounds on the same engine.

    Per grid point: table step ms of each calibration and the median device time of its rounds
    (transition and warm-up included). Separates "the device ran slower during the windows" from
    "host time between launches grew" when a table disagrees with live rounds."""
    import tempfile

    from speccal.calibrate.pipeline import CalibrateOptions, calibrate
    from speccal.costmodel.table import load_table

    w = max(args.ks)
    buckets = (1, 2, 4, 8)
    # the fields EngineConfig and CalibrateOptions share
    common = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        draft_width=w,
        request_buckets=buckets,
    )
    eng = Engine(EngineConfig.flat(kernels=KernelConfig.from_env(), **common, graph_mode=args.graph_mode,
                              attention_backend=args.attention_backend, acceptance="forced"))
    cuda = args.device.startswith("cuda")
    timer = _Timer.of(eng.runner, cuda)
    cfg = {
        "version": 1,
        "calibration": {
            "model": "additive",
            "request_buckets": list(buckets),
            "contexts": [
                {"prefill_tokens": args.prompt, "min_kv_length": 1, "max_kv_length": 1024}
            ],
            "warmup_steps": 4,
            "window_steps": 32,
            "windows_per_point": 3,
        },
    }
    out: dict[str, object] = {"config": cfg}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "c.json"
        cfg_path.write_text(json.dumps(cfg))
        for rep in range(2):
            timer.reset()
            table_path = Path(tmp) / f"t{rep}.json"
            opts = CalibrateOptions(
                **common,
                config_path=cfg_path,
                out=table_path,
                journal=Path(tmp) / f"j{rep}.jsonl",
                progress=False,
                # This check measures the windows' noise itself: no re-measuring, no refusal.
                remeasure_rounds=0,
                accept_noisy=True,
            )
            calibrate(opts, engine_factory=lambda o: eng)
            dev: dict[tuple[int, int], list[float]] = {}
            for ms, shape in timer.device_ms() if cuda else []:
                dev.setdefault(shape, []).append(ms)
            table = load_table(table_path)
            pts = {}
            for p in table.fits[0].diagnostics.points:
                k = p.g // p.bcap - 1
                d = dev.get((p.bcap, k), [float("nan")])
                pts[f"bcap{p.bcap}_g{p.g}"] = {
                    "table_ms": p.step_ms,
                    "device_ms_median": statistics.median(d),
                    "rounds": len(d),
                }
            out[f"calibration_{rep}"] = pts
    args2 = argparse.Namespace(**{**vars(args), "batch": 8})
    out["single_rounds_same_engine"] = measure_mode(args2, "forced", None, eng=eng)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dense-2b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--graph-mode", default="split")
    ap.add_argument("--attention-backend", default=None, help="default: triton on CUDA")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--out", default=".")
    ap.add_argument("--modes", default="forced,synthetic_0.9,synthetic_0.2")
    ap.add_argument(
        "--calibration-check",
        action="store_true",
        help="also calibrate twice on one engine with device times (see calibration_check)",
    )
    ap.add_argument("--trim", action="store_true",
                    help="also time each k with k - 1 drafts verified per request (trimmed G)")
    ap.add_argument("--pipeline", choices=("off", "on", "both"), default="off",
                    help="EngineConfig.pipeline of the mode engines (both: each mode twice)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.ks = [int(v) for v in args.ks.split(",")]
    if args.attention_backend is None:
        args.attention_backend = "triton" if args.device.startswith("cuda") else "torch"
    w = max(args.ks)
    modes = {
        "forced": ("forced", None),
        "synthetic_0.9": ("synthetic", (0.9,) * w),
        "synthetic_0.2": ("synthetic", (0.2,) * w),
    }
    res: dict[str, object] = {"setup": {k: v for k, v in vars(args).items()}}
    modes = {m: modes[m] for m in args.modes.split(",") if m}
    runs = {"off": [False], "on": [True], "both": [False, True]}[args.pipeline]
    names = []
    for name, (acc, prof) in modes.items():
        for pipe in runs:
            key = name + ("+pipe" if pipe else "")
            names.append(key)
            res[key] = measure_mode(argparse.Namespace(**vars(args), pipelined=pipe), acc, prof)
            Path(args.out, "round_phases.json").write_text(json.dumps(res, indent=1))
    if args.pipeline == "both":  # same workload, same process: steady-state speedup per k
        res["pipelined_speedup"] = {
            name: {kk: res[name][kk]["window_mean"] / res[name + "+pipe"][kk]["window_mean"]
                   for kk in res[name]}
            for name in modes
        }
        Path(args.out, "round_phases.json").write_text(json.dumps(res, indent=1))
    if args.calibration_check:
        res["calibration_check"] = calibration_check(args)
        Path(args.out, "round_phases.json").write_text(json.dumps(res, indent=1))
        cc = res["calibration_check"]
        print(f"{'point':14s} {'table 0':>9s} {'device 0':>9s} {'table 1':>9s} {'device 1':>9s}")
        for key, p0 in cc["calibration_0"].items():
            p1 = cc["calibration_1"][key]
            print(
                f"{key:14s} {p0['table_ms']:9.3f} {p0['device_ms_median']:9.3f} "
                f"{p1['table_ms']:9.3f} {p1['device_ms_median']:9.3f}"
            )
        for kk, med in cc["single_rounds_same_engine"].items():
            print(
                f"same engine, forced bcap8 {kk}: wall {med['wall']:.3f} window "
                f"{med['window_mean']:.3f} device {med.get('device_execute', float('nan')):.3f}"
            )
    cols = ["wall", "window_mean", "prepare", "execute", "collect", "other", "device_execute",
            "wall_over_device"]
    print(f"{'mode':16s} {'k':>3s} " + " ".join(f"{c:>14s}" for c in cols))
    for name in names:
        for kk, med in res[name].items():
            vals = " ".join(f"{med.get(c, float('nan')):14.3f}" for c in cols)
            print(f"{name:16s} {kk:>3s} {vals}")
    for name, per_k in res.get("pipelined_speedup", {}).items():
        print(f"pipelined speedup {name}: " + ", ".join(f"{kk} {v:.3f}" for kk, v in per_k.items()))


if __name__ == "__main__":
    main()
