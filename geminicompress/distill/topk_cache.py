"""The teacher's top-k logits for every training window, computed once and kept on disk.

With a cache the teacher does not run during training: epochs after the first, and later runs on the
same teacher, data and k, read (values, indices) instead. The cache lives under
`<cache root>/topk/<key>/topk.safetensors`; the key hashes the teacher's config and a digest of its
weights, the exact windows and k, so a different teacher or data never reuses a stale file.
Storage: values float16 + indices int32, 6 bytes x k per token (k=64, 100k tokens: 38 MB).

The weights digest is SHA-256 over every tensor's values as float32 (the dtype the teacher computes
in), read in chunks of `DIGEST_CHUNK` values, so a teacher in memory and the same teacher read tensor by
tensor from disk (streamed_teacher.py) give the same key, and neither needs more than one tensor plus
a chunk in memory. The config's `dtype` is left out of the key for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from geminicompress.distill.losses import SparseLogits
from geminicompress.models.demo import cache_root
from geminicompress.models.head import chunk_logits, final_states
from geminicompress.host.progress import NullProgress, Progress

DIGEST_CHUNK = 1 << 22  # values per hashed chunk (16 MiB as float32)
TOPK_FILE = "topk.safetensors"
_STORAGE_KEYS = ("dtype", "torch_dtype")  # how the weights are stored, not what the teacher computes


def teacher_key(config: dict, tensors: Iterable[tuple[str, torch.Tensor]], windows: torch.Tensor, k: int) -> str:
    """The cache key of a teacher given as its config dict and (name, tensor) pairs in state_dict order."""
    h = hashlib.sha256()
    kept = {key: value for key, value in config.items() if key not in _STORAGE_KEYS}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    for name, tensor in tensors:
        h.update(f"{name}:{tuple(tensor.shape)}".encode())
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), DIGEST_CHUNK):
            chunk = flat[start : start + DIGEST_CHUNK]
            h.update((chunk.float() if chunk.is_floating_point() else chunk).cpu().contiguous().numpy())
    h.update(windows.numpy().tobytes())
    h.update(str(k).encode())
    return h.hexdigest()[:24]


def cache_key(teacher: nn.Module, windows: torch.Tensor, k: int) -> str:
    return teacher_key(teacher.config.to_dict(), teacher.state_dict().items(), windows, k)


class TopKCache:
    """Top-k teacher logits of `windows` (n, T): `get(idx)` -> SparseLogits (len(idx), T, k)."""

    def __init__(self, values: torch.Tensor, indices: torch.Tensor, path: Path, reused: bool) -> None:
        self.values, self.indices, self.path, self.reused = values, indices, path, reused

    def get(self, idx: torch.Tensor, device: torch.device) -> SparseLogits:
        return SparseLogits(self.values[idx].to(device), self.indices[idx].to(device))


def cache_folder(key: str, root: Path | None = None) -> Path:
    return (root or cache_root() / "topk") / key


def read_cache(folder: Path) -> TopKCache | None:
    """The cache stored in `folder`, or None when there is none."""
    from safetensors.torch import load_file

    path = folder / TOPK_FILE
    if not path.is_file():
        return None
    data = load_file(path)
    return TopKCache(data["values"], data["indices"], path, reused=True)


def write_cache(folder: Path, values: torch.Tensor, indices: torch.Tensor) -> TopKCache:
    """Store values (n, T, k) float16 and indices (n, T, k) int32 in `folder` (atomically)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{TOPK_FILE}.tmp-{os.getpid()}"
    save_file({"values": values, "indices": indices}, str(tmp))
    tmp.rename(folder / TOPK_FILE)
    return TopKCache(values, indices, folder / TOPK_FILE, reused=False)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float16, indices int32) of the k largest logits (..., V) -> (..., k) each, on the CPU."""
    top = logits.float().topk(k, dim=-1)
    return top.values.half().cpu(), top.indices.int().cpu()


@torch.no_grad()
def build_topk_cache(
    teacher: nn.Module,
    windows: torch.Tensor,
    k: int,
    device: torch.device,
    batch_size: int = 4,
    root: Path | None = None,
    progress: Progress | None = None,
) -> TopKCache:
    """Load the cache for (teacher in memory, windows, k), computing and writing it first when absent."""
    folder = cache_folder(cache_key(teacher, windows, k), root)
    cached = read_cache(folder)
    if cached is not None:
        return cached
    progress = progress or NullProgress()
    values, indices = [], []
    with progress.task(f"teacher top-{k} logits", len(windows)) as bar:
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            hidden = final_states(teacher, batch)  # (b, T, d); the head in chunks of positions (models/head.py)
            parts = [top_k(logits, k) for _, logits in chunk_logits(teacher, hidden.flatten(0, 1))]  # (c, k) each
            values.append(torch.cat([v for v, _ in parts]).view(*batch.shape, k))
            indices.append(torch.cat([i for _, i in parts]).view(*batch.shape, k))
            bar.advance(len(batch))
    return write_cache(folder, torch.cat(values), torch.cat(indices))
