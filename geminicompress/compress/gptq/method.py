"""GPTQ as a method (its registry entry): Hessian-aware rounding, layer by layer."""

from __future__ import annotations

from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.gptq.stage import GPTQ
from geminicompress.compress.weight_quant import WeightQuantMethod


class GPTQMethod(WeightQuantMethod):
    name = "gptq"
    config = GPTQStage
    help = "GPTQ: Hessian-aware rounding, layer by layer (2/3/4/8-bit)"
    stage_class = GPTQ
    calibrated = True
    default_format = "gptq"
    needs = "each decoder layer's inputs (GPTQ's Hessians are gathered layer by layer)"
