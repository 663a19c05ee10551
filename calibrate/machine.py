"""The machine a calibration measures on: torch's intra-op threads and the load seen.

**Threads.** On a CPU a round's wall time depends on how many intra-op threads torch runs and on
who else wants the cores: on a busy 2-core machine consecutive identical ``speccal bench`` runs
gave TPOT from 3 ms to 295 ms with torch's default threads (OpenMP workers spin-waiting against
other work) and 3.2-5.3 ms with one thread. So a CPU calibration pins torch to one intra-op thread
by default (``--threads N`` to choose), records the count in the table (``calibration.threads``)
and restores the previous count when it ends. On cuda and npu the host threads only feed the
device: torch's count is left alone unless asked, and recorded either way.

**Load.** ``os.getloadavg`` (1, 5, 15 min) before sampling and after it, the CPU count and the
CPUs this process may run on; on cuda also the device's utilisation when ``torch.cuda`` can read
it cheaply (NVML; None otherwise). The table records them (``calibration.quality.load``).

torch is imported inside the functions that need it: ``speccal.calibrate.pipeline`` must import
without torch, so that ``speccal calibrate`` on a machine without torch says so in one line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import speccal
from speccal.base.errors import InputError, UnsupportedError

#: Intra-op threads a CPU calibration runs with unless ``--threads`` says otherwise.
DEFAULT_CPU_THREADS = 1
#: The refusal when torch is missing (the same words as the runner's, ``pipeline.make_engine``).
TORCH_MISSING = (
    "speccal calibrate drives the embedded runner, which needs torch: "
    "install it (pip install torch) or fit measurement rows with speccal fit"
)


def _torch() -> Any:
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        raise UnsupportedError(TORCH_MISSING) from None
    return torch


def device_kind(device: str) -> str:
    """``cpu``, ``cuda`` or ``npu`` of a device string (``cuda:1`` -> ``cuda``)."""
    return device.split(":", 1)[0]


def check_threads(threads: int | None) -> None:
    """Refuse a thread count that is not a positive integer (None: not given)."""
    if threads is not None and not (isinstance(threads, int) and threads >= 1):
        raise InputError("--threads", threads, "a positive integer (torch intra-op threads)")


@dataclass
class ThreadPin:
    """torch's intra-op threads for the duration of a ``with`` block (module docstring).

    Attributes
    ----------
    threads : intra-op threads while inside the block (what the table records).
    source : ``flag`` (``--threads``), ``default`` (pinned on cpu) or ``run`` (torch's own count).
    previous : the count before the block, restored at its end.
    """

    device: str
    requested: int | None = None
    threads: int = 0
    source: str = "run"
    previous: int = 0

    def __enter__(self) -> ThreadPin:
        torch = _torch()
        self.previous = torch.get_num_threads()
        want = self.requested
        if want is None and device_kind(self.device) == "cpu":
            want = DEFAULT_CPU_THREADS
            self.source = "default"
        elif want is not None:
            self.source = "flag"
        if want is not None:
            torch.set_num_threads(want)
        self.threads = torch.get_num_threads()
        return self

    def __exit__(self, *exc: object) -> None:
        _torch().set_num_threads(self.previous)

    def note(self) -> str:
        """How the count was chosen, for the effective-configuration printout."""
        return {
            "default": "default (cpu: pinned for stable timings)",
            "flag": "flag",
        }.get(self.source, "run (torch's own count)")


def pin_threads(device: str, threads: int | None = None) -> ThreadPin:
    """A :class:`ThreadPin` for a calibration on ``device`` (``threads`` None: the default)."""
    check_threads(threads)
    return ThreadPin(device=device, requested=threads)


def cpu_counts() -> dict[str, int | None]:
    """``{"cpu_count": CPUs of the machine, "affinity_cpus": CPUs this process may use}``."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"cpu_count": os.cpu_count(), "affinity_cpus": affinity}


def load_sample(device: str) -> dict[str, Any]:
    """``{"loadavg": [1, 5, 15 min] | None, "gpu_utilization_pct": float | None}`` now."""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"loadavg": load, "gpu_utilization_pct": _gpu_utilization(device)}


def _gpu_utilization(device: str) -> float | None:
    if device_kind(device) != "cuda":
        return None
    torch = _torch()
    try:
        # NVML through torch (needs the nvidia-ml-py package); any failure just means unknown.
        return float(torch.cuda.utilization(torch.device(device)))
    except Exception:  # an optional reading: unknown, never an error
        return None


def load_record(device: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The ``calibration.quality.load`` block from two :func:`load_sample` readings."""
    return {
        **cpu_counts(),
        "loadavg_before": before["loadavg"],
        "loadavg_after": after["loadavg"],
        "gpu_utilization_pct_before": before["gpu_utilization_pct"],
        "gpu_utilization_pct_after": after["gpu_utilization_pct"],
    }


def busy(sample: dict[str, Any]) -> bool:
    """Whether the 1-minute load says other work holds at least half of this process's CPUs."""
    load = sample.get("loadavg")
    cpus = cpu_counts()["affinity_cpus"] or os.cpu_count() or 1
    return load is not None and load[0] >= max(cpus / 2, 1.0)


def describe_load(sample: dict[str, Any]) -> str:
    """``load 1.21 / 1.84 / 1.70 (1, 5, 15 min) on 2 CPUs`` (+ GPU utilisation when known)."""
    counts = cpu_counts()
    cpus = counts["affinity_cpus"] or counts["cpu_count"]
    load = sample.get("loadavg")
    text = (
        "load unknown"
        if load is None
        else f"load {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1, 5, 15 min)"
    )
    text += f" on {cpus} CPUs"
    gpu = sample.get("gpu_utilization_pct")
    if gpu is not None:
        text += f", GPU {gpu:.0f} % busy"
    return text


def process_age_s() -> float | None:
    """Seconds a command spent before its own clock started (interpreter start-up, imports),
    shown in a cold start's breakdown: since this process started (Linux ``/proc``), at most
    since the ``speccal`` package was imported plus :data:`INTERPRETER_START_S`.

    The bound matters: a shell running ``pip install ... && speccal calibrate ...`` as its
    last command may ``exec`` speccal in its own process, whose start time is then the
    shell's (a first use once printed "start-up and imports 209.3 s": pip's minutes).
    """
    since_import = time.perf_counter() - speccal.IMPORTED_AT
    age = _proc_age_s()
    if age is None:
        return None
    return min(age, since_import + INTERPRETER_START_S)


#: The most a bare interpreter start (before any import of ours) is taken to cost, s.
INTERPRETER_START_S = 0.5


def _proc_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # field 22 (starttime, clock ticks since boot) counted after the ")" closing comm
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


#: The packages whose import a calibration's processes pay for (the main process and every
#: compile worker import torch and triton).
BYTECODE_PACKAGES = ("torch", "triton")


def missing_bytecode(packages: tuple[str, ...] = BYTECODE_PACKAGES) -> list[str]:
    """The imported ``packages`` that every process compiles from source: no cached bytecode
    for the package's ``__init__`` and an interpreter that writes none
    (``PYTHONDONTWRITEBYTECODE``, ``-B``). Empty when bytecode is written: then only the first
    process after an install pays.

    Why it is reported: the H200 image these tables are measured on ships torch without
    ``.pyc`` files and sets ``PYTHONDONTWRITEBYTECODE=1``; there a cold default calibration of
    dense-2b spent 4.1-4.7 s in start-up and imports and 5.9-8.3 s loading the model, against
    2.6-2.7 s and 2.0-2.1 s once ``python3 -m compileall`` had written the bytecode pip writes
    at install time (bench/RESULTS.md, 2026-12-02 02:00). Containers built with
    ``PYTHONDONTWRITEBYTECODE`` and without bytecode are common, and nothing else says why
    their start is slow.
    """
    if not sys.dont_write_bytecode:
        return []
    out = []
    for name in packages:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        try:
            cached = importlib.util.cache_from_source(path)
        except (NotImplementedError, ValueError):
            continue
        if not os.path.exists(cached):
            out.append(name)
    return out


def describe_missing_bytecode(names: list[str]) -> str:
    """One line for a non-empty answer of :func:`missing_bytecode`."""
    dirs = sorted({os.path.dirname(os.path.dirname(sys.modules[n].__file__)) for n in names})
    return (f"Python: no bytecode for {', '.join(names)} and PYTHONDONTWRITEBYTECODE is set, so "
            f"every process (this one and each compile worker) compiles their modules from "
            f"source; writing it once (python3 -m compileall -q {' '.join(dirs)}) took seconds "
            f"off a cold start on the H200")
