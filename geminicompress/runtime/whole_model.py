"""The whole-model fallback (issue #36): what needs no structure runs on any model whose linears we can name.

Every layer-by-layer method walks decoder layers (engine/walk.py). When the trace finds none (no list of
repeated blocks holding linears: `core.trace.find_layers`), three methods still need nothing but the linear
weights and run here, on the whole model in memory:
- global magnitude pruning: one threshold over every targeted linear's |w| (`compress/prune/whole_model.py`);
- RTN b-bit: each weight rounded alone (`compress/rtn/whole_model.py`);
- INT8 weight-only (`int8`), and `w8a8` without SmoothQuant: each linear swapped for its INT8 module
  (`compress/int8/whole_model.py`).
Each method says what it needs of decoder layers and what it refuses on the whole model (`Method.needs_layers`,
`whole_model_refusal`) and runs its own pass (`Method.whole_model`); this module checks the recipe, loads the
model, writes OUT and checks it.
This is the exception to "the decoder layer is the unit of work" (STYLE 14): there is no layer to be the
unit, so memory follows the model. One info line says so. Everything else refuses in one line (exit 2,
before loading), naming what is missing and what still works: a streamed run (nothing to read one layer at a
time), GPTQ/AWQ/Wanda/SparseGPT (each decoder layer's inputs; AWQ and SmoothQuant also the norm → linear
feeds they fold scales into), distillation.

OUT is written with the formats' public pieces (`pack_gptq`, `pack_ct`, the quantization configs, the sparse
bitmask's tensors), in the same formats the layer walk writes, and checked the same way: loaded back by our
loader and its logits compared with the in-process model's on the probe windows (`verify.compare`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from geminicompress import __version__
from geminicompress.core.errors import InputError
from geminicompress.core.trace import find_layers
from geminicompress.engine.verify import as_stored, compare, loaded_logits, model_logits, probe_windows, stored_dtype
from geminicompress.formats.checkpoint import WEIGHTS, write_config
from geminicompress.host.machine import machine, versions
from geminicompress.host.output import OutputDir, check_output_path, write_json
from geminicompress.host.progress import NullProgress, Progress
from geminicompress.models.lazy import skeleton
from geminicompress.models.loading import LoadedModel, load_model, local_dir
from geminicompress.runtime.methods import method_of
from geminicompress.runtime.recipes.inputs import recipe_inputs
from geminicompress.runtime.recipes.loader import recipe_yaml
from geminicompress.runtime.recipes.schema import Recipe, stage_tag

WORKS = "global magnitude pruning, rtn and int8 (and w8a8 with --smoothquant-alpha 0) run on the whole model in memory"


def without_layers(recipe: Recipe, loaded: LoadedModel | None) -> bool:
    """Whether the recipe's MODEL has no decoder layers the trace can find (a local directory is judged from its
    config.json alone, no weight read); False when there is nothing to judge before loading (a hub id, a GGUF)."""
    if not any(method_of(s).kind != "eval" for s in recipe.stages):
        return False
    if loaded is not None:
        model = loaded.model
    else:
        path = local_dir(recipe.model)
        if path is None or not (path / "config.json").is_file():
            return False
        model = skeleton(path, recipe.trust_remote_code)
    try:
        find_layers(model)
    except InputError:
        return True
    return False


def check_recipe(recipe: Recipe, stream: bool | None) -> Any:
    """The one stage the fallback runs; an InputError (before any work) for what it cannot."""
    stages = [s for s in recipe.stages if method_of(s).kind != "eval"]
    model_type = _model_type(recipe)
    if stream:
        raise InputError(f"--stream: MODEL {recipe.model} ('{model_type}') has no decoder layers to read one at a time; "
                         f"run it without --stream: {WORKS}")
    where = f"MODEL {recipe.model} ('{model_type}') has no decoder layers"
    for stage in stages:
        why = method_of(stage).needs_layers(stage, where)
        if why:
            raise InputError(f"{why}; {WORKS}")
    if len(stages) != 1 or len(recipe.stages) != 1:
        raise InputError(f"{where}: the whole-model fallback runs one compression stage and no eval stage; run "
                         "`geminicompress eval` on OUT")
    stage = stages[0]
    why = method_of(stage).whole_model_refusal(stage, where)
    if why:
        raise InputError(why)
    return stage


def run_whole_model(recipe: Recipe, out: Path, *, force: bool = False, progress: Progress | None = None,
                    command: list[str] | None = None, loaded: LoadedModel | None = None, stream: bool | None = None,
                    verify: bool = True) -> dict:
    """The recipe's one stage on the whole model in memory, OUT written and checked; returns the report."""
    progress = progress or NullProgress()
    stage = check_recipe(recipe, stream)
    inputs = recipe_inputs(recipe)
    check_output_path(out, force, inputs)  # before the model loads
    started = time.perf_counter()
    if loaded is None:
        progress.info(f"loading {recipe.model}")
        loaded = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code, allow_pickle=recipe.allow_pickle,
                            allow_nonfinite=recipe.allow_nonfinite)
    model = loaded.model
    method = method_of(stage)
    what = method.whole_model_label or method.name
    progress.info(f"'{_model_type(recipe, model)}': no decoder layers found; {what} runs on the whole model in memory")
    dtype = getattr(torch, recipe.output.dtype)
    with OutputDir(out, force, inputs=inputs) as tmp:
        t0 = time.perf_counter()
        written = method.whole_model(model, stage, dtype, progress)
        seconds = time.perf_counter() - t0
        windows = probe_windows(loaded.tokenizer, model.config.vocab_size)
        reference = None
        if verify:  # the in-process model as stored, before it is freed
            as_stored(model, dtype, written.exact)
            reference = model_logits(model, windows)
        tensors = written.tensors()
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        del tensors
        write_config(model, tmp, written.qconfig, dtype)
        if written.extra is not None:
            written.extra(tmp, written.qconfig)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp)
        export: dict[str, Any] = {"format": written.format, "whole_model": True, "dtype": recipe.output.dtype,
                                  "seconds": round(seconds, 3), "device": "cpu"}
        if reference is not None:
            progress.info("verifying: loading OUT back in memory")
            got = loaded_logits(tmp, windows, recipe.trust_remote_code, streamed=False)
            export["verified"] = compare(reference, got, stored_dtype(tmp), "in-memory")
        report = {"geminicompress": __version__, "command": command or [], "model": recipe.model, "output": str(out),
                  "total_seconds": round(time.perf_counter() - started, 3), "export": export,
                  "stages": [{"index": 0, "stage": stage_tag(stage), "options": stage.model_dump(mode="json"),
                              "seconds": round(seconds, 3), "result": written.summary}],
                  "versions": versions(), "machine": machine()}
        write_json(tmp / "report.json", report)
        (tmp / "recipe.yaml").write_text(recipe_yaml(recipe, dtype))
    return report


def _model_type(recipe: Recipe, model: nn.Module | None = None) -> str:
    if model is not None:
        return getattr(model.config, "model_type", "?")
    path = local_dir(recipe.model)
    try:
        return json.loads((path / "config.json").read_text()).get("model_type", "?") if path is not None else "?"
    except (OSError, ValueError):
        return "?"
