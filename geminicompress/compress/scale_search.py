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

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ScaleSearch:
    """How GPTQ picks a symmetric group's scale (`search_qparams`).

    signed: the scale maps the group's largest-magnitude weight, with its sign, onto the grid's lowest code
    (scale = w_max / −2^(b−1), negative when w_max > 0), so all 2^b codes are in reach of the row's largest
    weight; llama.cpp's Q4_0/Q5_0 quantizers do this. Unsigned: `qparams`' scale (full range, positive).
    weights: None (no search), "plain" (every column alike), "hdiag" (c_j = H_jj, the mean squared input of
    column j: llama.cpp's importance matrix), "llama" (c_rj = H_jj · sqrt(σ²_r + w_rj²), σ²_r the row's mean
    squared weight: llama.cpp's `quantize_row_q4_0_impl` weighting), "hinv" (c_j = 1 / [H⁻¹]_jj², the weight
    of column j's error in GPTQ's loss at its place in the solve; the caller passes it as `hdiag`).
    factors: the scale is searched over base · f for f in linspace(lo, hi, grid + 1); refit also tries, per
    candidate, the weighted least-squares scale of its codes, Σ c·w·l / Σ c·l² (llama.cpp's `make_qx_quants`).
    trial (GPTQ only, groups solved contiguously): the searched scale and base · f for every factor are each
    tried by solving the group's columns with GPTQ's feedback inside the group, and each row keeps the one
    with the least GPTQ loss Σ (w − q)² / [H⁻¹]_jj² (`trial_candidates`; solver.py).
    """

    signed: bool = False
    weights: str | None = None
    lo: float = 0.80
    hi: float = 1.00
    grid: int = 20
    refit: bool = True
    trial: bool = False

    def __post_init__(self) -> None:
        if self.weights not in (None, "plain", "hdiag", "llama", "hinv"):
            raise ValueError(f"scale search weights: {self.weights}")


def search_qparams(w: torch.Tensor, spec: QuantSpec, search: ScaleSearch,
                   importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (out, 1) of the symmetric group w (out, k) that minimise the weighted squared rounding
    error Σ_j c_j (w_j − s·(q_j − z))² over the candidates of `search` (see ScaleSearch).
    importance: (k,) or (out, k) non-negative c, or None (every column alike)."""
    if not spec.sym:
        raise ValueError("search_qparams searches symmetric grids only")
    w = w.float()
    half = (spec.maxq + 1) // 2
    if search.signed:
        idx = w.abs().argmax(dim=1, keepdim=True)
        wmax = torch.gather(w, 1, idx)  # (out, 1): the largest-magnitude weight, with its sign
        base = torch.where(wmax == 0, torch.ones_like(wmax), wmax / -half)
    else:
        base, _ = qparams(w, spec)
    zero = torch.full_like(base, half)
    if search.weights is None:
        return base, zero
    c = torch.ones_like(w) if importance is None or search.weights == "plain" else importance.float().expand_as(w)
    best_err = torch.full_like(base, float("inf"))
    best = base.clone()
    for i in range(search.grid + 1):
        f = search.lo + (search.hi - search.lo) * i / max(search.grid, 1)
        cands = [base * f]
        if search.refit:
            l = quantize(w, cands[0], zero, spec.maxq) - zero  # (out, k) codes − zero
            num, den = (c * w * l).sum(1, keepdim=True), (c * l * l).sum(1, keepdim=True)
            cands.append(torch.where(den > 0, num / den.clamp_min(1e-30), cands[0]))
        for s in cands:
            s = torch.where(s == 0, base, s)
            err = (c * (w - s * (quantize(w, s, zero, spec.maxq) - zero)).square()).sum(1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s, best)
    return best, zero


def trial_candidates(w: torch.Tensor, spec: QuantSpec, search: ScaleSearch, best: torch.Tensor) -> torch.Tensor:
    """The scales a trial search tries for the group w (out, k): `best` (out, 1), the weighted search's winner,
    then base · f for the factors of `search` (base: the signed or range scale). Returns (C, out, 1)."""
    half = (spec.maxq + 1) // 2
    if search.signed:
        wmax = torch.gather(w, 1, w.abs().argmax(dim=1, keepdim=True))
        base = torch.where(wmax == 0, torch.ones_like(wmax), wmax / -half)
    else:
        base, _ = qparams(w, spec)
    factors = [search.lo + (search.hi - search.lo) * i / max(search.grid, 1) for i in range(search.grid + 1)]
    return torch.stack([best, *(base * f for f in factors)])


def importance_for(weights: str | None, hdiag: torch.Tensor, w: torch.Tensor,
                   row_sigma2: torch.Tensor | None) -> torch.Tensor | None:
    """The c of `search_qparams` for a group: hdiag (k,) its columns' Hessian diagonal, w (out, k) its current
    weights, row_sigma2 (out, 1) each row's mean squared weight (for "llama")."""
    if weights in (None, "plain"):
        return None
    if weights in ("hdiag", "hinv"):
        return hdiag
    return hdiag * torch.sqrt(row_sigma2 + w.float().square())  # (out, k)
