"""The execution path is one value per engine: recorded in ``compatibility()``, held by the
round runner and every model module, never shared through process state."""

from __future__ import annotations

import dataclasses

import pytest

from speccal.kernels import ops
from speccal.kernels.config import AttentionTuning, GemvTuning, KernelConfig, NormFusion, PdlConfig
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.path import ExecutionPath, PathBound, bind_path

BASE = dict(model="tiny", draft_width=2, request_buckets=(1, 2), max_model_len=64)


def _modules_paths(eng: Engine) -> set:
    mods = [m for root in (eng.loaded.target, eng.loaded.draft) for m in root.modules()]
    return {id(m.path) for m in mods if isinstance(m, PathBound)}


def test_two_engines_keep_their_own_paths():
    a_path = ExecutionPath(kernels=KernelConfig(pdl=PdlConfig("off")))
    b_path = ExecutionPath(input_update="host", kernels=KernelConfig(norm=NormFusion("o")))
    a = Engine(EngineConfig(**BASE, path=a_path))
    b = Engine(EngineConfig(**BASE, path=b_path))
    assert _modules_paths(a) == {id(a_path)} and _modules_paths(b) == {id(b_path)}
    assert a.runner.path is a_path and b.runner.path is b_path
    assert a.compatibility()["kernels"] != b.compatibility()["kernels"]
    assert (a.input_update, b.input_update) == ("host", "host")
    # building b changed nothing of a: a still runs and reports its own configuration
    rid = a.add_request([1, 2, 3])
    a.step(RoundPlan(num_draft_steps=2))
    assert a.compatibility()["kernels"]["config"]["pdl"]["mode"] == "off"
    a.release(rid)


def test_each_engine_passes_its_own_kernel_config_to_the_ops(monkeypatch, fused_on_cpu):
    """Two engines whose modules take the fused code (references on CPU): every op call of each
    engine's forward carries that engine's ``KernelConfig``, interleaved in one process."""
    seen: list[KernelConfig] = []
    real = ops.rms_norm

    def spy(*args, tune, **kwargs):
        seen.append(tune)
        return real(*args, tune=tune, **kwargs)

    monkeypatch.setattr(ops, "rms_norm", spy)
    engines = {}
    for name, kx in (("a", KernelConfig(pdl=PdlConfig("early"))),
                     ("b", KernelConfig(attention=AttentionTuning(poll=True)))):
        eng = Engine(EngineConfig(**BASE, speculative=False, path=ExecutionPath(kernels=kx)))
        bind_path(eng.loaded.target, fused_on_cpu(kx))
        engines[name] = (eng, kx)
    for name in ("a", "b", "a"):
        eng, kx = engines[name]
        seen.clear()
        rid = eng.add_request([5, 6, 7, 8])
        eng.step(RoundPlan(num_draft_steps=0))
        eng.release(rid)
        assert seen and all(t is kx for t in seen), name


def _leaves(cfg: KernelConfig):
    """(group, field, a different valid value) for every kernel-config field."""
    for group in ("pdl", "gemv", "attention", "norm", "precision"):
        obj = getattr(cfg, group)
        for f in dataclasses.fields(obj):
            yield group, f.name, _other_value(group, f.name, getattr(obj, f.name))
    yield None, "backend", "reference"
    yield None, "prewait", not cfg.prewait


_CHOICES = {("pdl", "mode"): "off", ("gemv", "defer_scale"): "late", ("attention", "fold"): "on",
            ("attention", "spread"): "on", ("attention", "release"): "loop",
            ("attention", "reduce_release"): "wait", ("attention", "prewait"): "off",
            ("norm", "defer"): "all", ("precision", "fp32_dot"): "tf32",
            ("attention", "warps"): 8, ("attention", "stages"): 3,
            ("gemv", "wide_block_m"): 32, ("gemv", "overrides"): (),
            ("attention", "verify_block_n"): 32, ("attention", "block_n"): 32}


def _other_value(group, name, value):
    if (group, name) in _CHOICES:
        return _CHOICES[(group, name)]
    if isinstance(value, bool):
        return not value
    if value is None:
        return 2
    return value * 2 if value else 1


@pytest.mark.parametrize("group,name,value", list(_leaves(KernelConfig())),
                         ids=lambda v: str(v) if isinstance(v, str) else None)
def test_every_kernel_field_changes_the_compatibility(group, name, value):
    base = KernelConfig()
    if (group, name) == ("gemv", "overrides"):  # a non-empty override list
        from speccal.kernels.config import GemvOverride

        value = (GemvOverride.parse("2048:2048:16=16/128/1/8/1/panel"),)
    if group is None:
        changed = dataclasses.replace(base, **{name: value})
    else:
        changed = dataclasses.replace(
            base, **{group: dataclasses.replace(getattr(base, group), **{name: value})})
    assert changed.digest() != base.digest()
    eng = Engine(EngineConfig(**BASE, path=ExecutionPath(kernels=changed)))
    compat = eng.compatibility()
    recorded = changed.for_model(linear_attention=False)  # a dense target
    assert recorded.digest() != base.for_model(linear_attention=False).digest()
    assert compat["kernels"]["digest"] == recorded.digest()
    assert compat["kernels"]["config"] == recorded.to_dict()


def test_attention_backend_and_graph_mode_are_recorded():
    eng = Engine(EngineConfig(**BASE))
    c = eng.compatibility()
    assert (c["attention_backend"], c["graph_mode"], c["input_update"]) == ("torch", "eager",
                                                                            "host")
    in_graph = Engine(EngineConfig(**BASE, path=ExecutionPath(input_update="in_graph")))
    assert in_graph.compatibility()["input_update"] == "in_graph"


def test_triton_on_cpu_is_refused_not_a_silent_fallback():
    from speccal.base.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="attention_backend='triton'"):
        Engine(EngineConfig(**BASE, path=ExecutionPath(attention_backend="triton")))


def test_flat_config_puts_path_fields_in_the_path():
    cfg = EngineConfig.flat(**BASE, input_update="host", kernels=KernelConfig(
        gemv=GemvTuning(panel=False)))
    assert cfg.path.input_update == "host" and cfg.path.kernels.gemv.panel is False
