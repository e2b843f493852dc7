"""The baseline's per-window log-probs, kept so that each model's drift is computed without
re-running the baseline and without holding every model's logits in memory.

The log-probs are written window by window to one temporary float32 file and read back one window at
a time (plain file I/O, not a memory map, so the resident set does not grow with the file). When the
file would exceed `limit_bytes` (or the free disk space), nothing is stored and `get` recomputes the
window with the baseline model, which the caller then keeps loaded.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from geminicompress.eval.quality.perplexity import window_logprobs

DEFAULT_LIMIT_BYTES = 8 * 1024**3


class BaselineCache:
    def __init__(self, n_windows: int, positions: int, vocab: int, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.shape = (positions, vocab)  # per window: (T-1, V)
        self.window_bytes = positions * vocab * 4
        self.dir = Path(tempfile.mkdtemp(prefix="geminicompress-eval-"))
        free = shutil.disk_usage(self.dir).free
        self.stored = n_windows * self.window_bytes <= min(limit_bytes, free // 2)
        self.file = self.dir / "baseline-logprobs.f32"
        self._written = 0
        self.model = None  # set by the caller when not stored: the baseline recomputes
        self.device: torch.device | None = None

    def put(self, index: int, logp: torch.Tensor) -> None:
        """Store window `index` (windows must be put in order 0, 1, 2, ...)."""
        if not self.stored:
            return
        assert index == self._written and tuple(logp.shape) == self.shape, "windows are cached in order"
        with self.file.open("ab") as f:
            f.write(logp.float().contiguous().numpy().tobytes())
        self._written += 1

    def get(self, index: int, window: torch.Tensor) -> torch.Tensor:
        """The baseline's log-probs for window `index`: (T-1, V) float32."""
        if self.stored:
            data = np.fromfile(self.file, dtype=np.float32, count=self.shape[0] * self.shape[1],
                               offset=index * self.window_bytes)
            return torch.from_numpy(data).view(self.shape)
        assert self.model is not None, "recomputing needs the baseline model"
        return window_logprobs(self.model, window, self.device)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.model = None

    def __enter__(self) -> "BaselineCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
