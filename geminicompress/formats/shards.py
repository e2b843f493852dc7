"""Write a checkpoint's tensors as they are produced, into safetensors shards of at most `max_bytes`.

A safetensors file starts with a header (8-byte length, JSON of every tensor's dtype, shape and byte
range), so a shard cannot be written before all its tensors are known. The writer therefore appends each
tensor's bytes to the open shard's data file as soon as it is given, after a reserved region at its
start, and when the next tensor would make the shard exceed `max_bytes` it closes the shard: the header,
padded with spaces (which the format allows) to fill the reserved region exactly, is written into that
region and the file is renamed `part-NNNNN.safetensors`. Every byte is written once. (A header bigger
than the reserve, which needs thousands of tensors in one shard, and a shard so small that the padding
would be more than 1.5% of it, are written the slow way: header + data copied into a new file; a small
model's checkpoint is then as big as its tensors.) Memory: one tensor at a time.

Resumable at *unit* granularity (a unit = one decoder layer's tensors, or one module outside them):
after a unit's bytes are flushed to disk, `progress.json` (rewritten atomically) records the unit, its
summary and where its tensors lie. A restarted writer truncates the open data file back to the last
finished unit, so a killed run continues after its last finished layer with no second copy of it.
`finish(out)` renames the parts to transformers' `model-0000k-of-0000n.safetensors` (or
`model.safetensors` when there is one) and writes `model.safetensors.index.json`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from geminicompress.host.diskerrors import DiskError
from geminicompress.core.errors import GeminiError
from geminicompress.formats.checkpoint import CODE_DTYPES, DTYPE_CODES, INDEX, WEIGHTS

DEFAULT_MAX_BYTES = 2 * 10**9
PROGRESS = "progress.json"
RESERVE_MAX = 1 << 20  # bytes reserved for a shard's header: ~8,000 tensor entries
SMALL_SHARD = 64  # a shard with less data than this many reserves is rewritten with its exact header (no padding)


class DiskFullError(DiskError):
    """The disk filled up while writing `filename`; the finished units are kept and a rerun resumes after them."""

    def __init__(self, message: str, filename: str) -> None:
        super().__init__(message)
        self.filename = filename


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order, without a copy when it is contiguous on the CPU."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def header_reserve(max_bytes: int) -> int:
    """Bytes reserved at the start of each shard for its header: a thousandth of the shard limit, between
    512 bytes and RESERVE_MAX, a multiple of 8 (the data stays 8-byte aligned)."""
    return min(RESERVE_MAX, max(512, max_bytes // 1000)) // 8 * 8


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class ShardWriter:
    """`writer.write(unit, tensors, summary)` per finished unit, then `writer.finish(out)`."""

    def __init__(self, work: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        path = self.work / PROGRESS
        self.state: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {
            "max_bytes": max_bytes, "closed": [], "open": self._new_open(max_bytes), "units": {}}
        self._recover()

    # ---- public ----
    def finished(self, unit: str) -> bool:
        return unit in self.state["units"]

    def summary(self, unit: str) -> dict[str, Any]:
        return self.state["units"][unit]

    def write(self, unit: str, tensors: dict[str, torch.Tensor], summary: dict[str, Any] | None = None) -> None:
        """Append `tensors` (in order) and mark `unit` finished once they are on disk."""
        if self.finished(unit):
            return
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.state["open"]["bytes"] and self.state["open"]["bytes"] + size > self.max_bytes:
                self._close_open()
            self._append(name, t, size)
        self._sync()
        self.state["units"][unit] = summary or {}
        self.state.setdefault("unit_tensors", {})[unit] = list(tensors)
        self._save_state()

    def read(self, unit: str) -> dict[str, torch.Tensor]:
        """The tensors a finished unit wrote, read back from its shard(s) (to resume through it)."""
        from safetensors import safe_open

        names = self.state.get("unit_tensors", {}).get(unit, [])
        where = {t: shard["file"] for shard in self.state["closed"] for t in shard["tensors"]}
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if name in where:
                with safe_open(str(self.work / where[name]), framework="pt") as f:
                    out[name] = f.get_tensor(name)
                continue
            meta = self.state["open"]["tensors"][name]
            start, stop = meta["data_offsets"]
            with open(self._data_path(), "rb") as f:
                f.seek(self._reserve() + start)
                raw = bytearray(f.read(stop - start))
            dtype = CODE_DTYPES[meta["dtype"]]
            out[name] = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(meta["shape"]).clone()
                if raw else torch.empty(meta["shape"], dtype=dtype))
        return out

    def finish(self, out: Path) -> dict[str, Any]:
        """Close the last shard, put every shard into `out` under transformers' names, write the index
        (none for a single shard, which becomes model.safetensors); return {files, total_bytes}.
        The shards are hard-linked, not moved: the resume state stays whole (at no extra disk), so a failure
        after this (config, verification) still resumes; moved only where the filesystem has no links."""
        if self.state["open"]["tensors"]:
            self._close_open()
        closed = self.state["closed"]
        n = len(closed)
        names = [WEIGHTS] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        weight_map: dict[str, str] = {}
        total = 0
        for shard, name in zip(closed, names):
            src = self.work / shard["file"]
            if src.is_file():
                _link_or_move(src, Path(out) / name)
            elif not (Path(out) / name).is_file():
                raise GeminiError(f"{src} is missing: the resume state in {self.work} is damaged; rerun with --force")
            weight_map.update({t: name for t in shard["tensors"]})
            total += shard["bytes"]
        if n > 1:
            _write_json(Path(out) / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        return {"files": names, "total_bytes": total}

    # ---- shards ----
    @staticmethod
    def _new_open(max_bytes: int) -> dict[str, Any]:
        return {"tensors": {}, "bytes": 0, "reserve": header_reserve(max_bytes)}

    def _reserve(self) -> int:
        return self.state["open"].get("reserve", 0)

    def _data_path(self) -> Path:
        return self.work / f"part-{len(self.state['closed']) + 1:05d}.data"

    def _append(self, name: str, t: torch.Tensor, size: int) -> None:
        if t.dtype not in DTYPE_CODES:
            raise GeminiError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        opened = self.state["open"]
        start = opened["bytes"]
        path = self._data_path()
        with self._guard(path):
            if not path.is_file():  # a new shard: its header's reserved region first (a hole on most filesystems)
                with open(path, "wb") as f:
                    f.truncate(self._reserve())
            with open(path, "ab") as f:
                f.write(_bytes(t))
        opened["tensors"][name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + size]}
        opened["bytes"] = start + size

    def _close_open(self) -> None:
        """Write the open shard's header into its reserved region (or, when it does not fit, header + data
        into a new file) as part-NNNNN.safetensors; start a new open shard."""
        opened = self.state["open"]
        data = self._data_path()
        final = data.with_suffix(".safetensors")
        header = json.dumps({"__metadata__": {"format": "pt"}, **opened["tensors"]}, separators=(",", ":")).encode()
        reserve = self._reserve()
        if 8 + len(header) <= reserve and opened["bytes"] >= SMALL_SHARD * reserve:
            header += b" " * (reserve - 8 - len(header))  # trailing spaces: allowed, and the data starts at `reserve`
            with self._guard(data), open(data, "r+b") as out:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)
                out.flush()
                os.fsync(out.fileno())
            os.replace(data, final)
        else:
            self._copy_with_header(data, final, header, reserve)
        self.state["closed"].append({"file": final.name, "tensors": list(opened["tensors"]),
                                     "bytes": final.stat().st_size})
        self.state["open"] = self._new_open(self.max_bytes)
        self._save_state()
        data.unlink(missing_ok=True)

    def _copy_with_header(self, data: Path, final: Path, header: bytes, skip: int) -> None:
        header += b" " * (-len(header) % 8)  # keeps the data 8-byte aligned
        tmp = final.with_name(final.name + ".tmp")
        with self._guard(tmp), open(tmp, "wb") as out, open(data, "rb") as src:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            src.seek(skip)
            shutil.copyfileobj(src, out, 64 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)

    def _sync(self) -> None:
        path = self._data_path()
        if path.is_file():
            with self._guard(path), open(path, "ab") as f:
                f.flush()
                os.fsync(f.fileno())

    def _save_state(self) -> None:
        with self._guard(self.work / PROGRESS):
            _write_json(self.work / PROGRESS, self.state)

    def _recover(self) -> None:
        """Drop what a killed run wrote after its last finished unit."""
        for tmp in self.work.glob("*.tmp"):
            tmp.unlink()
        path = self._data_path()
        closed = path.with_suffix(".safetensors")
        if not path.is_file() and closed.is_file():  # killed between closing the shard and recording it
            os.replace(closed, path)  # its header region is rewritten when it closes again
        keep = self.state["open"]["bytes"]
        if path.is_file() and not keep:
            path.unlink()
        elif path.is_file() and path.stat().st_size != self._reserve() + keep:
            os.truncate(path, self._reserve() + keep)
        elif not path.is_file() and keep:
            raise GeminiError(f"{path} is missing: the resume state in {self.work} is damaged; rerun with --force")

    @contextmanager
    def _guard(self, path: Path) -> Iterator[None]:
        """Turn ENOSPC into one line naming the file; everything finished so far stays for the rerun."""
        finished = len(self.state["units"])
        try:
            yield
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                if exc.filename is None:
                    exc.filename = str(path)  # which file it was: the pipeline's one line says it (diskerrors.py)
                raise
            free = shutil.disk_usage(self.work).free
            raise DiskFullError(f"disk full while writing {path} ({free / 2**30:.2f} GiB free): free some space "
                                f"and rerun the same command; it resumes after the {finished} finished units",
                                str(path)) from exc


def _link_or_move(src: Path, dest: Path) -> None:
    """dest becomes src's file: a hard link (src stays), or a move where links are not supported."""
    if dest.exists() and os.path.samefile(src, dest):
        return
    tmp = dest.with_name(dest.name + ".link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # no hard links here (some network and FAT filesystems)
        os.replace(src, dest)
        return
    os.replace(tmp, dest)
