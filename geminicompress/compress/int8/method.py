"""INT8 weights (int8, W8A16) and INT8 weights and activations (w8a8, SmoothQuant) as methods (their
registry entries)."""

from __future__ import annotations

from typing import Any, ClassVar

from geminicompress.compress.int8.config import Int8Stage
from geminicompress.compress.int8.stage import Int8
from geminicompress.compress.int8.whole_model import int8_whole_model
from geminicompress.engine.method import Method
from geminicompress.kernels.int8 import Int8WeightOnlyLinear, W8A8Linear


class Int8Method(Method):
    name = "int8"
    type = "quantize"
    config = Int8Stage
    help = "INT8 weights, float activations (W8A16)"
    stage_class = Int8
    default_format = "compressed-tensors"
    quantizes = True
    needs = ""  # each linear is swapped alone: it runs on a model without decoder layers
    module: ClassVar[type] = Int8WeightOnlyLinear  # what a quantized linear becomes
    int8_activations: ClassVar[bool] = False

    @classmethod
    def whole_model_refusal(cls, cfg: Any, where: str) -> str | None:
        if cfg.format != "compressed-tensors":
            return f"{cls.name}: {where}: the whole-model fallback writes compressed-tensors only"
        return None

    @classmethod
    def whole_model(cls, model: Any, cfg: Any, dtype: Any, progress: Any) -> Any:
        return int8_whole_model(model, cfg, dtype, cls.module, cls.int8_activations)


class W8A8Method(Int8Method):
    name = "w8a8"
    help = "INT8 weights and per-token INT8 activations (fast on CPU); SmoothQuant calibrates"
    module = W8A8Linear
    int8_activations = True

    @classmethod
    def calibrates(cls, cfg: Any) -> bool:
        return cfg.smoothquant_alpha is not None

    @classmethod
    def needs_layers(cls, cfg: Any, where: str) -> str | None:
        if cfg.smoothquant_alpha is None:
            return None
        return (f"quantize w8a8: {where}, and it needs the norm -> linear feeds of a decoder layer to fold "
                "SmoothQuant's scales into")
