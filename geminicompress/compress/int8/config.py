"""The int8 / w8a8 stage's config (its method classes: method.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from geminicompress.core.config import StageBase
from geminicompress.core.gguf_config import GGUFFields


class Int8Stage(StageBase, GGUFFields):
    """INT8: `int8` = weight-only (W8A16); `w8a8` = INT8 weights and dynamic INT8 activations."""

    type: Literal["quantize"] = "quantize"
    method: Literal["int8", "w8a8"]
    bits: Literal[8] = Field(8, description="8")
    smoothquant_alpha: float | None = Field(
        0.5, ge=0.0, le=1.0, description="SmoothQuant strength in [0, 1] (default 0.5), calibrated on the stage's "
        "DATA; 0 or null = no SmoothQuant")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="module name pattern (regex) to keep "
                              "in float; repeatable (default lm_head)")
    format: Literal["compressed-tensors", "gguf"] = Field("compressed-tensors", description="compressed-tensors: "
                                                          "int-quantized (w8a8), pack-quantized 8-bit (int8); gguf: "
                                                          "OUT/model.gguf (Q8_0) beside it")

    @model_validator(mode="after")
    def _smoothquant_needs_w8a8(self) -> "Int8Stage":
        if self.method != "w8a8":
            if "smoothquant_alpha" in self.model_fields_set and self.smoothquant_alpha:
                raise ValueError("smoothquant_alpha applies to method w8a8 only (int8 keeps activations in float)")
            object.__setattr__(self, "smoothquant_alpha", None)
        elif self.smoothquant_alpha == 0:
            object.__setattr__(self, "smoothquant_alpha", None)  # 0 = off: one spelling in the report
        return self
