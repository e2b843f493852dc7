"""Where a distillation run's memory goes, for report.json: the models, the gradients, the optimizer's state, the
student's activations and the chunked head (chunked_head.py), beside the process's peak.

Models, gradients and optimizer state are counted from their tensors. Activations are measured: the bytes of the
tensors autograd keeps for the backward during the first micro-batch's student forward (each storage once,
parameters not counted; with `gradient_checkpointing` only the checkpointed layers' inputs are kept and one
layer's activations exist again during its recompute). The head is counted from its chunk sizes (head_bytes).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
import torch.nn as nn

from geminicompress.distill.chunked_head import LOSS_TEMPORARIES


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_bytes(model: nn.Module | None, besides: nn.Module | None = None) -> int:
    """Weights and buffers (a tied weight once); 0 for no model or one on the meta device (streamed). With
    `besides`, a tensor that model holds too is left out (counted there)."""
    if model is None:
        return 0
    theirs = set() if besides is None else {t.data_ptr() for t in [*besides.parameters(), *besides.buffers()]}
    return tensor_bytes(t for t in [*model.parameters(), *model.buffers()]
                        if t.device.type != "meta" and t.data_ptr() not in theirs)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class SavedForBackward:
    """Inside the block, counts the bytes of the tensors autograd saves for the backward (each storage once),
    leaving out the storages of `params`."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._skip:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def head_bytes(rows: tuple[int, int], weight_shape: torch.Size, positions: int, trains: bool, itemsize: int,
               teacher_cast: bool = True) -> int:
    """The chunked head's working memory: a chunk's float32 logits (rows[0], V) x the loss's temporaries, the
    gathered output gradients (rows[1], V) in the products' dtype (`itemsize` bytes), the hidden states' gradient
    (positions, d), the head's float32 gradient (V, d) when it trains, and the heads' weights cast once for the
    products when that dtype is not float32 (the student's; the teacher's too with `teacher_cast`)."""
    vocab, width = weight_shape
    casts = (1 + teacher_cast) * vocab * width * itemsize if itemsize != 4 else 0
    grads = rows[1] * vocab * itemsize + 4 * vocab * width if trains else 0
    return 4 * (rows[0] * vocab * LOSS_TEMPORARIES + positions * width) + grads + casts


def peak_rss_bytes() -> int:
    """The whole process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
