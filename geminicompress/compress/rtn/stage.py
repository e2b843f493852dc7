"""`quantize --method rtn`: round-to-nearest b-bit weights, per group of input columns (or per output
channel), with min-max ranges (`grid.rtn_quantize`). No calibration: the baseline every other method
is compared with, and the fastest path. Writes every format the other b-bit methods write.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from geminicompress.compress import gguf_types
from geminicompress.compress.targets import QuantTargets, weight_quant_targets
from geminicompress.core.config import WeightQuantStage
from geminicompress.core.gguf_config import GGUF_HELP, GGUFFields
from geminicompress.core.grid import KeptCodes, QuantizedWeight, QuantSpec, keep_codes, rtn_quantize
from geminicompress.engine.contract import Done, LayerStage, StageContext
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.formats import writer_for
from geminicompress.formats.checkpoint import scale_dtype
from geminicompress.formats.gguf_blocks import BlocksWriter, rtn_bytes


class RTNStage(WeightQuantStage, GGUFFields):
    """Round-to-nearest: scale and zero point from each group's min and max."""

    method: Literal["rtn"]
    sym: bool = Field(True, description="symmetric (default) or asymmetric with zero points",
                      json_schema_extra={"cli": "--sym/--asym"})
    format: Literal["gptq", "awq", "compressed-tensors", "dense", "gguf"] = Field(
        "gptq", description=f"on-disk format (default: the method's own); {GGUF_HELP}")


class RTN(LayerStage):
    """RTN as the engine runs it: every targeted linear of a layer rounded in place, its codes kept."""

    calibrated = False
    quantizes = True

    @staticmethod
    def find_targets(model: Any, cfg: RTNStage, progress: Any, planned: QuantTargets | None = None) -> QuantTargets:
        """Its targets and spec (targets.py): made by preflight on the model's skeleton (`planned`: None), then
        taken from that plan when the stage opens."""
        return weight_quant_targets(model, cfg, progress, sym=cfg.sym, fmt=cfg.format, planned=planned)

    def __init__(self, cfg: RTNStage, ctx: StageContext) -> None:
        found = self.find_targets(ctx.model, cfg, ctx.progress, ctx.plan.of(cfg))
        self.cfg, self.ctx, self.spec, self.targets = cfg, ctx, found.spec, found.names
        self.gguf_types = gguf_types.plan(cfg, ctx.model, found.shapes, calibrated=False)  # --gguf-type
        if self.gguf_types is not None:
            self.targets = [n for n in found.names if n in self.gguf_types]
        self.scales_as = scale_dtype(cfg.format, str(ctx.out_dtype).removeprefix("torch."))

    def layer_fn(self) -> LayerFn:
        targets = set(self.targets)

        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            prefix = f"{job.arch.layers}.{job.index}"
            kept: dict[str, torch.Tensor] = {}
            errors = []
            for n in job.arch.linears:
                if f"{prefix}.{n}" in targets and self.gguf_types is not None:  # llama-quantize's rounding
                    w = job.weight(n).detach().float()
                    w_hat, keep = gguf_types.keep_blocks(rtn_bytes(w.numpy(), self.gguf_types[f"{prefix}.{n}"]),
                                                         self.gguf_types[f"{prefix}.{n}"], n)
                    job.set_weight(n, w_hat)
                    kept.update(keep)
                    errors.append(float((w - w_hat).norm() / w.norm().clamp_min(1e-12)))
                elif f"{prefix}.{n}" in targets:
                    qw, err = quantize_linear(job.module(n).weight, self.spec, self.scales_as)
                    kept.update(keep_codes(qw, n))
                    errors.append(err)
            return {"errors": errors}, kept

        return process

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> KeptCodes:
        prefix = self.ctx.layer_prefix(i)
        names = dict.fromkeys(k.rsplit(".", 1)[0] for k in kept)
        return KeptCodes(kept, {f"{prefix}.{n}": (n, self.spec) for n in names})

    def writer(self) -> Any:
        if self.gguf_types is not None:  # dense checkpoint + the blocks (formats/gguf_blocks.py)
            return BlocksWriter(self.ctx.model, self.ctx.out_dtype, self.gguf_types)
        meta = {"dtype": str(self.ctx.out_dtype).removeprefix("torch."), "zero_point": not self.cfg.sym, "method": "rtn"}
        return writer_for(self.cfg.format, self.ctx.model, self.ctx.out_dtype, {n: self.spec for n in self.targets},
                          meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        errors = [e for s in layers for e in s.get("errors", [])]
        return {"bits": self.spec.bits, "group_size": self.spec.group_size, "sym": self.spec.sym,
                "format": self.cfg.format, "quantized_modules": len(self.targets),
                "mean_weight_rel_error": sum(errors) / len(errors)}


@torch.no_grad()
def quantize_linear(weight: torch.Tensor, spec: QuantSpec, scales_as: torch.dtype) -> tuple[QuantizedWeight, float]:
    """RTN of one weight (out, in), written back fake-quantized in place; returns its codes and the relative
    error ‖W − Ŵ‖ / ‖W‖."""
    w = weight.detach().float()  # (out, in)
    qw = rtn_quantize(w, spec)
    qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
    w_hat = qw.dequantize()
    err = float((w - w_hat).norm() / w.norm().clamp_min(1e-12))
    weight.copy_(w_hat.to(weight.dtype))
    return qw, err
