"""Running estimate of the layer Hessian H = 2/N · Σ xᵀx of the squared reconstruction error.

Shared by GPTQ (Frantar et al., 2022, eq. 1-2) and SparseGPT (Frantar & Alistarh, 2023).
"""

from __future__ import annotations

import torch


class HessianAccumulator:
    """`add_batch(x)` with x: (..., in) inputs of one linear layer; `H`: (in, in) float32."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(columns, columns, device=device, dtype=torch.float32)
        self.tokens = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """bfloat16 inputs are multiplied in bfloat16 (fp32 accumulation inside the matmul, the batch's xᵀx
        rounded to bfloat16: ~0.2% relative error per entry) and summed into the float32 H; anything
        else is multiplied in float32."""
        x = x.reshape(-1, x.shape[-1]).to(self.H.device)  # (t, in)
        if x.dtype != torch.bfloat16:
            x = x.float()
        t = x.shape[0]
        beta, alpha = self.tokens / (self.tokens + t), 2.0 / (self.tokens + t)
        if x.dtype == torch.float32:  # H ← H·n/(n+t) + 2/(n+t)·xᵀx in one call: no scaled copy of x
            self.H.addmm_(x.t(), x, beta=beta, alpha=alpha)
        else:
            self.H.mul_(beta).add_(x.t() @ x, alpha=alpha)
        self.tokens += t
