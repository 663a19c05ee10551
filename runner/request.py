"""Request lifecycle: prompt, generated tokens, KV blocks, stop rules.

This module owns :class:`Request`. A request is *waiting* until admitted to a batch slot,
*running* after its prefill, and *finished* when a stop rule fires (``max_tokens``, the model's
EOS unless ``ignore_eos``, a ``stop_token_ids`` entry; the stop token is kept in the output, as
vLLM does) or it is released. ``num_computed`` is the target's KV length (every token except the
pending one, which was sampled but not yet written); the draft-extend rows waiting in the slot's
device buffer number ``num_extend``.

Pipelined engines (``EngineConfig.pipeline``): ``num_computed`` / ``num_extend`` are the host's
view as of the last *collected* round (the device's per-slot state runs ahead), and
``num_inflight`` counts the queued rounds that still write the request's KV and slot state: a
finished or released request keeps its blocks and slot until it drops to 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speccal.runner.sampling import SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    slot: int = -1
    num_computed: int = 0
    num_extend: int = 0
    is_prefilled: bool = False
    finish_reason: str | None = None
    num_inflight: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> list[int]:
        """Append generated tokens until a stop rule fires; return the tokens kept."""
        kept = []
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops.update(self.eos_token_ids)
        for t in tokens:
            self.output.append(t)
            kept.append(t)
            if t in stops:
                self.finish_reason = "stop"
                break
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        return kept
