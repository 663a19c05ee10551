"""docs/round.svg is drawn by docs/make_round_diagram.py (the picture docs/ARCHITECTURE.md
embeds): the script runs and writes an SVG with both queue depths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_round_diagram_draws_both_queue_depths(tmp_path):
    spec = importlib.util.spec_from_file_location("make_round_diagram",
                                                  ROOT / "docs" / "make_round_diagram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.draw(tmp_path / "round.svg")
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for label in ("queue depth 0", "queue depth 1", "draft graph", "target graph", "collect"):
        assert label in text, label
    assert "(round.svg)" in (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert (ROOT / "docs" / "round.svg").is_file()
