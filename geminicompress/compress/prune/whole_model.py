"""Global magnitude pruning of a model without decoder layers, on the whole model in memory
(runtime/whole_model.py): one threshold over every targeted linear's |w| (threshold.py, the same
k = round(sparsity · total) smallest, ties first come first), written dense or sparse-bitmask."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.prune.threshold import global_threshold, prune_mask
from geminicompress.compress.targets import whole_model_targets
from geminicompress.core.arch import get_module
from geminicompress.core.config import ignore_to_check
from geminicompress.engine.whole import Written
from geminicompress.formats import sparse_bitmask
from geminicompress.formats.checkpoint import float_linears


@torch.no_grad()
def magnitude_whole_model(model: nn.Module, cfg: Any, dtype: torch.dtype) -> Written:
    """Global magnitude pruning of every targeted linear: exactly round(sparsity · total) weights zeroed."""
    names = whole_model_targets(model, cfg.ignore, ignore_to_check(cfg), "prune")
    weights = [get_module(model, n).weight for n in names]
    total = sum(w.numel() for w in weights)
    k = round(cfg.sparsity * total)
    th = global_threshold(weights, k, total=total)
    keep: dict[str, torch.Tensor] = {}
    rows = []
    for name, w, ties in zip(names, weights, th.ties):
        pruned = prune_mask(w, th.value, ties)
        w.masked_fill_(pruned, 0.0)
        keep[f"{name}.weight"] = pruned.logical_not_()  # in place: no second mask
        zeros = int((w == 0).sum())  # the rows prune's report has (compress/prune/report.py), one "layer"
        rows.append({"name": f"{name}.weight", "layer": "model", "linear": name, "shape": list(w.shape),
                     "params": w.numel(), "zeros": zeros, "sparsity": round(zeros / w.numel(), 6)})
    summary = {"method": "magnitude", "scope": "global", "pattern": None, "whole_model": True, "pruned_weights": k,
               "prunable_params": total, "achieved_sparsity": round(k / total, 6), "layers": rows}
    if cfg.format == "dense":
        return Written(model, dtype, "dense", None, summary, lambda t: t)
    ignore = [n for n in float_linears(model) if n not in names]

    def sparse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key, mask in keep.items():
            tensors.update(sparse_bitmask.weight_tensors(key, tensors.pop(key), mask, False))
        return tensors

    return Written(model, dtype, f"compressed-tensors:{sparse_bitmask.layout('unstructured')}",
                   sparse_bitmask.quantization_config("unstructured", k / total, ignore), summary, sparse)
