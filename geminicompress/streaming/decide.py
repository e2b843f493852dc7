"""Whether a recipe streams: the model must be a local dense safetensors directory and every stage one
that runs per layer (`not_streamable` says which does not); automatic when the weights are big."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geminicompress.errors import InputError
from geminicompress.models.lazy import available_memory, is_streamable_dir, weights_bytes
from geminicompress.models.loading import resolve_model
from geminicompress.recipes.schema import Recipe

AUTO_FRACTION = 0.5  # stream automatically when the float32 weights exceed this share of available memory


def source_dir(recipe: Recipe) -> Path | None:
    """The local safetensors directory MODEL names (the demo's converted copy included), else None."""
    source = resolve_model(recipe.model)
    if source.kind == "demo":
        from geminicompress.models.loading import _demo_dir

        return _demo_dir()
    return source.path if source.kind == "dir" and is_streamable_dir(source.path) else None


def not_streamable(recipe: Recipe) -> str | None:
    """Why the recipe cannot be streamed, or None when it can."""
    if source_dir(recipe) is None:
        return f"MODEL {recipe.model} is not a local dense safetensors directory"
    for k, stage in enumerate(recipe.stages):
        why = _stage_not_streamable(stage, first=k == 0)
        if why:
            return f"stage {k}: {why}"
    if sum(s.type == "quantize" for s in recipe.stages) > 1:
        return "more than one quantize stage"
    if len({s.data or recipe.calibration.data for s in recipe.stages if calibrated(s)}) > 1:
        return "the calibrated stages name different DATA; a streamed run calibrates them all in one pass per layer"
    return None


def _stage_not_streamable(stage: Any, first: bool) -> str | None:
    method = getattr(stage, "method", None)
    if stage.type == "prune":
        if stage.allocation in ("owl", "sensitivity"):
            return (f"prune --allocation {stage.allocation} needs a whole-model pass before pruning and is not "
                    "streamed; run it with --no-stream")
        if stage.method == "magnitude" and stage.scope == "global" and stage.pattern is None and not first:
            return "global magnitude pruning streams only as the first stage"
        return None
    if stage.type == "quantize" and method == "gptq":
        if stage.allocation is not None or stage.overrides:
            return "gptq with an allocation or overrides (mixed precision) is not streamed yet; run it with --no-stream"
        return None
    if stage.type == "quantize" and method in ("int8", "w8a8", "awq", "awq+gptq", "rtn"):
        return None
    return f"{stage.type} {method or ''} is not streamed yet".rstrip()


def calibrated(stage: Any) -> bool:
    """Whether the stage needs the layers' inputs on calibration windows."""
    if stage.type == "prune":
        return stage.method in ("wanda", "sparsegpt")
    if stage.method in ("int8", "w8a8"):
        return stage.smoothquant_alpha is not None
    return stage.method in ("gptq", "awq", "awq+gptq")


def calibration_data(recipe: Recipe) -> str:
    """The DATA every calibrated stage of a streamed recipe calibrates on (one, `not_streamable` checks)."""
    return next((s.data for s in recipe.stages if calibrated(s) and s.data), recipe.calibration.data)


def should_stream(recipe: Recipe, stream: bool | None) -> bool:
    """--stream: yes (or a one-line error saying why it cannot); --no-stream: no; neither: when the
    recipe can stream and the model's float32 weights exceed AUTO_FRACTION of available memory."""
    if stream is False:
        return False
    reason = not_streamable(recipe)
    if stream and reason:
        raise InputError(f"--stream: {reason}")
    if reason:
        return False
    return bool(stream) or weights_bytes(source_dir(recipe)) > AUTO_FRACTION * available_memory()
