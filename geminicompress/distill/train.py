"""The distillation training loop on `accelerate`: CPU, one GPU, or many (DDP/FSDP/DeepSpeed via
`accelerate launch`), with mixed precision, gradient accumulation and checkpointing, AdamW with linear
warm-up and cosine decay, held-out perplexity, and checkpoints that resume exactly.

Exact resume: the data order is a pure function of the micro-step (a seeded permutation per epoch), so
a checkpoint needs only the step count besides what `accelerator.save_state` keeps (model, optimizer,
scheduler, RNG states). A checkpoint is written to `ckpt.tmp` and renamed, so a kill never leaves half
of one.

Memory: the logit losses go a chunk of positions at a time through the heads (chunked_head.py), the student's
layers are checkpointed by default, AdamW is fused; report.json's `memory` says where the bytes went
(memory_use.py).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.distill.chunked_head import (
    ChunkJob,
    chunk_rows,
    chunked_logit_loss,
    head_bypassed,
    group_rows,
    head_parameters,
    products_dtype,
    weight_as,
)
from geminicompress.distill.losses import SparseLogits, hidden_terms, next_tokens
from geminicompress.distill import memory_use as MU
from geminicompress.distill.masks import apply_masks, mask_grads
from geminicompress.distill.memory_use import SavedForBackward
from geminicompress.distill.frozen_teacher import frozen_linears_as, table_in_file
from geminicompress.distill.precision import AUTOCAST_DTYPES, Precision, choose_precision
from geminicompress.distill.shared_prefix import TeacherInput, freeze_prefix, prefix_length, starting_at
from geminicompress.distill.topk_cache import TopKCache
from geminicompress.eval.quality.perplexity import perplexity
from geminicompress.core.arch import arch_for, get_module
from geminicompress.engine.layers import layer_input
from geminicompress.host.memory import heap_reuse, release_free_heap
from geminicompress.models.head import decoder_of, own_head
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.distill.config import DEFAULT_STEPS, DistillStage

CKPT = "ckpt"


@dataclass
class History:
    """What the run did: per-step losses, the held-out perplexity curve, tokens and time."""

    step: int = 0
    loss: list[float] = field(default_factory=list)
    terms: list[dict[str, float]] = field(default_factory=list)
    ppl: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    frozen_prefix: int = 0  # leading student blocks frozen as the teacher's (shared_prefix.py)
    shared_prefix: bool = False  # ... and skipped: the student's forward starts from the teacher's state there
    precision: str = ""  # what the loop computed in ("no", "bf16", "fp16"; precision.py)
    precision_why: str = ""
    memory: dict[str, int] = field(default_factory=dict)  # where the memory went, bytes (memory_use.py)


def batch_indices(micro: int, n_windows: int, batch_size: int, seed: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Window indices of one micro-batch: position p in an endless stream of seeded per-epoch permutations."""
    start = micro * batch_size * world + rank * batch_size
    out = []
    for p in range(start, start + batch_size):
        epoch, i = divmod(p, n_windows)
        perm = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[i]))
    return torch.tensor(out)


def lr_lambda(warmup: int, total: int):
    """Linear warm-up to the peak, then cosine decay to 10% of it."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


@dataclass(frozen=True)
class TrainRun:
    """Where a run computes and keeps its checkpoints, its seed, and what it reports progress to."""

    seed: int
    state_dir: Path
    device: torch.device
    progress: Progress | None = None


@dataclass(frozen=True)
class Guides:
    """What holds the student besides the teacher's logits: the hidden-state layer map (student layer ->
    teacher layer), the pruning masks that keep its zeros, the teacher's top-k logit cache."""

    layer_map: dict[int, int] | None = None
    masks: dict[str, torch.Tensor] | None = None
    cache: TopKCache | None = None


@dataclass(frozen=True)
class _Loop:
    """What every optimizer step reads (the prepared objects of one run)."""

    acc: Any
    student: nn.Module  # as prepared by accelerate (maybe wrapped)
    teacher: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    windows: torch.Tensor  # (n, T) training windows
    cfg: DistillStage
    seed: int
    guides: Guides  # masks on the accelerator's device
    prefix: int = 0  # frozen leading blocks (the teacher's own)
    share: TeacherInput | None = None  # the teacher's input to block `prefix`, when the student starts there
    rows: tuple[int, int] = (1, 1)  # positions per chunk of the head's loss, per product of its weight's gradient
    head_params: tuple[nn.Parameter, ...] = ()  # the student head's trainable parameters
    memory: dict[str, int] = field(default_factory=dict)  # filled by the first micro-batch: its activations
    teacher_in_file: int = 0  # bytes of the teacher's embedding table left in its checkpoint file (frozen_teacher.py)

    @property
    def hidden(self) -> bool:
        return self.cfg.loss.hidden


def train(student: nn.Module, teacher: nn.Module | None, train_windows: torch.Tensor, eval_windows: torch.Tensor,
          cfg: DistillStage, run: TrainRun, guides: Guides = Guides()) -> tuple[nn.Module, History]:
    """Train `student` towards `teacher` for cfg.steps optimizer steps (or cfg.train_minutes); return the
    unwrapped student and what the run did."""
    from accelerate.utils import set_seed

    progress = run.progress or NullProgress()
    precision = choose_precision(cfg.precision, run.device)
    if precision.slow:
        progress.warn(f"training in bf16 ({precision.why}; --precision no trains in float32)")
    elif cfg.precision == "auto":
        progress.info(f"training in {'float32' if precision.mode == 'no' else precision.mode} ({precision.why})")
    acc = _accelerator(precision, run.device)
    set_seed(run.seed)
    loop = _prepare(acc, student, teacher, train_windows, cfg, run.seed, guides)
    raw = acc.unwrap_model(loop.student)
    ckpt = _shared_path(acc, Path(run.state_dir) / CKPT)
    if cfg.resume and (ckpt / "history.json").is_file():
        acc.load_state(str(ckpt))
        history = History(**json.loads((ckpt / "history.json").read_text()))
        history.ppl = [tuple(x) for x in history.ppl]
        progress.info(f"resumed distillation at step {history.step} of {cfg.steps}")
    else:
        history = History(ppl=[(0, perplexity(raw, eval_windows, acc.device))])
    history.frozen_prefix, history.shared_prefix = loop.prefix, loop.share is not None
    history.precision, history.precision_why = precision.mode, precision.why
    if loop.prefix:
        progress.info(f"the student's first {loop.prefix} blocks are the teacher's: frozen"
                      + (", and the student's forward starts after them" if loop.share else ""))
    trims = _trims_in_backward(raw)
    try:
        _steps(loop, history, eval_windows, ckpt, progress)
    finally:
        if loop.share is not None:
            loop.share.close()
        for handle in trims:
            handle.remove()
    history.memory = _memory(loop, raw)
    acc.wait_for_everyone()
    if cfg.gradient_checkpointing:
        raw.activation_checkpointing_disable()
        raw.config.use_cache = True
    raw = acc.unwrap_model(loop.student, keep_fp32_wrapper=False)  # mixed precision: its autocast forward goes too
    acc.free_memory()
    return raw.eval(), history


def _accelerator(precision: Precision, device: torch.device):
    """accelerate's Accelerator in `precision`. Its state is one per process and refuses a second precision;
    a single process (not `accelerate launch`) that trained before in another precision (a recipe, a test,
    a notebook) starts afresh instead."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import AutocastKwargs

    state = AcceleratorState._shared_state
    if state and state.get("num_processes", 1) == 1 and state.get("_mixed_precision") != precision.mode:
        AcceleratorState._reset_state(True)
    # autocast's cache would keep a bf16 copy of every trainable weight for the whole micro-step; without it a
    # weight is cast where it is used (the same products; checkpointed layers cast theirs again when recomputed)
    return Accelerator(mixed_precision=precision.mode, cpu=device.type == "cpu",
                       kwargs_handlers=[AutocastKwargs(cache_enabled=False)])


def _prepare(acc, student: nn.Module, teacher: nn.Module | None, windows: torch.Tensor, cfg: DistillStage, seed: int,
             guides: Guides) -> _Loop:
    """The student in training mode with its optimizer and schedule, prepared by accelerate; the teacher on
    the device, frozen; the masks on the device and applied."""
    if cfg.gradient_checkpointing:
        student.config.use_cache = False
        student.activation_checkpointing_enable()  # non-reentrant (transformers' default) ...
        student.disable_input_require_grads()  # ... which needs no grad on the embedding's output (a frozen one)
    student.train()
    prefix, share = 0, None
    if cfg.freeze_prefix and teacher is not None:
        prefix = prefix_length(student, teacher)
        if prefix:
            freeze_prefix(student, prefix)
            if guides.cache is None and not cfg.loss.hidden and cfg.loss.teacher_logits:  # the teacher runs online
                share = TeacherInput(teacher, prefix)
    trainable = [p for p in student.parameters() if p.requires_grad]
    # fused: one kernel per tensor, without the whole-tensor temporaries of the loop version (two of the embedding's
    # size at once: 1.3 GB for Gemma 3's), the same steps to float rounding (1e-7 relative over 20 steps, tested)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=_fused_adamw(acc.device))
    # a minutes budget (steps None) starts on the default horizon; _steps sets it from the first step's time
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, cfg.steps or DEFAULT_STEPS))
    student, optimizer = acc.prepare(student, optimizer)
    acc.register_for_checkpointing(scheduler)
    in_file = 0
    if teacher is not None:
        teacher.to(acc.device).eval().requires_grad_(False)
        if acc.mixed_precision in AUTOCAST_DTYPES:  # it runs under autocast only: fewer bytes, the same products
            # what trains stays as it is; a frozen tensor the student shares (shared_embedding.py) is read the same way
            dtype, shared = AUTOCAST_DTYPES[acc.mixed_precision], [p for p in student.parameters() if p.requires_grad]
            frozen_linears_as(teacher, dtype, keep=shared)
            if table_in_file(teacher, dtype, keep=shared):
                in_file = MU.tensor_bytes([teacher.get_input_embeddings().weight])
    if guides.masks:
        guides = replace(guides, masks={k: v.to(acc.device) for k, v in guides.masks.items()})
        apply_masks(acc.unwrap_model(student), guides.masks)
    raw = acc.unwrap_model(student)
    vocab = raw.get_output_embeddings().weight.shape[0]
    itemsize = 4 if acc.mixed_precision == "no" else 2  # the products' dtype: float32, or bf16/fp16 under autocast
    rows = (chunk_rows(vocab, cfg.head_chunk_mb), group_rows(vocab, cfg.head_chunk_mb, itemsize))
    return _Loop(acc, student, teacher, optimizer, scheduler, windows, cfg, seed, guides, prefix, share, rows,
                 tuple(head_parameters(raw)), teacher_in_file=in_file)


def _trims_in_backward(model: nn.Module) -> list:
    """Hooks that hand the heap's free pages back to the system as the backward leaves each decoder layer: the
    gradients it keeps and the recomputed activations it drops come from the same heap (inside heap_reuse), and
    without a trim the freed pages between the gradients stay resident (demo: ~0.4 GiB at the end of a backward)."""

    def on_input(_layer: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = layer_input(args, kwargs)
        if torch.is_grad_enabled() and hidden.requires_grad:
            hidden.register_hook(lambda grad: release_free_heap() and None)

    return [layer.register_forward_pre_hook(on_input, with_kwargs=True)
            for layer in get_module(model, arch_for(model).layers)]


def _fused_adamw(device: torch.device) -> bool | None:
    return True if device.type in ("cpu", "cuda") else None


def _steps(loop: _Loop, history: History, eval_windows: torch.Tensor, ckpt: Path, progress: Progress) -> None:
    """Optimizer steps until cfg.steps or the minutes budget; held-out perplexity every eval_every steps."""
    cfg, acc = loop.cfg, loop.acc
    raw = acc.unwrap_model(loop.student)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * loop.windows.shape[1] * acc.num_processes
    budget = cfg.train_minutes * 60.0 if cfg.train_minutes else None  # seconds of optimizer steps
    last = cfg.steps  # None: until the minutes budget ends
    # heap_reuse: the CLI keeps glibc's mmap threshold at 1 MB (memory.py), so every activation buffer of a step
    # above 1 MB would be a fresh mmap whose pages fault in again; on the demo (batch 4 x 512) that was a third
    # of the step's CPU time in the kernel: 59 -> 73 tokens/s with it, the same losses
    with progress.task("distill", last) as bar, heap_reuse():
        bar.advance(history.step)
        while (last is None or history.step < last) and (budget is None or history.seconds < budget):
            t0 = time.perf_counter()
            loss, terms = _optimizer_step(loop, history.step)
            history.step += 1
            history.loss.append(loss)
            history.terms.append(terms)
            history.tokens += tokens_per_step
            history.seconds += time.perf_counter() - t0
            if budget is not None and history.step == 1:  # the schedule's horizon: the steps the budget allows
                horizon = max(cfg.warmup_steps + 1, int(budget / max(history.seconds, 1e-9)))
                loop.scheduler.lr_lambdas[0] = lr_lambda(cfg.warmup_steps,
                                                         horizon if last is None else min(horizon, last))
            done = history.step == last or (budget is not None and history.seconds >= budget)
            if history.step % cfg.eval_every == 0 or done:
                history.ppl.append((history.step, perplexity(raw, eval_windows, acc.device)))
            if cfg.save_every and history.step % cfg.save_every == 0 and not done:
                _save(acc, ckpt, history)
            bar.advance(1, loss=loss, tok_s=round(history.tokens / max(history.seconds, 1e-9)),
                        ppl=history.ppl[-1][1])


def _optimizer_step(loop: _Loop, step: int) -> tuple[float, dict[str, float]]:
    """cfg.grad_accum micro-batches, one AdamW step; masked weights stay zero. Returns the mean loss."""
    acc, cfg, student, windows = loop.acc, loop.cfg, loop.student, loop.windows
    masks, raw = loop.guides.masks, acc.unwrap_model(student)
    total, terms_sum = 0.0, {}
    for a in range(cfg.grad_accum):
        micro = step * cfg.grad_accum + a
        idx = batch_indices(micro, len(windows), cfg.batch_size, loop.seed, acc.process_index, acc.num_processes)
        ids = windows[idx].to(acc.device)  # (B, T)
        sync = acc.no_sync(student) if a < cfg.grad_accum - 1 else nullcontext()
        with sync:
            loss, terms = _micro_loss(loop, raw, ids, idx)
        total += loss / cfg.grad_accum
        for k, v in terms.items():
            terms_sum[k] = terms_sum.get(k, 0.0) + v / cfg.grad_accum
    if masks:
        mask_grads(raw, masks)
    acc.clip_grad_norm_(student.parameters(), 1.0)
    loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    if masks:
        apply_masks(raw, masks)
    return total, terms_sum


def _micro_loss(loop: _Loop, raw: nn.Module, ids: torch.Tensor, idx: torch.Tensor) -> tuple[float, dict[str, float]]:
    """One micro-batch ids (B, T): the teacher's final hidden states, the student's forward up to its head, the
    logit losses chunk by chunk (chunked_head.py), the hidden-state losses, backward. Returns (loss, terms)."""
    acc, cfg = loop.acc, loop.cfg
    release_free_heap()  # the heap's free pages, left by the step before (heap_reuse keeps them), back to the system
    teacher_logits, t_hidden = _teacher_side(loop, ids, idx)
    start = starting_at(raw, loop.prefix, loop.share.take()) if loop.share is not None else nullcontext()
    with acc.autocast(), start:
        saved = SavedForBackward(raw.parameters()) if not loop.memory else nullcontext()
        with head_bypassed(raw) as handoff, saved:  # through the (maybe DDP-wrapped) student: its forward, not its head
            s_out = loop.student(ids, output_hidden_states=loop.hidden)
        if not loop.memory:
            loop.memory["activations"] = saved.bytes
        release_free_heap()  # ... and those the decoders' forwards left, before the head's chunks
        head = raw.get_output_embeddings()
        job = ChunkJob(None, head, teacher_logits, next_tokens(ids), cfg.loss, cfg.temperature, *loop.rows)
        loss = torch.zeros((), device=acc.device)
        if cfg.loss.teacher_logits or cfg.loss.ce > 0:
            dtype = products_dtype(acc.device, head.weight.dtype)
            cast = weight_as(loop.teacher.get_output_embeddings(), dtype) if loop.teacher is not None else nullcontext()
            with own_head(raw) as job.head, cast:
                loss = chunked_logit_loss(job, handoff.hidden)
        hidden = hidden_terms(cfg.loss, s_out.hidden_states, t_hidden, loop.guides.layer_map)
        del s_out, handoff
        loss = loss + sum(getattr(cfg.loss, name) * value for name, value in hidden.items())
        acc.backward(loss / cfg.grad_accum)
    release_free_heap()  # what the backward freed, before the gradients meet the optimizer's state
    return float(loss.detach()), {**job.terms, **{k: float(v.detach()) for k, v in hidden.items()}}


def _teacher_side(loop: _Loop, ids: torch.Tensor, idx: torch.Tensor):
    """(the teacher's logits for positions [start, stop) of the micro-batch's B·T, its hidden states or None):
    logits from its head over its final hidden states, one chunk at a time, or from the top-k cache."""
    acc, cfg, cache, teacher = loop.acc, loop.cfg, loop.guides.cache, loop.teacher
    t_final, t_hidden = None, None
    if (loop.hidden or cfg.loss.teacher_logits) and (cache is None or loop.hidden):  # the teacher runs online
        with torch.no_grad(), acc.autocast():
            t_out = decoder_of(teacher)(input_ids=ids, output_hidden_states=loop.hidden, use_cache=False)
        t_final, t_hidden = t_out.last_hidden_state.flatten(0, 1), t_out.hidden_states  # (B·T, d)
    if cfg.loss.teacher_logits and cache is not None:  # from the top-k cache: (B·T, k) each
        top = cache.get(idx, acc.device)
        values, indices = top.values.flatten(0, 1), top.indices.flatten(0, 1)
        return (lambda a, b: SparseLogits(values[a:b], indices[a:b])), t_hidden
    if not cfg.loss.teacher_logits:
        return (lambda a, b: None), t_hidden

    def dense(a: int, b: int) -> torch.Tensor:  # (b - a, V), under the autocast of the student's chunk
        with torch.no_grad(), own_head(teacher) as head:
            return head(t_final[a:b].unsqueeze(0))[0]

    return dense, t_hidden


def _memory(loop: _Loop, raw: nn.Module) -> dict[str, int]:
    """Bytes of what the run held (memory_use.py): models, gradients, optimizer state, the first micro-batch's
    activations, the head's chunk and gradients; the process's peak so far."""
    head = raw.get_output_embeddings().weight
    n_pos = loop.cfg.batch_size * loop.windows.shape[1]
    cache = loop.guides.cache
    return {"teacher": MU.model_bytes(loop.teacher) - loop.teacher_in_file, "teacher_in_file": loop.teacher_in_file,
            "student": MU.model_bytes(raw, besides=loop.teacher),
            "gradients": MU.tensor_bytes(p for p in raw.parameters() if p.requires_grad),
            "optimizer": MU.optimizer_bytes(loop.optimizer), "activations": loop.memory.get("activations", 0),
            "head": MU.head_bytes((min(loop.rows[0], n_pos), min(loop.rows[1], n_pos)), head.shape, n_pos,
                                  bool(loop.head_params), 4 if loop.acc.mixed_precision == "no" else 2,
                                  _casts_teacher_head(loop.teacher)),
            "head_rows": min(loop.rows[0], n_pos), "head_group_rows": min(loop.rows[1], n_pos),
            "topk_cache": MU.tensor_bytes([cache.values, cache.indices]) if cache is not None else 0,
            "peak_rss": MU.peak_rss_bytes()}


def _casts_teacher_head(teacher: nn.Module | None) -> bool:
    """Whether a step casts the teacher's head weight for the products (a float32 one; not when frozen_teacher.py
    holds it in the products' dtype already)."""
    head = teacher.get_output_embeddings() if teacher is not None else None
    return head is not None and head.weight.dtype == torch.float32


def _shared_path(acc, path: Path) -> Path:
    """Rank 0's checkpoint folder, used by every process (each rank's pipeline has its own OUT)."""
    if acc.num_processes == 1:
        return path
    from accelerate.utils import broadcast_object_list

    return Path(broadcast_object_list([str(path)])[0])


def _save(acc, ckpt: Path, history: History) -> None:
    tmp = ckpt.with_name(CKPT + ".tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # before the other ranks write their RNG states into it (they raced rank 0's mkdir)
    acc.wait_for_everyone()
    acc.save_state(str(tmp), safe_serialization=False)
    if acc.is_main_process:
        (tmp / "history.json").write_text(json.dumps(asdict(history)))
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)
    acc.wait_for_everyone()
