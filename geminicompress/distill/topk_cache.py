"""The teacher's top-k logits for every training window, computed once and kept on disk.

With a cache the teacher does not run during training: epochs after the first, and later runs on the
same teacher, data and k, read (values, indices) instead. The cache lives under
`<cache root>/topk/<key>/topk.safetensors`; the key hashes the teacher's config and a checksum of its
weights, the exact windows and k, so a different teacher or data never reuses a stale file.
Storage: values float16 + indices int32, 6 bytes x k per token (k=64, 100k tokens: 38 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from geminicompress.distill.losses import SparseLogits
from geminicompress.models.demo import cache_root
from geminicompress.progress import NullProgress, Progress


def cache_key(teacher: nn.Module, windows: torch.Tensor, k: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(teacher.config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in teacher.state_dict().items():
        h.update(f"{name}:{float(p.double().sum()):.10e}:{float(p.double().abs().sum()):.10e}".encode())
    h.update(windows.numpy().tobytes())
    h.update(str(k).encode())
    return h.hexdigest()[:24]


class TopKCache:
    """Top-k teacher logits of `windows` (n, T): `get(idx)` -> SparseLogits (len(idx), T, k)."""

    def __init__(self, values: torch.Tensor, indices: torch.Tensor, path: Path, reused: bool) -> None:
        self.values, self.indices, self.path, self.reused = values, indices, path, reused

    def get(self, idx: torch.Tensor, device: torch.device) -> SparseLogits:
        return SparseLogits(self.values[idx].to(device), self.indices[idx].to(device))


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
    """Load the cache for (teacher, windows, k), computing and writing it first when absent."""
    from safetensors.torch import load_file, save_file

    folder = (root or cache_root() / "topk") / cache_key(teacher, windows, k)
    path = folder / "topk.safetensors"
    if path.is_file():
        data = load_file(path)
        return TopKCache(data["values"], data["indices"], path, reused=True)
    progress = progress or NullProgress()
    values, indices = [], []
    with progress.task(f"teacher top-{k} logits", len(windows)) as bar:
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = teacher(batch).logits  # (b, T, V)
            top = logits.float().topk(k, dim=-1)
            values.append(top.values.half().cpu())
            indices.append(top.indices.int().cpu())
            bar.advance(len(batch))
    data = {"values": torch.cat(values), "indices": torch.cat(indices)}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"topk.safetensors.tmp-{os.getpid()}"
    save_file(data, str(tmp))
    tmp.rename(path)
    return TopKCache(data["values"], data["indices"], path, reused=False)
