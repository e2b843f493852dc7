"""Fold per-channel scales (AWQ's, SmoothQuant's) into the model so that it computes the same function (in exact arithmetic):
the op feeding a group divides its output by s, the group's linears multiply their input columns by s.

    prev = RMSNorm / LayerNorm:  weight ← weight / s   (Gemma's (1 + weight): 1 + weight ← (1 + weight) / s),
                                 bias ← bias / s
    prev = Linear:               rows of weight (and bias) ← / s
    each linear of the group:    weight[:, j] ← weight[:, j] · s_j
"""

from __future__ import annotations

import torch
import torch.nn as nn


def fold_problem(prev: nn.Module, linears: list[nn.Linear]) -> str | None:
    """Why `prev` cannot absorb 1/s for these linears (shapes differ, e.g. v_proj -> o_proj under
    grouped-query attention), or None when it can."""
    width = linears[0].in_features
    if any(lin.in_features != width for lin in linears):
        return "the linears read inputs of different sizes"
    if isinstance(prev, nn.Linear):
        if prev.out_features != width:
            return f"{prev.out_features} outputs feed {width} inputs (grouped-query attention)"
        return None
    weight = getattr(prev, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{type(prev).__name__} has no per-channel weight to fold the scales into"
    if weight.numel() != width:
        return f"{type(prev).__name__} has {weight.numel()} channels, the linears read {width}"
    return None


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Divide prev's output channels by s (in,) and multiply the linears' input columns by s, in place."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.to(prev.weight).view(-1, 1))
    else:
        w = prev.weight
        w.copy_((w + norm_offset) / s.to(w) - norm_offset)
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.div_(s.to(bias))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight).view(1, -1))
