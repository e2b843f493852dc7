"""Whether a recipe streams: the model must be a local dense safetensors directory and every stage one
that runs per layer (`not_streamable` says which does not); automatic when the weights are big."""

from __future__ import annotations

from pathlib import Path

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
        if stage.type == "prune":
            if stage.method != "magnitude":
                return f"stage {k}: prune --method {stage.method} is not streamed yet (magnitude is)"
            if stage.scope == "global" and stage.pattern is None and k != 0:
                return f"stage {k}: global magnitude pruning streams only as the first stage"
            if stage.format != "dense":
                return f"stage {k}: prune --format {stage.format} is not streamed yet (dense is)"
        elif stage.type == "quantize" and getattr(stage, "method", None) in ("int8", "w8a8"):
            if stage.smoothquant_alpha is not None:
                return f"stage {k}: SmoothQuant calibration is not streamed yet"
        elif stage.type == "quantize" and getattr(stage, "method", None) == "gptq":
            if stage.format not in ("gptq", "dense"):
                return f"stage {k}: gptq --format {stage.format} is not streamed yet (gptq and dense are)"
        else:
            return f"stage {k}: {stage.type} {getattr(stage, 'method', '')} is not streamed yet".rstrip()
    if sum(s.type == "quantize" for s in recipe.stages) > 1:
        return "more than one quantize stage"
    return None


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
