"""The CPU probe clock (``speccal.calibrate.timing``), the CPU defaults of the window design, and
the runner's CPU steadiness fixes (block layout after a reset, a resident host heap)."""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from speccal.base.geometry import Geometry
from speccal.calibrate.config import (
    DEFAULT_WARMUP_STEPS,
    KIND_DEFAULTS,
    UserConfig,
    parse_config_obj,
    resolve_config,
)
from speccal.calibrate.gate import GateConfig
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.calibrate.timing import SpeedProbe, WindowTimer, at_run_speed
from speccal.costmodel.table import load_table
from speccal.runner.kv_cache import BlockAllocator


class _Engine:
    device = None

    def synchronize(self) -> None:
        pass


class _Probe:
    """A probe whose n-th call reports ``times[n]`` seconds."""

    def __init__(self, times):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_a_window_is_its_rounds_over_the_probe_at_the_first_windows_reference(monkeypatch):
    """Each round's thread time over the probe timed after it; the median ratio times the
    reference, which the first window sets to its median probe."""
    cpu = iter([0.0, 0.004, 1.0, 1.008, 2.0, 2.012])  # rounds of 4, 8 and 12 ms
    monkeypatch.setattr("speccal.calibrate.timing.time.thread_time", lambda: next(cpu))
    timer = WindowTimer(_Engine(), lambda: 0.0, probe=_Probe([0.001, 0.002, 0.003]))
    results, span = timer.run(lambda: "r", 3)
    assert results == ["r", "r", "r"]
    assert timer.probe_ref_ms == pytest.approx(2.0)  # the window's median probe, ms
    assert span.probe_ms == pytest.approx(2.0)
    # ratios 4, 4, 4 -> 4 * 2.0 ms a round; elapsed_s is the window's normalised total
    assert 1000 * span.elapsed_s / 3 == pytest.approx(8.0)
    assert span.probe_ref_ms == pytest.approx(2.0) and span.wall_s == 0.0
    # a later window keeps the reference: a machine twice as slow gives the same price
    cpu2 = iter([0.0, 0.008, 1.0, 1.016, 2.0, 2.024])
    monkeypatch.setattr("speccal.calibrate.timing.time.thread_time", lambda: next(cpu2))
    timer._probe = _Probe([0.002, 0.004, 0.006])
    _, slow = timer.run(lambda: "r", 3)
    assert 1000 * slow.elapsed_s / 3 == pytest.approx(8.0)


def test_without_a_probe_the_window_is_timed_by_the_wall_clock():
    ticks = iter([1.0, 1.5])
    timer = WindowTimer(_Engine(), lambda: next(ticks))
    assert timer.clock_name == "wall"
    _, span = timer.run(lambda: None, 4)
    assert span.elapsed_s == pytest.approx(0.5) and span.probe_ms is None
    with pytest.raises(ValueError, match="reference without a probe"):
        WindowTimer(_Engine(), lambda: 0.0, probe_ref_ms=1.0)


def test_rows_are_priced_at_the_runs_median_probe():
    rows = [
        {"clock": "cpu_probe", "step_ms": 8.0, "elapsed_s": 0.032, "window_steps": 4,
         "probe_ms": 2.0, "probe_ref_ms": 2.0},
        {"clock": "cpu_probe", "step_ms": 6.0, "elapsed_s": 0.024, "window_steps": 4,
         "probe_ms": 3.0, "probe_ref_ms": 1.0},  # a re-measure call with its own reference
        {"clock": "cpu_probe", "step_ms": 4.0, "elapsed_s": 0.016, "window_steps": 4,
         "probe_ms": 4.0, "probe_ref_ms": 2.0},
    ]
    out = at_run_speed(rows)
    # the run's median probe is 3.0 ms: ratios 4, 6, 2 -> 12, 18, 6 ms
    assert [r["step_ms"] for r in out] == pytest.approx([12.0, 18.0, 6.0])
    assert all(r["probe_ref_ms"] == 3.0 for r in out)
    assert all(r["step_ms"] == pytest.approx(1000 * r["elapsed_s"] / 4) for r in out)
    assert rows[0]["step_ms"] == 8.0  # the journal's rows are not changed
    wall = [{"step_ms": 5.0, "elapsed_s": 0.02}]
    assert at_run_speed(wall) == wall


def test_the_probe_prices_a_known_multiple_of_itself():
    """A "round" of three probe workloads is priced at about three probes (seeded workload;
    tolerance +-30 % over 40 rounds, for a shared CI box)."""
    probe = SpeedProbe()
    timer = WindowTimer(_Engine(), lambda: 0.0, probe=probe)
    timer.run(lambda: probe(), 40)  # sets the reference where the rounds leave the caches
    _, span = timer.run(lambda: (probe(), probe(), probe()), 40)
    ratio = 1000 * span.elapsed_s / 40 / timer.probe_ref_ms
    assert 2.1 <= ratio <= 3.9, ratio


def test_a_cpu_calibration_records_the_probe_clock(tmp_path, small_config, engine_factory):
    """A real CPU engine is timed by the probe clock: journal rows name it, the table's timing
    block records it and the run's median probe, and every stored window is consistent."""
    out = tmp_path / "t.json"
    opts = CalibrateOptions(config_path=small_config, out=out, progress=False,
                            remeasure_rounds=0, accept_noisy=True)
    calibrate(opts, console=Console(quiet=True), engine_factory=engine_factory)
    lines = [json.loads(x) for x in opts.journal_path.read_text().splitlines()]
    assert lines[0]["measurement"]["clock"] == "cpu_probe"
    rows = [x["row"] for x in lines if x.get("kind") == "window"]
    assert rows and all(r["clock"] == "cpu_probe" and r["probe_ms"] > 0 and r["wall_s"] > 0
                        for r in rows)
    assert len({r["probe_ref_ms"] for r in rows}) == 1  # one reference for the whole call
    table = load_table(out)
    assert table.calibration.timing.clock == "cpu_probe"
    assert table.calibration.timing.probe_ref_ms == pytest.approx(
        float(np.median([r["probe_ms"] for r in rows])))
    for fit in table.fits:
        for w in fit.windows:
            assert w.step_ms == pytest.approx(1000 * w.elapsed_s / w.window_steps)


def _geometry() -> Geometry:
    rows = {1: (1, 2, 3, 4), 2: (2, 3, 4, 6, 8), 4: (4, 6, 8, 12, 16), 8: (8, 12, 16, 24, 32)}
    return Geometry(draft_width=3, request_buckets=(1, 2, 4, 8), target_rows=rows,
                    kv_capacity_tokens=32832, max_model_len=4096, block_size=16)


def test_cpu_defaults_of_the_window_design_and_contexts():
    cpu = resolve_config(UserConfig.build(), _geometry(), device_kind="cpu")
    want = KIND_DEFAULTS["cpu"]
    assert (cpu.warmup_steps, cpu.window_steps, cpu.windows_per_point) == (
        want["warmup_steps"], want["window_steps"], want["windows_per_point"])
    assert len(cpu.contexts) == 1 and cpu.contexts[0].max_kv_length == 4096
    assert cpu.sources["window_steps"] == "default (cpu)"
    assert "one interval" in cpu.notes["contexts"]
    # cuda: short warm-up only, the seeds' windows and the geometric KV levels
    gpu = resolve_config(UserConfig.build(), _geometry(), device_kind="cuda")
    assert gpu.warmup_steps == KIND_DEFAULTS["cuda"]["warmup_steps"] and len(gpu.contexts) == 4
    assert gpu.sources["warmup_steps"] == "default (cuda)"
    assert gpu.sources["window_steps"] == "default" and gpu.windows_per_point == 3
    # a kind without its own defaults keeps the seeds'
    npu = resolve_config(UserConfig.build(), _geometry(), device_kind="npu")
    assert npu.warmup_steps == DEFAULT_WARMUP_STEPS and npu.sources["warmup_steps"] == "default"
    # explicit values win over a kind's defaults
    given = resolve_config(UserConfig.build(parse_config_obj({"windows_per_point": 3})),
                           _geometry(), device_kind="cpu")
    assert given.windows_per_point == 3 and given.sources["windows_per_point"] == "file"
    gate = GateConfig.resolve("cpu")
    assert gate.remeasure_rounds == 1 and gate.sources["remeasure_rounds"] == "default (cpu)"
    assert GateConfig.resolve("cuda").remeasure_rounds == 2


def test_a_reset_hands_blocks_out_in_order_again():
    alloc = BlockAllocator(16, 4)
    a, b = [], []
    for n in range(4, 17, 4):  # two requests growing side by side interleave their blocks
        alloc.grow(a, n)
        alloc.grow(b, n)
    assert a == [1, 3, 5, 7]
    alloc.free(b)
    alloc.free(a)
    c: list[int] = []
    alloc.grow(c, 12)
    assert c != [1, 2, 3]  # the history's order
    alloc.free(c)
    alloc.sort_free()
    alloc.grow(c, 12)
    assert c == [1, 2, 3]


def test_engine_reset_sorts_the_free_blocks():
    from speccal.runner.engine import Engine, EngineConfig, RoundPlan
    from speccal.runner.sampling import SamplingParams

    eng = Engine(EngineConfig(model="tiny", device="cpu", draft_width=2,
                              request_buckets=(1, 2), max_model_len=256))
    for _ in range(2):
        eng.add_request(list(range(1, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(4):
        eng.step(RoundPlan(num_draft_steps=2))
    eng.reset()
    free = eng.kv.allocator._free
    assert free == sorted(free, reverse=True)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_cpu_engine_keeps_its_heap_resident():
    from speccal.runner.device import keep_host_heap

    assert keep_host_heap() is True


def test_startup_is_counted_from_speccal_not_from_an_execing_shell():
    """A shell that ``exec``s the command as its last step hands it its own start time: the
    reported start-up stays what the interpreter and imports took."""
    code = "from speccal.calibrate import machine; print(machine.process_age_s())"
    script = f"sleep 2; exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert 0 < float(out.stdout) < 1.9, out.stdout
