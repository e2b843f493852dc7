"""AWQ's two searches as pure functions on tensors (Lin et al., 2023, §3.2-3.3).

1. Scales: for a group of linears reading the same input x, protect salient input channels by
   scaling them up before quantization: W' = Q(W·diag(s))·diag(s)⁻¹, with
       s = mean|x|^α,  normalised so that sqrt(max(s)·min(s)) = 1,
   and α chosen on a grid in [0, 1) to minimise the error of the group's output (eq. 5):
       α* = argmin_α ‖f(x; Q(W·s)/s) − f(x; W)‖²
   where f is the `inspect` module (the attention block, the MLP, or the linear itself).
2. Clipping: per output row and weight group, shrink the quantization range max|w| by up to 50%
   and keep the shrink that minimises the group's output error on a sample of inputs.

Quantization here is fake (quantize then dequantize) with the same grid functions as
`grid.rtn_quantize`, so the searched error is the error of the weights that ship.
"""

from __future__ import annotations

from typing import Callable

import torch

from geminicompress.core.grid import QuantSpec, fake_quantize, qparams, rtn_quantize


def pseudo_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Fake-quantized copy of w (out, in), groups along the input dimension, as rtn_quantize does."""
    out_f, in_f = w.shape
    width = in_f if spec.group_size == -1 else spec.group_size
    if in_f % width:
        return rtn_quantize(w, spec).dequantize().to(w.dtype)
    rows = w.float().reshape(-1, width)  # (out · groups, width)
    scale, zero = qparams(rows, spec)
    return fake_quantize(rows, scale, zero, spec.maxq).reshape(out_f, in_f).to(w.dtype)


def smooth_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^α, normalised by sqrt(max·min) (llm-awq).  x_mean: (in,) -> s: (in,)."""
    s = x_mean.float().pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def scaled_weights(weights: list[torch.Tensor], s: torch.Tensor, spec: QuantSpec) -> list[torch.Tensor]:
    """Q(W·s)/s for each weight (out, in): what the group computes on x once s is folded in."""
    return [pseudo_quantize(w * s, spec) / s for w in weights]


def search_scales(x_mean: torch.Tensor, error: Callable[[torch.Tensor], float],
                  n_grid: int = 20) -> tuple[torch.Tensor, float, float, float]:
    """Grid search of α in {0, 1/n, ..., (n−1)/n}; `error(s)` measures the group's output error.

    Returns (best s, best α, best error, error at α = 0, i.e. plain round-to-nearest).
    """
    best: tuple[torch.Tensor, float, float] | None = None
    rtn_error = float("nan")
    for i in range(n_grid):
        alpha = i / n_grid
        s = smooth_scales(x_mean, alpha)
        err = error(s)
        if i == 0:
            rtn_error = err
        if best is None or err < best[2]:
            best = (s, alpha, err)
    assert best is not None
    return best[0], best[1], best[2], rtn_error


def linear_error(weights: list[torch.Tensor], H: torch.Tensor, spec: QuantSpec) -> Callable[[torch.Tensor], float]:
    """`error(s)` for a group whose inspected output is the linears' own: with H = 2/N Σ xᵀx (in, in),
    mean ‖x ΔWᵀ‖² over tokens and outputs is tr(ΔW H ΔWᵀ) / (2 · out), no activations needed."""
    rows = sum(w.shape[0] for w in weights)

    def error(s: torch.Tensor) -> float:
        total = 0.0
        for w, wq in zip(weights, scaled_weights(weights, s, spec)):
            delta = (wq - w).float()  # (out, in)
            total += float(((delta @ H) * delta).sum())
        return total / (2 * rows)

    return error


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, n_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """Best clipping bound per (output row, weight group).  w: (out, in), x: (tokens, in) -> (out, groups).

    Tries max|w| · (1 − i/n_grid) for i < max_shrink · n_grid and keeps, per row and group, the bound
    whose fake-quantized group gives the smallest squared error of Σ_k x_k w_k over the tokens."""
    out_f, in_f = w.shape
    width = in_f if spec.group_size == -1 else spec.group_size
    if not spec.whole_groups(in_f):
        raise ValueError(f"clipping needs a group size dividing the input size ({in_f} % {width} != 0)")
    groups = in_f // width
    wg = w.float().reshape(out_f, groups, width)  # (out, G, k)
    xg = x.float().reshape(-1, groups, width).transpose(0, 1)  # (G, t, k)
    ref = torch.bmm(xg, wg.permute(1, 2, 0))  # (G, t, out)
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # (out, G, 1)
    best_max = org_max.clone()
    best_err = torch.full((out_f, groups, 1), float("inf"), device=w.device)
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        clipped = torch.maximum(torch.minimum(wg, max_val), -max_val)
        q = pseudo_quantize(clipped.reshape(out_f, in_f), spec).reshape(out_f, groups, width)
        out = torch.bmm(xg, q.permute(1, 2, 0))  # (G, t, out)
        err = (out - ref).pow(2).mean(dim=1).t().unsqueeze(-1)  # (out, G, 1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max.squeeze(-1)  # (out, G)


def apply_clip(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp w (out, in) to [−max_val, max_val] per (row, group).  max_val: (out, groups)."""
    out_f, in_f = w.shape
    groups = max_val.shape[1]
    bound = max_val.to(w.dtype).unsqueeze(-1)  # (out, G, 1)
    wg = w.reshape(out_f, groups, in_f // groups)
    return torch.maximum(torch.minimum(wg, bound), -bound).reshape(out_f, in_f)
