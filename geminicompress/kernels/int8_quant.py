"""Symmetric INT8 grids: per-output-channel weight scales and per-token activation scales.

Weights (what is stored): for each output row i, scale_i = max_j |W_ij| / 127 and
codes q_ij = clamp(round(W_ij / scale_i), -127, 127) as int8, so W ≈ scale · q with
|W - scale · q| <= scale / 2 element-wise. -128 is never used (the grid is symmetric), as in
compressed-tensors' `int` type with `symmetric: true`.

Activations (what the w8a8 kernels compute on the fly): the same rule per token (per row of X).

All functions are pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch

from geminicompress.core.rows import BLOCK_BYTES, rows_within

QMAX = 127


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric scale.  w: (out, in) -> (out, 1) float32; an all-zero row gets scale 1."""
    amax = w.detach().float().abs().amax(dim=1, keepdim=True)  # (out, 1)
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-127, 127].  w: (out, in), scale: (out, 1)."""
    return torch.clamp(torch.round(w.float() / scale), -QMAX, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale · q as `dtype`.  q: (out, in) int8, scale: (out, 1)."""
    return (q.float() * scale.float()).to(dtype)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor | None = None, block_bytes: int = BLOCK_BYTES,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (out, in), scale float32 (out, 1)) for a linear weight (`scale`: given, else its rows'
    own, rounded to `scale_dtype` first where a format stores them so: GGUF's Q8_0 in float16), `block_bytes`
    of float32 rows at a time: every row is independent, so the codes are those of the whole tensor at once,
    without its float32 copy (4 GiB for a 262,144 x 4,096 output head)."""
    rows = rows_within(w.shape[-1], block_bytes)
    if scale is None:
        scale = torch.cat([channel_scales(w[r:r + rows]) for r in range(0, w.shape[0], rows)])
        scale = scale.to(scale_dtype).float()
    codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for r in range(0, w.shape[0], rows):
        codes[r:r + rows] = quantize(w[r:r + rows], scale[r:r + rows])
    return codes, scale


def relative_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> float:
    """||W - scale · q|| / ||W|| (Frobenius), summed over blocks of rows in float32."""
    rows, err, norm = rows_within(w.shape[-1], block_bytes), 0.0, 0.0
    for r in range(0, w.shape[0], rows):
        block = w[r:r + rows].detach().float()
        err += float((block - dequantize(q[r:r + rows], scale[r:r + rows]).to(block.device)).square().sum())
        norm += float(block.square().sum())
    return (err / max(norm, 1e-24)) ** 0.5


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x rounded onto a symmetric 8-bit grid per token (last dim): the reference for dynamic A8."""
    scale = channel_scales(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], 1)
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX) * scale
