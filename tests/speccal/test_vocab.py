"""The run's vocabulary (speccal.base.vocab) is the one every layer validates against: the
runner, calibrate, the CLI and the policy take it; the cost table's schema writes the same
values (plus ``unknown`` / ``none`` where a table may not know)."""

from __future__ import annotations

import typing

from speccal.base import vocab
from speccal.costmodel.compat import Compatibility as ExecutionBlockFields
from speccal.costmodel.table_schema import CalibrationConfig, PolicyConfig
from speccal.policy import AdaptiveStepConfig


def _literal(model, name) -> set:
    ann = model.model_fields[name].annotation
    return {a for arg in (typing.get_args(ann) or (ann,)) for a in (typing.get_args(arg) or (arg,))
            if isinstance(a, str)}


def test_the_table_writes_the_run_vocabulary():
    extra = {"unknown", "none"}
    assert _literal(ExecutionBlockFields, "loop") - extra == set(vocab.LOOPS)
    assert _literal(ExecutionBlockFields, "state_strategy") - extra == set(vocab.STATE_STRATEGIES)
    assert set(vocab.GRAPH_MODES) <= _literal(ExecutionBlockFields, "graph_mode")
    assert _literal(ExecutionBlockFields, "verification_mode") == set(vocab.ACCEPTANCE_MODES)
    assert _literal(CalibrationConfig, "mode") == set(vocab.TABLE_MODES)


def test_every_layer_takes_the_vocabulary():
    from speccal.calibrate import config, pipeline
    from speccal.cli import cmd_run
    from speccal.costmodel import measurements

    assert pipeline.LOOPS is vocab.LOOPS and cmd_run.LOOPS is vocab.LOOPS
    assert pipeline.STATE_STRATEGIES is vocab.STATE_STRATEGIES
    assert set(config.MODES) == set(measurements.MODES) == set(vocab.TABLE_MODES)
    defaults = vocab.POLICY_DEFAULTS
    assert AdaptiveStepConfig() == AdaptiveStepConfig(**defaults)
    assert PolicyConfig().model_dump() == defaults
    assert (config.DEFAULT_WINDOW_SIZE, config.DEFAULT_UPDATE_INTERVAL,
            config.DEFAULT_SWITCH_MIN_GAIN) == tuple(defaults.values())


def test_the_runner_takes_the_vocabulary():
    from speccal.runner import engine_config, hybrid_state, path

    assert hybrid_state.STATE_STRATEGIES is vocab.STATE_STRATEGIES
    assert path.GRAPH_MODES is vocab.GRAPH_MODES
    assert engine_config.ACCEPTANCE_MODES is vocab.ACCEPTANCE_MODES
