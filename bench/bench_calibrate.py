"""Wall time of ``speccal calibrate`` on the default grid, split into warmup/capture, sampling and
fitting.

Run: ``python3 bench/bench_calibrate.py [--model tiny] [--device cpu] [--threads N] [--record]``
(on the H200: ``--model dense-2b --device cuda --metric calibration_wall_s_2b_h200``).

One calibration with no config file (every documented default: additive model, all captured
request buckets, every legal captured target bucket, one context prefill 2048 / KV 1..4096 shrunk to
fit, 8 warmup rounds, 3 windows of 32 rounds per point), run in-process through the same library
call as the CLI, into a temporary directory. Reported:

- ``warmup_capture_s``: building and warming the runner (model load, graph capture when any);
- ``sampling_s``: driving the grid: transitions (fresh requests + prefill round), warmup rounds and
  timed windows (``windows_s`` is the timed part alone);
- ``fit_s``: ``build_table`` (fit + diagnostics);
- ``total_s``: the whole call, including printing and the atomic table write;
- ``transition_s``: the part of ``sampling_s`` that puts each window's fresh requests in place
  (the prompt source's one prefill included) and runs their first round.

``--prompt-fill prefill`` prefills every window's prompts instead of admitting them from the
prompt source (``Engine.set_prompt_source``), to compare the two on the same grid.
``--config FILE`` is ``speccal calibrate --config`` (a smaller grid).

``--record`` appends ``calibration_wall_s_<model>_<device>`` (or ``--metric``) to
``bench/results.jsonl`` as ``{metric, value, unit, device, commit, date, command}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

from results import append_results, git_commit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="runner preset or checkpoint folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-width", type=int, default=None)
    ap.add_argument("--request-buckets", default=None, help="captured buckets, e.g. 1,2,4,8")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument(
        "--metric", default=None, help="metric name (default calibration_wall_s_<model>_<device>)"
    )
    ap.add_argument("--device-label", default=None, help="device text for results.jsonl")
    ap.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    ap.add_argument("--table-out", default=None, help="also keep the calibrated table here")
    ap.add_argument("--graph-mode", default=None, help="EngineConfig.graph_mode (default: eager)")
    ap.add_argument("--attention-backend", default=None, help="torch (default) or triton")
    ap.add_argument("--json-out", default=None, help="also write the result JSON here")
    ap.add_argument("--config", default=None, help="calibration config file (JSON)")
    ap.add_argument("--prompt-fill", choices=("auto", "prefill"), default="auto",
                    help="auto: the engine's prompt source where it has one; prefill: every "
                    "window's prompts prefilled")
    args = ap.parse_args(argv)

    from rich.console import Console

    from speccal.calibrate.pipeline import CalibrateOptions, calibrate

    buckets = (
        tuple(int(b) for b in args.request_buckets.split(",")) if args.request_buckets else None
    )
    with tempfile.TemporaryDirectory() as tmp:
        opts = CalibrateOptions(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            draft_width=args.draft_width,
            request_buckets=buckets,
            out=Path(tmp) / "table.json",
            threads=args.threads,  # calibrate pins (default: 1 on cpu) and restores them
            config_path=Path(args.config) if args.config else None,
        )
        factory = None
        if args.graph_mode or args.attention_backend:
            from speccal.kernels.config import KernelConfig
            from speccal.runner.engine import Engine, EngineConfig

            def factory(o: CalibrateOptions) -> Engine:
                # make_engine's settings (forced acceptance) plus the graph mode / backend.
                kwargs = {"model": o.model, "device": o.device, "acceptance": "forced"}
                kwargs["seed"] = o.seed
                for name in ("dtype", "draft_width", "request_buckets"):
                    if getattr(o, name) is not None:
                        kwargs[name] = getattr(o, name)
                if args.graph_mode:
                    kwargs["graph_mode"] = args.graph_mode
                if args.attention_backend:
                    kwargs["attention_backend"] = args.attention_backend
                return Engine(EngineConfig.flat(kernels=KernelConfig.from_env(), **kwargs))

        if args.prompt_fill == "prefill":
            from speccal.calibrate.pipeline import make_engine

            built = factory or make_engine

            def factory(o: CalibrateOptions):
                eng = built(o)
                # the driver asks the engine whether it has a prompt source: say no
                eng.__class__ = type("PrefillingEngine", (type(eng),),
                                     {"supports_prompt_source": property(lambda self: False)})
                return eng

        summary = calibrate(opts, console=Console(stderr=True), engine_factory=factory)
        if args.table_out:
            import shutil

            shutil.copyfile(Path(tmp) / "table.json", args.table_out)
    t = summary["timings"]
    result = {
        "warmup_capture_s": t["compile_capture_s"],
        "sampling_s": t["transition_s"] + t["warmup_s"] + t["sampling_s"],
        "windows_s": t["sampling_s"],
        "transition_s": t["transition_s"],
        "prompt_fill": args.prompt_fill,
        "fit_s": t["fit_s"],
        "total_s": t["total_s"],
        "points": summary["points_done"],
        "rounds": summary["rounds"],
        "torch_threads": summary["effective_config"]["threads"],
        "geometry": summary["effective_config"]["geometry"],
        "contexts": summary["effective_config"]["config"]["contexts"],
        "heldout_lopo": summary["fit"][0]["leave_one_point_out"],
    }
    print(json.dumps(result, indent=2, sort_keys=True))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, sort_keys=True))
    if args.record:
        kind = args.device.split(":")[0]
        metric = args.metric or f"calibration_wall_s_{Path(args.model).name}_{kind}"
        default_label = (
            f"cpu ({os.cpu_count()} cores, {result['torch_threads']} torch threads)"
            if kind == "cpu"
            else args.device
        )
        line = {
            "metric": metric,
            "value": round(t["total_s"], 3),
            "unit": "s",
            "device": args.device_label or default_label,
            "commit": git_commit(),
            "date": date.today().isoformat(),
            "command": "python3 bench/bench_calibrate.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        append_results([line])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
