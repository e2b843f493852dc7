"""`quantize --method rtn`: round-to-nearest b-bit weights, per group of input columns (or per output
channel), with min-max ranges (`grid.rtn_quantize`). No calibration: the baseline every other method
is compared with, and the fastest path. Writes every format the other b-bit methods write.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from geminicompress.compress.arch import get_module
from geminicompress.compress.grid import QuantizedWeight, QuantSpec, rtn_quantize
from geminicompress.compress.targets import weight_quant_targets
from geminicompress.formats.checkpoint import scale_dtype, write_quantized
from geminicompress.recipes.base import WeightQuantStage


class RTNStage(WeightQuantStage):
    """Round-to-nearest: scale and zero point from each group's min and max."""

    method: Literal["rtn"]
    sym: bool = True
    format: Literal["gptq", "awq", "compressed-tensors", "dense"] = "gptq"


def run(cfg: RTNStage, ctx: Any) -> dict[str, Any]:
    """Quantize every decoder linear of ctx.model in place (fake-quantized weights) and set the exporter."""
    model = ctx.model
    found = weight_quant_targets(model, cfg, ctx.progress, sym=cfg.sym, fmt=cfg.format)
    targets, spec = found.names, found.spec
    scales_as = scale_dtype(cfg.format, ctx.recipe.output.dtype)
    qweights = {}
    errors = []
    with ctx.progress.task(f"rtn {spec.bits}-bit", len(targets)) as bar:
        for name in targets:
            qweights[name], err = quantize_linear(get_module(model, name).weight, spec, scales_as)
            errors.append(err)
            bar.advance(1)
    meta = export_meta(cfg, ctx.recipe.output.dtype)
    ctx.exporter = lambda m, tok, out: write_quantized(m, tok, out, qweights, cfg.format, meta)
    return summary(cfg, spec, len(qweights), errors)


@torch.no_grad()
def quantize_linear(weight: torch.Tensor, spec: QuantSpec, scales_as: torch.dtype) -> tuple[QuantizedWeight, float]:
    """RTN of one weight (out, in), written back fake-quantized in place; returns its codes (uint8, on the
    CPU) and the relative error ‖W − Ŵ‖ / ‖W‖."""
    w = weight.detach().float()  # (out, in)
    qw = rtn_quantize(w, spec)
    qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
    w_hat = qw.dequantize()
    err = float((w - w_hat).norm() / w.norm().clamp_min(1e-12))
    weight.copy_(w_hat.to(weight.dtype))
    qw.q, qw.zeros = qw.q.to(torch.uint8).cpu(), qw.zeros.to(torch.uint8).cpu()  # a quarter of int32
    return qw, err


def export_meta(cfg: RTNStage, dtype: str) -> dict[str, Any]:
    """What the format writers read of the stage's options."""
    return {"dtype": dtype, "zero_point": not cfg.sym, "method": "rtn"}


def summary(cfg: RTNStage, spec: QuantSpec, quantized: int, errors: list[float]) -> dict[str, Any]:
    return {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym, "format": cfg.format,
            "quantized_modules": quantized, "mean_weight_rel_error": sum(errors) / len(errors)}
