"""The `distill` stage: choose teacher and student, read the training text, train, hand the student on.

Who is who (the pipeline passes one model in memory, `ctx.model`):
- `student`, `student_layers` or `student_config` given: the teacher is `ctx.model` (or `teacher`), the
  student is loaded / derived / built from it;
- none given, and an earlier stage changed the model (prune -> distill): the student is `ctx.model`
  and the teacher is the recipe's input model, loaded fresh (or `teacher`);
- none given and distill comes first: a student with half the teacher's layers.
A teacher bigger than memory is read one decoder layer at a time for its top-k cache and never loaded
whole (streamed_teacher.py; `ctx.model` is None when the pipeline left the teacher on disk for us).
The student replaces `ctx.model`/`ctx.tokenizer` for the following stages and the export. A pruned
student (masks from `ctx.masks` or `prune_masks.safetensors`) keeps its zeros; with `reconstruct` its
pruned linears are first refit to the teacher's, layer by layer, on calibration windows (reconstruct.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from geminicompress.data import pack_windows, read_text, text_prefix, tokenize, vocab_of
from geminicompress.data.restyle import restyle
from geminicompress.distill import masks as M
from geminicompress.distill import streamed_teacher as ST
from geminicompress.distill.cut import CutSpec, planned_student
from geminicompress.distill.latency_target import keep_for_latency
from geminicompress.distill.plot import plot_curve
from geminicompress.distill.reconstruct import check_same_shape, reconstruct
from geminicompress.distill.repair import RepairSpec
from geminicompress.distill.student import (
    boundary_mapped,
    check_student_layers,
    check_tokenizers,
    derive_student,
    evenly_mapped,
    n_params,
    remembered_kept,
    student_from_config,
)
from geminicompress.distill.survey import check_walk_memory
from geminicompress.distill.synthetic import prefix_len, teacher_samples
from geminicompress.distill.shared_embedding import own_input_embedding, share_input_embedding
from geminicompress.distill.topk_cache import build_topk_cache
from geminicompress.distill.train import Guides, TrainRun, train
from geminicompress.core.errors import InputError
from geminicompress.formats.masks import read_masks, write_masks
from geminicompress.host.memory import heap_reuse
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.models.loading import load_model, load_tokenizer
from geminicompress.distill.config import DistillStage

CURVE = "distill_curve.png"
PLAN = "plan.json"


@dataclass
class Pair:
    teacher: Any
    student: Any
    tokenizer: Any
    kept: list[int] | None  # teacher layers the student copied, when derived
    masks: dict[str, torch.Tensor] | None
    how: str
    lazy: LazyCheckpoint | None = None  # the streamed teacher's checkpoint (`teacher` is its skeleton)
    plan: dict[str, Any] | None = None  # plan.json of a student cut by measurement and repaired (cut.py)


def run(cfg: DistillStage, ctx) -> dict:
    pair = choose_models(cfg, ctx)
    if cfg.reconstruct:
        check_same_shape(pair.student, pair.teacher)
        if not pair.masks:
            raise InputError("reconstruct refits a pruned student, and this student has no masks and no pruned zeros: "
                             "prune it first (a prune stage before distill), or drop reconstruct")
    t_params, s_params = n_params(pair.teacher), n_params(pair.student)
    if s_params >= t_params and not pair.masks:  # a pruned student is smaller by its zeros
        ctx.progress.warn(f"the student ({s_params / 1e6:.1f}M parameters) is not smaller than the teacher "
                          f"({t_params / 1e6:.1f}M): distilling anyway")
    summary: dict[str, Any] = {"how": pair.how, "teacher_params": t_params, "student_params": s_params,
                               "student_layers": pair.student.config.num_hidden_layers, "kept_layers": pair.kept}
    if pair.plan is not None:
        (ctx.out_dir / PLAN).write_text(json.dumps(pair.plan, indent=1))
        summary.update(plan=PLAN, predicted_drift=pair.plan["predicted_drift"], repair=pair.plan["repair"]["mode"])
    if not cfg.trains:  # a budget of 0: the cut (and repaired) student is the result
        ctx.model, ctx.tokenizer = pair.student.to("cpu").eval(), pair.tokenizer
        return {**summary, "steps": 0, "tokens": 0}
    if cfg.train_tokens is not None:
        per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
        cfg = cfg.model_copy(update={"steps": max(1, math.ceil(cfg.train_tokens / per_step))})
    layer_map = _layer_map(cfg, pair)
    train_w, eval_w = training_windows(cfg, ctx, pair.tokenizer)
    rebuilt = _reconstruct(cfg, ctx, pair) if cfg.reconstruct else None
    if pair.lazy is not None:  # one streamed pass: the cache and the held-out perplexity
        cache, teacher_ppl = ST.build_streamed_topk_cache(pair.lazy, train_w, eval_w, cfg.topk_cache, ctx.device,
                                                          work_dir=ctx.state_dir, progress=ctx.progress)
    else:
        cache = build_topk_cache(pair.teacher, train_w, cfg.topk_cache, ctx.device, cfg.batch_size,
                                 progress=ctx.progress) if cfg.topk_cache else None
        teacher_ppl = _teacher_ppl(pair.teacher, eval_w, ctx.device)
    ctx.progress.info(f"distilling {pair.how}: teacher {t_params / 1e6:.1f}M -> student {s_params / 1e6:.1f}M "
                      f"parameters, {len(train_w)} training windows of {cfg.seq_len}")
    shared = not cfg.train_embedding and share_input_embedding(pair.student, pair.teacher,
                                                                 pair.kept is not None and cfg.student is None)
    student, history = train(pair.student, None if cache and not layer_map else pair.teacher, train_w, eval_w, cfg,
                             TrainRun(ctx.recipe.seed, ctx.state_dir, ctx.device, ctx.progress),
                             Guides(layer_map, pair.masks, cache))
    if shared:
        own_input_embedding(student)
    student = student.to("cpu")
    ctx.model, ctx.tokenizer = student, pair.tokenizer
    if pair.masks:
        ctx.masks = {k: v.cpu() for k, v in pair.masks.items()}
        write_masks(ctx.masks, ctx.out_dir)
        summary["sparsity"] = round(M.sparsity(student, ctx.masks), 6)
    plot_curve(history.loss, history.ppl, ctx.out_dir / CURVE, f"distill: {pair.how}")
    steps = max(1, len(history.loss))
    return {**summary, "steps": history.step, "tokens": history.tokens, "train_seconds": round(history.seconds, 3),
            "tokens_per_s": round(history.tokens / max(history.seconds, 1e-9), 1),
            "embedding": "frozen, the teacher's" if shared else "trained",
            "frozen_prefix": history.frozen_prefix, "shared_prefix": history.shared_prefix,
            "precision": history.precision, "precision_why": history.precision_why, "memory": history.memory,
            "loss_first": history.loss[0] if history.loss else None, "loss_last": history.loss[-1] if history.loss else None,
            "loss_curve": history.loss[:: max(1, steps // 200)], "ppl_curve": history.ppl,
            "teacher_ppl": teacher_ppl, "layer_map": layer_map, "reconstruct": rebuilt, "topk_cache": str(cache.path) if cache else None,
            "topk_cache_reused": cache.reused if cache else None, "teacher_streamed": pair.lazy is not None,
            "curve_png": CURVE}


def choose_models(cfg: DistillStage, ctx) -> Pair:
    """Teacher, student, tokenizer and masks following the rules in the module docstring."""
    explicit = any(getattr(cfg, k) is not None for k in ("student", "student_layers", "student_config", "target_latency"))
    first = next((i for i, s in enumerate(ctx.recipe.stages) if s is cfg), 0) == 0
    if not explicit and not first:
        spec = cfg.teacher or ctx.recipe.model
        ctx.progress.info(f"loading the teacher {spec} for the model of the previous stages")
        teacher, tokenizer, lazy = _teacher(spec, cfg, ctx)
        check_tokenizers(tokenizer, ctx.tokenizer, teacher, ctx.model, "(the pipeline's model)")
        return Pair(teacher, ctx.model, ctx.tokenizer, None, _masks(ctx.model, ctx.masks), "previous stages' model",
                    lazy)
    if cfg.teacher:
        teacher, tokenizer, lazy = _teacher(cfg.teacher, cfg, ctx)
    elif ctx.model is None:  # the pipeline left the recipe's model on disk: it streams (ST.streamed_input)
        lazy = ST.open_teacher(ctx.recipe.model, ctx.recipe.trust_remote_code, ctx.recipe.allow_nonfinite)
        teacher, tokenizer = lazy.model, ctx.tokenizer
    else:
        teacher, tokenizer, lazy = ctx.model, ctx.tokenizer, None
    if cfg.student is not None:
        loaded = _load(cfg.student, ctx)
        check_tokenizers(tokenizer, loaded.tokenizer, teacher, loaded.model, cfg.student)
        local = loaded.source.path if loaded.source.path and loaded.source.kind == "dir" else None
        masks = read_masks(local) if local is not None else None
        kept = remembered_kept(local, teacher, loaded.model)  # a student distill cut earlier: its layer map
        return Pair(teacher, loaded.model, loaded.tokenizer, kept, _masks(loaded.model, masks),
                    f"the student loaded from {cfg.student}", lazy)
    if cfg.student_config is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.student_config)
        student, kept = student_from_config(teacher, config, lazy)
        return Pair(teacher, student, tokenizer, kept, None, f"a student built from {cfg.student_config}", lazy)
    if cfg.student_layers is not None:  # a recipe's, checked here on the loaded teacher (the command checked it before)
        check_student_layers(teacher.config.num_hidden_layers, cfg.student_layers, cfg.mlp_ratio)
    spec, target = cfg.student_layers if cfg.student_layers is not None else 0.5, None
    if cfg.target_latency is not None:  # the layer count from the parameter share read per token
        spec, ratio = keep_for_latency(teacher, cfg.target_latency)
        target = {"target": cfg.target_latency, "keep": spec, "predicted_ratio": ratio, "basis": "parameter share"}
        ctx.progress.info(f"--target-latency {cfg.target_latency:g}x: {spec} of {teacher.config.num_hidden_layers} "
                          f"layers (predicted {ratio:.3f}x of the teacher's weights read per token)")
    derive, repair_mode = cfg.derive or ("even" if lazy else "measured"), cfg.repair or ("none" if lazy else "down_proj")
    how = f"into {{}} of {teacher.config.num_hidden_layers} layers"
    if lazy is None and (derive == "measured" or repair_mode != "none"):
        student, kept, plan = _planned(cfg, ctx, teacher, spec, derive, repair_mode)
        if target is not None:
            plan["target_latency"] = target
        return Pair(teacher, student, tokenizer, kept, None, how.format(len(kept)), lazy, plan)
    if lazy is not None and (derive == "measured" or repair_mode != "none" or cfg.repair_synthetic):
        raise InputError("derive: measured, repair and repair_synthetic need the teacher in memory, and this one "
                         "streams: use --derive even --repair none, or --no-teacher-stream")
    student, kept = derive_student(teacher, spec, cfg.mlp_ratio, lazy)
    return Pair(teacher, student, tokenizer, kept, None, how.format(len(kept)), lazy)


def _planned(cfg: DistillStage, ctx, teacher, spec, derive: str, repair_mode: str):
    """plan -> cut -> repair (cut.planned_student) on the stage's calibration windows."""
    windows = ctx.calibration(cfg.data, samples=cfg.repair_windows + cfg.plan_held_windows)
    if cfg.plan_data:  # the held-out windows from the text the student will serve (same count, same seed)
        held = ctx.calibration(cfg.plan_data, samples=cfg.plan_held_windows, seq_len=windows.shape[1])
        windows = torch.cat([windows[: cfg.repair_windows], held])
    rspec = RepairSpec(repair_mode, cfg.repair_objective, cfg.repair_ridge, cfg.repair_follow)
    fit_windows = cfg.repair_windows + cfg.repair_synthetic
    check_walk_memory(teacher, fit_windows + cfg.plan_held_windows, windows.shape[1])
    if cfg.repair_synthetic:  # the teacher's own continuations join the fit windows, never the held-out ones
        ctx.progress.info(f"the teacher writes {cfg.repair_synthetic} more repair windows, continuing the first "
                          f"{prefix_len(windows.shape[1])} tokens of the calibration windows by sampling")
        sampled = teacher_samples(teacher, windows[: cfg.repair_windows], cfg.repair_synthetic, seed=ctx.recipe.seed,
                                  progress=ctx.progress)
        windows = torch.cat([windows[: cfg.repair_windows], sampled, windows[cfg.repair_windows:]])
    ctx.progress.info(f"cutting by {derive} derivation with {repair_mode} repair on {cfg.repair_windows} + "
                      f"{cfg.plan_held_windows} calibration windows of {windows.shape[1]} tokens"
                      + (f" and {cfg.repair_synthetic} sampled ones" if cfg.repair_synthetic else "")
                      + (f" (held-out ones from {cfg.plan_data})" if cfg.plan_data else ""))
    cut = CutSpec(derive, rspec, fit_windows, cfg.plan_shortlist, cfg.mlp_ratio, cfg.plan_search,
                  cfg.plan_greedy_pool)
    with heap_reuse():  # the walk's and the repair's activation buffers reused, not faulted in again (memory.py)
        student, kept, plan = planned_student(teacher, spec, windows, cut, device=ctx.device, progress=ctx.progress)
    plan["held_data"] = cfg.plan_data or cfg.data or ctx.recipe.calibration.data
    plan["repair_synthetic"] = cfg.repair_synthetic  # of the fit windows, these many the teacher wrote
    ctx.progress.info(f"kept teacher layers {kept}; drift on the held-out calibration windows "
                      f"{plan['student_drift']:+.1%} (teacher {plan['teacher_ppl']:.2f} -> student {plan['student_ppl']:.2f})")
    return student, kept, plan


def _teacher(spec: str, cfg: DistillStage, ctx) -> tuple[Any, Any, LazyCheckpoint | None]:
    """(model, tokenizer, lazy checkpoint) of the teacher `spec`: loaded, or opened to stream when it
    does not fit (the model is then its skeleton on the meta device)."""
    if ST.streams(cfg, spec, ctx.progress):
        lazy = ST.open_teacher(spec, ctx.recipe.trust_remote_code, ctx.recipe.allow_nonfinite)
        return lazy.model, load_tokenizer(str(lazy.path), ctx.recipe.trust_remote_code), lazy
    loaded = _load(spec, ctx)
    return loaded.model, loaded.tokenizer, None


def training_windows(cfg: DistillStage, ctx, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed windows (n, seq_len) of DATA: the last `eval_windows` are the held-out split."""
    data = cfg.data or ctx.recipe.calibration.data
    ids = tokenize(tokenizer, read_text(data, ctx.recipe.calibration.text_column))
    prefix = text_prefix(tokenizer, ctx.recipe.frame, vocab_of(ctx.model))
    windows = pack_windows(ids, cfg.seq_len, prefix=prefix)
    if len(windows) < cfg.eval_windows + 1:
        raise InputError(f"{data} gives {len(windows)} windows of {cfg.seq_len} tokens; distillation needs at least "
                         f"{cfg.eval_windows + 1} (eval_windows + 1): use more text or a shorter seq_len")
    train, held = windows[: -cfg.eval_windows], windows[-cfg.eval_windows :]
    if cfg.restyle:
        train = restyled_windows(tokenizer, train, cfg.restyle, ctx.recipe.seed, ctx.progress, prefix)
    needed = cfg.steps * cfg.batch_size * cfg.grad_accum if cfg.steps else 0  # minutes: not known
    if len(train) < needed:
        epochs = math.ceil(needed / len(train))
        ctx.progress.info(f"{data} gives {len(train)} training windows; {cfg.steps} steps read them about {epochs} times")
    return train, held


def restyled_windows(tokenizer, windows: torch.Tensor, share: float, seed: int, progress,
                     prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """The training windows' text (after their `prefix`), `share` of it restyled (data/restyle.py), packed and
    framed again: the held-out windows come after these in DATA and are never part of the text restyled."""
    body = windows[:, len(prefix):]
    text = tokenizer.decode(body.reshape(-1).tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    styled, count, total = restyle(text, share, seed)
    out = pack_windows(tokenize(tokenizer, styled), windows.shape[1], prefix=prefix)
    progress.info(f"restyled {count} of {total} stretches of the training text: {len(windows)} -> "
                  f"{len(out)} windows")
    return out


def _reconstruct(cfg: DistillStage, ctx, pair: Pair) -> dict[str, Any]:
    """The layer-wise refit of a pruned student to its teacher (reconstruct.py) on calibration windows."""
    windows = ctx.calibration(cfg.data)
    state = ctx.state_dir / "reconstruct"
    state.mkdir(parents=True, exist_ok=True)
    summary = reconstruct(pair.student, pair.teacher, windows, pair.masks, device=ctx.device, progress=ctx.progress,
                          state_dir=state)
    last = summary["layers"][-1]
    ctx.progress.info(f"reconstructed {len(summary['layers'])} layers on {summary['windows']} windows in "
                      f"{summary['seconds']:.0f} s (last layer's output error {last['error_before']:.3g} -> "
                      f"{last['error_after']:.3g} of its norm)")
    return summary


def _load(spec: str, ctx):
    return load_model(spec, trust_remote_code=ctx.recipe.trust_remote_code, allow_pickle=ctx.recipe.allow_pickle,
                      allow_nonfinite=ctx.recipe.allow_nonfinite)


def _masks(model, masks):
    masks = masks or M.masks_from_zeros(model)  # none given: from its exact zeros (None: not pruned)
    return M.check_masks(model, masks) if masks else None


def _layer_map(cfg: DistillStage, pair: Pair) -> dict[int, int] | None:
    if not cfg.loss.hidden:
        return None
    n_s, n_t = pair.student.config.num_hidden_layers, pair.teacher.config.num_hidden_layers
    if cfg.layer_map:
        bad = [(s, t) for s, t in cfg.layer_map.items() if not (0 <= s < n_s and 0 <= t < n_t)]
        if bad:
            raise InputError(f"layer_map {bad[0][0]}: {bad[0][1]} is out of range (student 0..{n_s - 1}, teacher 0..{n_t - 1})")
        return dict(cfg.layer_map)
    if pair.kept:
        return boundary_mapped(pair.kept, n_t)
    return evenly_mapped(n_s, n_t)


def _teacher_ppl(teacher, eval_windows: torch.Tensor, device: torch.device) -> float:
    from geminicompress.eval.quality.perplexity import perplexity

    teacher.to(device)
    return round(perplexity(teacher, eval_windows, device), 4)
