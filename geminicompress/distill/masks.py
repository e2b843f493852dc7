"""Sparse recovery: keep a pruned student's zeros at zero while it trains.

A mask is {parameter name: keep-mask (bool or uint8, the parameter's shape)}, as the prune stage leaves
it in `ctx.masks` or writes it next to the pruned weights (formats/masks.py). Training zeroes
the masked gradients before each optimizer step (so Adam's moments stay zero there) and re-applies the
mask after it (so weight decay or numerical noise cannot revive a pruned weight).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geminicompress.core.errors import InputError


def check_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masks as bool tensors keyed like `model.named_parameters()`; names and shapes must match."""
    params = dict(model.named_parameters())
    out = {}
    for name, mask in masks.items():
        if name not in params:
            raise InputError(f"prune mask for '{name}' names no parameter of the student")
        if mask.shape != params[name].shape:
            raise InputError(f"prune mask for '{name}' has shape {tuple(mask.shape)}, the weight {tuple(params[name].shape)}")
        out[name] = mask.bool()
    return out


def masks_from_zeros(model: nn.Module, min_fraction: float = 0.1) -> dict[str, torch.Tensor] | None:
    """Masks inferred from exact zeros in 2-D weights, when at least `min_fraction` of them are zero
    (a pruned checkpoint written without its mask file); else None."""
    weights = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n}
    zeros = sum(int((p == 0).sum()) for p in weights.values())
    total = sum(p.numel() for p in weights.values())
    if total == 0 or zeros < min_fraction * total:
        return None
    return {n: p.detach() != 0 for n, p in weights.items() if bool((p == 0).any())}


def mask_grads(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in masks and p.grad is not None:
            p.grad.mul_(masks[name].to(p.grad.device, p.grad.dtype))


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in masks:
            p.mul_(masks[name].to(p.device, p.dtype))


def sparsity(model: nn.Module, masks: dict[str, torch.Tensor]) -> float:
    """Fraction of exact zeros in the masked parameters."""
    params = dict(model.named_parameters())
    zeros = sum(int((params[n] == 0).sum()) for n in masks)
    return zeros / max(1, sum(params[n].numel() for n in masks))
