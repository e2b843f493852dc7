"""The AWQ / awq+gptq stage's config (its method classes: method.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from geminicompress.core.config import WeightQuantStage
from geminicompress.core.gguf_config import GGUF_HELP, GGUFFields


class AWQStage(WeightQuantStage, GGUFFields):
    """AWQ (Lin et al., 2023): activation-aware scaling (+ clipping), then RTN or GPTQ."""

    method: Literal["awq", "awq+gptq"]
    zero_point: bool = Field(True, description="asymmetric with zero points (default) or symmetric")
    clip: bool = Field(True, description="search a clipping range per group (default on)")
    n_grid: int = Field(20, ge=1, le=1000, description="points in the alpha grid in [0, 1) of the scale search "
                        "(default 20)")
    search_windows: int = Field(8, ge=1, description="calibration windows on which the scale search measures the "
                                "output error (activation statistics use all windows)")
    damp: float = Field(0.01, gt=0.0, lt=1.0, description="dampening of GPTQ's Hessian (awq+gptq), "
                        "fraction of its mean diagonal")
    block_size: int = Field(128, ge=1, description="GPTQ's columns per lazy-update block (awq+gptq)")
    keep_zeros: bool = Field(False, description="keep a pruned weight's zeros at exactly zero in GPTQ (awq+gptq; "
                             "see gptq); awq's round-to-nearest keeps them anyway")
    search_results: str | None = Field(None, description="re-apply saved scales/clips (OUT/awq_search/) instead of "
                                       "searching")
    format: Literal["awq", "compressed-tensors", "dense", "gguf"] = Field(
        "awq", description=f"on-disk format (default: the method's own); {GGUF_HELP}")
