"""Options shared by the commands that build a runner (``generate``, ``bench``; ``--model``,
``--device``, ``--dtype`` also ``calibrate``, ``trace``, ``compat``) and the one conversion of
their values into an engine configuration.

Each capitalised name is an ``Annotated`` type a command's parameter takes (its flag and help:
``model: o.Model``); :func:`engine_config` turns the parsed values into the ``RunSpec`` of the
run (``speccal.base.run_spec``) and the runner's ``EngineConfig`` of it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from speccal.base.errors import InputError
from speccal.base.run_spec import RunSpec
from speccal.cli import parse

Model = Annotated[
    str, typer.Option("--model", help="Runner preset (tiny, dense-2b, qwen3.5-2b, moe-16b-a3b, "
                      "...: speccal.runner.presets) or a Hugging Face checkpoint folder.")
]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or float16. Default: float32 on CPU, else bfloat16.",
        show_default=False,
    ),
]
DraftWidth = Annotated[int, typer.Option("--draft-width", help="Draft width w.")]
K = Annotated[
    int | None,
    typer.Option("--k", help="Draft steps per round (1..w). Default: w.", show_default=False),
]
Profile = Annotated[
    str | None,
    typer.Option(
        "--acceptance-profile",
        "--profile",
        help="Synthetic acceptance profile, w comma-separated values (as in `speccal trace`).",
        show_default=False,
    ),
]
GraphMode = Annotated[
    str | None,
    typer.Option(
        "--graph-mode",
        help="eager or split (captured CUDA/NPU round graphs). Default: split on cuda/npu, "
        "eager on cpu.",
        show_default=False,
    ),
]
Attention = Annotated[
    str | None,
    typer.Option(
        "--attention-backend",
        help="torch or triton. Default: triton on cuda, torch elsewhere.",
        show_default=False,
    ),
]
Loop = Annotated[
    str,
    typer.Option(
        "--loop",
        help="Round loop: pipelined (the host prepares round n + 1 while the device runs round n; "
        "what a deployment serves and what `speccal calibrate` measures by default) or "
        "synchronous (every round's host work in series with its device work).",
    ),
]
Tp = Annotated[
    int,
    typer.Option("--tp", help="Tensor-parallel ranks per model replica (launch with torchrun "
                 "--nproc-per-node TP*DP -m speccal generate|bench ...)."),
]
Dp = Annotated[
    int,
    typer.Option("--dp", help="Data-parallel replicas; replica d decodes prompts d, d + DP, ... "
                 "(in step: one agreed round shape per step)."),
]
StateStrategy = Annotated[
    str,
    typer.Option(
        "--state-strategy",
        help="Hybrid (linear-attention) targets: scratch_swap or snapshots, as `speccal "
        "calibrate --state-strategy` (a --cost-table must have been measured with the same "
        "one); ignored by full-attention targets.",
    ),
]
ScoreInformativeness = Annotated[
    float,
    typer.Option(
        "--score-informativeness",
        help="Synthetic acceptance: how much a draft's score says about its acceptance, 0-1 "
        "(0: every score is its position's profile value; 1: the score is the outcome; "
        "between, scores rank drafts as a real draft head's probabilities do, which adaptive "
        "verify allocates by). The acceptance rate stays the profile's.",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print results as JSON on stdout.")]


def engine_config(
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
    score_informativeness=0.0,
):
    """The ``EngineConfig`` of a command's options (defaults: the path served on ``device``, the
    pipelined round loop, the scratch-swap state strategy): their ``RunSpec`` through the one
    conversion, ``speccal.runner.engine_config.from_spec``."""
    spec = RunSpec(
        model=model, device=device, dtype=dtype, draft_width=draft_width,
        request_buckets=request_buckets, acceptance=acceptance,
        acceptance_profile=parse.floats(profile, "--acceptance-profile"),
        score_informativeness=score_informativeness, seed=seed,
        max_model_len=max_model_len, speculative=speculative, loop=loop,
        state_strategy=state_strategy, graph_mode=graph_mode,
        attention_backend=attention_backend)
    # lazy: the runner imports torch; the CLI starts (and reports a missing torch) without it
    from speccal.runner.engine_config import from_spec

    return from_spec(spec)


def check_replica_k(k: int | None, dp: int) -> None:
    """Refuse ``--k`` with ``--dp > 1``: the data-parallel replicas agree on ``k`` every round."""
    if dp > 1 and k is not None:
        raise InputError("--k", k, "unset with --dp > 1 (the replicas agree on k every round)")
