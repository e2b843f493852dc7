"""Dense checkpoints: plain transformers layout, every weight in float (quantized weights written
dequantized, for tools that know no quantized format). Loading needs no geminicompress code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.arch import get_module
from geminicompress.compress.grid import QuantSpec

KEY = "dense"


def detect(qc: dict[str, Any]) -> bool:
    return not qc


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Any shape: dense weights hold whatever the grid produced."""


def write(model: nn.Module, tokenizer: Any, out: Path, qweights: Any = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write model + tokenizer with float weights in meta["dtype"] (the quantized ones dequantized)."""
    dtype_name = (meta or {}).get("dtype", "float32")
    with torch.no_grad():
        for name, qw in (qweights or {}).items():
            weight = get_module(model, name).weight
            weight.copy_(qw.dequantize().to(weight.device, weight.dtype))
    model.to(getattr(torch, dtype_name)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    info: dict[str, Any] = {"format": KEY, "dtype": dtype_name}
    if qweights:
        info["quantized_modules"] = len(qweights)
    return info


def load(path: Path, config: dict, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
