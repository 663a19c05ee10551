"""Device strings, backends and dtypes: validated, never a silent CPU fallback.

This module owns the mapping from a user device string (``cpu``, ``cuda``, ``cuda:N``, ``npu``,
``npu:N``) to a ``torch.device``, the lazy ``torch_npu`` import, the default dtype per backend,
device synchronisation and the human-readable device name recorded in compatibility metadata.
"""

from __future__ import annotations

import contextlib
import importlib
import platform
import re
from collections.abc import Iterator

import torch
from torch import nn

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.memory import check_fits, host_memory_available
from speccal.kernels.precompile import CompileMeter as CompileMeter  # calibrate's compile count

_DEVICE_RE = re.compile(r"^(cpu|cuda|npu)(?::(\d+))?$")


def resolve_device(spec: str) -> torch.device:
    """Validate ``spec`` and return the device; refuse unavailable backends with the reason."""
    m = _DEVICE_RE.match(spec.strip()) if isinstance(spec, str) else None
    if m is None:
        raise InputError("device", spec, "cpu, cuda, cuda:N, npu or npu:N")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise InputError("device", spec, "cpu (there is one CPU device)")
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(
                f"device {spec!r}: CUDA is not available in this torch build / machine "
                f"(torch {torch.__version__}); use --device cpu explicitly"
            )
        n = torch.cuda.device_count()
        i = int(index or 0)
        if i >= n:
            raise InputError("device", spec, f"a CUDA index below {n}")
        return torch.device("cuda", i)
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        raise UnsupportedError(
            f"device {spec!r}: the npu backend needs torch_npu, which is not installed "
            "(pip install speccal[npu] on an Ascend host)"
        ) from None
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        raise UnsupportedError(f"device {spec!r}: torch_npu is installed but no NPU is available")
    i = int(index or 0)
    if i >= torch.npu.device_count():
        raise InputError("device", spec, f"an NPU index below {torch.npu.device_count()}")
    return torch.device("npu", i)


#: glibc ``mallopt`` parameters: ``M_TRIM_THRESHOLD`` and ``M_MMAP_THRESHOLD``.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: The largest fixed mmap threshold glibc accepts on 64-bit hosts (``HEAP_MAX_SIZE / 2``).
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_host_heap() -> bool:
    """Keep freed host memory in the process's heap instead of handing it back to the kernel
    after every round (glibc only; True when applied).

    A CPU round allocates its temporaries (the KV gathers of a Bcap 8 batch at a 2,000-token
    context: several MB each) and frees them before the next round. With glibc's defaults the
    freed top of the heap above 128 KB is trimmed back to the kernel and blocks past the
    (dynamic) mmap threshold are unmapped, so the next round faults the same pages in again:
    on the 2-vCPU VM such rounds cost 1.8-2.3x their shape's rate, depending on which sizes
    the process had freed before (calibration points of one shape 2x apart whose prompts
    differed by 15 tokens; bench/RESULTS.md). A trim threshold of 1 GiB and the largest fixed
    mmap threshold keep those pages resident; the engine calls this once for a CPU device.
    Elsewhere (another C library) nothing changes.
    """
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None or platform.libc_ver()[0] != "glibc":
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30)) and bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return str(torch.npu.get_device_name(device.index or 0))
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def default_dtype(device: torch.device) -> str:
    return "float32" if device.type == "cpu" else "bfloat16"


def memory_available(device: torch.device) -> int | None:
    """Bytes ``device`` can still allocate: free device memory on CUDA / NPU
    (``mem_get_info``), the host's ``MemAvailable`` on the CPU; None when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "npu":
            return int(torch.npu.mem_get_info(device)[0])
    except (RuntimeError, AttributeError):
        return None
    return host_memory_available()


def check_memory(
    device: torch.device, need_bytes: int, *, field: str, value: object, what: str
) -> None:
    """Refuse, before allocating, ``need_bytes`` of ``what`` on ``device`` that cannot fit
    (``speccal.base.memory.check_fits``: one ``InputError`` naming ``field``, ``value`` and the
    bytes needed and available)."""
    where = "host" if device.type == "cpu" else f"{device} device"
    check_fits(need_bytes, memory_available(device), field=field, value=value, what=what,
               where=where)


def is_pinnable(device: torch.device) -> bool:
    """Whether host staging buffers should be pinned (device-side copies can be async)."""
    return device.type in ("cuda", "npu")


def default_execution_path(spec: str) -> tuple[str, str]:
    """``(graph_mode, attention_backend)`` a deployment on device ``spec`` would serve with.

    CUDA: captured split graphs and Triton attention; NPU: captured graphs (torch_npu) and the
    torch attention; CPU: eager and the torch attention. Calibration and benchmarks default to
    this so that a cost table describes the fast path, not a debugging configuration.
    """
    kind = spec.strip().split(":", 1)[0] if isinstance(spec, str) else ""
    if kind == "cuda":
        return "split", "triton"
    if kind == "npu":
        return "split", "torch"
    return "eager", "torch"


def driver_version(device: torch.device) -> str | None:
    """Accelerator driver/runtime versions for table provenance; None on CPU.

    CUDA: the NVIDIA driver (through NVML when ``nvidia-ml-py`` is installed) and the CUDA runtime
    torch was built with; NPU: the torch_npu version. Performance-only metadata: a mismatch on
    reuse warns, never refuses.
    """
    if device.type == "cuda":
        parts = []
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                drv = pynvml.nvmlSystemGetDriverVersion()
                parts.append(f"driver {drv.decode() if isinstance(drv, bytes) else drv}")
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # NVML absent or unusable: the runtime version still identifies the stack
            pass
        parts.append(f"cuda {torch.version.cuda}")
        return ", ".join(parts)
    if device.type == "npu":
        npu = importlib.import_module("torch_npu")
        return f"torch_npu {getattr(npu, '__version__', 'unknown')}"
    return None


# torch.nn.init's in-place initialisers (every one a module's reset_parameters may call)
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_")


def _skip_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device with ``torch.nn.init``'s initialisers skipped.

    A meta tensor holds no values, so initialising it does nothing useful, but it is not free:
    ``nn.Embedding``'s ``normal_`` on a meta tensor goes through ``torch._refs``, whose wrapper
    imports ``torch._dynamo`` (and with it sympy and ``torch.distributed.fsdp``) on first use.
    On the H200 image, which ships no bytecode, that import compiled about a thousand modules
    from source inside every engine build (bench/RESULTS.md, 2026-12-02 02:00). The
    initialisers are module attributes looked up at call time, so replacing them for the
    duration of the block covers every module built in it; the originals come back on exit,
    exception or not. Not thread-safe (the engine builds on one thread).
    """
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, _skip_init)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
