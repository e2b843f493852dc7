"""A teacher bigger than memory: its top-k logits computed one decoder layer at a time.

When the teacher is a local dense safetensors directory that does not fit (or `teacher_stream: true`,
`--teacher-stream`), it is never loaded whole. It is opened as a `LazyCheckpoint` (skeleton on the meta
device), and the shared layer-streamed forward (`engine/forward.py`) runs every training window through
decoder layer 0, then layer 1, ..., then the model's own final norm and head, one window at a time;
only each window's top-k logits are kept (float16 values, int32 indices: the `topk_cache` format). The
activations of all windows (two (n, T, d) float32 arrays) go to memory-mapped files when they exceed
`SPILL_SHARE` of the available memory. The held-out windows ride along in the same pass, and the
teacher's perplexity on them comes from their logits (the `perplexity()` protocol), so the layers are
read from disk once.

What needs the whole teacher during training cannot stream and is refused before any work: training
without `topk_cache` (the teacher online), hidden-state losses, `reconstruct`. The student, when derived
from the teacher, reads only the layers it keeps (student.py).

The cache key is the in-memory teacher's (topk_cache.teacher_key), computed tensor by tensor from disk,
so a cache written by either path is reused by the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from geminicompress.distill.topk_cache import TopKCache, cache_folder, read_cache, teacher_key, top_k, write_cache
from geminicompress.engine.forward import activations_bytes, final_hidden, head_chunks
from geminicompress.core.errors import InputError
from geminicompress.host.memory import available_memory, too_big
from geminicompress.models.head import chunk_rows
from geminicompress.models.headers import is_streamable_dir, weights_bytes
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.models.loading import LoadedModel, load_tokenizer, local_dir, resolve_model
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.distill.config import DistillStage

SPILL_SHARE = 0.25  # activations go to disk when the two (n, T, d) float32 arrays exceed this share
TEACHER_PPL = "teacher_ppl.json"  # next to the cache: held-out perplexity by held-out windows' digest


# ---- deciding ----
def streamable_dir(spec: str) -> Path | None:
    """The local dense safetensors directory MODEL `spec` names (the demo's converted copy included), else None:
    what a streamed teacher, or a streamed run (pipeline.py), reads."""
    path = local_dir(spec)
    return path if path is not None and is_streamable_dir(path) else None


def cannot_stream(cfg: DistillStage, spec: str) -> str | None:
    """Why the teacher `spec` of stage `cfg` cannot be streamed, or None when it can."""
    if streamable_dir(spec) is None:
        return f"the teacher {spec} is not a local dense safetensors directory"
    if not cfg.topk_cache:
        return ("a streamed teacher teaches through its cached top-k logits: add --topk-cache K "
                "(topk_cache: K; e.g. 64), or load it whole with --no-teacher-stream")
    if cfg.reconstruct:
        return "reconstruct refits to the whole teacher's layers: drop --reconstruct"
    return None


def streams(cfg: DistillStage, spec: str, progress: Progress | None = None) -> bool:
    """--teacher-stream: yes (or a one-line error saying why not); --no-teacher-stream: no; neither:
    when it can and the teacher's float32 weights do not fit (memory.too_big, the one rule)."""
    if cfg.teacher_stream is False:
        return False
    why = cannot_stream(cfg, spec)
    if cfg.teacher_stream and why:
        raise InputError(f"--teacher-stream: {why}")
    if cfg.teacher_stream:
        return True
    path = streamable_dir(spec)
    big = path is not None and too_big(weights_bytes(path))
    if big and why and progress is not None:
        progress.warn(f"the teacher {spec} may not fit in memory, and it cannot be streamed: {why}")
    return big and why is None


def check_teacher_stream(cfg: DistillStage, model: str) -> None:
    """Before any work: a stage that forces `teacher_stream` can stream its teacher (`model`: the recipe's)."""
    if cfg.teacher_stream:
        why = cannot_stream(cfg, cfg.teacher or model)
        if why:
            raise InputError(f"--teacher-stream: {why}")


def streamed_input(cfg: DistillStage, recipe: Any, progress: Progress) -> LoadedModel | None:
    """When stage `cfg`, the recipe's first, streams the recipe's model as its teacher: the input as the
    pipeline hands it on: the tokenizer, no model (the stage reads the teacher layer by layer)."""
    if cfg.teacher is not None or not streams(cfg, recipe.model, progress):
        return None
    progress.info(f"reading the teacher {recipe.model} one decoder layer at a time (it is not loaded whole)")
    path = streamable_dir(recipe.model)
    return LoadedModel(None, load_tokenizer(str(path), recipe.trust_remote_code), resolve_model(recipe.model))


def open_teacher(spec: str, trust_remote_code: bool = False, allow_nonfinite: bool = False) -> LazyCheckpoint:
    """The teacher's checkpoint, read lazily (headers checked against config.json now; NaN/Inf as read)."""
    return LazyCheckpoint(streamable_dir(spec), trust_remote_code=trust_remote_code, allow_nonfinite=allow_nonfinite)


def spill_needed(windows: torch.Tensor, hidden_size: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the forward's two activation arrays for `windows` (n, T) exceed SPILL_SHARE of memory."""
    return 2 * activations_bytes(windows, hidden_size, dtype) > SPILL_SHARE * available_memory()


# ---- the key, from disk ----
def checkpoint_tensors(ckpt: LazyCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the in-memory model's state_dict order, one tensor in memory at a time; buffers
    the model computes at init (not on disk) come from the skeleton."""
    buffers = dict(ckpt.model.named_buffers())
    for name in ckpt.names():
        if ckpt.stored_name(name) in ckpt.tensors:
            yield name, ckpt.read([name])[name]
        else:
            yield name, buffers[name]


def lazy_key(ckpt: LazyCheckpoint, windows: torch.Tensor, k: int) -> str:
    """`topk_cache.cache_key` of the loaded teacher, computed without loading it."""
    return teacher_key(ckpt.model.config.to_dict(), checkpoint_tensors(ckpt), windows, k)


# ---- the pass ----
@torch.no_grad()
def topk_and_nll(ckpt: LazyCheckpoint, train: torch.Tensor, held_out: torch.Tensor, k: int, *, device: torch.device,
                 spill_dir: Path | None = None, progress: Progress | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """One streamed pass over `train` (n, T) and `held_out` (m, T): the top-k of every training
    window's logits, values (n, T, k) float16 and indices (n, T, k) int32, and the summed next-token
    NLL of the held-out windows with its token count."""
    progress = progress or NullProgress()
    windows = torch.cat([train, held_out])  # (n + m, T)
    n, T = train.shape
    values = torch.empty((n, T, k), dtype=torch.float16)
    indices = torch.empty((n, T, k), dtype=torch.int32)
    nll, count = 0.0, 0
    source = LazyLayers(ckpt, torch.float32)
    hidden = final_hidden(source, windows, device=device, dtype=torch.float32, spill_dir=spill_dir,
                          progress=progress, description="teacher layers")
    try:
        with progress.task(f"teacher top-{k} logits", len(windows)) as bar:
            rows = chunk_rows(ckpt.model.config.vocab_size)  # the head over chunks of positions (models/head.py)
            for i, start, logits in head_chunks(source, hidden, device=device, positions=T, rows=rows):  # (c, V)
                stop = start + logits.shape[0]
                if i < n:
                    values[i, start:stop], indices[i, start:stop] = top_k(logits, k)
                elif start < T - 1:
                    targets = windows[i, start + 1:stop + 1].to(logits.device)  # the last position has none
                    nll += float(F.cross_entropy(logits[:targets.numel()], targets, reduction="sum"))
                    count += targets.numel()
                if stop == T:
                    bar.advance(1)
    finally:
        hidden.close()
    return values, indices, nll, count


def build_streamed_topk_cache(ckpt: LazyCheckpoint, train: torch.Tensor, held_out: torch.Tensor, k: int,
                              device: torch.device, *, work_dir: Path, root: Path | None = None,
                              progress: Progress | None = None) -> tuple[TopKCache, float]:
    """The top-k cache of (teacher, train windows, k) and the teacher's held-out perplexity, from disk:
    read back when cached, else one streamed pass (activations under `work_dir` when they do not fit)."""
    folder = cache_folder(lazy_key(ckpt, train, k), root)
    cache = read_cache(folder)
    ppl = _known_ppl(folder).get(_digest(held_out)) if cache is not None else None
    if cache is not None and ppl is not None:
        return cache, ppl
    todo = train[:0] if cache is not None else train  # a cache without this held-out set: the held-out only
    spill = work_dir / "teacher-activations" if spill_needed(torch.cat([todo, held_out]), ckpt.model.config.hidden_size) else None
    if spill is not None:
        spill.mkdir(parents=True, exist_ok=True)
    try:
        values, indices, nll, count = topk_and_nll(ckpt, todo, held_out, k, device=device, spill_dir=spill,
                                                   progress=progress)
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    cache = cache or write_cache(folder, values, indices)
    ppl = round(math.exp(nll / count), 4)
    _store_ppl(folder, held_out, ppl)
    return cache, ppl


def _digest(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:24]


def _known_ppl(folder: Path) -> dict[str, float]:
    """The held-out perplexities stored next to the cache, by held-out windows' digest."""
    try:
        return json.loads((folder / TEACHER_PPL).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _store_ppl(folder: Path, held_out: torch.Tensor, ppl: float) -> None:
    known = _known_ppl(folder)
    known[_digest(held_out)] = ppl
    tmp = folder / f"{TEACHER_PPL}.tmp"
    tmp.write_text(json.dumps(known))
    tmp.rename(folder / TEACHER_PPL)
