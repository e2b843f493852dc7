"""SparseGPT (Frantar & Alistarh, 2023, "Massive Language Models Can Be Accurately Pruned in One-Shot").

Prune a linear layer W (out, in) so as to keep W·X close, given H = 2XXᵀ (hessian.HessianAccumulator).
Columns are visited left to right in blocks of `block_size` (Algorithm 1):
- mask selection: inside each block, prune the weights with the lowest w² / [H⁻¹]²_jj over the whole
  block (adaptive mask selection, §3.3), or the N lowest of every group of M columns for N:M (§3.5);
- optimal brain surgeon update: zero the pruned weight of column j and spread its error over the
  not-yet-visited columns through the upper Cholesky factor of H⁻¹, exactly as GPTQ does for rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geminicompress.compress.hessian import inverse_hessian_factor
from geminicompress.compress.prune.masks import Pattern


def _block_mask(W1: Tensor, d: Tensor, sparsity: float) -> Tensor:
    """Prune mask (True = pruned) of the int(sparsity · numel) lowest w²/d² in one block. W1: (out, B); d: (B,)."""
    scores = (W1.square() / d.square().unsqueeze(0)).flatten()
    k = int(scores.numel() * sparsity)
    pruned = torch.zeros_like(scores, dtype=torch.bool)
    if k:
        pruned[torch.argsort(scores, stable=True)[:k]] = True
    return pruned.view_as(W1)


def sparsegpt_prune(weight: Tensor, H: Tensor, sparsity: float, pattern: Pattern | None = None,
                    block_size: int = 128, damp: float = 0.01) -> tuple[Tensor, Tensor]:
    """Return (pruned and updated weight, keep-mask). weight: (out, in); H: (in, in)."""
    W = weight.detach().clone().float()  # (out, in)
    cols = W.shape[1]
    U = inverse_hessian_factor(H.to(W.device), damp)  # (in, in), upper
    pruned = torch.zeros_like(W, dtype=torch.bool)
    if pattern is not None:
        n, m = pattern
        assert block_size % m == 0 and cols % m == 0, "N:M groups must not straddle blocks"
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()  # (out, B)
        U1 = U[i1:i2, i1:i2]  # (B, B)
        d = torch.diag(U1)
        mask1 = _block_mask(W1, d, sparsity) if pattern is None else torch.zeros_like(W1, dtype=torch.bool)
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            if pattern is not None and i % m == 0:
                scores = W1[:, i:i + m].square() / d[i:i + m].square().unsqueeze(0)  # (out, M)
                lowest = torch.argsort(scores, dim=1, stable=True)[:, :n]
                mask1[:, i:i + m].scatter_(1, lowest, True)
            w = W1[:, i]
            q = torch.where(mask1[:, i], torch.zeros_like(w), w)
            err = (w - q) / d[i]  # (out,)
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            W1[:, i] = q
            Err1[:, i] = err
        W[:, i1:i2] = W1
        pruned[:, i1:i2] = mask1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    W[pruned] = 0.0  # exact zeros (the update above already leaves them 0; this guards -0.0/rounding)
    return W.to(weight.dtype), ~pruned
