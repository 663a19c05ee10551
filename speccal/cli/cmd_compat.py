"""CLI command ``speccal table compat``: a run's compatibility metadata, for ``fit --compat`` and
``table validate --expect``.

It builds the runner as ``speccal calibrate`` does (``speccal.calibrate.pipeline.make_engine``,
imported inside the command: it needs torch) and writes its ``Engine.compatibility()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable, write_json_atomic
from speccal.base.errors import InputError
from speccal.cli import options as o
from speccal.cli.render_table import echo_json, err_console


def compat(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Write the JSON here (atomically) instead of stdout.",
            show_default=False,
        ),
    ] = None,
    model: o.Model = "tiny",
    device: o.Device = "cpu",
    dtype: o.Dtype = None,
    draft_width: Annotated[
        int | None,
        typer.Option(
            "--draft-width",
            help="num_speculative_tokens w (runner default if unset).",
            show_default=False,
        ),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Model context (runner default if unset).", show_default=False
        ),
    ] = None,
    graph_mode: Annotated[
        str | None,
        typer.Option(
            "--graph-mode",
            help="eager or split (captured CUDA/NPU graphs). Default: what calibrate uses.",
            show_default=False,
        ),
    ] = None,
    attention_backend: Annotated[
        str | None,
        typer.Option(
            "--attention-backend",
            help="torch or triton. Default: what calibrate uses.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print a run's compatibility metadata (Engine.compatibility()), for --compat / --expect.

    The runner is built exactly as speccal calibrate builds it, with the same options."""
    # lazy: the runner needs torch; the CLI starts (and names a missing torch) without it
    from speccal.calibrate.pipeline import CalibrateOptions, make_engine

    if out is not None:
        if out.suffix.lower() != ".json":
            raise InputError("--out", str(out), "a path ending in .json")
        check_writable(out, "--out")  # before the runner is built
    engine = make_engine(
        CalibrateOptions(
            model=model,
            device=device,
            dtype=dtype,
            draft_width=draft_width,
            max_model_len=max_model_len,
            graph_mode=graph_mode,
            attention_backend=attention_backend,
        )
    )
    doc = engine.compatibility()
    if out is None:
        echo_json(doc)
        return
    write_json_atomic(out, doc, field="--out")
    err_console.print(
        f"wrote the compatibility of {doc['model']['architecture']} (w={doc['draft_width']}, "
        f"{doc['device']['kind']}, graph {doc['graph_mode']}) to {out}",
        markup=False,
    )
