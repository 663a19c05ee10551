"""The CLI speaks the run's vocabulary (``speccal.base.vocab``): every command that takes a loop,
a state strategy, an acceptance mode or a graph mode refuses any other value with a message
listing exactly the vocabulary's values, and its help names each of them. A value added to the
vocabulary (or to a command) without the other fails here."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from speccal.base import vocab
from speccal.cli import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
FLAGS = {"--loop": vocab.LOOPS, "--state-strategy": vocab.STATE_STRATEGIES,
         "--acceptance": vocab.ACCEPTANCE_MODES, "--graph-mode": vocab.GRAPH_MODES}
COMMANDS = {"bench": ("--loop", "--state-strategy", "--acceptance", "--graph-mode"),
            "calibrate": ("--loop", "--state-strategy", "--graph-mode"),
            "generate": ("--loop", "--state-strategy", "--acceptance", "--graph-mode")}
CASES = [(cmd, flag) for cmd, flags in COMMANDS.items() for flag in flags]


@pytest.mark.parametrize(("command", "flag"), CASES)
def test_a_value_outside_the_vocabulary_is_refused_with_the_vocabulary(command, flag, tmp_path):
    args = [command, "--model", "tiny", flag, "bogus"]
    if command == "generate":
        args += ["--prompt-ids", "1,2,3"]
    if command == "calibrate":
        args += ["--out", str(tmp_path / "t.json")]
    res = CliRunner().invoke(app, args, env=ENV)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip().splitlines()[-1]
    assert "'bogus'" in line, line
    listed = set(re.findall(r"[a-z_]+", line.split("expected", 1)[1])) - {"or", "one", "of"}
    assert listed == set(FLAGS[flag]), line


@pytest.mark.parametrize(("command", "flag"), CASES)
def test_the_help_names_the_flag_and_its_values(command, flag):
    """The flag exists on the command; the loop and state-strategy help name every value."""
    res = CliRunner().invoke(app, [command, "--help"], env=ENV)
    assert res.exit_code == 0 and flag in res.output, res.output
    if flag in ("--loop", "--state-strategy"):
        for value in FLAGS[flag]:
            assert value in res.output, (command, flag, value)
