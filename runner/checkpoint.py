"""Tensor sources for loading: Hugging Face safetensors folders (single or sharded) and fingerprints.

This module owns reading a checkpoint folder (``config.json`` + ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) behind a small :class:`TensorSource` interface that
the loader also gets from presets (``speccal.runner.presets``), and the model fingerprint of a
folder. Tensors are read one at a time (``safe_open``) straight to the target device and dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from speccal.base.errors import InputError, SchemaError

_FULL_HASH_LIMIT = 2 * 1024**3  # hash whole files below this total size, else sample them
_SAMPLE_CHUNKS = 64
_CHUNK = 1 << 20


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
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise InputError("model", str(path), "a folder containing config.json")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise SchemaError(str(cfg_path), str(exc), "valid JSON") from None
        index = self.path / "model.safetensors.index.json"
        self.key_to_file: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
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
                with safe_open(str(f), framework="pt") as sf:
                    for key in sf.keys():
                        self.key_to_file[key] = f
        self._handles: dict[Path, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def files(self) -> list[Path]:
        return sorted(set(self.key_to_file.values()))

    def _open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def keys(self) -> list[str]:
        return sorted(self.key_to_file)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            self._shapes[key] = tuple(self._open(self.key_to_file[key]).get_slice(key).get_shape())
        return self._shapes[key]

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self._open(self.key_to_file[key]).get_tensor(key).to(device=device, dtype=dtype)

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
