"""Grid validation: overlapping contexts and the additive connectivity rule."""

from __future__ import annotations

import pandas as pd
import pytest

from speccal.base.errors import GridError
from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.grid import check_connected, check_contexts, grid_components
from speccal.costmodel.measurements import validate_measurements

from .helpers import measurements


def test_components_of_a_disconnected_grid():
    pts = [(1, 2), (2, 2), (2, 4), (4, 12), (8, 12)]
    assert grid_components(pts) == [([1, 2], [2, 4]), ([4, 8], [12])]


def test_disconnected_grid_error_names_each_component():
    with pytest.raises(GridError) as info:
        check_connected([(1, 2), (2, 4), (4, 12), (8, 12)])
    msg = str(info.value)
    assert "3 disconnected components" in msg
    assert "bcap=[1] g=[2]" in msg and "bcap=[2] g=[4]" in msg and "bcap=[4, 8] g=[12]" in msg


def test_additive_fit_refuses_a_disconnected_grid():
    X = [[1, 2], [1, 4], [4, 12], [4, 16]]
    with pytest.raises(GridError, match="disconnected"):
        AdditiveCostModel().fit(X, [1.0, 2.0, 3.0, 4.0])


def test_connected_grid_passes():
    check_connected([(1, 2), (2, 2), (2, 4), (4, 4)])


@pytest.mark.parametrize(
    ("intervals", "ok"),
    [
        ({0: (512, 1, 1024), 1: (2048, 1025, 4096)}, True),
        ({0: (512, 1, 1024), 1: (2048, 1024, 4096)}, False),  # shared bound: inclusive overlap
        ({0: (512, 1, 4096), 1: (2048, 100, 200)}, False),  # nested
    ],
)
def test_context_overlap(intervals, ok):
    if ok:
        check_contexts(intervals)
    else:
        with pytest.raises(GridError, match="non-overlapping"):
            check_contexts(intervals)


def test_overlapping_contexts_in_measurements_are_refused():
    first = measurements(contexts=((512, 1, 2048),))
    second = measurements(contexts=((2048, 2000, 4096),)).assign(context_index=1)
    with pytest.raises(GridError, match="non-overlapping"):
        validate_measurements(pd.concat([first, second], ignore_index=True))
