"""``notebooks/analysis.ipynb``: stored without outputs, runs top to bottom on CPU (nbclient).

The notebook reads only files the repository ships (``tables/tiny-cpu.json``,
``notebooks/data/transition.parquet``) and writes its figures to a temporary folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
#: Library calls the notebook must share with the CLI (``speccal table``, ``plot``, ``replay``).
SHARED_CALLS = (
    "from speccal.costmodel.table import load_table",
    "from speccal.costmodel.table_build import refit_table",
    "from speccal.costmodel.report import cost_grid, diff_tables, summary",
    "from speccal.plots_table import write_table_plots",
    "from speccal.plots_replay import write_plots",
    "from speccal.replay import ReplayConfig, replay",
    "from speccal.interop.export import ExportRequest, run_export",
)


def read() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stored_without_outputs():
    nb = read()
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has stored outputs"
            assert cell.execution_count is None, f"cell {i} has an execution count"


def test_notebook_imports_the_cli_library_functions():
    source = "\n".join(c.source for c in read().cells if c.cell_type == "code")
    for line in SHARED_CALLS:
        assert line in source
    assert 'tables" / "tiny-cpu.json' in source and "transition.parquet" in source


@pytest.fixture(scope="module")
def executed():
    nb = read()
    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    return nb, time.perf_counter() - t0


def _outputs(nb, kind: str) -> list:
    return [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})
    ]


def test_notebook_runs_top_to_bottom(executed):
    nb, elapsed = executed
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    # 3 table figures + 2 replay figures + 1 exported-schedule figure, each displayed as a PNG
    assert len(_outputs(nb, "image/png")) == 6
    assert elapsed < 60, f"notebook took {elapsed:.1f} s"


def test_notebook_shows_fit_report_what_if_and_comparison(executed):
    nb, _ = executed
    html = "\n".join(o["data"]["text/html"] for o in _outputs(nb, "text/html"))
    for needle in (
        "leave-one-point-out",
        "leave-one-G-out",
        "best fixed",
        "adaptive gain %",
        "delta_pct",
        "sps refit",
    ):
        assert needle in html, f"no output shows {needle!r}"
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "preset:tiny" in text and "metadata differences" in text
    assert "num_speculative_tokens_per_batch_size" in text and "over the best single fixed k" in text
