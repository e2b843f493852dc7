"""Dense checkpoints: plain transformers layout, every weight in float (quantized weights written
dequantized, as the layer holds them, for tools that know no quantized format). Loading needs no
geminicompress code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.grid import QuantSpec
from geminicompress.formats.writer import LayerWriter

KEY = "dense"


def detect(qc: dict[str, Any]) -> bool:
    return not qc


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Any shape: dense weights hold whatever the grid produced."""


def writer(model: nn.Module, dtype: torch.dtype, *args: Any) -> LayerWriter:
    """The per-layer writer of a dense checkpoint: every tensor as the layer holds it (a b-bit method's
    fake-quantized weights included), in `dtype`."""
    return LayerWriter(model, dtype)


def load(path: Path, config: dict, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
