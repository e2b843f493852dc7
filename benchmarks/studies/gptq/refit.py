"""Least-squares refit of the group scales once the codes are fixed.

GPTQ decides each group's scale before it rounds the group's columns (from the weights at that moment), and
then chooses codes for that scale. With the codes q and zero points z fixed, the layer's output error is a
quadratic in the scales: row r dequantizes to ŵ_r = A_r s_r, A_r (in, G) with A_r[j, g(j)] = q_rj − z_rg(j),
and

    min_s (w_r − A_r s)ᵀ H (w_r − A_r s)   ⇒   (A_rᵀ H A_r) s_r = A_rᵀ H w_r,

a G x G system per row. The same objective GPTQ reduces (H = 2/N · Σ xᵀx); the formats store any scale, so
the refit is free at inference.

A study, not part of the package: gptq_variants.py, gptq_screen.py and ../gguf/gguf_scale_ablation.py try it
(tried, not adopted: docs/gptq.md, docs/llama-cpp.md); tests/test_gptq_refit.py keeps it tested.
"""

from __future__ import annotations

import torch

from geminicompress.core.grid import QuantizedWeight


def refit_scales(qw: QuantizedWeight, W: torch.Tensor, H: torch.Tensor, rows: int = 4096) -> QuantizedWeight:
    """qw with every row's scales replaced by the least-squares ones when they all keep their signs and lower
    the row's error tr(ΔW H ΔWᵀ) (else the row keeps its scales). W: (out, in) the target; H: (in, in)."""
    g = qw.g_idx.long()  # (in,)
    G = qw.scales.shape[1]
    E = torch.nn.functional.one_hot(g, G).to(torch.float32)  # (in, G)
    scales = qw.scales.clone()
    for r0 in range(0, W.shape[0], rows):
        r = slice(r0, r0 + rows)
        a = qw.q[r].float() - qw.zeros[r][:, g].float()  # (n, in)
        w = W[r].float()
        M = torch.empty(a.shape[0], G, G)
        for h in range(G):
            cols = torch.nonzero(g == h).flatten()
            M[:, h, :] = ((a[:, cols] @ H[cols, :]) * a) @ E  # Σ_{j∈h, k} a_j H_jk a_k per group of k
        b = ((w @ H) * a) @ E  # (n, G)
        diag = torch.diagonal(M, dim1=1, dim2=2)
        ok = (diag > 0).all(dim=1)
        M = M + torch.diag_embed(torch.where(diag > 0, 1e-9 * diag, torch.ones_like(diag)))
        s = torch.linalg.solve(M, b.unsqueeze(-1)).squeeze(-1)  # (n, G)
        old = scales[r]
        ok &= (s * old > 0).all(dim=1) & torch.isfinite(s).all(dim=1)  # each scale keeps its sign
        e_new = _row_error(a * s[:, g] - w, H)
        e_old = _row_error(a * old[:, g] - w, H)
        ok &= e_new < e_old
        scales[r] = torch.where(ok.unsqueeze(1), s, old)
    return QuantizedWeight(qw.q, scales, qw.zeros, qw.g_idx, qw.spec)


def _row_error(d: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """dᵀ H d per row of d (n, in)."""
    return ((d @ H) * d).sum(dim=1)
