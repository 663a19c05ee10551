"""Cold start: compile every Triton kernel a set of captures needs in parallel, before capturing.

A fresh machine (empty Triton cache) compiles each kernel specialization the first time it is
launched, one after the other in the launching process: an engine build with split graphs meets
well over a hundred of them, which made the first ``speccal calibrate`` on an H200 spend most of
its compile/capture time in the compiler. :func:`precompile` removes that series:

1. **Dry pass.** Each callable (a graph's forward) runs once eagerly with Triton's own
   ``knobs.runtime.jit_cache_hook`` installed. The hook sees every launch of a
   ``speccal.kernels`` kernel that would compile (other libraries' kernels, such as
   flash-linear-attention's autotuned ones, compile and run in-process as usual),
   submits the kernel's specialization (Triton's ``specialization_data``: signature, constexprs,
   attributes, options) to a pool of worker processes and tells Triton to skip the launch. While
   the pass is on, the ``speccal.kernels.ops`` ops that produce indices and lengths (metadata,
   acceptance, tiling) run their pure-torch references after the (skipped) launch, so the values
   downstream ops read are real ones; the ops that produce activations (GEMVs, attention, LM
   head) return zeros of their shapes instead, so no launch reads uninitialised memory and no
   fp32 reference runs (those made the pass cost seconds).
2. **Workers** rebuild each kernel's ``ASTSource`` from that data and ``triton.compile`` it for the
   device's target, then build its launcher (Triton compiles a small C module per kernel
   signature with the host compiler the first time a kernel loads); binaries and launchers land
   in Triton's on-disk cache (``TRITON_CACHE_DIR``).
3. The **real capture** that follows compiles each kernel again in-process, and every one of those
   compiles, launchers included, is a cache load (milliseconds).

Kernels already compiled in this process launch for real during the dry pass (Triton never calls
the hook for them); the reference that follows overwrites their outputs. A kernel the dry pass
misses is compiled in-process later, as without this module: precompiling is a speed-up, never a
change of what runs. :class:`CompileMeter` counts and times in-process compiles (the calibration
report shows them).
"""

from __future__ import annotations

import contextvars
import importlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["CompileMeter", "CompilePool", "PrecompileReport", "compile_specialization",
           "dry_pass_active", "precompile", "triton_cache_is_empty"]

# modules whose Triton kernels the dry pass hands to the workers (and whose ops return zeros)
OWN_KERNELS = "speccal.kernels."

_DRY = contextvars.ContextVar("speccal_precompile_dry_pass", default=False)


def dry_pass_active() -> bool:
    """True inside :func:`precompile`'s dry pass: Triton launches that would compile are skipped
    and every op also computes its torch reference (``speccal.kernels.ops``)."""
    return _DRY.get()


@dataclass
class PrecompileReport:
    """What one :func:`precompile` call did.

    Attributes
    ----------
    kernels : distinct kernel specializations compiled by the workers.
    workers : worker processes used (0: nothing to compile).
    dry_pass_s : wall time of the dry pass (the callables, their references, the submissions).
    compile_wall_s : wall time from the first submission until the last compile finished.
    compile_cpu_s : sum of the workers' per-kernel compile times.
    total_s : wall time of the whole call (dry pass, then waiting for the last compile).
    failed : ``module.kernel: error`` for specializations the workers could not compile (they
        compile in-process later, where a real error surfaces with Triton's own message), and
        ``dry pass stopped: error`` when a callable raised (the rest compiles in-process).
    by_kernel : compiled specializations per ``module.kernel``.
    """

    kernels: int = 0
    workers: int = 0
    dry_pass_s: float = 0.0
    compile_wall_s: float = 0.0
    compile_cpu_s: float = 0.0
    total_s: float = 0.0
    failed: list[str] = field(default_factory=list)
    by_kernel: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kernels": self.kernels, "workers": self.workers,
                "dry_pass_s": round(self.dry_pass_s, 3),
                "compile_wall_s": round(self.compile_wall_s, 3),
                "compile_cpu_s": round(self.compile_cpu_s, 3), "total_s": round(self.total_s, 3),
                "failed": list(self.failed),
                "by_kernel": dict(self.by_kernel)}


def _jit_function(module: str, name: str):
    """The ``JITFunction`` named ``module.name`` (unwrapping heuristics / autotuner wrappers)."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "create_binder") and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def compile_specialization(module: str, name: str, spec: str, target: tuple) -> float:
    """Compile one kernel specialization into Triton's cache; returns the seconds it took.

    ``spec`` is Triton's ``specialization_data`` JSON (as ``JITFunction.preload`` reads it);
    ``target`` is ``(backend, arch, warp_size)`` of the device. Runs in a worker process: it needs
    no GPU, only the same Triton, the same kernel source and the same cache directory.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    t0 = time.perf_counter()
    fn = _jit_function(module, name)
    obj = json.loads(spec)
    constexprs = {
        tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                   tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v
                   else v)
        for k, v in zip(obj["constant_keys"], obj["constant_vals"], strict=True)
    }
    attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True)}
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    gpu = GPUTarget(*target)
    opts = make_backend(gpu).parse_options(options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu,
                            options=opts.__dict__)
    _build_launcher(kernel)
    return time.perf_counter() - t0


def _build_launcher(kernel) -> None:
    """Build ``kernel``'s launcher into Triton's cache, as its first load in the parent would
    (``CompiledKernel._init_handles`` -> the driver's ``launcher_cls``: C source generated from
    the signature, compiled by the host compiler, cached by source hash). Needs no GPU context.
    A failure leaves it to the parent (built there at first load, as without precompiling)."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001  # a speed-up only: the parent builds what is missing
        return


def _default_workers() -> int:
    """One worker per CPU this process may use but one: the dry pass itself is a busy Python
    thread, and the workers' start-up (each imports torch and Triton) and compiles would take
    its core otherwise."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(32, n - 1))


# what a worker imports before its first compile: the kernel modules (each imports torch) and
# Triton's compiler with its CUDA backend
_WORKER_IMPORTS = ("triton.compiler.compiler", "triton.backends.nvidia.compiler",
                   "speccal.kernels.gemv", "speccal.kernels.paged_attention",
                   "speccal.kernels.rmsnorm", "speccal.kernels.rotary_kv",
                   "speccal.kernels.attention_tiling", "speccal.kernels.verify_accept",
                   "speccal.kernels.verify_metadata", "speccal.kernels.verify_tokens")


def _prepare_worker() -> None:
    """Worker initializer: the imports every compile needs, done while the parent still loads
    the model instead of in front of the first compile."""
    for name in _WORKER_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  # a speed-up only: the compile imports what it needs
            continue


def _ready() -> int:
    return os.getpid()


def triton_cache_is_empty() -> bool:
    """Whether Triton's on-disk cache (``triton.knobs.cache.dir``) holds nothing yet: a fresh
    host, where every kernel the capture needs will be compiled (:class:`CompilePool` is then
    worth starting before the dry pass). False when Triton is missing or the cache has entries
    (then most kernels load from it and a pool is started only if the dry pass meets a compile).
    """
    try:
        import triton
    except ImportError:
        return False
    path = triton.knobs.cache.dir
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except OSError:
        return False


class CompilePool:
    """The precompile worker processes, started ahead of the dry pass.

    Each spawned worker starts an interpreter and imports torch and Triton (seconds, on every
    core at once); started when the engine build begins (``Engine``, on a host whose Triton
    cache is empty), that start-up runs beside the model load instead of in front of the first
    compile. With a warm cache the engine starts none: its workers would only import and exit,
    and shutting them down waits for their imports. ``workers``: None for one per CPU this
    process may use but one. The owner calls :meth:`shutdown` (also usable as a context
    manager).
    """

    def __init__(self, workers: int | None = None):
        self.workers = workers or _default_workers()
        self._pool = ProcessPoolExecutor(self.workers,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_prepare_worker)
        # one task per worker: the executor spawns a process per task while none is idle
        for _ in range(self.workers):
            self._pool.submit(_ready)

    @classmethod
    def start(cls, workers: int | None = None) -> CompilePool | None:
        """A started pool, or None where processes cannot be started here (a speed-up only:
        :func:`precompile` then starts its own at the first compile, or the capture compiles
        in-process)."""
        try:
            return cls(workers)
        except (OSError, RuntimeError, ValueError):
            return None

    def submit(self, fn: Callable, *args):
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _device_target() -> tuple:
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def precompile(fns: Iterable[Callable[[], object]], *,
               workers: int | None = None, pool: CompilePool | None = None) -> PrecompileReport:
    """Run each of ``fns`` once in a dry pass and compile the Triton kernels it would launch in
    ``workers`` processes (default: the CPUs this process may use) into Triton's cache.

    ``pool``: workers started earlier (:class:`CompilePool`, owned and shut down by the caller);
    None: a pool of ``workers`` is started at the first compile the pass meets and shut down
    here.

    ``fns`` must be safe to run eagerly (a captured graph's forward is, by construction). Returns
    a :class:`PrecompileReport`; the caller captures afterwards. With triton missing, nothing to
    compile, or a worker pool that cannot start, the report says so and nothing else changes.
    """
    import triton

    report = PrecompileReport()
    target = _device_target()
    submitted: dict[tuple, object] = {}
    own = pool is None
    n_workers = pool.workers if pool is not None else workers or _default_workers()
    t_first = 0.0

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002, ARG001
        nonlocal pool, t_first
        if not fn.module.startswith(OWN_KERNELS):
            # another library's kernel (flash-linear-attention's): compiled and launched
            # in-process as usual. Its autotuner times real launches; skipped ones would all
            # time ~0 and it would cache an arbitrary config.
            return False
        spec = compile["specialization_data"]
        ident = (fn.module, fn.name, spec)
        if ident not in submitted:
            if not submitted:
                t_first = time.perf_counter()
            if pool is None:  # started at the first compile the pass meets
                pool = CompilePool(n_workers)
            submitted[ident] = pool.submit(compile_specialization, fn.module, fn.name, spec, target)
        return True  # skip this compile and its launch: the worker compiles it

    knobs = triton.knobs.runtime
    previous = knobs.jit_cache_hook
    token = _DRY.set(True)
    t0 = time.perf_counter()
    knobs.jit_cache_hook = hook
    try:
        for fn in fns:
            fn()
    except Exception as exc:  # noqa: BLE001  # a speed-up only: the capture compiles the rest
        report.failed.append(f"dry pass stopped: {type(exc).__name__}: {exc}")
    finally:
        knobs.jit_cache_hook = previous
        _DRY.reset(token)
        report.dry_pass_s = time.perf_counter() - t0
    try:
        if submitted:
            wait(list(submitted.values()))
            report.compile_wall_s = time.perf_counter() - t_first
        for (module, name, _), fut in submitted.items():
            label = f"{module}.{name}"
            exc = fut.exception()
            if exc is not None:
                report.failed.append(f"{label}: {type(exc).__name__}: {exc}")
                continue
            report.kernels += 1
            report.compile_cpu_s += fut.result()
            report.by_kernel[label] = report.by_kernel.get(label, 0) + 1
    finally:
        if own and pool is not None:
            pool.shutdown()
    report.workers = n_workers if submitted else 0
    report.total_s = time.perf_counter() - t0
    return report


class CompileMeter:
    """Counts and times the Triton compiles (cache loads included) made in this process while
    :meth:`measuring` is active, through Triton's ``jit_cache_hook`` / ``jit_post_compile_hook``
    (each called around every in-process compile; hooks already installed are kept and called).
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._start: dict = {}

    @contextmanager
    def measuring(self):
        try:
            import triton
        except ImportError:
            triton = None
        if triton is None:
            # yielded outside the except block: an error inside the caller's with-block is
            # not chained to "No module named 'triton'"
            yield self
            return
        knobs = triton.knobs.runtime
        pre, post = knobs.jit_cache_hook, knobs.jit_post_compile_hook

        def on_start(**kw):
            self._start[kw["key"]] = time.perf_counter()
            return pre(**kw) if pre is not None else None

        def on_done(**kw):
            t = self._start.pop(kw["key"], None)
            if t is not None:
                self.count += 1
                self.seconds += time.perf_counter() - t
            return post(**kw) if post is not None else None

        knobs.jit_cache_hook, knobs.jit_post_compile_hook = on_start, on_done
        try:
            yield self
        finally:
            knobs.jit_cache_hook, knobs.jit_post_compile_hook = pre, post
