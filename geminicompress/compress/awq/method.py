"""AWQ and AWQ+GPTQ as methods (their registry entries): activation-aware scales and clipping, then
round-to-nearest or GPTQ."""

from __future__ import annotations

from geminicompress.compress.awq.config import AWQStage
from geminicompress.compress.awq.stage import AWQ
from geminicompress.compress.weight_quant import WeightQuantMethod


class AWQMethod(WeightQuantMethod):
    name = "awq"
    config = AWQStage
    help = "AWQ: activation-aware scales and clipping, then round-to-nearest"
    stage_class = AWQ
    calibrated = True
    default_format = "awq"
    needs = "the norm -> linear feeds of a decoder layer to fold AWQ's scales into"


class AWQGPTQMethod(AWQMethod):
    name = "awq+gptq"
    help = "AWQ's scales and clipping, then GPTQ"
