"""Per-module quantization specs of a GPTQ stage: a budgeted allocation over a sensitivity table, then
explicit `overrides`. The budget is one of: average stored bits per weight (scales and zero points
included, as the gptq format stores them), checkpoint size, or predicted drift (percent of perplexity,
predicted as exp(Σ KL) − 1: the KL of a unit's change is the cross-entropy it costs on text the model
itself would write, and the units' KLs add up to first order).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn as nn

from geminicompress.compress.allocation import allocate, allocate_within_drift, check_budget, frontier
from geminicompress.compress.sensitivity.measure import measure_sensitivity, read_table, SensitivitySettings
from geminicompress.compress.sensitivity.options import parse_options
from geminicompress.core.grid import QuantSpec
from geminicompress.core.errors import InputError

ALLOCATION_FILE = "allocation.json"
FRONTIER_FILE = "allocation_frontier.png"
TABLE_FILE = "sensitivity.json"  # the table an allocation measured for itself


def spec_of_label(label: str, sym: bool) -> QuantSpec:
    """'b4g64' or 'gptq:b4g64' -> QuantSpec(4, 64, sym)."""
    m = re.fullmatch(r"(?:gptq:)?b(\d+)g(-?\d+)", label)
    if not m:
        raise InputError(f"'{label}' is not b<bits>g<group size>")
    return QuantSpec(int(m.group(1)), int(m.group(2)), sym)


def drift_pct(kl: float) -> float:
    return 100.0 * math.expm1(kl)


def fixed_bytes(model: nn.Module, quantized: list[str], dtype_bytes: int, tied: str | None = None) -> float:
    """Bytes of everything but the quantized weights' codes/scales: float tensors (tied ones once) at the
    output dtype, plus each quantized module's int32 g_idx. `tied`: the output head stored as the input
    embedding (a skeleton read from disk does not share the tensor in memory)."""
    skip = {f"{n}.weight" for n in quantized} | ({f"{tied}.weight"} if tied else set())
    seen, total = set(), 0.0
    for key, t in model.state_dict(keep_vars=True).items():
        if key in skip or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * (dtype_bytes if t.is_floating_point() else t.element_size())
    return total + sum(4 * dict(model.named_modules())[n].in_features for n in quantized)


def table_matrices(table: dict[str, Any], options: list[str], targets: list[str]) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """(units, cost in bits (units, options), drift in KL (units, options)) for the stage's options."""
    missing = [o for o in options if o not in table["options"]]
    if missing:
        raise InputError(f"the sensitivity table has no column {', '.join(missing)} (it has {', '.join(table['options'])})")
    cols = [table["options"].index(o) for o in options]
    wanted = set(targets)
    units = [u for u in table["units"] if set(u["modules"]) <= wanted]
    covered = {m for u in units for m in u["modules"]}
    if covered != wanted:
        raise InputError(f"the sensitivity table does not cover {sorted(wanted - covered)[0]} "
                         "(another model, or other --ignore patterns?)")
    cost = np.array([[u["params"] * u["bits_per_weight"][j] for j in cols] for u in units])
    drift = np.array([[u["drift"][j] for j in cols] for u in units])
    return units, cost, drift


def allocate_specs(table: dict[str, Any], alloc: Any, targets: list[str], sym: bool,
                   fixed: float) -> tuple[dict[str, QuantSpec], dict[str, Any]]:
    """Module -> spec from the knapsack, and the summary (choice, prediction, frontier)."""
    labels, summary = allocate_labels(table, alloc, targets, fixed)
    return {m: spec_of_label(label, sym) for m, label in labels.items()}, summary


def allocate_labels(table: dict[str, Any], alloc: Any, targets: list[str],
                    fixed: float) -> tuple[dict[str, str], dict[str, Any]]:
    """Module -> the option's label from the knapsack, and the summary (choice, prediction, frontier)."""
    units, cost, drift = table_matrices(table, alloc.options, targets)
    params = float(sum(u["params"] for u in units))
    bits = lambda v: f"{v / params:.4g} bits per weight"  # noqa: E731
    if alloc.target_bits is not None:
        target = {"target_bits": alloc.target_bits}
        check_budget(cost, drift, alloc.target_bits * params, "--target-bits", bits)
        a = allocate(cost, drift, alloc.target_bits * params)
    elif alloc.target_size_mb is not None:
        target = {"target_size_mb": alloc.target_size_mb}
        size = lambda v: f"{(v / 8 + fixed) / 1e6:.3f} MB"  # noqa: E731
        budget = (alloc.target_size_mb * 1e6 - fixed) * 8
        check_budget(cost, drift, budget, "--target-size-mb", size)
        a = allocate(cost, drift, budget)
    else:
        target = {"max_drift_pct": alloc.max_drift}
        least = float(drift.min(1).sum())
        if math.log1p(alloc.max_drift / 100) < least:
            raise InputError(f"--max-drift {alloc.max_drift:g}% cannot be met with these options: the reachable "
                             f"range is {drift_pct(least):.3g}% (dearest choice) and up")
        a = allocate_within_drift(cost, drift, math.log1p(alloc.max_drift / 100))
    labels = {m: alloc.options[j] for u, j in zip(units, a.choice) for m in u["modules"]}
    curve = [{"bits": round(c / params, 5), "predicted_drift_pct": round(drift_pct(d), 5)}
             for c, d in frontier(cost, drift, resolution=256)]
    counts = {o: sum(u["params"] for u, j in zip(units, a.choice) if j == i) for i, o in enumerate(alloc.options)}
    return labels, {**target, "average_bits": round(a.cost / params, 5), "predicted_kl": round(a.drift, 6),
                   "predicted_drift_pct": round(drift_pct(a.drift), 4),
                   "predicted_size_mb": round((a.cost / 8 + fixed) / 1e6, 4), "weights_per_option": counts,
                   "frontier": curve, "table_measure": table.get("measure")}


def module_specs(cfg: Any, ctx: Any, targets: list[str], spec: QuantSpec) -> tuple[dict[str, QuantSpec], dict[str, Any]]:
    """Every target's spec: the stage's (`spec`, its group size resolved), the allocation's, then the
    explicit overrides."""
    specs = {n: spec for n in targets}
    summary: dict[str, Any] = {}
    if cfg.allocation is not None:
        table = _table(cfg, ctx, targets)
        measured = cfg.allocation.sensitivity is None
        chosen, summary = allocate_specs(table, cfg.allocation, targets, cfg.sym,
                                         fixed_bytes(ctx.model, targets, ctx.out_dtype.itemsize, ctx.layers.tied_output))
        specs.update(chosen)
        if measured:  # kept beside the allocation (OUT/sensitivity.json): reusable with --sensitivity
            summary["table"] = table
    for name, label in cfg.overrides.items():
        if name not in specs:
            raise InputError(f"override '{name}' is not a quantized module (names look like '{targets[0]}')")
        specs[name] = spec_of_label(label, cfg.sym)
    return specs, summary


def gguf_auto_types(cfg: Any, ctx: Any, targets: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """--gguf-type auto: each target's GGUF type, the knapsack's choice over the `gguf:<TYPE>` options under the
    budget (the file's size: the other tensors and the tokenizer counted by formats/gguf_export.fixed_bytes),
    the drift measured per linear with llama-quantize's rounding (a sensitivity table); and the summary."""
    from geminicompress.formats.gguf_export import fixed_bytes

    options = parse_options(",".join(cfg.allocation.options))
    modules = dict(ctx.model.named_modules())
    held = {n: [o for o in options if o.applies(modules[n].in_features)] for n in targets}
    bare = next((n for n, h in held.items() if not h), None)
    if bare is not None:
        raise InputError(f"--gguf-type auto: no type among {', '.join(cfg.allocation.options)} holds {bare} "
                         f"({modules[bare].in_features} inputs); add gguf:IQ4_NL or gguf:Q8_0 (blocks of 32), or --ignore it")
    fixed = fixed_bytes(ctx.model, targets, getattr(ctx, "tokenizer", None))
    alloc = cfg.allocation
    if alloc.target_size_mb is not None:  # before any work: a size no choice of types reaches
        lo, hi = (fixed + sum(modules[n].weight.numel() * pick(o.bits_per_weight(0) for o in held[n]) / 8
                              for n in targets) for pick in (min, max))
        if not lo <= alloc.target_size_mb * 1e6 <= hi:
            raise InputError(f"--target-size-mb {alloc.target_size_mb:g} cannot be met by --gguf-type auto: its files "
                             f"range from {lo / 1e6:.3f} to {hi / 1e6:.3f} MB")
    table = _table(cfg, ctx, targets)
    labels, summary = allocate_labels(table, alloc, targets, fixed)
    types = {m: label.split(":", 1)[1] for m, label in labels.items()}
    summary["types"] = types
    if alloc.sensitivity is None:
        summary["table"] = table
    return types, summary


def _table(cfg: Any, ctx: Any, targets: list[str]) -> dict[str, Any]:
    alloc = cfg.allocation
    if alloc.sensitivity is not None:
        return read_table(alloc.sensitivity)
    return measure_sensitivity(ctx.model, ctx.calibration(cfg.data), parse_options(",".join(alloc.options)),
                               SensitivitySettings(keep=set(targets), kl_windows=alloc.kl_windows,
                                                   measure=alloc.measure, fuse=alloc.fuse, device=ctx.device,
                                                   progress=ctx.progress, seed=ctx.recipe.seed, act_order=cfg.act_order,
                                                   first_token_weight=cfg.first_token_weight))


def write_allocation(summary: dict[str, Any], specs: dict[str, QuantSpec], out: Path) -> None:
    """OUT/allocation.json (the choice per module, the prediction, the frontier) and the frontier plot."""
    from geminicompress.compress.sensitivity.plot import write_frontier

    data = {**{k: v for k, v in summary.items() if k not in ("table", "types")},
            "modules": summary.get("types") or {n: f"b{s.bits}g{s.group_size}" for n, s in specs.items()}}
    if "table" in summary:
        (out / TABLE_FILE).write_text(json.dumps(summary["table"]) + "\n")
        data["sensitivity_file"] = TABLE_FILE
    (out / ALLOCATION_FILE).write_text(json.dumps(data, indent=2) + "\n")
    write_frontier(data, out / FRONTIER_FILE)
