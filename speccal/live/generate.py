"""Library entry point of ``speccal generate``: :func:`generate` runs requests to completion.

The benches (``speccal bench``) are ``speccal.live.bench``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from speccal.runner.engine import Engine, RoundPlan
from speccal.runner.sampling import SamplingParams


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    num_draft_steps: int,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Run ``prompts`` to completion; returns each request's generated token ids.

    ``on_step(num_new_tokens)`` is called after every round (progress bars).
    """
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    plan = RoundPlan(num_draft_steps)
    while engine.has_unfinished():
        res = engine.step(plan)
        if on_step is not None:
            on_step(sum(len(e) for e in res.emitted))
    out = [list(engine.requests[r].output) for r in rids]
    for r in rids:
        engine.release(r)
    return out
