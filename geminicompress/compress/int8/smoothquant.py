"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantization.

For a linear Y = X W^T whose input X has a few channels with huge magnitudes, pick per input channel j

    s_j = max|X_:,j|^α / max|W_:,j|^(1-α)                                       (Eq. 4 of the paper)

and compute Y = (X diag(s)^-1) (W diag(s))^T instead. X / s is easier to quantize per token, W · s
a little harder per output channel; α balances the two. diag(s)^-1 is folded into the op that
produces X (a RMSNorm/LayerNorm weight, or the rows of a preceding linear such as up_proj whose output
is only multiplied element-wise before it reaches down_proj), so the smoothed model costs nothing
extra at run time. Which op feeds which linears comes from the architecture table (`arch.py`).

The activation statistic max|X_:,j| is taken per calibration window (`window_max`) and averaged over the
windows (the int8 stage, one decoder layer at a time), not maxed over all of them: the maximum over all tokens keeps growing with the
number of windows (one rare token sets it), so the scales, and the quality, would depend on how much text
was given. Measured on the demo model with 32 / 128 windows of builtin:pydoc, alpha 0.5, WikiText-2
drift: max over all tokens +0.75% / +1.15%, mean of the window maxima +0.86% / +0.59% (docs/int8.md).

`smooth_scales`, `window_max` and `smooth_group` are pure tensor math; the int8 stage runs the calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from geminicompress.compress.fold import fold_problem, fold_scales
from geminicompress.core.arch import Arch, get_module


@dataclass(frozen=True)
class Smoothing:
    """One foldable group in one decoder layer: full module names of the producer and its consumers."""

    prev: str
    linears: tuple[str, ...]


def smooth_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act_max^α / weight_max^(1-α), per input channel.  act_max, weight_max: (in,) -> s: (in,).

    Channels never seen active (act_max = 0) or with all-zero weights keep s = 1."""
    act_max, weight_max = act_max.float(), weight_max.float()
    s = act_max.pow(alpha) / weight_max.pow(1.0 - alpha)
    keep = (act_max <= 0) | (weight_max <= 0) | ~torch.isfinite(s)
    return torch.where(keep, torch.ones_like(s), s.clamp(min=1e-5))


def weight_column_max(linears: list[nn.Linear]) -> torch.Tensor:
    """max over all rows of all linears of |W[:, j]|.  -> (in,)"""
    return torch.stack([lin.weight.detach().float().abs().amax(dim=0) for lin in linears]).amax(dim=0)


def foldable_groups(model: nn.Module, arch: Arch, quantized: set[str]) -> tuple[list[Smoothing], list[str]]:
    """The smoothing groups that can be folded: every consumer is a linear we quantize and the producer
    is a norm, or a linear whose output width equals the consumers' input width (not v_proj -> o_proj
    under grouped-query attention). Returns (groups, reasons for the groups skipped)."""
    layers = get_module(model, arch.layers)
    groups, skipped = [], []
    for i in range(len(layers)):
        base = f"{arch.layers}.{i}"
        for group in arch.smooth:
            name = Smoothing(f"{base}.{group.prev}", tuple(f"{base}.{n}" for n in group.linears))
            why = ("a consumer is kept in float" if not all(n in quantized for n in name.linears) else
                fold_problem(get_module(model, name.prev), [get_module(model, n) for n in name.linears]))
            if why:
                skipped.append(f"{name.prev} -> {', '.join(n.rsplit('.', 1)[-1] for n in name.linears)}: {why}")
            else:
                groups.append(name)
    return groups, skipped


def window_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| per input channel over one window's tokens.  x: (1, T, in) -> (in,) float32"""
    return x.detach().float().abs().reshape(-1, x.shape[-1]).amax(dim=0)


@torch.no_grad()
def smooth_group(prev: nn.Module, linears: list[nn.Linear], act_max: torch.Tensor, alpha: float,
                 norm_offset: float) -> float:
    """Fold one group's scales (Eq. 4) into `prev` and `linears` in place; return the largest scale."""
    s = smooth_scales(act_max, weight_column_max(linears), alpha)
    fold_scales(prev, linears, s, norm_offset)
    return round(float(s.max()), 4)
