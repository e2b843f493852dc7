"""The `quantize` stage for methods `int8` (W8A16) and `w8a8`: optional SmoothQuant, then per-channel
INT8 of every linear not ignored, each swapped for the fast module of `modules.py`.

Steps: pick the linears (`ignore` regexes; a tied output head always stays float) -> SmoothQuant
(w8a8, on by default with alpha 0.5: calibrate per-channel activation maxima on the stage's DATA or the
recipe's calibration data, builtin:pydoc unless told otherwise, and fold the scales; per-token INT8
activations without it drift ~2x more on the demo model, docs/int8.md) -> replace the
linears -> set the exporter to the compressed-tensors `int-quantized` writer. The summary lists what
was done to every linear (goes into report.json).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.arch import arch_for, get_module, set_module
from geminicompress.compress.int8 import smoothquant as sq
from geminicompress.compress.int8.modules import MODULES
from geminicompress.compress.targets import check_patterns_match, compile_patterns
from geminicompress.errors import InputError
from geminicompress.compress.int8.shared_input import share_inputs
from geminicompress.formats import int_quantized
from geminicompress.recipes.quantize import Int8Stage


def run(cfg: Int8Stage, ctx: Any) -> dict:
    model: nn.Module = ctx.model
    targets, kept = select_linears(model, cfg.ignore, explicit="ignore" in cfg.model_fields_set)
    if not targets:
        raise InputError("the ignore patterns leave no linear layer to quantize")
    smoothing: dict[str, Any] = {"alpha": None}
    smoothed: dict[str, float] = {}
    if cfg.smoothquant_alpha is not None:
        smoothing, smoothed = _smooth(model, cfg, ctx, set(targets))
    layers = []
    with torch.no_grad(), ctx.progress.task(f"{cfg.method}: quantizing linears", len(targets)) as bar:
        for name in targets:
            linear = get_module(model, name)
            module = MODULES[cfg.method].from_linear(linear)
            err = _relative_error(linear.weight, module.dequantized_weight())
            set_module(model, name, module)
            layers.append({"name": name, "shape": [module.out_features, module.in_features], "kernel": module.kernel,
                           "smoothquant_max_scale": smoothed.get(name), "weight_rel_error": round(err, 6)})
            bar.advance(1)
    share_inputs(model)  # run-time only: q/k/v and gate/up as one GEMM each (compress/int8/shared_input.py)
    ctx.exporter = int_quantized.exporter(cfg.method, ctx.recipe.output.dtype)
    return {
        "method": cfg.method,
        "weights": "int8 symmetric per output channel",
        "activations": "int8 dynamic per token" if cfg.method == "w8a8" else "float (weight-only)",
        "quantized": len(targets),
        "kept_float": kept,
        "smoothquant": smoothing,
        "layers": layers,
    }


def select_linears(model: nn.Module, ignore: list[str], explicit: bool) -> tuple[list[str], dict[str, str]]:
    """(names of linears to quantize, {kept linear: why}).  A user-given pattern matching no linear is
    an InputError: it is almost always a typo."""
    patterns = compile_patterns(ignore)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if explicit:
        check_patterns_match(patterns, linears)
    tied_head = _tied_output_name(model)
    targets, kept = [], {}
    for name in linears:
        hit = next((rx.pattern for rx in patterns if rx.search(name)), None)
        if hit is not None:
            kept[name] = f"ignore '{hit}'"
        elif name == tied_head:
            kept[name] = "output head tied to the input embeddings"
        else:
            targets.append(name)
    return targets, kept


def _tied_output_name(model: nn.Module) -> str | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    return next(name for name, m in model.named_modules() if m is out)


def _smooth(model: nn.Module, cfg: Int8Stage, ctx: Any, quantized: set[str]) -> tuple[dict, dict[str, float]]:
    """Calibrate and fold SmoothQuant scales; return (summary, {linear: max scale})."""
    arch = arch_for(model)
    groups, skipped = sq.foldable_groups(model, arch, quantized)
    windows = ctx.calibration(cfg.data)
    with ctx.progress.task("smoothquant: calibrating", len(windows)) as bar:
        maxima = sq.activation_maxima(model, windows, [g.linears[0] for g in groups], bar)
    smoothed: dict[str, float] = {}
    for g in groups:
        top = sq.smooth_group(get_module(model, g.prev), [get_module(model, n) for n in g.linears],
                              maxima[g.linears[0]], cfg.smoothquant_alpha, arch.norm_offset)
        smoothed.update({n: top for n in g.linears})
    return smoothing_summary(cfg, ctx.recipe.calibration.data, windows, len(groups), skipped), smoothed


def smoothing_summary(cfg: Int8Stage, default_data: str, windows: torch.Tensor, folded: int,
                      skipped: list[str]) -> dict[str, Any]:
    return {"alpha": cfg.smoothquant_alpha, "data": cfg.data or default_data,
            "calibration_windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
            "folded_groups": folded, "skipped_groups": skipped}


def _relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    w = w.detach().float()
    return float((w - w_hat.to(w.device)).norm() / w.norm().clamp_min(1e-12))
