"""Run a recipe: load the model once, pass it through the stages in memory, write OUT atomically.

command -> pipeline -> stage -> solver. A stage is a function `run(cfg, ctx) -> dict`: it transforms
`ctx.model` in place (or replaces it), may set `ctx.exporter` to write its on-disk format, and returns
a small JSON-able summary that goes into report.json. Stages are found through an explicit table.

Order of work: non-eval stages -> export OUT (into the hidden partial folder), verified: loaded back, it
gives the in-process model's logits on probe windows (verify.py) -> eval stages, which load the written
checkpoint back from disk and compare it with the recipe's input model, so what is measured is exactly
what ships -> report.json -> rename onto OUT.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from geminicompress import __version__
from geminicompress.data.windows import calibration_windows
from geminicompress.machine import machine, versions
from geminicompress.methods import METHODS
from geminicompress.models.loading import LoadedModel, ModelSource, load_model
from geminicompress.output import OutputDir, write_json
from geminicompress.progress import NullProgress, Progress
from geminicompress.recipes.loader import recipe_yaml
from geminicompress.recipes.schema import Recipe, stage_tag

STAGES: dict[str, str] = {
    **{f"quantize:{name}": m.runner for name, m in METHODS.items()},
    "prune": "geminicompress.compress.prune.stage:run",
    "distill": "geminicompress.distill.stage:run",
    "eval": "geminicompress.eval.stage:run",
}

Exporter = Callable[[Any, Any, Path], dict]


@dataclass
class StageContext:
    """What a stage can see and change. `model`/`tokenizer` flow from stage to stage."""

    model: Any
    tokenizer: Any
    source: ModelSource
    recipe: Recipe
    progress: Progress
    device: torch.device
    out_dir: Path  # the (partial) output folder; stages may add artifacts next to the weights
    state_dir: Path  # this stage's private folder for resumable state; removed on success
    exporter: Exporter | None = None
    masks: dict[str, torch.Tensor] | None = None  # set by prune, honoured by distill
    artifacts: dict[str, Any] = field(default_factory=dict)
    _calibration: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def calibration(self, data: str | None = None, samples: int | None = None, seq_len: int | None = None) -> torch.Tensor:
        """Seeded calibration windows (n, seq_len) from the stage's DATA or the recipe's default."""
        cal = self.recipe.calibration
        key = (data or cal.data, samples or cal.samples, seq_len or cal.seq_len, self.recipe.seed)
        if key not in self._calibration:
            self._calibration[key] = calibration_windows(self.tokenizer, key[0], key[1], key[2], key[3], cal.text_column)
        return self._calibration[key]


def stage_runner(tag: str) -> Callable[[Any, StageContext], dict]:
    module_name, func = STAGES[tag].split(":")
    return getattr(importlib.import_module(module_name), func)


def fingerprint(recipe: Recipe) -> str:
    """Identifies a run for resuming: the resolved recipe, minus the `resume` switch itself and the thread
    count (neither changes what is computed)."""
    data = recipe.model_dump(mode="json")
    data.pop("threads", None)
    for stage in data["stages"]:
        stage.pop("resume", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dense_exporter(dtype: str) -> Exporter:
    from geminicompress.formats import dense

    return lambda model, tokenizer, out: dense.write(model, tokenizer, out, meta={"dtype": dtype})


def run_recipe(
    recipe: Recipe,
    out: Path,
    *,
    force: bool = False,
    progress: Progress | None = None,
    device: torch.device | None = None,
    command: list[str] | None = None,
    loaded: LoadedModel | None = None,
    stream: bool | None = None,
    verify: bool = True,
) -> dict:
    """Run every stage of `recipe` and write OUT; return the report (also written to OUT/report.json).

    stream: run layer by layer from disk (streaming/): True, False, or None to decide from the model's
    size and whether every stage can stream.
    verify: load OUT back and compare its logits with the in-process model's before keeping it (verify.py)."""
    progress = progress or NullProgress()
    device = device or default_device()
    if loaded is None and not _helper_rank():
        from geminicompress.streaming import run_streamed, should_stream

        if should_stream(recipe, stream):
            return run_streamed(recipe, out, force=force, progress=progress, device=device, command=command,
                                verify=verify)
    tags = [stage_tag(s) for s in recipe.stages]
    runners = [stage_runner(t) for t in tags]  # fail before loading anything if a stage is missing
    if loaded is None:  # a first distill stage may read its teacher, the recipe's model, layer by layer
        from geminicompress.distill.streamed_teacher import streamed_input

        loaded = streamed_input(recipe, progress)
    torch.manual_seed(recipe.seed)
    started = time.perf_counter()
    helper = _helper_rank()
    if helper:  # another process of `accelerate launch`/torchrun: it trains along, rank 0 writes OUT
        out, force = out.with_name(f".{out.name}.rank{helper}"), True
    with OutputDir(out, force, fingerprint(recipe)) as tmp:
        t0 = time.perf_counter()
        if loaded is None:
            progress.info(f"loading {recipe.model}")
            loaded = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code, allow_pickle=recipe.allow_pickle)
        load_s = time.perf_counter() - t0
        ctx = StageContext(loaded.model, loaded.tokenizer, loaded.source, recipe, progress, device, tmp, tmp)
        results: list[dict] = []
        exported = None
        for i, (stage, tag, run) in enumerate(zip(recipe.stages, tags, runners)):
            if stage.type == "eval" and exported is None:
                exported = _export(ctx, recipe, tmp, progress, verify)
            ctx.state_dir = tmp / "state" / f"{i}-{stage.type}"
            ctx.state_dir.mkdir(parents=True, exist_ok=True)
            progress.info(f"stage {i}: {tag}")
            t0 = time.perf_counter()
            summary = run(stage, ctx)
            results.append({"index": i, "stage": tag, "options": stage.model_dump(mode="json"),
                            "seconds": round(time.perf_counter() - t0, 3), "result": summary})
        if exported is None:
            exported = _export(ctx, recipe, tmp, progress, verify)
        report = {
            "geminicompress": __version__,
            "command": command or sys.argv,
            "model": recipe.model,
            "output": str(out),
            "load_seconds": round(load_s, 3),
            "total_seconds": round(time.perf_counter() - started, 3),
            "export": exported,
            "stages": results,
            "versions": versions(),
            "machine": machine(),
        }
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe))
    if helper:
        shutil.rmtree(out, ignore_errors=True)
    return report


def _helper_rank() -> int:
    """This process's rank when it is not the main process of a multi-process launch, else 0."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _export(ctx: StageContext, recipe: Recipe, tmp: Path, progress: Progress, verify: bool = True) -> dict:
    from geminicompress.verify import Probe

    probe = Probe(ctx.model, ctx.tokenizer) if verify else None  # before export: exporters may cast the model
    progress.info(f"writing {tmp.name.removeprefix('.').removesuffix('.partial')}")
    t0 = time.perf_counter()
    exporter = ctx.exporter or dense_exporter(recipe.output.dtype)
    info = exporter(ctx.model, ctx.tokenizer, tmp)
    info["seconds"] = round(time.perf_counter() - t0, 3)
    if probe is not None:
        info["verified"] = probe.check(tmp, ctx.model, trust_remote_code=recipe.trust_remote_code, progress=progress)
    return info
