"""Inputs that lie: weights holding NaN or Inf (a bad fine-tune, an fp16 overflow) found as they are read.

A checkpoint with a handful of non-finite weights looks healthy until something uses them: INT8 turns a NaN
into an ordinary-looking code, a global magnitude threshold sorts NaN anywhere, a Hessian fills with NaN.
So every float tensor a command reads (a model loaded in memory: all of it, once; a checkpoint read one
layer at a time: each tensor as it is read, which the run does anyway) is checked, and the first bad one
stops the command before anything is written, in one line naming the tensor, how many values and the first
index. `--allow-nonfinite` (recipe: `allow_nonfinite: true`) lets it through; report.json then records what
was found.

Cost: one reduction per tensor, no tensor-sized temporary: the minimum and maximum together
(`torch.aminmax`: a NaN anywhere makes both NaN, a +Inf is the maximum, a -Inf the minimum, so both are
finite exactly when every value is), ~27 GB/s on bfloat16 here (a float32 sum of a bfloat16 tensor ran at
1.2 GB/s: 5.5% of an 8B-shaped streamed prune); the exact pass (`isfinite` a block of rows at a time, for
the count and the first index) runs only for a tensor that holds a non-finite value.

A model loaded in memory from safetensors in the dtype it is stored in is a set of views of the mapped file:
checking its tensors would read every page into the process (the demo's 0.5 GB counted in its resident
memory from the first second, which made it the in-memory GPTQ peak). So such a model is checked from the
file instead (`check_stored`), read in blocks into one buffer: the same values, the same verdict and the same
line, and each layer's pages come in only when the walk reaches it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import torch

from geminicompress.core.errors import InputError

ROWS = 1024  # rows per block of the exact pass
BLOCK_BYTES = 32 << 20  # bytes per read of check_stored


class NonFiniteError(InputError):
    """The input model holds NaN/Inf values (exit 2: an input error, not a failure of the run)."""


def nonfinite(t: torch.Tensor, rows: int = ROWS) -> tuple[int, list[int]] | None:
    """(how many values of `t` are NaN or ±Inf, the index of the first) or None when all are finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    low, high = torch.aminmax(t)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return None
    flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
    count, first = 0, None
    for r in range(0, flat.shape[0], rows):
        bad = ~torch.isfinite(flat[r:r + rows])  # (≤ rows, cols)
        n = int(bad.sum())
        if n and first is None:
            row, col = (int(v) for v in bad.nonzero()[0])
            first = [int(v) for v in np.unravel_index((r + row) * flat.shape[1] + col, t.shape)] if t.dim() else []
        count += n
    return (count, first) if count else None


def describe(name: str, count: int, first: list[int], t: torch.Tensor) -> str:
    value = t[tuple(first)] if first else t
    kind = "NaN" if bool(torch.isnan(value)) else ("+Inf" if float(value) > 0 else "-Inf")
    return f"{name} holds {count:,} non-finite value{'s' if count != 1 else ''} (the first, {kind}, at {first})"


def check(name: str, t: torch.Tensor, allow: bool, found: list[dict[str, Any]] | None = None) -> None:
    """Raise NonFiniteError naming tensor `name` when it holds NaN/Inf; with `allow`, record it in `found`."""
    hit = nonfinite(t)
    if hit is None:
        return
    count, first = hit
    what = describe(name, count, first, t)
    if not allow:
        raise NonFiniteError(f"the input model is broken: {what}; fix or re-export it (nothing was written), or "
                             "pass --allow-nonfinite to compress it anyway")
    if found is not None:
        found.append({"tensor": name, "count": count, "first_index": first, "what": what})


def check_named(tensors: Iterable[tuple[str, torch.Tensor]], allow: bool) -> list[dict[str, Any]]:
    """Check every float tensor of (name, tensor) pairs (a model in memory: its state dict); return what
    `allow` let through."""
    found: list[dict[str, Any]] = []
    for name, t in tensors:
        check(name, t, allow, found)
    return found


def check_stored(tensors: Mapping[str, Any], allow: bool, block_bytes: int = BLOCK_BYTES) -> list[dict[str, Any]]:
    """`check_named` of a safetensors checkpoint from its files: `tensors` maps each stored name to its
    `headers.TensorInfo` (file, dtype, shape, offset of its bytes). Each float tensor is read in blocks of
    `block_bytes` into one reused buffer (page cache, not this process's memory) and reduced with aminmax;
    a tensor with a non-finite value is then read whole and passed to `check`, which words the line."""
    found: list[dict[str, Any]] = []
    buf = bytearray(block_bytes)
    for name, info in tensors.items():
        if info.dtype.is_floating_point and info.numel and not _finite_on_disk(info, buf):
            check(name, _read_whole(info), allow, found)
    return found


def _finite_on_disk(info: Any, buf: bytearray) -> bool:
    item = info.dtype.itemsize
    step = len(buf) // item * item
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        left = info.nbytes
        while left:
            n = f.readinto(memoryview(buf)[:min(step, left)])
            if not n:
                raise OSError(f"{info.file} ends before tensor data at {info.offset}: the file is truncated")
            low, high = torch.aminmax(torch.frombuffer(buf, dtype=info.dtype, count=n // item))
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return False
            left -= n
    return True


def _read_whole(info: Any) -> torch.Tensor:
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        data = bytearray(f.read(info.nbytes))
    return torch.frombuffer(data, dtype=info.dtype).reshape(info.shape)
