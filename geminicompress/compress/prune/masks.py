"""Keep-masks from a score (|W| for magnitude, |W|·‖X‖ for Wanda): per tensor, per row, or N:M.

Convention (as in the SparseGPT and Wanda reference code): pattern N:M prunes exactly N weights in every
group of M consecutive input columns of a row; 2:4 and 4:8 both mean 50% sparsity. Lower scores are
pruned first; ties go to the lower column index (stable sort), so every mask is deterministic.
All functions return a bool keep-mask of the score's shape: True = kept.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

Pattern = tuple[int, int]  # (N pruned, per group of M)


def parse_pattern(text: str | None) -> Pattern | None:
    """'2:4' -> (2, 4); None -> None (the schema already checked the form)."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", text)
    assert m, f"pattern {text!r} should have been validated by the schema"
    return int(m.group(1)), int(m.group(2))


def tensor_mask(scores: Tensor, sparsity: float) -> Tensor:
    """Prune exactly round(sparsity · numel) lowest scores of the whole tensor (ties: lower flat index first):
    `row_mask` of the flattened scores as one row."""
    return row_mask(scores.detach().float().reshape(1, -1), sparsity).view_as(scores)


def row_mask(scores: Tensor, sparsity: float) -> Tensor:
    """Prune the round(sparsity · in) lowest scores of every row (Wanda's per-output comparison group)."""
    rows, cols = scores.shape  # (out, in)
    k = round(cols * sparsity)
    if k == 0:
        return torch.ones_like(scores, dtype=torch.bool)
    value = torch.kthvalue(scores, k, dim=1, keepdim=True).values  # (out, 1): each row's k-th lowest
    pruned = scores < value
    tied = scores == value
    need = k - pruned.sum(1, keepdim=True)  # ties to prune per row, lower columns first
    pruned |= tied & (tied.cumsum(1) <= need)
    return ~pruned


def row_mask_count(scores: Tensor, k: int) -> Tensor:
    """Prune exactly k lowest scores in all, row by row: every row loses k // rows, the first k % rows rows
    one more (Wanda's per-output comparison with an exact total, for a sparsity map)."""
    rows, cols = scores.shape  # (out, in)
    per_row = torch.full((rows, 1), k // rows, dtype=torch.long, device=scores.device)
    per_row[: k % rows] += 1
    rank = torch.argsort(torch.argsort(scores, dim=1, stable=True), dim=1)  # (out, in): rank in its row
    return rank >= per_row


def nm_mask(scores: Tensor, pattern: Pattern) -> Tensor:
    """Prune the N lowest scores of every group of M consecutive columns in each row."""
    n, m = pattern
    rows, cols = scores.shape  # (out, in)
    assert cols % m == 0, f"{cols} input columns are not a multiple of M={m}"
    groups = scores.reshape(rows, cols // m, m)
    order = torch.argsort(groups, dim=-1, stable=True)[..., :n]  # (out, in/M, N)
    keep = torch.ones_like(groups, dtype=torch.bool)
    keep.scatter_(-1, order, False)
    return keep.reshape(rows, cols)


def pattern_mask(scores: Tensor, sparsity: float, pattern: Pattern | None, per_row: bool) -> Tensor:
    """The mask for one weight: N:M when a pattern is given, else per row or per tensor."""
    if pattern is not None:
        return nm_mask(scores, pattern)
    return row_mask(scores, sparsity) if per_row else tensor_mask(scores, sparsity)
