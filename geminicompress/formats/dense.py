"""Dense checkpoints: plain transformers layout, every weight in float (quantized weights written
dequantized, as the layer holds them, for tools that know no quantized format). Only written here:
reading one needs no geminicompress code (no `quantization_config`, so `formats.detect` gives None and
models/loading.py loads it with transformers, under the remote-code and pickle rules it owns)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.core.grid import QuantSpec
from geminicompress.formats.writer import LayerWriter

KEY = "dense"
GROUPS = None  # any group: the weights are written dequantized


def check_shape(name: str, out_f: int, in_f: int, spec: QuantSpec) -> None:
    """Any shape: dense weights hold whatever the grid produced."""


def writer(model: nn.Module, dtype: torch.dtype, *args: Any) -> LayerWriter:
    """The per-layer writer of a dense checkpoint: every tensor as the layer holds it (a b-bit method's
    fake-quantized weights included), in `dtype`."""
    return LayerWriter(model, dtype)
