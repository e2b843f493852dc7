"""`quantize --method rtn`: round-to-nearest b-bit weights, per group of input columns (or per output
channel), with min-max ranges (`grid.rtn_quantize`). No calibration: the baseline every other method
is compared with, and the fastest path. Writes every format the other b-bit methods write.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from geminicompress.compress.arch import arch_for, get_module
from geminicompress.compress.grid import QuantSpec, rtn_quantize
from geminicompress.compress.targets import decoder_linears, resolve_group_size
from geminicompress.errors import InputError
from geminicompress.formats.checkpoint import check_shapes, scale_dtype, write_quantized
from geminicompress.recipes.base import GROUP_SIZE_HELP, GroupSize, StageBase


class RTNStage(StageBase):
    """Round-to-nearest: scale and zero point from each group's min and max."""

    type: Literal["quantize"] = "quantize"
    method: Literal["rtn"]
    bits: Literal[2, 3, 4, 8] = 4
    group_size: GroupSize = Field("auto", description=GROUP_SIZE_HELP)
    sym: bool = True
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="module name patterns to keep in float")
    format: Literal["gptq", "awq", "compressed-tensors", "dense"] = "gptq"


def run(cfg: RTNStage, ctx: Any) -> dict[str, Any]:
    """Quantize every decoder linear of ctx.model in place (fake-quantized weights) and set the exporter."""
    model = ctx.model
    targets = decoder_linears(model, arch_for(model), cfg.ignore, check="ignore" in cfg.model_fields_set)
    if not targets:
        raise InputError("the model has no linear layer left to quantize (check ignore)")
    shapes = {n: tuple(get_module(model, n).weight.shape) for n in targets}
    spec = QuantSpec(cfg.bits, resolve_group_size(cfg.group_size, shapes, ctx.progress), cfg.sym)
    check_shapes(cfg.format, shapes, spec)
    scales_as = scale_dtype(cfg.format, ctx.recipe.output.dtype)
    qweights = {}
    errors = []
    with torch.no_grad(), ctx.progress.task(f"rtn {spec.bits}-bit", len(targets)) as bar:
        for name in targets:
            weight = get_module(model, name).weight
            w = weight.detach().float()  # (out, in)
            qw = rtn_quantize(w, spec)
            qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
            w_hat = qw.dequantize()
            errors.append(float((w - w_hat).norm() / w.norm().clamp_min(1e-12)))
            weight.copy_(w_hat.to(weight.dtype))
            qw.q, qw.zeros = qw.q.to(torch.uint8).cpu(), qw.zeros.to(torch.uint8).cpu()  # a quarter of int32
            qweights[name] = qw
            bar.advance(1)
    meta = {"dtype": ctx.recipe.output.dtype, "zero_point": not cfg.sym, "method": "rtn"}
    ctx.exporter = lambda m, tok, out: write_quantized(m, tok, out, qweights, cfg.format, meta)
    return {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym, "format": cfg.format,
            "quantized_modules": len(qweights), "mean_weight_rel_error": sum(errors) / len(errors)}
