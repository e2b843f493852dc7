"""What a safetensors checkpoint holds, from its headers alone: every tensor's file, dtype, shape and offset
(`read_headers`, checked against the index), its config.json (`read_config`), whether a folder is one this
project can read layer by layer, and the sizes that decide whether it fits (memory.too_big) and whether OUT
fits on the disk."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from geminicompress.core.errors import InputError
from geminicompress.formats import FORMATS, detect
from geminicompress.formats.checkpoint import CODE_DTYPES, INDEX, WEIGHTS


class TensorInfo:
    __slots__ = ("file", "dtype", "shape", "offset")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int = -1) -> None:
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset  # offset: of its bytes in file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def is_streamable_dir(path: Path, config: dict | None = None) -> bool:
    """A dense (no quantization_config) transformers directory with safetensors weights. `config`: its
    config.json where the caller has read it already (else it is read here)."""
    config = config if config is not None and holds_safetensors(path) else safetensors_config(path)
    return config is not None and not config.get("quantization_config")


def is_readable_dir(path: Path) -> bool:
    """A transformers directory with safetensors weights, dense or in a format geminicompress reads
    (what `LazyCheckpoint` can read one layer at a time)."""
    config = safetensors_config(path)
    return config is not None and (not config.get("quantization_config") or detect(config) in FORMATS)


def safetensors_config(path: Path) -> dict | None:
    """config.json of a directory that holds safetensors weights, else None (also when it cannot be read)."""
    if not holds_safetensors(path):
        return None
    try:
        return read_config(path)
    except InputError:
        return None


def holds_safetensors(path: Path) -> bool:
    """Whether folder `path` holds safetensors weights (one file, or an index of shards)."""
    return (Path(path) / INDEX).is_file() or (Path(path) / WEIGHTS).is_file()


def read_config(folder: Path) -> dict | None:
    """`folder`/config.json, parsed; None where there is none; an InputError naming it when it is not JSON."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} cannot be read as JSON ({exc}); fix or replace it") from None


def open_file(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error type for a damaged header
        raise InputError(f"{file}: cannot be read ({str(exc).splitlines()[0]}): the shard is truncated or damaged") from exc


def _data_offsets(file: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file (8-byte header length, JSON header, data)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return {}
        size = struct.unpack("<Q", raw)[0]
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError, MemoryError):
            return {}  # safe_open reports the damage in one line
    return {k: 8 + size + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def read_headers(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint at `path` (name -> file, dtype, shape), checked against the index."""
    path = Path(path)
    index_file = path / INDEX
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise InputError(f"{index_file}: not a safetensors index ({exc})") from exc
    elif (path / WEIGHTS).is_file():
        weight_map = {}
    else:
        raise InputError(f"{path} has neither {WEIGHTS} nor {INDEX}")
    files = sorted(set(weight_map.values())) or [WEIGHTS]
    infos: dict[str, TensorInfo] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise InputError(f"{index_file} names shard {file.name}, which does not exist")
        offsets = _data_offsets(file)
        with open_file(file) as f:
            for key in f.keys():
                sl = f.get_slice(key)
                infos[key] = TensorInfo(file, CODE_DTYPES[sl.get_dtype()], tuple(sl.get_shape()), offsets.get(key, -1))
    for key, name in weight_map.items():
        if key not in infos or infos[key].file.name != name:
            raise InputError(f"{index_file} maps tensor {key} to {name}, which does not hold it")
    return infos


def weights_bytes(path: Path, dtype_size: int = 4) -> int:
    """Bytes the checkpoint's float weights take in memory at `dtype_size` bytes each (headers only)."""
    return sum(i.numel * (dtype_size if i.dtype.is_floating_point else i.dtype.itemsize)
               for i in read_headers(path).values())


def loaded_bytes(path: Path, dtype: torch.dtype) -> int:
    """About what the model at `path` holds in memory when loaded in `dtype`: float tensors in `dtype`,
    packed integer codes at twice their stored bytes (a 4-bit code unpacks to one byte), int8 codes as stored."""
    return sum(i.numel * dtype.itemsize if i.dtype.is_floating_point
               else i.nbytes * (2 if i.dtype == torch.int32 else 1) for i in read_headers(path).values())
