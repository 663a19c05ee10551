"""Parallel precompilation (``speccal.kernels.precompile``): a worker's compile lands in Triton's
cache and the launching process's compile of the same specialization is then a cache load.

These run without a GPU (Triton compiles for an explicit sm_90 target); they need triton itself
and skip without it. The dry pass over a real engine is covered by
``tests/runner/test_precompile_cuda.py``.
"""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from speccal.kernels.precompile import CompileMeter, dry_pass_active

TARGET = ("cuda", 90, 32)


def _spec(block_b: int) -> str:
    """Triton's ``specialization_data`` of ``verify_tokens._verify_token_kernel`` (the format
    ``JITFunction._call_hook`` serialises and ``JITFunction.preload`` reads)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    names = ["base_ptr", "bidx_ptr", "draft_ptr", "vl_ptr", "ids_ptr", "B", "G", "K_MAX",
             "stride_d", "pad_id", "BLOCK_B", "BLOCK_R", "BLOCK_G", "INDEXED"]
    types = ["*i64"] * 5 + ["i32"] * 4 + ["i64"] + ["constexpr"] * 4
    consts = {(10,): block_b, (11,): 4, (12,): 16, (13,): True}
    opts = make_backend(GPUTarget(*TARGET)).parse_options({})
    return json.dumps({
        "name": "speccal.kernels.verify_tokens._verify_token_kernel",
        "signature": dict(zip(names, types, strict=True)),
        "constant_keys": [list(k) for k in consts], "constant_vals": list(consts.values()),
        "attrs_keys": [[i] for i in range(5)], "attrs_vals": [[["tt.divisibility", 16]]] * 5,
        "options": opts.__dict__, "key": "test",
    })


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cache"), raising=False)
    return tmp_path / "cache"


def _compile_in_process(spec: str, monkeypatch, fail: bool) -> float:
    """``compile_specialization`` here; with ``fail``, building the IR raises (a cache miss)."""
    from triton.compiler import compiler

    from speccal.kernels.precompile import compile_specialization

    if fail:
        def boom(*a, **k):
            raise AssertionError("compiled again: the worker's result was not in the cache")
        monkeypatch.setattr(compiler.ASTSource, "make_ir", boom)
    return compile_specialization("speccal.kernels.verify_tokens", "_verify_token_kernel", spec,
                                  TARGET)


def test_worker_compile_is_a_cache_hit_in_the_parent(triton_cache, monkeypatch):
    from speccal.kernels.precompile import compile_specialization

    spec = _spec(8)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        seconds = pool.submit(compile_specialization, "speccal.kernels.verify_tokens",
                              "_verify_token_kernel", spec, TARGET).result()
    assert seconds > 0
    assert any(p.suffix == ".cubin" for p in triton_cache.rglob("*")), "no cubin in the cache"
    _compile_in_process(spec, monkeypatch, fail=True)  # a cache load: make_ir never runs


def test_another_specialization_is_not_in_the_cache(triton_cache, monkeypatch):
    _compile_in_process(_spec(8), monkeypatch, fail=False)
    with pytest.raises(AssertionError, match="compiled again"):
        _compile_in_process(_spec(16), monkeypatch, fail=True)


def test_dry_pass_flag_is_off_outside_precompile():
    assert dry_pass_active() is False


def test_compile_meter_restores_hooks_and_counts(triton_cache):
    import triton

    knobs = triton.knobs.runtime
    before = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    meter = CompileMeter()
    with meter.measuring():
        assert knobs.jit_cache_hook is not None
        knobs.jit_cache_hook(key="k")  # what JITFunction._call_hook does around a compile
        knobs.jit_post_compile_hook(key="k")
    assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == before
    assert meter.count == 1 and meter.seconds >= 0



def test_the_dry_pass_argmax_key_decodes_to_column_zero():
    """The LM head's dry-pass stand-in fills its keys with the key of an all-zero row: it must
    decode to column 0 (a zero key would decode to column 2**32 - 1, an invalid token id)."""
    from speccal.kernels import ops
    from speccal.kernels import reference as ref

    keys = torch.full((3,), ops._ZERO_ROW_KEY, dtype=torch.int64)
    assert ref.unpack_argmax_keys_ref(keys).tolist() == [0, 0, 0]
    assert ops._ZERO_ROW_KEY == int(ref.argmax_keys_ref(torch.zeros(1, 5))[0])
    assert ref.unpack_argmax_keys_ref(torch.zeros(1, dtype=torch.int64)).item() == 2**32 - 1


def test_compile_pool_starts_its_workers_up_front():
    """``CompilePool`` spawns every worker when it is made (the engine starts it before the model
    load, so the workers' imports overlap the load); a task then runs in one of them, and the
    pool stops on ``shutdown``."""
    import os

    from speccal.kernels.precompile import CompilePool, _ready

    with CompilePool(1) as pool:
        assert pool.workers == 1
        assert len(pool._pool._processes) == 1  # spawned now, not at the first compile
        pid = pool.submit(_ready).result(timeout=120)
        assert pid != os.getpid()
    assert pool._pool._shutdown_thread


def test_a_compile_pool_that_cannot_start_is_none(monkeypatch):
    """The engine starts its pool with ``CompilePool.start``: where processes cannot be started
    the build goes on without it (the precompile starts its own, or the capture compiles)."""
    import concurrent.futures

    from speccal.kernels.precompile import CompilePool

    def refuse(*a, **k):
        raise OSError("no processes here")

    monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor, "submit", refuse)
    assert CompilePool.start(1) is None


def test_without_triton_no_host_is_cold(monkeypatch):
    import sys

    from speccal.kernels.precompile import triton_cache_is_empty

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert triton_cache_is_empty() is False


def test_an_empty_triton_cache_is_a_cold_host(tmp_path, monkeypatch):
    """The engine pre-starts its compile workers only on a cold host: Triton's cache dir missing
    or empty; a cache with entries is not cold."""
    triton = pytest.importorskip("triton")
    from speccal.kernels.precompile import triton_cache_is_empty

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "missing"))
    assert triton_cache_is_empty() is True
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert triton_cache_is_empty() is True
    (tmp_path / "abc123").mkdir()
    assert triton_cache_is_empty() is False


def test_an_error_inside_the_meter_is_not_chained_to_a_missing_triton(monkeypatch):
    """Without triton, an error raised in the measured block keeps its own context (a full
    disk once printed "During handling of ... No module named 'triton'" above it)."""
    import builtins

    real = builtins.__import__

    def no_triton(name, *a, **kw):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(OSError) as exc:
        with CompileMeter().measuring():
            raise OSError(28, "No space left on device")
    assert exc.value.__context__ is None
