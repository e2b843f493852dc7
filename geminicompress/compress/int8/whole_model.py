"""INT8 of a model without decoder layers, on the whole model in memory (runtime/whole_model.py): every
targeted linear swapped for its INT8 module (int8: W8A16; w8a8 without SmoothQuant, which needs the norm ->
linear feeds of a decoder layer to fold its scales into)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.int8.stage import select_linears
from geminicompress.core.arch import get_module
from geminicompress.core.config import ignore_to_check
from geminicompress.core.errors import InputError
from geminicompress.core.grid import QuantSpec
from geminicompress.engine.whole import Written, tied_head
from geminicompress.formats import int_quantized, pack_quantized
from geminicompress.formats.checkpoint import float_linears
from geminicompress.kernels.int8_quant import relative_error


@torch.no_grad()
def int8_whole_model(model: nn.Module, cfg: Any, dtype: torch.dtype, module_class: Any,
                     int8_activations: bool) -> Written:
    """Every targeted linear swapped for its INT8 module (int8: W8A16; w8a8 without SmoothQuant)."""
    names, kept = select_linears(model, cfg.ignore, ignore_to_check(cfg), tied_head(model))
    if not names:
        raise InputError("the ignore patterns leave no linear layer to quantize")
    rows = []
    for name in names:
        linear = get_module(model, name)
        module = module_class.from_linear(linear)
        err = relative_error(linear.weight, module.weight, module.weight_scale)
        parent, _, child = name.rpartition(".")
        setattr(get_module(model, parent) if parent else model, child, module)
        rows.append({"name": name, "shape": [module.out_features, module.in_features], "weight_rel_error": round(err, 6)})
    summary = {"method": cfg.method, "whole_model": True, "weights": "int8 symmetric per output channel",
               "activations": "int8 dynamic per token" if int8_activations else "float (weight-only)",
               "quantized": len(rows), "kept_float": kept, "smoothquant": {"alpha": None}, "layers": rows}
    ignore = float_linears(model, set(names))
    if int8_activations:
        return Written(model, dtype, int_quantized.KEY, int_quantized.quantization_config(ignore), summary, lambda t: t)
    return Written(model, dtype, pack_quantized.KEY, pack_quantized.ct_config(QuantSpec(8), {}, sorted(ignore)),
                   summary, int_quantized.w8a16_packed)
