"""Dense linears for a few rows of activations on a CPU: a decode step of a small batch, a speculative
verification of k + 1 tokens.

For float32 X with 2 to a few dozen rows, torch's `linear` (X·Wᵀ) on this CPU takes a BLAS path slower than its
one-row path, although both read each weight once. The same product taken as (W·Xᵀ)ᵀ is up to 3.5x faster there
(benchmarks/studies/serving/small_rows_gemm.py, every linear of the demo, quiet, 2 threads: 2 rows 58.0 against
17.0 ms, 4 rows 57.7 against 20.6; 8 rows 0.68x, 16 rows 0.77x; one row the same). In bfloat16 it is the other way
round (2-16 rows: 1.3-1.6x slower), so bf16 keeps torch's route. The numbers are the same products summed in another
order (float rounding: a few ulps).

`FewRowsLinear` is an `nn.Linear` that takes that route for 2..FEW_ROWS_MAX rows of float32 on a CPU and torch's
otherwise; it holds no state of its own, so `few_rows(model)` turns a loaded model's dense linears into it in place
(their weights, tied or not, and hooks untouched). It is a route of the dense kernel, not a kernel of its own: it
has no `kernel` name, so what eval reports for the model ("dense") is the same however often it is asked.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FEW_ROWS_MAX = 16  # rows up to which (W·Xᵀ)ᵀ is the faster route here (small_rows_gemm.py)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) · weight (out, in)ᵀ + bias, computed as (weight · x2ᵀ)ᵀ over the flattened rows x2, returned
    row-major as `linear` returns it (the transposed product left as it is made the ops after it slower than the
    linear itself became faster: a demo decode step of batch 8 took 74 ms against 55 ms)."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, flat.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(nn.Linear):
    """nn.Linear whose forward takes few_rows_linear for 2..FEW_ROWS_MAX rows of a float32 CPU tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if 1 < rows <= FEW_ROWS_MAX and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            return few_rows_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def few_rows(model: nn.Module) -> int:
    """Turn every plain `nn.Linear` of `model` into a FewRowsLinear in place; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = FewRowsLinear
            n += 1
    return n
