"""Wanda (Sun et al., 2023, "A Simple and Effective Pruning Approach for Large Language Models").

Score each weight by its magnitude times the L2 norm of its input feature over the calibration tokens,
S_ij = |W_ij| · ‖X_j‖₂ (eq. 1), and prune the lowest scores within each output row (the paper's
per-output comparison group), or within each group of M columns for N:M. No weight update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geminicompress.compress.prune.masks import Pattern, pattern_mask


class InputNorms:
    """`add_batch(x)` with x: (..., in) inputs of one linear layer; `norms()`: (in,) ‖X_j‖₂ over all tokens."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.sumsq = torch.zeros(columns, device=device, dtype=torch.float64)

    def add_batch(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sumsq.device, torch.float32)  # (t, in)
        self.sumsq += x.square().sum(0).double()

    def norms(self) -> Tensor:
        return self.sumsq.sqrt().float()


def wanda_scores(weight: Tensor, norms: Tensor) -> Tensor:
    """S = |W| · ‖X‖₂ broadcast over rows. weight: (out, in); norms: (in,)."""
    return weight.detach().abs().float() * norms.to(weight.device).float().unsqueeze(0)


def wanda_mask(weight: Tensor, norms: Tensor, sparsity: float, pattern: Pattern | None = None) -> Tensor:
    """Keep-mask (True = kept) of one linear weight: per-row unstructured, or N:M."""
    return pattern_mask(wanda_scores(weight, norms), sparsity, pattern, per_row=True)
