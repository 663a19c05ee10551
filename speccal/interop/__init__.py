"""Speaking to other engines: schedules and cost tables out, acceptance data in (SPEC section 9).

Torch-free (it sits beside the policy floor: ``costmodel``, ``replay``, ``trace``, ``base``).
One job per module:

- ``acceptance``: measured accepted lengths of full-width rounds (:class:`Acceptance`) and their
  conversion into a speccal :class:`~speccal.trace.RoundTrace`;
- ``prometheus``: the Prometheus text exposition format (what vLLM's ``/metrics`` serves);
- ``importers``: vLLM spec-decode counters, vLLM per-request stats, ``speculation_profile.json``
  and plain CSV of accepted lengths -> :class:`Acceptance`;
- ``schedule``: per batch bucket, predicted tokens/s of every ``k`` by replaying the acceptance
  at that bucket (``speccal.replay``), the best ``k`` (``0`` where speculation does not pay) and
  the whole workload under a schedule vs every single fixed ``k``;
- ``pricing``: what a table's lookup prices at one KV length in the forms engine files carry
  (its KV model at that KV, else the interval's fit), the sidecar's record of it and the
  held-out error of the model that prices;
- ``vllm``, ``trtllm``, ``sglang`` (DSpark cost table), ``sglang_adaptive`` (EAGLE / MTP
  adaptive steps): one engine's file format, its key and unit conventions and the rule it reads
  the file with;
- ``report``: the evidence sidecar written next to every exported file;
- ``export``: the ``speccal export`` pipeline (table + acceptance -> engine file + sidecar).

docs/INTEROP.md cites the engine code each module matches.
"""
