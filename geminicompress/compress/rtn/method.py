"""RTN as a method: round-to-nearest b-bit weights per group, no calibration (its registry entry)."""

from __future__ import annotations

from typing import Any

from geminicompress.compress.rtn.stage import RTN, RTNStage
from geminicompress.compress.rtn.whole_model import rtn_whole_model
from geminicompress.compress.weight_quant import WeightQuantMethod


class RTNMethod(WeightQuantMethod):
    name = "rtn"
    config = RTNStage
    help = "round-to-nearest b-bit weights per group: no calibration, the baseline and the fastest path"
    stage_class = RTN
    default_format = "gptq"
    needs = ""  # each weight is rounded alone: it runs on a model without decoder layers

    @classmethod
    def whole_model_refusal(cls, cfg: Any, where: str) -> str | None:
        if cfg.format not in ("gptq", "compressed-tensors", "dense"):
            return f"rtn: {where}: the whole-model fallback writes gptq, compressed-tensors or dense, not {cfg.format}"
        return None

    @classmethod
    def whole_model(cls, model: Any, cfg: Any, dtype: Any, progress: Any) -> Any:
        return rtn_whole_model(model, cfg, dtype, progress)
