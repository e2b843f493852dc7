"""Clipping search for a group's quantization range: shrink the min-max range by a grid of factors and keep,
per row, the one whose rounding error is least.

    α* = argmin_α Σ_j c_j · |w_j − Q_α(w_j)|^p,   α ∈ {1, 1 − δ, ..., 1 − maxshrink}

where Q_α is the grid of `grid.qparams` with its range scaled by α (symmetric: the scale times α, zero point
fixed; asymmetric: both ends times α, zero point recomputed) and c_j ≥ 0 the importance of column j
(None: every column alike). The plain version is llm-compressor's `mse` observer and the GPTQ reference's
`Quantizer(mse=True)` (grid 100, p = 2.4); with c_j = H_jj, the diagonal of the layer Hessian (the mean
squared input of column j), it is llama.cpp's importance-weighted scale search (`make_qx_quants` with
`quant_weights`). Clipping trades a larger error on the few largest weights for a finer step on all others.
"""

from __future__ import annotations

import torch

from geminicompress.core.grid import QuantSpec, qparams, quantize


def clip_qparams(w: torch.Tensor, spec: QuantSpec, importance: torch.Tensor | None = None, *,
                 grid: int = 20, maxshrink: float = 0.2, norm: float = 2.0,
                 sym_range: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (out, 1) each for w (out, k), searched over α = 1 − i·maxshrink/grid, i = 0..grid.

    importance: (k,) or (out, k) non-negative weights of the columns' errors, or None. grid = 0 is
    `qparams` itself (no search)."""
    w = w.float()
    scale0, zero0 = qparams(w, spec, sym_range=sym_range)
    if grid <= 0:
        return scale0, zero0
    c = None if importance is None else importance.float().expand_as(w)
    if not spec.sym:
        zeros_ = torch.zeros(w.shape[0], 1, device=w.device)
        xmin = torch.minimum(w.min(dim=1, keepdim=True).values, zeros_)
        xmax = torch.maximum(w.max(dim=1, keepdim=True).values, zeros_)
    best_err = torch.full((w.shape[0], 1), float("inf"), device=w.device)
    best_scale, best_zero = scale0.clone(), zero0.clone()
    for i in range(grid + 1):
        alpha = 1.0 - i * maxshrink / grid
        if spec.sym:
            scale, zero = scale0 * alpha, zero0
        else:
            lo, hi = alpha * xmin, alpha * xmax
            scale = torch.where(hi > lo, (hi - lo) / spec.maxq, scale0)
            zero = torch.round(-lo / scale)
        err = (w - scale * (quantize(w, scale, zero, spec.maxq) - zero)).abs_().pow_(norm)  # (out, k)
        if c is not None:
            err.mul_(c)
        err = err.sum(dim=1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero
