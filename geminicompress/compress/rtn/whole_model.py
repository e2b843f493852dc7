"""RTN of a model without decoder layers, on the whole model in memory (runtime/whole_model.py): each
targeted linear rounded alone (`quantize_linear`, scales rounded to the format's dtype), packed in the
recipe's format (gptq, compressed-tensors or dense)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.rtn.stage import quantize_linear
from geminicompress.compress.targets import resolve_group_size, whole_model_targets
from geminicompress.core.arch import get_module
from geminicompress.core.config import ignore_to_check
from geminicompress.core.errors import InputError
from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.engine.whole import Written
from geminicompress.formats import check_shapes, gptq, pack_quantized
from geminicompress.formats.checkpoint import float_linears, scale_dtype
from geminicompress.host.progress import Progress


@torch.no_grad()
def rtn_whole_model(model: nn.Module, cfg: Any, dtype: torch.dtype, progress: Progress) -> Written:
    """RTN of every targeted linear, packed in the recipe's format (gptq, compressed-tensors or dense)."""
    if getattr(cfg, "allocation", None) is not None:
        raise InputError("rtn: mixed precision (allocation) needs decoder layers; this model has none")
    names = whole_model_targets(model, cfg.ignore, ignore_to_check(cfg), "quantize")
    shapes = {n: tuple(get_module(model, n).weight.shape) for n in names}
    spec = QuantSpec(cfg.bits, resolve_group_size(cfg.group_size, shapes, progress), cfg.sym)
    check_shapes(cfg.format, shapes, spec)
    meta = {"dtype": str(dtype).removeprefix("torch."), "zero_point": not cfg.sym, "method": "rtn"}
    scales_as = scale_dtype(cfg.format, meta["dtype"])
    codes: dict[str, QuantizedWeight] = {}
    errors = []
    for name in names:
        qw, err = quantize_linear(get_module(model, name).weight, spec, scales_as)
        codes[name] = qw
        errors.append(err)
    summary = {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym, "format": cfg.format,
               "whole_model": True, "quantized_modules": len(names), "mean_weight_rel_error": sum(errors) / len(errors),
               "max_weight_rel_error": max(errors)}
    if cfg.format == "dense":
        return Written(model, dtype, "dense", None, summary, lambda t: t)
    not_quantized = float_linears(model, set(names))
    if cfg.format == "gptq":
        pack, fmt, extra = gptq.pack_gptq, gptq.KEY, gptq.write_quantize_config
        qconfig = gptq.quantization_config(spec, {n: spec for n in names}, meta, "", not_quantized)
    else:
        pack, fmt, extra = pack_quantized.packer(meta), pack_quantized.KEY, None
        qconfig = pack_quantized.ct_config(spec, meta, sorted(not_quantized))

    def packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, qw in codes.items():
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": v.cpu().contiguous() for k, v in pack(qw).items()})
        return tensors

    return Written(model, dtype, fmt, qconfig, summary, packed, exact=[f"{n}.weight" for n in names], extra=extra)
