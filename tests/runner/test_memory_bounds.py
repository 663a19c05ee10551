"""Sizes from user input are checked against memory before the runner allocates (issue 34,
item 4): a KV cache, static buffers or a context that cannot fit is one InputError naming the
option, the value, the bytes needed and available; nothing large is ever allocated here."""

from __future__ import annotations

import pytest
import torch

from speccal.base.errors import InputError
from speccal.base.memory import check_fits, format_bytes, host_memory_available
from speccal.calibrate.config import parse_config_obj
from speccal.runner import device as device_mod
from speccal.runner import engine_build as engine_mod
from speccal.runner.buffers import StaticInputs
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.kv_cache import KVCache

CPU = torch.device("cpu")


def _cfg(**kw):
    base = dict(model="tiny", draft_width=3, request_buckets=(1, 2, 4), max_model_len=128)
    return EngineConfig.flat(**(base | kw))


class _NoKVCache:
    """Stands in for the cache: constructing it means the check came too late."""

    nbytes = staticmethod(KVCache.nbytes)

    def __init__(self, *args, **kwargs):
        raise AssertionError("the KV cache was allocated before the memory check")


def _available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(device_mod, "host_memory_available", lambda: nbytes)


def test_host_memory_available_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       2048 kB\nMemAvailable:   1024 kB\n")
    assert host_memory_available(str(info)) == 1024 * 1024
    assert host_memory_available(str(tmp_path / "missing")) is None
    (tmp_path / "none").write_text("MemTotal: 1 kB\n")
    assert host_memory_available(str(tmp_path / "none")) is None


def test_check_fits_names_option_value_and_bytes():
    check_fits(10, None, field="x", value=1, what="y")  # unknown: nothing refused
    check_fits(10, 10, field="x", value=1, what="y")
    with pytest.raises(InputError) as exc:
        check_fits(52_500_000_000, 24_000_000_000, field="--request-buckets", value=100000,
                   what="KV cache")
    msg = str(exc.value)
    assert msg.startswith("--request-buckets: got 100000, expected a value whose KV cache fits")
    assert "52.5 GB" in msg and "24.0 GB available" in msg and "\n" not in msg
    assert exc.value.exit_code == 2
    assert format_bytes(999) == "999 B"


def test_a_huge_request_bucket_is_refused_before_the_kv_cache_is_allocated(monkeypatch):
    _available(monkeypatch, 8 * 10**9)
    monkeypatch.setattr(engine_mod, "KVCache", _NoKVCache)
    with pytest.raises(InputError) as exc:
        Engine(_cfg(request_buckets=(100000,), max_model_len=None))
    msg = str(exc.value)
    assert "max_model_len x max(request_buckets)" in msg and "x 100000" in msg
    assert "needs" in msg and "available" in msg


def test_a_kv_cache_above_available_memory_is_refused(monkeypatch):
    _available(monkeypatch, 1000)
    monkeypatch.setattr(engine_mod, "KVCache", _NoKVCache)
    with pytest.raises(InputError, match=r"max_model_len x max\(request_buckets\): got '128 x 4'"):
        Engine(_cfg())
    with pytest.raises(InputError, match="kv_capacity_tokens: got 4096"):
        Engine(_cfg(kv_capacity_tokens=4096))


def test_max_model_len_above_the_model_context_is_refused_before_loading(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model (and its rotary tables) was loaded first")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(InputError) as exc:
        Engine(_cfg(max_model_len=100_000_000))
    assert "max_model_len: got 100000000" in str(exc.value)
    assert "max_position_embeddings=4096" in str(exc.value)


def test_max_model_len_of_a_folder_is_checked_before_loading(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(InputError, match="max_position_embeddings=2048"):
        Engine(_cfg(model=str(tmp_path), max_model_len=100_000_000))


def test_kv_cache_and_static_buffers_check_before_allocating(monkeypatch):
    _available(monkeypatch, 1000)
    monkeypatch.setattr(
        "speccal.runner.buffers.host_memory_available", lambda: 1000
    )
    with pytest.raises(InputError, match="KV cache"):
        KVCache(2, 64, 16, 2, 32, torch.float32, CPU)
    with pytest.raises(InputError, match="static round buffers"):
        StaticInputs({"tokens": (10_000, torch.int64)}, CPU)
    # small enough: allocated as before
    StaticInputs({"tokens": (8, torch.int64)}, CPU)
    KVCache(1, 2, 1, 1, 1, torch.float32, CPU)


def test_an_empty_request_bucket_list_in_a_config_is_one_line():
    with pytest.raises(InputError, match=r"request_buckets: got \[\]"):
        parse_config_obj({"request_buckets": []})
