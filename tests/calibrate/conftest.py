"""Shared fixtures: real tiny-preset engines (built once per draft width) behind a step counter."""

from __future__ import annotations

import json

import pytest
import torch

from speccal.runner.engine import Engine, EngineConfig

# A short model context keeps the tiny preset's rounds cheap on a 2-core CI machine.
MAX_MODEL_LEN = 256
BUCKETS = (1, 2, 4)

# A small explicit config: Bcap 1 at G {2, 4}, Bcap 2 at G {4, 8} (connected through G=4).
SMALL = {
    "request_buckets": [1, 2],
    "target_graph_rows": {"1": [2], "2": [4]},
    "contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 128}],
    "warmup_steps": 1,
    "window_steps": 2,
    "windows_per_point": 2,
}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core CI box OpenMP spin-waiting under contention makes
    the tiny model's rounds 10-25x slower than single-threaded ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountingEngine:
    """A real Engine whose ``step`` calls are counted (to prove that nothing was sampled)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.steps = 0

    def step(self, plan):
        self.steps += 1
        return self._engine.step(plan)

    def __getattr__(self, name):
        return getattr(self._engine, name)


_ENGINES: dict[tuple[int, bool], Engine] = {}


def real_engine(draft_width: int = 3, pipeline: bool = False) -> Engine:
    key = (draft_width, pipeline)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(
            EngineConfig(
                model="tiny",
                acceptance="forced",
                draft_width=draft_width,
                request_buckets=BUCKETS,
                max_model_len=MAX_MODEL_LEN,
                pipeline=pipeline,
            )
        )
    return _ENGINES[key]


@pytest.fixture
def engine_factory():
    """``factory(opts) -> CountingEngine`` honouring ``opts.draft_width`` and ``opts.loop``
    (pipelined by default, as ``make_engine``); ``.last`` is the last one."""

    def factory(opts):
        eng = CountingEngine(real_engine(opts.draft_width or 3, opts.loop == "pipelined"))
        factory.last = eng
        return eng

    factory.last = None
    return factory


@pytest.fixture
def small_config(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return path


@pytest.fixture
def small():
    """A fresh copy of the small explicit config (dict)."""
    return json.loads(json.dumps(SMALL))


@pytest.fixture
def write_config(tmp_path):
    def write(obj, name="cfg.json"):
        path = tmp_path / name
        path.write_text(json.dumps(obj))
        return path

    return write
