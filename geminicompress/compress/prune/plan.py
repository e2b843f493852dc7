"""The per-linear sparsity map of a prune stage (`allocation: owl | sensitivity`), before any pruning.

- owl: one observe-only walk layer by layer over the calibration windows through the *dense* model
  (as the OWL reference does; it streams like any walk), collecting each group's input norms ‖X_j‖₂; the outlier ratio of every
  decoder layer from its Wanda scores; layer sparsities by `allocate.owl_layer_sparsity`.
- sensitivity: a knapsack (compress/allocation.py) over a sensitivity table's `<method>:<sparsity>`
  options (measured first when no table file is given: that pass needs the model in memory): least total predicted drift with the kept weights ≤ (1 − S) · total.
Both end in whole pruned counts per linear summing exactly to round(S · total) (`allocate.exact_counts`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from geminicompress.compress.allocation import allocate
from geminicompress.compress.prune.allocate import exact_counts, outlier_ratio, owl_layer_sparsity
from geminicompress.compress.prune.wanda import InputNorms, wanda_scores
from geminicompress.compress.sensitivity.measure import measure_sensitivity, read_table, SensitivitySettings
from geminicompress.compress.sensitivity.options import parse_options
from geminicompress.compress.targets import present_groups
from geminicompress.core.arch import Arch
from geminicompress.engine.layers import LayerJob
from geminicompress.engine.walk import WalkOptions, run_layerwise
from geminicompress.core.errors import InputError


def layer_of(name: str, arch: Arch) -> int:
    return int(name.removeprefix(arch.layers + ".").split(".", 1)[0])


def owl_map(ctx: Any, cfg: Any, arch: Arch, targets: dict[str, nn.Linear]) -> tuple[dict[str, float], dict]:
    """Sparsity per linear from the outlier ratio D_l of every decoder layer (dense model, calibration windows)."""

    @torch.no_grad()
    def observe(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        prefix = f"{job.arch.layers}.{job.index}"
        groups = present_groups(job.arch, lambda n: f"{prefix}.{n}.weight" in targets)
        norms = {g[0]: InputNorms(job.module(g[0]).in_features, job.device) for g in groups}
        job.forward({job.module(g[0]): (lambda x, y, acc=norms[g[0]]: acc.add_batch(x)) for g in groups})
        scores = [wanda_scores(job.module(n).weight, norms[g[0]].norms()) for g in groups for n in g]
        return {"outlier_ratio": outlier_ratio(scores, cfg.owl_threshold) if scores else 0.0}, {}

    # an observe-only walk over the dense model (in memory, or read from disk layer by layer in float32)
    walked = run_layerwise(ctx.layers.reading_in(torch.float32), ctx.calibration(cfg.data), observe,
                           WalkOptions(device=ctx.device, progress=ctx.progress, state_dir=None,
                                       description="owl outliers"))
    ratios = [s["outlier_ratio"] for s in walked.summaries]
    layers = sorted({layer_of(n, arch) for n in targets})
    params = [sum(t.weight.numel() for n, t in targets.items() if layer_of(n, arch) == i) for i in layers]
    per_layer = dict(zip(layers, owl_layer_sparsity([ratios[i] for i in layers], params, cfg.sparsity, cfg.owl_lambda)))
    return ({n: per_layer[layer_of(n, arch)] for n in targets},
            {"owl_outlier_ratio": [round(r, 6) for r in ratios], "owl_layer_sparsity": [round(per_layer[i], 6) for i in layers]})


def sensitivity_map(table: dict[str, Any], method: str, targets: dict[str, nn.Linear],
                    target: float) -> tuple[dict[str, float], dict]:
    """Knapsack over the table's `<method>:<s>` columns (plus s = 0, drift 0) for total sparsity `target`."""
    cols = [(i, float(o.split(":", 1)[1])) for i, o in enumerate(table["options"])
            if o.split(":", 1)[0] == method]
    if not cols:
        raise InputError(f"the sensitivity table has no '{method}:<sparsity>' option "
                         f"(it has {', '.join(table['options'])}); measure one with --options {method}:0.5,...")
    units = table["units"]
    by_module = {m: u for u in units for m in u["modules"]}
    missing = [n for n in targets if n.removesuffix(".weight") not in by_module]
    if missing:
        raise InputError(f"the sensitivity table does not cover {missing[0]} (a table of another model?)")
    levels = [0.0] + [s for _, s in cols]
    unit_list = [u for u in units if any(f"{m}.weight" in targets for m in u["modules"])]
    cost = np.array([[u["params"] * (1 - s) for s in levels] for u in unit_list])
    drift = np.array([[0.0] + [u["drift"][i] for i, _ in cols] for u in unit_list])
    total = float(sum(u["params"] for u in unit_list))
    a = allocate(cost, drift, (1 - target) * total)
    chosen = {m: levels[c] for u, c in zip(unit_list, a.choice) for m in u["modules"]}
    return ({n: chosen[n.removesuffix(".weight")] for n in targets},
            {"predicted_drift": round(a.drift, 6), "sensitivity_levels": levels})


PRUNE_LEVELS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def prune_table(ctx: Any, cfg: Any, targets: dict) -> dict[str, Any]:
    """A proxy sensitivity table for a prune stage's method at PRUNE_LEVELS (allocation: sensitivity
    without a table file), on the stage's calibration windows."""
    options = parse_options(",".join(f"{cfg.method}:{s}" for s in PRUNE_LEVELS))
    keep = {n.removesuffix(".weight") for n in targets}
    return measure_sensitivity(ctx.model, ctx.calibration(cfg.data), options, SensitivitySettings(keep=keep,
                                                                                                  measure="proxy",
                                                                                                  kl_windows=1,
                                                                                                  device=ctx.device,
                                                                                                  progress=ctx.progress,
                                                                                                  seed=ctx.recipe.seed))


def module_counts(cfg: Any, ctx: Any, arch: Arch, targets: dict[str, nn.Linear]) -> tuple[dict[str, int] | None, dict]:
    """Whole pruned counts per linear for owl/sensitivity allocations (None: the stage's own uniform/global)."""
    if cfg.allocation == "owl":
        sparsity, extra = owl_map(ctx, cfg, arch, targets)
    elif cfg.allocation == "sensitivity":
        table = prune_table(ctx, cfg, targets) if cfg.sensitivity is None else read_table(cfg.sensitivity)
        sparsity, extra = sensitivity_map(table, cfg.method, targets, cfg.sparsity)
    else:
        return None, {}
    params = {n: t.weight.numel() for n, t in targets.items()}
    return exact_counts(params, sparsity, cfg.sparsity), {"allocation": cfg.allocation, **extra}
