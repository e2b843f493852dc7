"""The run's plan: what a run will do, decided once, before any weight is read, from the recipe and MODEL's
config.json (issues #34, #36, #60).

MODEL is resolved here, once: its local folder (`models.loading.local_dir`), its config.json, and the model's
skeleton built from it with every parameter on the meta device (`models.lazy.skeleton`: no weight read, a
second where a load of the model costs 10 s for 270M, 55 s from a GGUF, minutes for a big one). The plan says,
in this order (the recipe, then the model, then the machine):
- that OUT may be written: it is not, holds or points to an input that the run reads (`--force` never deletes
  one), and exists only with `--force` (`host.output.check_output_path`);
- whole model or layers: a model in which the trace finds no decoder layers (`core.trace.find_layers`) runs
  its one stage on the whole model in memory (whole_model.py), or is refused in one line, naming what is
  missing and what still works;
- what each stage's method found on the skeleton (`engine.contract.Plan`: a b-bit stage's targets with its
  group size "auto" made a number, the shapes checked against the group and the format, an N:M pattern
  against the pruned linears, a student's layers against the teacher's); each stage opens with its entry;
- streamed or in memory: `--stream` yes (or one line saying why not), `--no-stream` no, neither: when the
  recipe can stream and the model's float32 weights do not fit (`host.memory.too_big`, the one rule);
- the fingerprint a resumed run must match, and the inputs that `--force` must never delete;
- the torch threads (`RunOptions.threads` "auto": the recipe's `threads:`, else those of the interrupted run
  this one resumes, else the free cores: `host.threads.choose_threads`).
A MODEL without a local config.json (a hub id, a .gguf file) is checked when it has loaded; a model handed in
(`loaded`) is judged as it is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geminicompress.core.arch import arch_for
from geminicompress.core.errors import InputError
from geminicompress.core.trace import find_layers
from geminicompress.engine.contract import Plan
from geminicompress.host.memory import too_big
from geminicompress.host.output import check_output_path, resume_threads
from geminicompress.host.threads import ThreadChoice, choose_threads
from geminicompress.models.headers import is_streamable_dir, read_config, weights_bytes
from geminicompress.models.lazy import skeleton
from geminicompress.models.loading import LoadedModel, local_dir
from geminicompress.runtime.methods import method_of
from geminicompress.runtime.options import RunOptions
from geminicompress.runtime.recipes.inputs import recipe_inputs
from geminicompress.runtime.recipes.schema import Recipe

WORKS = "global magnitude pruning, rtn and int8 (and w8a8 with --smoothquant-alpha 0) run on the whole model in memory"


@dataclass(frozen=True)
class RunPlan:
    """What the run does, decided before any weight is read.

    whole_model: the one stage that runs on the whole model (no decoder layers), else None. stream_from: the
    folder a streamed run reads one decoder layer at a time, else None (in memory). stages: what each stage's
    method found on the skeleton. fingerprint, inputs: what OUT's folder is opened with (host/output.py).
    threads: the torch thread count the run uses (host/threads.py), None: the caller's own."""

    whole_model: Any | None
    stream_from: Path | None
    stages: Plan
    fingerprint: str
    inputs: list[tuple[str, str]]
    threads: ThreadChoice | None


def plan_run(recipe: Recipe, out: Path, opts: RunOptions, loaded: LoadedModel | None = None,
             may_stream: bool = True) -> RunPlan:
    """The plan of `recipe` writing `out` (an InputError, before any weight is read, for what cannot run).
    `opts`: how the run goes (its force, stream, threads and recipe file are read here). `loaded`: a model
    handed in, judged as it is (nothing streams). `may_stream`: False for a helper process of a multi-process
    launch (it trains along in memory)."""
    # first what the recipe alone says: OUT may be written (never an input), the fingerprint, what compresses
    key, inputs = fingerprint(recipe), recipe_inputs(recipe, opts.recipe_file)
    check_output_path(out, opts.force, inputs)
    compresses = [s for s in recipe.stages if method_of(s).kind != "eval"]
    # then MODEL, read once: its folder, its config.json, its skeleton (no weight read)
    model_dir = local_dir(recipe.model) if loaded is None else None
    config = read_config(model_dir) if model_dir is not None else None
    model = loaded.model if loaded is not None else None  # the model judged: the one handed in, else the skeleton
    if loaded is None and config is not None and compresses:
        model = skeleton(model_dir, recipe.trust_remote_code)
    whole, stages, stream_from = None, Plan(), None
    if compresses and model is not None and not _has_layers(model):
        whole = whole_model_stage(recipe, opts.stream, getattr(model.config, "model_type", None) or "?")
    else:
        stages = preflight(recipe, config, model) if loaded is None else Plan()
        stream_from = _stream_from(recipe, opts.stream, model_dir if may_stream else None, config)
    if loaded is None and whole is None and stream_from is None:  # what a stage cannot do with MODEL, before it loads
        for stage in recipe.stages:
            method_of(stage).before_load(stage, recipe.model)
    # last the machine: the threads, once the run is known to go ahead
    threads = None if opts.threads is None else choose_threads(
        None if opts.threads == "auto" else opts.threads, recipe.threads, resume_threads(out, key))
    return RunPlan(whole, stream_from, stages, key, inputs, threads)


def _stream_from(recipe: Recipe, stream: bool | None, model_dir: Path | None, config: dict | None) -> Path | None:
    """The folder a streamed run reads one layer at a time, or None: the run is in memory. `config`: the
    folder's config.json, as the plan read it."""
    source = model_dir if model_dir is not None and is_streamable_dir(model_dir, config) else None
    return source if source is not None and should_stream(recipe, stream, source) else None


def _has_layers(model: Any) -> bool:
    try:
        find_layers(model)
    except InputError:
        return False
    return True


def whole_model_stage(recipe: Recipe, stream: bool | None, model_type: str) -> Any:
    """The one stage the whole-model fallback runs; an InputError (before any work) for what it cannot."""
    stages = [s for s in recipe.stages if method_of(s).kind != "eval"]
    if stream:
        raise InputError(f"--stream: MODEL {recipe.model} ('{model_type}') has no decoder layers to read one at a "
                         f"time; run it without --stream: {WORKS}")
    where = f"MODEL {recipe.model} ('{model_type}') has no decoder layers"
    for stage in stages:
        why = method_of(stage).needs_layers(stage, where)
        if why:
            raise InputError(f"{why}; {WORKS}")
    if len(stages) != 1 or len(recipe.stages) != 1:
        raise InputError(f"{where}: the whole-model fallback runs one compression stage and no eval stage; run "
                         "`geminicompress eval` on OUT")
    why = method_of(stages[0]).whole_model_refusal(stages[0], where)
    if why:
        raise InputError(why)
    return stages[0]


def preflight(recipe: Recipe, config: dict[str, Any] | None, model: Any) -> Plan:
    """Each stage's method checks config.json, then the skeleton `model` (None: nothing to check before
    loading); returns what the methods found (empty when nothing was checked)."""
    plan = Plan()
    if config is None:
        return plan
    for stage in recipe.stages:
        method_of(stage).check_config(stage, config)
    stages = [s for s in recipe.stages if method_of(s).kind == "layers"]
    if stages:
        arch = arch_for(model)
        for stage in stages:
            plan.record(stage, method_of(stage).preflight(stage, model, arch))
    return plan


def not_streamable(recipe: Recipe, source_dir: Path | None) -> str | None:
    """Why the recipe cannot run one decoder layer at a time from disk, or None when it can."""
    if source_dir is None:
        return f"MODEL {recipe.model} is not a local dense safetensors directory"
    layers = [s for s in recipe.stages if method_of(s).kind != "eval"]
    for k, stage in enumerate(layers):
        why = method_of(stage).cannot_stream(stage, k == 0)
        if why:
            return f"stage {k}: {why}"
    if sum(method_of(s).quantizes for s in layers) > 1:
        return "more than one quantize stage"
    if len({s.data or recipe.calibration.data for s in layers if method_of(s).calibrates(s)}) > 1:
        return "the calibrated stages name different DATA; a streamed run calibrates them all in one pass per layer"
    return None


def should_stream(recipe: Recipe, stream: bool | None, source_dir: Path | None) -> bool:
    """--stream: yes (or a one-line error saying why it cannot); --no-stream: no; neither: when the recipe
    can stream and the model's float32 weights do not fit (memory.too_big: the one rule)."""
    if stream is False:
        return False
    reason = not_streamable(recipe, source_dir)
    if stream and reason:
        raise InputError(f"--stream: {reason}")
    if reason:
        return False
    return bool(stream) or too_big(weights_bytes(source_dir))


def fingerprint(recipe: Recipe) -> str:
    """Identifies a run for resuming: the resolved recipe, minus the `resume` switch itself and the thread
    count (neither changes what is computed)."""
    data = recipe.model_dump(mode="json")
    data.pop("threads", None)
    for stage in data["stages"]:
        stage.pop("resume", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
