"""GPTQ as a method (its registry entry): Hessian-aware rounding, layer by layer."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.gptq.stage import GPTQ
from geminicompress.compress.weight_quant import WeightQuantMethod
from geminicompress.engine.contract import LayerStage, StageContext


class GPTQMethod(WeightQuantMethod):
    name = "gptq"
    config = GPTQStage
    help = "GPTQ: Hessian-aware rounding, layer by layer (2/3/4/8-bit)"
    default_format = "gptq"
    needs = "each decoder layer's inputs (GPTQ's Hessians are gathered layer by layer)"

    @classmethod
    def calibrates(cls, cfg: Any) -> bool:
        return True

    @classmethod
    def cannot_stream(cls, cfg: Any, first: bool) -> str | None:
        return GPTQ.cannot_stream(cfg, first)

    @classmethod
    def stage(cls, cfg: Any, ctx: StageContext) -> LayerStage:
        return GPTQ(cfg, ctx)
