"""AWQ and AWQ+GPTQ as methods (their registry entries): activation-aware scales and clipping, then
round-to-nearest or GPTQ."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.awq.config import AWQStage
from geminicompress.compress.awq.stage import AWQ
from geminicompress.compress.weight_quant import WeightQuantMethod
from geminicompress.engine.contract import LayerStage, StageContext


class AWQMethod(WeightQuantMethod):
    name = "awq"
    config = AWQStage
    help = "AWQ: activation-aware scales and clipping, then round-to-nearest"
    default_format = "awq"
    needs = "the norm -> linear feeds of a decoder layer to fold AWQ's scales into"

    @classmethod
    def calibrates(cls, cfg: Any) -> bool:
        return True

    @classmethod
    def cannot_stream(cls, cfg: Any, first: bool) -> str | None:
        return AWQ.cannot_stream(cfg, first)

    @classmethod
    def stage(cls, cfg: Any, ctx: StageContext) -> LayerStage:
        return AWQ(cfg, ctx)


class AWQGPTQMethod(AWQMethod):
    name = "awq+gptq"
    help = "AWQ's scales and clipping, then GPTQ"
