"""The run's vocabulary, spelled once (no torch): every layer validates against these tuples.

- :data:`LOOPS`: the round loop (``pipelined``: the two-slot pipeline, a deployment's loop;
  ``synchronous``: collect before the next prepare);
- :data:`STATE_STRATEGIES`: a hybrid target's recurrent state under speculation
  (``speccal.runner.hybrid_state``);
- :data:`GRAPH_MODES`: how the runner executes a round (``eager``, ``split`` CUDA graphs);
- :data:`ACCEPTANCE_MODES`: how a round's drafts are accepted (``greedy`` and ``sample``: the
  target decides; ``synthetic``: a profile; ``forced``: every draft, calibration's shapes);
- :data:`TABLE_MODES`: what a cost table measured (``draft_step``, ``target_verify``);
- :data:`POLICY_DEFAULTS`: the adaptive draft step's window, update interval and switch gain
  (the seeds' 20 / 5 / 0.05).

The cost table's schema (``speccal.costmodel.compat``, ``table_schema``) writes the same values
as pydantic literals, plus ``unknown`` / ``none`` where a table may not know;
``tests/speccal/test_vocab.py`` fails when the two disagree.
"""

from __future__ import annotations

LOOPS = ("pipelined", "synchronous")
STATE_STRATEGIES = ("scratch_swap", "snapshots")
GRAPH_MODES = ("eager", "split")
ACCEPTANCE_MODES = ("greedy", "sample", "synthetic", "forced")
TABLE_MODES = ("target_verify", "draft_step")
POLICY_DEFAULTS = {"window_size": 20, "update_interval": 5, "switch_min_gain": 0.05}
