"""CLI commands ``speccal generate`` and ``speccal bench`` (the embedded runner).

``generate`` runs prompts (token ids, or text when the checkpoint folder has a tokenizer) through
the speculative engine (``speccal.live.generate``) and prints the generated ids (and text);
``bench`` compares speculative and plain decoding of the same random prompts in one process
(``speccal.live.bench.bench``: tokens/s, TPOT, acceptance rate, mean accepted length, speed-up).
``bench --policy P`` (repeatable or comma list: ``fixed:K``, ``adaptive-step``,
``adaptive-verify``; the two adaptive modes together are refused before anything runs) instead
runs the same workload live under each policy (``speccal.live.bench.run_policy_bench``) with
``--cost-table`` (loaded against the engine's compatibility; required by adaptive policies),
reports tokens/s, TPOT, acceptance, decisions, gain over the best fixed ``k`` and the replay
prediction of each run from its own trace; ``--trace-out`` writes the run traces.
``bench --policy ... --repeats N`` runs each policy ``N`` times on the same workload in an
interleaved order (round-robin, rotated each cycle: A B C, B C A, C A B, ...;
``speccal.live.policies.interleaved_order``) and reports per policy the median tokens/s with its
min-max spread, the median replay error and the gain over the best fixed ``k`` from medians;
``--json`` adds ``repeats``, ``order`` and ``run_log`` (per-run cycle, position, UTC start/end).
``N = 1`` (the ``--policy`` default) is one run per policy, output as before.
Under ``torchrun`` both commands take ``--tp``/``--dp`` (``speccal.cli.dist.run_ranks``): every
rank runs the library call, rank 0 alone prints (``bench``: tokens/s of the whole world, titled
with the number of ranks), and an error on another rank surfaces on rank 0 naming the rank;
``bench --policy`` stays on one rank.
Human output goes to stderr through Rich, ``--json`` to stdout. Random-weight presets are
labelled as such in both outputs. The commands only parse options into a config
(``speccal.runner.engine.EngineConfig``, ``speccal.live.bench.PolicyBenchConfig``), call the
library and print; ``speccal.live`` and ``speccal.runner`` are imported inside the commands,
because they import torch and the CLI must start (and report a missing torch) without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.progress import ProgressReporter
from speccal.base.rich_tables import make_console, print_table
from speccal.base.run_spec import RunSpec
from speccal.cli.dist import is_distributed, run_ranks

err_console = make_console()


def _parse_ids(text: str, field: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(field, text, "comma- or space-separated integer token ids") from None
    if not ids:
        raise InputError(field, text, "at least one token id")
    return ids


def _parse_floats(text: str | None, field: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise InputError(field, text, "comma-separated probabilities") from None


# Options shared by ``generate`` and ``bench``.
ModelOpt = Annotated[
    str, typer.Option("--model", help="Preset (tiny, dense-0.5b, dense-2b, mimo-7b) or HF folder.")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or float16. Default: float32 on CPU, else bfloat16.",
        show_default=False,
    ),
]
DraftWidthOpt = Annotated[int, typer.Option("--draft-width", help="Draft width w.")]
KOpt = Annotated[
    int | None,
    typer.Option("--k", help="Draft steps per round (1..w). Default: w.", show_default=False),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--acceptance-profile",
        "--profile",
        help="Synthetic acceptance profile, w comma-separated values (as in `speccal trace`).",
        show_default=False,
    ),
]
GraphModeOpt = Annotated[
    str | None,
    typer.Option(
        "--graph-mode",
        help="eager or split (captured CUDA/NPU round graphs). Default: split on cuda/npu, "
        "eager on cpu.",
        show_default=False,
    ),
]
AttentionOpt = Annotated[
    str | None,
    typer.Option(
        "--attention-backend",
        help="torch or triton. Default: triton on cuda, torch elsewhere.",
        show_default=False,
    ),
]

LoopOpt = Annotated[
    str,
    typer.Option(
        "--loop",
        help="Round loop: pipelined (the host prepares round n + 1 while the device runs round n; "
        "what a deployment serves and what `speccal calibrate` measures by default) or "
        "synchronous (every round's host work in series with its device work).",
    ),
]
TpOpt = Annotated[
    int,
    typer.Option("--tp", help="Tensor-parallel ranks per model replica (launch with torchrun "
                 "--nproc-per-node TP*DP -m speccal generate|bench ...)."),
]
DpOpt = Annotated[
    int,
    typer.Option("--dp", help="Data-parallel replicas; replica d decodes prompts d, d + DP, ... "
                 "(in step: one agreed round shape per step)."),
]
StateStrategyOpt = Annotated[
    str,
    typer.Option(
        "--state-strategy",
        help="Hybrid (linear-attention) targets: scratch_swap or snapshots, as `speccal "
        "calibrate --state-strategy` (a --cost-table must have been measured with the same "
        "one); ignored by full-attention targets.",
    ),
]


def _engine_config(
    model,
    device,
    dtype,
    draft_width,
    acceptance,
    profile,
    seed,
    max_model_len,
    speculative,
    request_buckets=None,
    graph_mode=None,
    attention_backend=None,
    loop="pipelined",
    state_strategy="scratch_swap",
):
    """The ``EngineConfig`` of a command's options (defaults: the path served on ``device``, the
    pipelined round loop, the scratch-swap state strategy): their ``RunSpec`` through the one
    conversion, ``speccal.runner.engine_config.from_spec``."""
    spec = RunSpec(
        model=model, device=device, dtype=dtype, draft_width=draft_width,
        request_buckets=request_buckets, acceptance=acceptance,
        acceptance_profile=_parse_floats(profile, "--acceptance-profile"), seed=seed,
        max_model_len=max_model_len, speculative=speculative, loop=loop,
        state_strategy=state_strategy, graph_mode=graph_mode,
        attention_backend=attention_backend)
    # lazy: the runner imports torch; the CLI starts (and reports a missing torch) without it
    from speccal.runner.engine_config import from_spec

    return from_spec(spec)


def generate(
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt-ids",
            help="Prompt token ids, e.g. '1,2,3'; repeat for a batch.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt",
            help="Prompt text (needs a checkpoint folder with a tokenizer); repeatable.",
            show_default=False,
        ),
    ] = None,
    model: ModelOpt = "tiny",
    device: DeviceOpt = "cpu",
    graph_mode: GraphModeOpt = None,
    attention_backend: AttentionOpt = None,
    loop: LoopOpt = "pipelined",
    state_strategy: StateStrategyOpt = "scratch_swap",
    tp: TpOpt = 1,
    dp: DpOpt = 1,
    dtype: DtypeOpt = None,
    draft_width: DraftWidthOpt = 3,
    k: KOpt = None,
    acceptance: Annotated[
        str,
        typer.Option(
            "--acceptance",
            help="greedy (lossless), sample (rejection sampling), synthetic (accepted lengths "
            "drawn from --acceptance-profile) or forced (every draft accepted).",
        ),
    ] = "greedy",
    profile: ProfileOpt = None,
    plain: Annotated[bool, typer.Option("--plain", help="Plain decoding (no draft head).")] = False,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens to generate per prompt.")
    ] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="1 = off.")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="0 = off.")] = 0.0,
    stop_ids: Annotated[
        str | None, typer.Option("--stop-ids", help="Extra stop token ids.", show_default=False)
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past EOS.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Sampling / preset-weight seed.")] = 0,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Context limit. Default: min(model, 4096).", show_default=False
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
) -> None:
    """Generate tokens with the embedded speculative runner (token ids in and out)."""
    # lazy: these import torch; the CLI starts (and reports a missing torch) without it
    from speccal.live.generate import generate as run_generate
    from speccal.live.generate import generate_on_ranks
    from speccal.runner.engine import Engine
    from speccal.runner.sampling import SamplingParams

    if not prompt_ids and not prompt:
        raise InputError("--prompt-ids/--prompt", None, "at least one prompt")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop_token_ids=tuple(_parse_ids(stop_ids, "--stop-ids")) if stop_ids else (),
        ignore_eos=ignore_eos,
    )
    if k is not None and not (plain or 1 <= k <= draft_width):
        raise InputError("--k", k, f"an integer in [1, {draft_width}] (--draft-width)")
    cfg = _engine_config(
        model,
        device,
        dtype,
        draft_width,
        acceptance,
        profile,
        seed,
        max_model_len,
        not plain,
        graph_mode=graph_mode,
        attention_backend=attention_backend,
        loop=loop,
        state_strategy=state_strategy,
    )
    num_k = 0 if plain else (k if k is not None else draft_width)

    def run(comm, console: Console):
        """Build this rank's engine, tokenize, decode (every rank of a torchrun run calls it)."""
        if comm is None:
            engine = Engine(cfg)
        else:
            from speccal.runner.distributed.engine import DistributedEngine

            engine = DistributedEngine(cfg, comm)
        tokenizer = None
        if engine.loaded.tokenizer_path is not None:
            from transformers import AutoTokenizer  # lazy: only checkpoints with a tokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(engine.loaded.tokenizer_path))
        prompts = [_parse_ids(p, "--prompt-ids") for p in (prompt_ids or [])]
        if prompt:
            if tokenizer is None:
                raise InputError(
                    "--prompt", prompt[0], "token ids (--prompt-ids): the model has no tokenizer"
                )
            prompts += [tokenizer.encode(p) for p in prompt]
        if engine.is_random_weights:
            console.print(f"[yellow]RANDOM WEIGHTS[/]: {escape(engine.description)}",
                          soft_wrap=True)
        if comm is not None:
            outs = generate_on_ranks(engine, prompts, params, num_k, comm)
            engine.compatibility()  # every rank: gathers the ranks' device names (cached)
            return engine, tokenizer, prompts, outs
        with ProgressReporter(
            "generate",
            console=console,
            total=max_tokens * len(prompts),
            unit="tokens",
            transient=True,
        ) as bar:
            outs = run_generate(engine, prompts, params, num_k,
                                on_step=lambda n: bar.update(advance=n))
        return engine, tokenizer, prompts, outs

    if is_distributed(tp, dp):
        if dp > 1 and k is not None:
            raise InputError("--k", k, "unset with --dp > 1 (the replicas agree on k every round)")
        got = run_ranks(tp, dp, device, run, err_console, command="generate")
        if got is None:  # not rank 0: rank 0 prints
            return
    else:
        got = run(None, err_console)
    engine, tokenizer, prompts, outs = got
    results = []
    for p, o in zip(prompts, outs, strict=True):
        item = {"prompt_ids": p, "output_ids": o}
        if tokenizer is not None:
            item["text"] = tokenizer.decode(o)
        results.append(item)
    stats = engine.stats.to_dict() if num_k > 0 else None
    doc = {
        "model": engine.description,
        "random_weights": engine.is_random_weights,
        "num_draft_steps": num_k,
        "outputs": results,
        "stats": stats,
        "compatibility": engine.compatibility(),
    }
    if as_json:
        typer.echo(json.dumps(_clean(doc), allow_nan=False))
        return
    for i, item in enumerate(results):
        err_console.print(f"[bold]request {i}[/] ids: {escape(str(item['output_ids']))}",
                          soft_wrap=True)
        if "text" in item:
            err_console.print(f"  text: {item['text']!r}", soft_wrap=True, markup=False)
    if stats:
        err_console.print(
            f"k={num_k}: acceptance rate {stats['acceptance_rate']:.3f}, mean accepted length "
            f"{stats['mean_accepted_length']:.3f}, accepted-length histogram "
            f"{stats['accepted_length_hist']}",
            markup=False,
        )


def _clean(obj):
    """``obj`` with every NaN float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def bench(
    model: ModelOpt = "tiny",
    device: DeviceOpt = "cpu",
    graph_mode: GraphModeOpt = None,
    attention_backend: AttentionOpt = None,
    loop: LoopOpt = "pipelined",
    state_strategy: StateStrategyOpt = "scratch_swap",
    tp: TpOpt = 1,
    dp: DpOpt = 1,
    dtype: DtypeOpt = None,
    draft_width: DraftWidthOpt = 3,
    k: KOpt = None,
    acceptance: Annotated[
        str,
        typer.Option(
            "--acceptance",
            help="greedy (lossless), synthetic (accepted lengths drawn from "
            "--acceptance-profile) or forced (every draft accepted).",
        ),
    ] = "greedy",
    profile: ProfileOpt = None,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Requests decoded together, 1..256.")
    ] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Random prompt length.")] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens generated per request.")
    ] = 64,
    repeats: Annotated[
        int | None,
        typer.Option(
            "--repeats",
            help="Timed runs per side (median reported); with --policy, runs per policy, "
            "interleaved in a rotated round-robin. Default: 3, or 1 with --policy.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Prompt / weight seed.")] = 0,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="Run live under policies instead of spec vs plain: fixed:K, adaptive-step, "
            "adaptive-verify (repeatable or comma list).",
            show_default=False,
        ),
    ] = None,
    cost_table: Annotated[
        Path | None,
        typer.Option(
            "--cost-table",
            help="Cost table for --policy (checked against the engine); adaptive policies need one.",
            show_default=False,
        ),
    ] = None,
    phase: Annotated[
        list[str] | None,
        typer.Option(
            "--phase",
            help="With --policy and synthetic acceptance: 'FRACTION:p1,..,pw' switches the profile "
            "once that fraction of the workload's tokens is out (repeatable).",
            show_default=False,
        ),
    ] = None,
    request_buckets: Annotated[
        str | None,
        typer.Option(
            "--request-buckets",
            help="Captured request buckets, e.g. 1,2,4,8 (default: the device's served set, "
            "as speccal calibrate: 1..64 in powers of two on cuda/npu, 1,2,4,8 on cpu).",
            show_default=False,
        ),
    ] = None,
    trace_out: Annotated[
        Path | None,
        typer.Option(
            "--trace-out",
            help="With --policy: write each run's round trace (.jsonl/.parquet; several "
            "policies add '.<policy>' before the suffix).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
) -> None:
    """Speculative vs plain decoding in one process: tokens/s, TPOT, acceptance, speed-up.

    With --policy: the same workload live under each policy (one engine), with the replay
    prediction of every run from its own trace. Under torchrun with --tp/--dp: every rank runs
    both sides; rank 0 reports the whole world's tokens/s."""
    # lazy: these import torch; the CLI starts (and reports a missing torch) without it
    from speccal.live.bench import PolicyBenchConfig, run_policy_bench
    from speccal.live.bench import bench as run_bench

    if not policy:
        for name, given in (
            ("--cost-table", cost_table),
            ("--phase", phase),
            ("--trace-out", trace_out),
            ("--request-buckets", request_buckets),
        ):
            if given:
                raise InputError(name, str(given), "only together with --policy")
    if trace_out is not None:
        check_writable(trace_out, "--trace-out")  # before the runs, not after them
    cfg = _engine_config(
        model,
        device,
        dtype,
        draft_width,
        acceptance,
        profile,
        seed,
        None,
        True,
        _parse_buckets(request_buckets),
        graph_mode=graph_mode,
        attention_backend=attention_backend,
        loop=loop,
        state_strategy=state_strategy,
    )
    workload = {"num_requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens}
    if is_distributed(tp, dp):
        if policy:
            raise InputError("--policy", ",".join(policy),
                             "unset with --tp/--dp (live policy benches run on one rank)")
        if dp > 1 and k is not None:
            raise InputError("--k", k, "unset with --dp > 1 (the replicas agree on k every round)")

        def body(comm, console: Console) -> dict:
            with _status_bar(console) as report:
                return run_bench(cfg, num_draft_steps=k if k is not None else draft_width,
                                 repeats=3 if repeats is None else repeats, seed=seed,
                                 on_progress=report, comm=comm, **workload)

        res = run_ranks(tp, dp, device, body, err_console, command="bench")
        if res is not None:  # rank 0 prints
            _print_bench(_clean(res), model, as_json)
        return
    if policy:
        config = PolicyBenchConfig(
            engine=cfg,
            policies=tuple(t for v in policy for t in v.split(",") if t.strip()),
            cost_table=cost_table,
            phases=_parse_phases(phase),
            seed=seed,
            repeats=1 if repeats is None else repeats,
            trace_out=trace_out,
            **workload,
        )
        check_outputs(_trace_outputs(config), [("--cost-table", cost_table)])
        with _status_bar() as report:
            doc = run_policy_bench(config, on_progress=report)
        doc.pop("runs")  # the TimedRun objects (not JSON)
        _print_policy_bench(_clean(doc), model, as_json)
        return
    with _status_bar() as report:
        res = run_bench(
            cfg,
            num_draft_steps=k if k is not None else draft_width,
            repeats=3 if repeats is None else repeats,
            seed=seed,
            on_progress=report,
            **workload,
        )
    _print_bench(_clean(res), model, as_json)


def _trace_outputs(config) -> list[tuple[str, Path]]:
    """``--trace-out`` and the path of every run's trace (``speccal.live.bench``'s naming)."""
    if config.trace_out is None:
        return []
    from speccal.live.bench import _trace_path  # lazy: speccal.live imports torch

    runs = [SimpleNamespace(policy=p, cycle=c)
            for p in config.policies for c in range(config.repeats)]
    paths = [config.trace_out, *(_trace_path(r, config)[1] for r in runs)]
    # one policy run once writes --trace-out itself: one output, not two
    return [("--trace-out", path) for path in dict.fromkeys(Path(x) for x in paths)]


def _print_bench(res: dict, model: str, as_json: bool) -> None:
    """Print a ``speccal.live.bench.bench`` result (NaN already None)."""
    if as_json:
        typer.echo(json.dumps(res, allow_nan=False, sort_keys=True))
        return
    eng = res["engine"]["spec"]
    setup = res["setup"]
    if eng["is_random_weights"]:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {escape(eng['description'])}",
                          soft_wrap=True)
    else:
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
        acc = r.get("acceptance_rate")
        mal = r.get("mean_accepted_length")
        table.add_row(
            name,
            f"{r['tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['tpot_ms']:.2f}",
            "-" if acc is None else f"{acc:.3f}",
            "-" if mal is None else f"{mal:.3f}",
        )
    print_table(err_console, table)
    err_console.print(
        f"speed-up {res['speedup']:.2f}x tokens/s, {res['tpot_speedup']:.2f}x TPOT; "
        f"outputs equal: {res['outputs_equal']}",
        markup=False,
    )


def _parse_buckets(text: str | None) -> tuple[int, ...] | None:
    """``--request-buckets``: comma- or space-separated integers (None: the engine's default,
    ``speccal.base.geometry.SERVED_REQUEST_BUCKETS`` of the device)."""
    if not text:
        return None
    try:
        return tuple(int(b) for b in text.replace(",", " ").split())
    except ValueError:
        raise InputError("--request-buckets", text, "integers, e.g. 1,2,4,8") from None


def _parse_phases(values: list[str] | None) -> tuple:
    """``--phase FRACTION:p1,..,pw`` values as ``speccal.live.policies.Phase`` objects."""
    from speccal.live.policies import Phase  # lazy: speccal.live imports torch

    out = []
    for v in values or ():
        frac, _, prof = v.partition(":")
        try:
            f = float(frac)
        except ValueError:
            raise InputError("--phase", v, "FRACTION:p1,..,pw, e.g. 0.5:0.4,0.3,0.2") from None
        out.append(Phase(f, _parse_floats(prof, "--phase") or ()))
    return tuple(out)


@contextmanager
def _status_bar(console: Console | None = None) -> Iterator[Callable[[str], None]]:
    """A transient status line on stderr (log lines when it is not a terminal); yields
    ``report(message)``. ``console``: a rank's (silent on ranks other than 0)."""
    with ProgressReporter("bench", console=console or err_console, transient=True) as bar:
        yield lambda msg: bar.update(phase=msg)


def _print_policy_bench(doc: dict, model: str, as_json: bool) -> None:
    """Print a ``speccal.live.bench.run_policy_bench`` document (NaN already None)."""
    eng = doc["engine"]
    repeats = doc.get("repeats", 1)
    setup = doc["setup"]
    if as_json:
        typer.echo(json.dumps(doc, allow_nan=False, sort_keys=True))
        return
    if eng["is_random_weights"]:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {escape(eng['description'])}",
                          soft_wrap=True)
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
            _coverage(s),
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


def _coverage(summary: dict) -> str:
    """``priced / rounds`` of a policy's live run (a median over repeats)."""
    priced, rounds = summary.get("rounds_priced"), summary.get("rounds")
    if priced is None or not rounds:
        return "-"
    return f"{priced:.0f}/{rounds:.0f}"


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("generate")(generate)
    app.command("bench")(bench)
