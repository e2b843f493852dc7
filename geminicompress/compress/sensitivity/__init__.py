"""Per-module sensitivity tables (measure.py), their options (options.py) and heat-map (plot.py)."""

from __future__ import annotations

from typing import Any

PRUNE_LEVELS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def prune_table(ctx: Any, cfg: Any, targets: dict) -> dict[str, Any]:
    """A proxy sensitivity table for a prune stage's method at PRUNE_LEVELS (allocation: sensitivity
    without a table file), on the stage's calibration windows."""
    from geminicompress.compress.sensitivity.measure import measure_sensitivity
    from geminicompress.compress.sensitivity.options import parse_options

    options = parse_options(",".join(f"{cfg.method}:{s}" for s in PRUNE_LEVELS))
    keep = {n.removesuffix(".weight") for n in targets}
    return measure_sensitivity(ctx.model, ctx.calibration(cfg.data), options, keep=keep, measure="proxy", kl_windows=1,
                               device=ctx.device, progress=ctx.progress, seed=ctx.recipe.seed)
