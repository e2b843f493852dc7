"""Quality of a model bigger than memory: its windows go through one decoder layer at a time
(`engine/forward.py`), read from disk (`models/lazy.py`, dense or any format geminicompress writes),
and the log-probs of each window are scored by the same meters as a model in memory (quality.py).

Chosen per model: `--stream` forces it, `--no-stream` forbids it, and otherwise a model streams when
its weights, as the loader would hold them, exceed half of the available memory (memory.too_big: the
one rule, which prune/quantize and distill's teacher use too). Latency and throughput are not measured for a
streamed model: a model that does not fit has no in-memory latency to report (reading every layer from
disk per token is not a serving figure), and the report says so.
"""

from __future__ import annotations

import tempfile
from itertools import groupby
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from geminicompress.engine.forward import activations_bytes, final_hidden, head_chunks
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.eval.cost.footprint import count_params
from geminicompress.host.memory import available_memory, too_big
from geminicompress.models.head import chunk_rows
from geminicompress.models.headers import is_readable_dir, loaded_bytes
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.models.loading import local_dir
from geminicompress.host.progress import Progress

SPILL_FRACTION = 0.25  # keep the activations in files when the two stores exceed this share of available memory


def stream_reason(spec: str, stream: bool | None, dtype: torch.dtype) -> str | None:
    """Why `spec` is evaluated one layer at a time, or None when it is loaded into memory (as also for a
    MODEL that does not resolve: the loader then says why, in the model's own entry)."""
    if stream is False:
        return None
    try:
        path = local_dir(spec)
    except GeminiError:
        return None
    readable = path is not None and is_readable_dir(path)
    if stream and not readable:
        raise InputError(f"--stream: {spec} is not a local directory of safetensors weights (dense or in a format "
                         "geminicompress writes); download or convert it to one first")
    if not readable:
        return None
    if stream:
        return "--stream"
    need, free = loaded_bytes(path, dtype), available_memory()
    if too_big(need):
        return (f"its weights take {need / 2**30:.1f} GiB in memory, more than half of the "
                f"{free / 2**30:.1f} GiB available")
    return None


def open_streamed(spec: str, trust_remote_code: bool) -> tuple[LazyCheckpoint, Path]:
    path = local_dir(spec)
    return LazyCheckpoint(path, trust_remote_code=trust_remote_code), path


def streamed_logprobs(ckpt: LazyCheckpoint, windows: torch.Tensor, device: torch.device, dtype: torch.dtype,
                      progress: Progress | None = None) -> Iterator[Iterable[torch.Tensor]]:
    """Log-probabilities of the next token at every position but the last, for each window of `windows`
    (n, T) in order, as consecutive chunks (c, V) float32 on the CPU: what `models.head.window_chunks` gives
    for a model in memory. Each window's chunks must be consumed before the next window's."""
    hidden_size, (n, T) = ckpt.model.config.hidden_size, windows.shape
    spill = 2 * activations_bytes(windows, hidden_size, dtype) > SPILL_FRACTION * available_memory()
    source = LazyLayers(ckpt, dtype)
    with tempfile.TemporaryDirectory(prefix="geminicompress-activations-") as folder:
        hidden = final_hidden(source, windows, device=device, dtype=dtype,
                              spill_dir=Path(folder) if spill else None, progress=progress)
        try:
            chunks = head_chunks(source, hidden, device=device, dtype=dtype, positions=T - 1,
                                 rows=chunk_rows(ckpt.model.config.vocab_size))
            for _, part in groupby(chunks, key=lambda c: c[0]):
                yield (F.log_softmax(logits, dim=-1).cpu() for _, _, logits in part)
        finally:
            hidden.close()


def params_of(ckpt: LazyCheckpoint) -> int:
    """Parameters of the checkpoint's architecture (quantized linears at their logical in*out), a tied head once."""
    total = count_params(ckpt.model)
    head = ckpt.model.get_output_embeddings()
    if ckpt.tied_output and head is not None and head.weight is not ckpt.model.get_input_embeddings().weight:
        total -= head.weight.numel()
    return total
