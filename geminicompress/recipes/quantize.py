"""Configs of the quantization methods that predate the method registry (`geminicompress/methods.py`
maps each method name to its config class, runner, default format and whether it calibrates)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from geminicompress.recipes.base import GROUP_SIZE_HELP, GroupSize, StageBase


class Int8Stage(StageBase):
    """INT8: `int8` = weight-only (W8A16); `w8a8` = INT8 weights and dynamic INT8 activations."""

    type: Literal["quantize"] = "quantize"
    method: Literal["int8", "w8a8"]
    bits: Literal[8] = 8
    smoothquant_alpha: float | None = Field(
        0.5, ge=0.0, le=1.0, description="w8a8: SmoothQuant migration strength, calibrated on the stage's DATA "
        "(default: the recipe's calibration data); 0 or null = no SmoothQuant. Not used by int8")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="module name patterns to keep in float")
    format: Literal["compressed-tensors"] = "compressed-tensors"

    @model_validator(mode="after")
    def _smoothquant_needs_w8a8(self) -> "Int8Stage":
        if self.method != "w8a8":
            if "smoothquant_alpha" in self.model_fields_set and self.smoothquant_alpha:
                raise ValueError("smoothquant_alpha applies to method w8a8 only (int8 keeps activations in float)")
            object.__setattr__(self, "smoothquant_alpha", None)
        elif self.smoothquant_alpha == 0:
            object.__setattr__(self, "smoothquant_alpha", None)  # 0 = off: one spelling in the report
        return self


class GPTQStage(StageBase):
    """GPTQ (Frantar et al., 2022): Hessian-aware rounding, layer by layer."""

    type: Literal["quantize"] = "quantize"
    method: Literal["gptq"]
    bits: Literal[2, 3, 4, 8] = 4
    group_size: GroupSize = Field("auto", description=GROUP_SIZE_HELP)
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    one_pass: bool = Field(True, description="true-sequential in one pass over the windows per layer (holds every "
                           "window's activations of one layer); false re-runs the layer per group (less memory)")
    damp: float = Field(0.01, gt=0.0, lt=1.0, description="dampening, fraction of the mean Hessian diagonal")
    block_size: int = Field(128, ge=1)
    calib_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype the layers compute in while calibrating (their forward passes); "
        "Hessians and the solver are always float32. bfloat16 is faster on GPUs and on CPUs with AVX512-BF16/AMX")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    format: Literal["gptq", "compressed-tensors", "dense"] = "gptq"


class AWQStage(StageBase):
    """AWQ (Lin et al., 2023): activation-aware scaling (+ clipping), then RTN or GPTQ."""

    type: Literal["quantize"] = "quantize"
    method: Literal["awq", "awq+gptq"]
    bits: Literal[2, 3, 4, 8] = 4
    group_size: GroupSize = Field("auto", description=GROUP_SIZE_HELP)
    zero_point: bool = True
    clip: bool = True
    n_grid: int = Field(20, ge=1, le=1000, description="points of the alpha grid in [0, 1) for the scale search")
    search_windows: int = Field(8, ge=1, description="calibration windows on which the scale search measures the "
                                "output error (activation statistics use all windows)")
    damp: float = Field(0.01, gt=0.0, lt=1.0)
    block_size: int = Field(128, ge=1)
    search_results: str | None = Field(None, description="re-apply saved scales/clips instead of searching")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    format: Literal["awq", "compressed-tensors", "dense"] = "awq"
