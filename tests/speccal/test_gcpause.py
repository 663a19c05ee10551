"""The cyclic collector is held off while rounds are timed (calibration windows, live runs)."""

from __future__ import annotations

import gc

import pytest

from speccal.base.gcpause import paused_gc


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_paused_then_restored_even_on_error_and_when_nested():
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # only the outermost pause re-enables
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_no_collection_runs_inside_a_paused_region():
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    try:
        with paused_gc():
            junk = []
            for _ in range(50_000):  # far past generation 0's threshold
                a = []
                a.append(a)  # a cycle: only the collector frees it
                junk.append(a)
            del junk
            inside = list(seen)
        gc.collect()
    finally:
        gc.callbacks.remove(cb)
    assert inside == [] and 2 in seen
