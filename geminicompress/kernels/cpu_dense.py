"""Dense float32 linears on an x86 CPU: the product routed by its row count to the fastest of three routines
that compute it, instead of torch's `linear` (X·Wᵀ through MKL's sgemm / sgemv).

On this machine (an AMD EPYC, 2 threads) MKL runs that product at about 40% of what the CPU does: one row
(a decode step's) reads the weights at 17 GB/s where the memory gives 46, and runs on one thread whatever
torch's thread count; a 320-row prefill gets 98 GFLOP/s of a core's 250. oneDNN's inner product, which torch
ships (`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU backend calls), takes the plain weight
as it is stored and runs at the machine's speed: every linear of the demo for one row 18.2 against 33.4 ms
(small_rows_gemm.py), a whole decode step 26.2 against 39.5 ms, a 320-token prefill 252 against 448 ms
(cpu_dense_decode.py). For 2 to 4 rows, (W·Xᵀ)ᵀ through torch's `mm` is faster still (a decode step of batch 4:
29.5 ms, oneDNN 37.9, `linear` 63.5). Measured by benchmarks/studies/serving/, quiet. On an Intel Xeon MKL is not
held back, and both routes are slower than `linear` (a decode step 43.9 ms routed against 30.2, batch 4 62.3
against 45.1; one product of the demo's MLP for one row 58.7 µs through oneDNN against 33.9): `cpu_dense(model)`
routes a model on an AMD CPU only (cpu_vendor.py).

`CpuDenseLinear` is an `nn.Linear` that routes float32 CPU inputs so when no gradient is asked of it, and
leaves every other input (bf16, CUDA, training) to torch's `linear`. It holds no state of its own, so
`cpu_dense(model)` turns a loaded model's dense linears into it in place, on an AMD CPU (their weights, tied or
not, and hooks untouched). It is a route of the dense kernel, not a kernel of its own: what eval reports for the
model is "dense" however often it is asked. The routes sum the same products in other orders: they agree with `linear`
to float rounding (a few ulps), and a greedy answer can change only where two logits tie to that rounding.
"""

from __future__ import annotations

import platform

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.kernels.cpu_vendor import AMD

FEW_ROWS_MAX = 4  # rows up to which (W·Xᵀ)ᵀ beats oneDNN here (cpu_dense_decode.py: batch 4 29.5 ms against 37.9,
#                   batch 6 45.1 against 39.0)
# weights (elements) from which oneDNN's route is taken: a smaller one (256 KB in float32) stays in cache, where
# torch's route is as fast and oneDNN's call costs more (one quick measurement: 6 µs against 13 for a one-row
# 192 x 576 product in cache; the eval tests' tiny models ran 5% slower through it). Every linear of the demo is
# above it.
ONEDNN_MIN_WEIGHT = 1 << 16


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) · weight (out, in)ᵀ + bias, computed as (weight · x2ᵀ)ᵀ over the flattened rows x2, returned
    row-major as `linear` returns it (the transposed product left as it is made the ops after it slower than the
    linear itself became faster: a demo decode step of batch 8 took 74 ms against 55 ms)."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, flat.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) · weight (out, in)ᵀ + bias through oneDNN's inner product on the weight as stored."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _has_onednn() -> bool:
    """oneDNN's linear where it was measured: an x86 CPU build of torch that has it (ARM builds route it
    through other libraries, not timed here)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        got = onednn_linear(torch.ones(2, 3), torch.ones(4, 3), None)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(got, torch.full((2, 4), 3.0)))


ONEDNN = _has_onednn()
ROUTED = AMD  # where the routes beat torch's `linear` (cpu_vendor.py); elsewhere cpu_dense() changes nothing


class CpuDenseLinear(nn.Linear):
    """nn.Linear whose forward routes a float32 CPU input without gradient by its rows: 2..FEW_ROWS_MAX as
    (W·Xᵀ)ᵀ, the rest through oneDNN (where it is there, for a weight of ONEDNN_MIN_WEIGHT elements or more);
    everything else through torch's `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or not x.dtype == self.weight.dtype == torch.float32
                or not self.weight.is_contiguous()
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // max(x.shape[-1], 1)
        if 1 < rows <= FEW_ROWS_MAX:
            return few_rows_linear(x, self.weight, self.bias)
        if ONEDNN and rows > 0 and self.weight.numel() >= ONEDNN_MIN_WEIGHT:
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def cpu_dense(model: nn.Module) -> int:
    """Turn every plain `nn.Linear` of `model` into a CpuDenseLinear in place, on a CPU where the routes are
    faster (ROUTED); returns how many (0 elsewhere: the model is left as it is)."""
    if not ROUTED:
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = CpuDenseLinear
            n += 1
    return n
