"""A linear layer holding integer codes that rebuilds its float weight on the fly.

Used by our loaders for every packed format (GPTQ, AWQ, compressed-tensors): what eval measures is
exactly the packed checkpoint. Codes are kept unpacked as uint8 (1 byte per weight: a quarter of
float32) so that a forward pass costs one gather and one multiply more than a float linear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.compress.arch import get_module, set_module
from geminicompress.compress.grid import QuantizedWeight
from geminicompress.errors import GeminiError
from geminicompress.formats.checkpoint import float_skeleton, read_tensors


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
        g = self.g_idx
        return self.scales[:, g] * (self.q.to(self.scales.dtype) - self.zeros[:, g].to(self.scales.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, bias={self.bias is not None}"


def load_with_dequant_linears(path: Path, dtype: torch.dtype, suffixes: tuple[str, ...],
                              unpack: Callable[[dict[str, torch.Tensor]], QuantizedWeight],
                              bias_key: str = "bias",
                              unpack_module: Callable[[str, dict[str, torch.Tensor]], QuantizedWeight] | None = None,
                              ) -> nn.Module:
    """Build the model, put a `DequantLinear` wherever the checkpoint has `<module>.<suffixes[0]>`
    (the per-module tensors named by `suffixes` go to `unpack`, or to `unpack_module(name, tensors)` when
    the spec depends on the module: mixed precision), load everything else as it is."""
    tensors = read_tensors(path)
    model = float_skeleton(path, dtype)
    marker = "." + suffixes[0]
    prefixes = sorted(k[: -len(marker)] for k in tensors if k.endswith(marker))
    for prefix in prefixes:
        parts = {s: tensors.pop(f"{prefix}.{s}") for s in suffixes if f"{prefix}.{s}" in tensors}
        bias = tensors.pop(f"{prefix}.{bias_key}", None)
        try:
            get_module(model, prefix)
        except AttributeError as exc:
            raise GeminiError(f"{path}: quantized module {prefix} does not exist in the model's architecture") from exc
        qw = unpack_module(prefix, parts) if unpack_module is not None else unpack(parts)
        set_module(model, prefix, DequantLinear(qw, bias, dtype))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    quantized = tuple(p + "." for p in prefixes)
    missing = [k for k in missing if not k.startswith(quantized)]
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise GeminiError(f"{path}: checkpoint does not match the architecture ({what})")
    return model.eval()
