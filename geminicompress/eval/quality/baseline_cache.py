"""The baseline's per-window log-probs, kept so that each model's drift is computed without
re-running the baseline and without holding every model's logits in memory.

The log-probs are written chunk by chunk (a chunk: consecutive positions of one window, models/head.py)
to one temporary float32 file and read back one chunk at a time (plain file I/O, not a memory map, so the
resident set does not grow with the file): the KL stays exact and memory follows one chunk. When the
file would exceed `limit_bytes` (or the free disk space), nothing is stored and `get` recomputes the
chunk with the baseline model, which the caller then keeps loaded (its final hidden states of the
current window, (T-1, d), are kept, so a window's decoder runs once).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from geminicompress.models.head import chunk_logits, final_states

DEFAULT_LIMIT_BYTES = 8 * 1024**3


class BaselineCache:
    def __init__(self, n_windows: int, positions: int, vocab: int, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.shape = (positions, vocab)  # per window: (T-1, V)
        self.window_bytes = positions * vocab * 4
        self.dir = Path(tempfile.mkdtemp(prefix="geminicompress-eval-"))
        free = shutil.disk_usage(self.dir).free
        self.stored = n_windows * self.window_bytes <= min(limit_bytes, free // 2)
        self.file = self.dir / "baseline-logprobs.f32"
        self._written = 0  # positions written, over all windows
        self._buffer = np.empty(0, dtype=np.float32)  # get's chunk, read into the same memory every time
        self._hidden: tuple[int, torch.Tensor] | None = None  # recomputing: (window index, its (T-1, d) states)
        self.model = None  # set by the caller when not stored: the baseline recomputes
        self.device: torch.device | None = None

    def put(self, index: int, start: int, logp: torch.Tensor) -> None:
        """Store positions start.. of window `index` (logp (c, V)); chunks must be put in order."""
        if not self.stored:
            return
        assert index * self.shape[0] + start == self._written and logp.shape[1] == self.shape[1], (
            "chunks are cached in order")
        with self.file.open("ab") as f:
            logp.float().contiguous().numpy().tofile(f)  # no bytes copy of the chunk
        self._written += logp.shape[0]

    def get(self, index: int, window: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The baseline's log-probs for positions start..stop-1 of window `index` (all by default): (c, V)
        float32."""
        positions, vocab = self.shape
        stop = positions if stop is None else stop
        if self.stored:
            count = (stop - start) * vocab
            if self._buffer.size < count:
                self._buffer = np.empty(count, dtype=np.float32)
            data = self._buffer[:count]
            with self.file.open("rb") as f:
                f.seek((index * positions + start) * vocab * 4)
                assert f.readinto(data) == data.nbytes, "the cache holds every position asked for"
            return torch.from_numpy(data).view(stop - start, vocab)
        assert self.model is not None, "recomputing needs the baseline model"
        if self._hidden is None or self._hidden[0] != index:
            self._hidden = None  # the previous window's states go before the next are made
            self._hidden = (index, final_states(self.model, window.view(1, -1).to(self.device))[0, :-1])
        _, logits = next(chunk_logits(self.model, self._hidden[1][start:stop], rows=stop - start))
        return F.log_softmax(logits, dim=-1).cpu()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.model, self._hidden = None, None

    def __enter__(self) -> "BaselineCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
