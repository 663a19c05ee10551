"""The runner face (``speccal.base.runner_face.Runner``): the engine and the calibration fakes
implement it, and calibrate reads a runner only through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from speccal.base.runner_face import BuildReport, Runner

CALIBRATE = Path(__file__).resolve().parents[2] / "calibrate"


def test_the_engine_and_the_fakes_are_runners():
    from speccal.runner.engine import Engine, EngineConfig
    from tests.calibrate.fakes import FakeClock, FakeEngine

    eng = Engine(EngineConfig(model="tiny", draft_width=2, request_buckets=(1, 2)))
    assert isinstance(eng, Runner)
    report = eng.build_report()
    assert isinstance(report, BuildReport) and report.timings["total_s"] > 0
    assert report.precompile is None and report.graphs == 0  # CPU: eager, nothing compiled
    assert eng.vocab_size == eng.loaded.config.vocab_size
    assert isinstance(FakeEngine(FakeClock()), Runner)


def test_a_runner_without_the_face_is_not_one():
    class Partial:
        geometry = description = device = None

        def step(self, plan):
            return None

    assert not isinstance(Partial(), Runner)


@pytest.mark.parametrize("path", sorted(CALIBRATE.glob("*.py")), ids=lambda p: p.name)
def test_calibrate_never_probes_an_engine(path):
    """No ``getattr`` / ``hasattr`` on an engine, and no reach into its runner or model."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and "engine" in ast.unparse(node.args[0])):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Attribute) and node.attr in ("runner", "loaded")
                and "engine" in ast.unparse(node.value)):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert bad == []
