"""A linear layer holding integer codes that rebuilds its float weight on the fly.

Used by our loaders for every packed format (GPTQ, AWQ, compressed-tensors): what eval measures is
exactly the packed checkpoint. Codes are kept unpacked as uint8 (1 byte per weight: a quarter of
float32) so that a forward pass costs one gather and one multiply more than a float linear.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.core.grid import QuantizedWeight
from geminicompress.core.rows import BLOCK_BYTES, rows_within, spans
from geminicompress.formats.reader import ModuleReader


class DequantLinear(nn.Module):
    """y = x Ŵᵀ + b with Ŵ[o, j] = scales[o, g_idx[j]] · (q[o, j] − zeros[o, g_idx[j]])."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.bits = qw.spec.bits
        self.register_buffer("q", qw.q.to(torch.uint8))  # (out, in)
        self.register_buffer("scales", qw.scales.to(dtype))  # (out, groups)
        self.register_buffer("zeros", qw.zeros.to(torch.uint8))  # (out, groups)
        self.register_buffer("g_idx", qw.g_idx.to(torch.int64))  # (in,)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (out, in) weight, in the dtype of the scales."""
        return self.weight_rows(0, self.out_features)

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the dequantized weight, in the dtype of the scales."""
        dtype = self.scales.dtype
        q, scales, zeros = self.q[start:stop], self.scales[start:stop], self.zeros[start:stop]
        if scales.shape[1] == 1:  # per channel: broadcast, no gather
            return scales * (q.to(dtype) - zeros.to(dtype))
        g = self.g_idx
        return scales[:, g] * (q.to(dtype) - zeros[:, g].to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = rows_within(self.in_features, BLOCK_BYTES, self.scales.dtype.itemsize)
        if rows >= self.out_features:
            return F.linear(x, self.weight.to(x.dtype), bias)
        # a big weight (an output head: 4 GiB of float32 at 262,144 x 4,096, and twice that in temporaries
        # on the way) is rebuilt a block of rows at a time; each output column comes from its own row
        y = x.new_empty(*x.shape[:-1], self.out_features)
        for start, stop in spans(self.out_features, rows):
            y[..., start:stop] = F.linear(x, self.weight_rows(start, stop).to(x.dtype),
                                          None if bias is None else bias[start:stop])
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, bias={self.bias is not None}"


def dequant_reader(suffixes: tuple[str, ...],
                   unpack_module: Callable[[str, dict[str, torch.Tensor]], QuantizedWeight]) -> ModuleReader:
    """How a packed format's linear is read: a `DequantLinear` wherever the checkpoint has
    `<module>.<suffixes[0]>`, its tensors named by `suffixes` unpacked by `unpack_module(name, tensors)`
    (the spec may depend on the module: mixed precision)."""

    def build(name: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
        bias = parts.pop("bias", None)
        return DequantLinear(unpack_module(name, parts), bias, dtype)

    return ModuleReader(suffixes[0], (*suffixes, "bias"), build)
