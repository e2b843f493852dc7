"""In-place data movement on square matrices, with O(rows) scratch: the symmetric permutation P A Pᵀ and
the mirroring of one triangle. Used by the Hessian inverse factor (hessian.py) so that an 8B model's
14336 x 14336 down_proj Hessian (822 MB in float32) needs no second buffer of its size."""

from __future__ import annotations

import torch

BLOCK = 512  # rows x columns moved per step by the blocked loops (1 MB of float32 scratch)


def permute_rows_(A: torch.Tensor, perm: torch.Tensor) -> None:
    """A ← A[perm] in place: row r becomes the old row perm[r], following the permutation's cycles with
    one row of scratch. A: (n, m); perm: (n,) a permutation of range(n)."""
    p = perm.tolist()
    seen = bytearray(len(p))
    for start in range(len(p)):
        if seen[start]:
            continue
        seen[start] = 1
        if p[start] == start:
            continue
        first = A[start].clone()
        r = start
        while p[r] != start:
            A[r].copy_(A[p[r]])
            r = p[r]
            seen[r] = 1
        A[r].copy_(first)


def transpose_(A: torch.Tensor, block: int = BLOCK) -> None:
    """A ← Aᵀ in place for a square (n, n) A, one (block, block) tile of scratch at a time."""
    n = A.shape[0]
    for i in range(0, n, block):
        d = A[i:i + block, i:i + block]
        d.copy_(d.t().clone())
        for j in range(i + block, n, block):
            a, b = A[i:i + block, j:j + block], A[j:j + block, i:i + block]
            tile = a.clone()
            a.copy_(b.t())
            b.copy_(tile.t())


def permute_symmetric_(A: torch.Tensor, perm: torch.Tensor) -> None:
    """A ← A[perm][:, perm] (= P A Pᵀ) in place: permute the rows, transpose, permute the rows again,
    transpose back ((P (P A)ᵀ)ᵀ = P A Pᵀ, for any square A, not only a symmetric one)."""
    permute_rows_(A, perm)
    transpose_(A)
    permute_rows_(A, perm)
    transpose_(A)


def mirror_lower_(A: torch.Tensor, block: int = BLOCK) -> None:
    """The upper triangle of square A ← the transpose of its lower one, in place (A becomes exactly
    symmetric, its lower triangle and diagonal unchanged)."""
    n = A.shape[0]
    for i in range(0, n, block):
        d = A[i:i + block, i:i + block]
        d.copy_(torch.tril(d) + torch.tril(d, -1).t())
        for j in range(i + block, n, block):
            A[i:i + block, j:j + block].copy_(A[j:j + block, i:i + block].t())
