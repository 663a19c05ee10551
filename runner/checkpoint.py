"""Tensor sources for loading: Hugging Face safetensors folders (single or sharded) and fingerprints.

This module owns reading a checkpoint folder (``config.json`` + ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) behind a small :class:`TensorSource` interface that
the loader also gets from presets (``speccal.runner.presets``), and the model fingerprint of a
folder. Tensors are read one at a time (``safe_open``) straight to the target device and dtype.
An unreadable file (bad JSON, a truncated or corrupt safetensors file) is an ``InputError``
naming the file, never a library traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from speccal.base.errors import InputError, SchemaError

_FULL_HASH_LIMIT = 2 * 1024**3  # hash whole files below this total size, else sample them
_SAMPLE_CHUNKS = 64
_CHUNK = 1 << 20
T = TypeVar("T")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SchemaError(str(path), str(exc), "valid JSON") from None


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint folder's ``config.json`` as a dict.

    Raises
    ------
    InputError
        No ``config.json`` in the folder.
    SchemaError
        It is not valid JSON, or not a JSON object.
    """
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise InputError("model", str(folder), "a folder containing config.json")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise SchemaError(str(cfg_path), type(cfg).__name__, "a JSON object")
    return cfg


def _guard(f: Path, read: Callable[[], T]) -> T:
    """``read()``, a safetensors library error of file ``f`` turned into an ``InputError``."""
    try:
        return read()
    except (SafetensorError, OSError) as exc:
        raise InputError(f"checkpoint file {f}", None, "a complete, valid safetensors file",
                         found=f"an unreadable file ({exc})") from None


class TensorSource(Protocol):
    """Where the loader reads tensors from."""

    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class SafetensorsFolder:
    """A Hugging Face checkpoint folder: ``config.json`` and one or more safetensors files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise InputError("model", str(path), "a preset name or a checkpoint folder")
        self.config: dict[str, Any] = read_config(self.path)
        index = self.path / "model.safetensors.index.json"
        self.key_to_file: dict[str, Path] = {}
        self._handles = {}
        self._shapes = {}
        if index.is_file():
            doc = _read_json(index)
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise SchemaError(str(index), weight_map, "a non-empty weight_map")
            for key, fname in weight_map.items():
                f = self.path / fname
                if not f.is_file():
                    raise InputError(f"{index.name}:{key}", fname, "an existing shard file")
                self.key_to_file[key] = f
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise InputError("model", str(path), "a folder with *.safetensors weights")
            for f in files:
                for key in _guard(f, lambda f=f: list(self._open(f).keys())):
                    self.key_to_file[key] = f
    _handles: dict[Path, Any]
    _shapes: dict[str, tuple[int, ...]]

    def files(self) -> list[Path]:
        return sorted(set(self.key_to_file.values()))

    def _open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = _guard(f, lambda: safe_open(str(f), framework="pt"))
        return self._handles[f]

    def keys(self) -> list[str]:
        return sorted(self.key_to_file)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            f = self.key_to_file[key]
            self._shapes[key] = tuple(_guard(f, lambda: self._open(f).get_slice(key).get_shape()))
        return self._shapes[key]

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        f = self.key_to_file[key]
        return _guard(f, lambda: self._open(f).get_tensor(key)).to(device=device, dtype=dtype)

    def has_tokenizer(self) -> bool:
        return any(
            (self.path / n).is_file()
            for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )

    def fingerprint(self) -> str:
        """Hash of the safetensors files (whole files when small, else headers + sampled chunks)."""
        files = self.files()
        total = sum(f.stat().st_size for f in files)
        h = hashlib.sha256()
        is_full = total <= _FULL_HASH_LIMIT
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                if is_full:
                    for block in iter(lambda fh=fh: fh.read(_CHUNK * 8), b""):
                        h.update(block)
                    continue
                header_len = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(header_len))
                for i in range(_SAMPLE_CHUNKS):
                    fh.seek(int(size * i / _SAMPLE_CHUNKS))
                    h.update(fh.read(_CHUNK))
        return ("st-full:" if is_full else "st-sampled:") + h.hexdigest()[:32]
