"""Run a recipe: its stages through the one engine (engine/), OUT written atomically, verified, evaluated.

command -> pipeline -> engine -> stage's per-layer function -> solver. Layer stages (quantize methods,
prune) are their method classes' layer stages (methods.py) run one decoder layer at a time; a model stage (distill)
is a function `run(cfg, ctx) -> dict` on the model in memory; eval stages come last. What the run does is
decided first, once, before any weight is read (plan.py: the checks, in memory or streamed, layers or the whole
model); a model without decoder layers runs its one stage on the whole model in memory (whole_model.py).

In memory: the model is loaded; every layer stage walks it (in order, model stages between), and a last
walk writes OUT. Streamed (`--stream`, or automatically when the model does not fit, memory.too_big): the
checkpoint is read one layer at a time and one walk applies every stage to layer i and writes it before
layer i+1 is read (stages.py). Both write OUT with the same sink and writers, in the format of the last
stage that sets one, into the hidden partial folder (output.py); OUT is verified on the way out (a probe
carried through the layers as written, compared with OUT loaded back: verify.py); eval stages then load it
back from disk and compare it with the recipe's input model, so what is measured is exactly what ships;
report.json; rename onto OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from geminicompress import __version__
from geminicompress.data.windows import prefix_note, text_prefix, vocab_of
from geminicompress.host.diskerrors import disk_errno, disk_error
from geminicompress.engine.contract import StageContext
from geminicompress.engine.estimate import announce, check_disk_in_memory
from geminicompress.engine.export import check_gguf, finish_export, open_export, outside_head, writing_stage
from geminicompress.engine.walk import ModelLayers
from geminicompress.core.errors import InputError
from geminicompress.host.machine import machine, versions
from geminicompress.host.memory import out_of_the_mapping
from geminicompress.runtime.methods import method_of
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.models.loading import (
    LoadedModel,
    load_model,
    load_tokenizer,
    resolve_model,
    unused_warning,
)
from geminicompress.host.output import STATE_DIR, THREADS_FILE, OutputDir, final_name, partial_dir, write_json
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.host.threads import apply_threads
from geminicompress.runtime.recipes.loader import recipe_yaml
from geminicompress.runtime.recipes.schema import Recipe, stage_tag
from geminicompress.runtime.options import RunOptions
from geminicompress.runtime.plan import plan_run
from geminicompress.runtime.stages import make_stage, run_stage, walk
from geminicompress.runtime.whole_model import run_whole_model


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_recipe(recipe: Recipe, out: Path, options: RunOptions | None = None, *,
               loaded: LoadedModel | None = None) -> dict:
    """Run every stage of `recipe` and write OUT; return the report (also written to OUT/report.json).

    options: how the run goes (`RunOptions`; None: its defaults). loaded: a model already in memory,
    run as it is (the stages change it). A disk that refuses a write of OUT (full, read-only, no permission)
    is one line (diskerrors.py)."""
    opts = options if options is not None else RunOptions()
    try:
        return _run_recipe(recipe, out, opts, loaded)
    except Exception as exc:
        if isinstance(exc, InputError) or disk_errno(exc) is None:  # an InputError: already said, before the work
            raise
        raise disk_error(exc, str(partial_dir(out)), partial=partial_dir(out)) from exc


def _run_recipe(recipe: Recipe, out: Path, opts: RunOptions, loaded: LoadedModel | None) -> dict:
    progress = opts.progress or NullProgress()
    device = opts.device or default_device()
    force = opts.force
    helper = _helper_rank()
    plan = plan_run(recipe, out, opts, loaded, may_stream=not helper)  # before any weight is read (plan.py)
    if plan.threads is not None:
        apply_threads(plan.threads.threads)
    started = time.perf_counter()
    if helper:  # another process of `accelerate launch`/torchrun: it trains along, rank 0 writes OUT
        out, force = out.with_name(f".{out.name}.rank{helper}"), True
    with OutputDir(out, force, plan.fingerprint, plan.inputs) as tmp:
        threads = _record_threads(tmp, progress)
        t0 = time.perf_counter()
        ctx = (_open_streamed(recipe, plan.stream_from, tmp, progress, device) if plan.stream_from else
               _open_in_memory(recipe, loaded, tmp, progress, device, layers=plan.whole_model is None))
        ctx.plan = plan.stages
        load_s = time.perf_counter() - t0
        if plan.whole_model is not None:  # no decoder layers to walk: its one stage on the whole model
            seconds, summary, export = run_whole_model(ctx, plan.whole_model, tmp, opts.verify)
            results = [_result(0, plan.whole_model, seconds, summary)]
        else:
            results, export = _run_stages(ctx, tmp, opts, streamed=plan.stream_from is not None,
                                          owned=loaded is None)
        found = ctx.layers.ckpt.nonfinite if plan.stream_from else (ctx.input_nonfinite or [])
        report = {"geminicompress": __version__, "command": opts.command or sys.argv, "model": recipe.model,
                  "output": str(out), "load_seconds": round(load_s, 3), "threads": threads,
                  **({"threads_chosen": plan.threads.reason} if plan.threads is not None else {}),
                  "frame": recipe.frame, "window_prefix": _window_prefix(ctx.tokenizer, recipe.frame, vocab_of(ctx.model)),
                  **({"input_nonfinite": found} if found else {}),
                  "total_seconds": round(time.perf_counter() - started, 3), "export": export, "stages": results,
                  "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe, ctx.out_dtype))
    if helper:
        shutil.rmtree(out, ignore_errors=True)
    return report


def _run_stages(ctx: StageContext, tmp: Path, opts: RunOptions, streamed: bool, owned: bool) -> tuple[list, dict]:
    """The layer and model stages (in memory or streamed), OUT written, then the eval stages on OUT."""
    check_gguf(ctx)
    stages = ctx.recipe.stages
    layers = [s for s in stages if method_of(s).kind != "eval"]
    if streamed:
        results, export = _streamed(ctx, layers, tmp, opts.verify, opts.max_shard_bytes)
    else:
        results, export = _in_memory(ctx, layers, tmp, opts, owned=owned)
    for i, stage in enumerate(stages):
        if method_of(stage).kind == "eval":  # after OUT is written: it loads OUT back from disk
            t0 = _start(ctx, tmp, i, stage)
            summary = method_of(stage).run(stage, ctx)
            results.append(_result(i, stage, time.perf_counter() - t0, summary))
    return results, export


def _window_prefix(tokenizer, frame: str, vocab: int | None) -> dict | str:
    """What report.json says of how the run's windows start (data/windows.py); a run that built none (RTN,
    INT8) and whose tokenizer cannot frame a text says why instead."""
    try:
        return prefix_note(tokenizer, text_prefix(tokenizer, frame, vocab))
    except InputError as exc:
        return str(exc)


def _record_threads(tmp: Path, progress: Progress) -> int:
    """The torch thread count, kept with the resume state (a resumed run takes it: commands/common.py)."""
    path = tmp / STATE_DIR / THREADS_FILE
    threads = torch.get_num_threads()
    if path.is_file():
        was = json.loads(path.read_text())["threads"]
        if was != threads:
            progress.warn(f"resuming with {threads} torch threads where the interrupted run had {was}: the resumed "
                          "layers may differ from an uninterrupted run's in the last bits")
    write_json(path, {"threads": threads})
    return threads


def _helper_rank() -> int:
    """This process's rank when it is not the main process of a multi-process launch, else 0."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _open_in_memory(recipe: Recipe, loaded: LoadedModel | None, tmp: Path, progress: Progress,
                    device: torch.device, layers: bool = True) -> StageContext:
    if loaded is None:  # a first distill stage may read its teacher, the recipe's model, layer by layer
        first = recipe.stages[0]  # a recipe has at least one stage
        loaded = method_of(first).streamed_input(first, recipe, progress)
    if loaded is None:
        progress.info(f"loading {recipe.model}")
        loaded = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code, allow_pickle=recipe.allow_pickle,
                            allow_nonfinite=recipe.allow_nonfinite)
    if loaded.unused:
        progress.warn(unused_warning(recipe.model, loaded.unused))
    torch.manual_seed(recipe.seed)
    return StageContext(loaded.model, loaded.tokenizer, loaded.source, recipe, progress, device, tmp, tmp,
                        out_dtype=getattr(torch, recipe.output.dtype), input_nonfinite=loaded.nonfinite,
                        layers=ModelLayers(loaded.model) if layers and loaded.model is not None else None)


def _open_streamed(recipe: Recipe, path: Path, tmp: Path, progress: Progress, device: torch.device) -> StageContext:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ckpt = LazyCheckpoint(path, trust_remote_code=recipe.trust_remote_code, allow_nonfinite=recipe.allow_nonfinite)
    if ckpt.unused:
        progress.warn(unused_warning(recipe.model, ckpt.unused))
    # OUT's float dtype: the recipe's `output.dtype` when given; else, unlike in memory (float32), the input's own
    out_dtype = getattr(torch, recipe.output.dtype) if "dtype" in recipe.output.model_fields_set else ckpt.dtype
    ctx = StageContext(ckpt.model, load_tokenizer(str(path), recipe.trust_remote_code), resolve_model(recipe.model),
                       recipe, progress, device, tmp, tmp / "state" / "stream", out_dtype=out_dtype,
                       source_dtype=ckpt.dtype, streamed=True, layers=LazyLayers(ckpt, None))
    ctx.state_dir.mkdir(parents=True, exist_ok=True)
    return ctx


def _result(i: int, stage: Any, seconds: float, summary: dict) -> dict:
    return {"index": i, "stage": stage_tag(stage), "options": stage.model_dump(mode="json"),
            "seconds": round(seconds, 3), "result": summary}


def _in_memory(ctx: StageContext, stages: list[Any], tmp: Path, opts: RunOptions,
               owned: bool = True) -> tuple[list, dict]:
    """Each stage on the model in memory (a layer stage walks it), then the walk that writes OUT. `owned`: the
    run loaded the model itself, so once OUT holds its layers (and the probe has been through them) their
    weights and the stage's kept codes are freed before OUT is loaded back for the check: on the demo's 4-bit
    GPTQ that check was the peak, with the model and OUT both in float32 (1.88 GiB). A caller's model is left
    as the stages made it."""
    # before the work: OUT's estimated size against the free disk
    check_disk_in_memory(ctx, any(method_of(s).quantizes for s in stages), opts.max_shard_bytes)
    results: list[dict] = []
    owner: tuple[Any, dict, dict] | None = None  # (the stage whose format OUT takes, its result, its kept tensors)
    for i, stage in enumerate(stages):
        t0 = _start(ctx, tmp, i, stage)
        method = method_of(stage)
        if method.kind == "model":
            summary = method.run(stage, ctx)
            ctx.layers = ModelLayers(ctx.model)  # a distilled student replaces the model
        else:
            layer_stage, summary, kept = run_stage(stage, ctx, last=owned and i == len(stages) - 1)
            if layer_stage.writer() is not None:
                owner = (layer_stage, summary, kept)
        results.append(_result(i, stage, time.perf_counter() - t0, summary))
    ctx.state_dir = tmp / "state" / "out"
    ctx.state_dir.mkdir(parents=True, exist_ok=True)
    writer_stage, result, kept = owner or (None, {}, {})
    export = open_export(ctx, [writer_stage] if writer_stage is not None else [], opts.verify, opts.max_shard_bytes,
                         kept=kept)
    ctx.progress.info(f"writing {final_name(tmp)}")
    walked = walk(ctx, [], export.sink, "writing")
    if owned:
        kept.clear()
        for layer in ctx.layers.layers:
            for param in layer.parameters():
                param.data = torch.empty(0, dtype=param.dtype)
        out_of_the_mapping(ctx.model)
    return results, finish_export(ctx, tmp, export, result, walked.seconds)


def _streamed(ctx: StageContext, stages: list[Any], tmp: Path, verify: bool, max_shard: int) -> tuple[list, dict]:
    """Every stage applied to layer i, and layer i written, before layer i+1 is read."""
    layer_stages = [make_stage(s, ctx) for s in stages]
    need = announce(ctx, layer_stages, max_shard)  # estimated memory and disk; refuses when the disk is short
    export = open_export(ctx, layer_stages, verify, max_shard)  # the probe before any layer is read
    walked = walk(ctx, layer_stages, export.sink, "streamed layers")
    results = [_result(k, stage, walked.seconds, s.summary(walked.summaries[k], walked.done(k, ctx)))
               for k, (stage, s) in enumerate(zip(stages, layer_stages))]
    owner = writing_stage(layer_stages)
    out = finish_export(ctx, tmp, export, results[owner]["result"] if owner is not None else {}, walked.seconds,
                        head=outside_head(layer_stages) if layer_stages else None)
    out.update(streamed=True, estimated=need)
    if ctx.device.type == "cuda":
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return results, out


def _start(ctx: StageContext, tmp: Path, i: int, stage: Any) -> float:
    """Stage i's own state folder (its resume state) and its info line; returns its start time."""
    ctx.state_dir = tmp / "state" / f"{i}-{stage.type}"
    ctx.state_dir.mkdir(parents=True, exist_ok=True)
    ctx.progress.info(f"stage {i}: {stage_tag(stage)}")
    return time.perf_counter()
